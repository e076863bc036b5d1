"""torch's operator database as a test bed for the ``gradcheck`` fixture.

Every op torch's own gradient tests run on the CPU (``op_db`` of
``torch.testing._internal.common_methods_invocations``, the ops that support autograd
in the dtype and are not skipped or expected to fail in ``TestBwdGradients.test_fn_grad``,
as ``test/test_ops_gradients.py`` runs them), each sample checked twice: by
``torch.autograd.gradcheck`` on the tensors that require grad, as torch's test calls it
(through ``op.gradcheck_wrapper``), and by the fixture's ``gradcheck`` on the sample as a
user passes it (the input, the positional and keyword arguments, nested lists
included). Their verdicts are compared. Besides the samples:

- :func:`empty_cases`: each elementwise op (unary and binary ufuncs) on an empty tensor,
  in every input position;
- :func:`planted_cases`: a sample routed through a custom autograd Function whose
  backward plants a bug (one element off, a scale, the sign, two elements swapped);
  both checks must fail, and the fixture must name the Function, the input and, for one
  element off, the element.

The tests run a sample of it (``tests/test_plugin_gradcheck_ops.py``), the benchmark
``benchmarks/gradcheck_op_db.py`` all of it. Drawing samples inspects the call stack in
``torch.testing`` to seed per test; that is turned off (``extract_test_fn``): each
op's samples come from torch's fixed seed instead.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.gradcheck import GradcheckError
from torch.testing._internal import common_utils
from torch.utils import _pytree as pytree

common_utils.extract_test_fn = lambda: None  # see the module docstring
from torch.testing._internal.common_methods_invocations import (  # noqa: E402
    BinaryUfuncInfo,
    UnaryUfuncInfo,
    op_db,
)

# Importing torch's test utilities freezes the cuDNN and other backend flags for the
# whole process (torch.backends.disable_global_flags(), for torch's own test suite):
# other tests in the same process set them, so they are thawed again.
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

# Above this many elements the fixture's default picks fast mode; torch's check of the
# same sample runs in the same mode.
FAST_MODE_ABOVE = 2048
SAMPLES_PER_OP = 2


class Verdict(enum.Enum):
    PASS = "pass"
    FAIL = "fail"  # the check says the gradient is wrong (or cannot be checked there)
    ERROR = "error"  # anything else raised


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    error: BaseException | None
    seconds: float

    def __str__(self) -> str:
        text = f": {type(self.error).__name__}: {str(self.error)[:300]}" if self.error else ""
        return f"{self.verdict.value}{text}"


@dataclass(frozen=True)
class Case:
    """One op on one set of inputs, as the user's call and as torch's test calls it."""

    name: str  # "fft.ifft[0]", "add (empty input)"
    op: Any  # the OpInfo
    input: Any
    args: tuple
    kwargs: dict[str, Any]
    output_process: Callable[[Any], Any] | None = None
    wrapped: Callable[..., Any] | None = None  # in place of the op (a planted bug)

    def call(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        if self.wrapped is not None:
            return self.wrapped(input, *args, **kwargs)
        output = self.op.gradcheck_wrapper(self.op.get_op(), input, *args, **kwargs)
        return self.output_process(output) if self.output_process else output

    def differentiable(self) -> list[torch.Tensor]:
        """The tensors that require grad, in the order of the arguments (torch's inputs)."""
        leaves = pytree.tree_leaves((self.input, self.args, self.kwargs))
        return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.differentiable())

    def torch_function(self) -> Callable[..., Any]:
        """A function of the differentiable tensors alone, as torch's test builds it."""
        leaves, spec = pytree.tree_flatten((self.input, self.args, self.kwargs))
        positions = [
            i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]

        def function(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for position, tensor in zip(positions, tensors, strict=True):
                filled[position] = tensor
            input, args, kwargs = pytree.tree_unflatten(filled, spec)
            return self.call(input, *args, **kwargs)

        return function


def _skipped(op: Any, dtype: torch.dtype) -> bool:
    """Whether torch's own test skips ``test_fn_grad`` for this op and dtype on the CPU."""
    for decoration in op.decorators:
        is_active = getattr(decoration, "is_active", None)
        if is_active is None or not is_active("TestBwdGradients", "test_fn_grad", "cpu", dtype, {}):
            continue
        for decorator in decoration.decorators:
            name = getattr(decorator, "__qualname__", "")
            if name.startswith("skip") or name == "expectedFailure":
                return True
    return False


def ops(dtype: torch.dtype = torch.float64) -> list[Any]:
    """The ops torch's gradient tests run on the CPU in ``dtype``."""
    return [
        op
        for op in op_db
        if op.supports_autograd
        and dtype in op.supported_backward_dtypes("cpu")
        and not _skipped(op, dtype)
    ]


def op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def cases(
    dtype: torch.dtype = torch.float64,
    samples_per_op: int = SAMPLES_PER_OP,
    names: set[str] | None = None,
) -> Iterator[Case]:
    """The first ``samples_per_op`` samples of each op (of those named, if given)."""
    for op in ops(dtype):
        if names is not None and op_name(op) not in names:
            continue
        conjugated = dtype.is_complex and op.test_conjugated_samples
        samples = op.sample_inputs(
            "cpu", dtype, requires_grad=True, include_conjugated_inputs=conjugated
        )
        for index, sample in enumerate(samples):
            if index == samples_per_op:
                break
            yield Case(
                f"{op_name(op)}[{index}]",
                op,
                sample.input,
                tuple(sample.args),
                dict(sample.kwargs),
                sample.output_process_fn_grad,
            )


def empty_cases(dtype: torch.dtype = torch.float64) -> Iterator[Case]:
    """Each elementwise op on an empty tensor, in every input position.

    A unary op's first sample with its input emptied (its first dimension 0, the other
    arguments as they were); a binary op on an empty ``(0, 3)`` tensor and a full
    ``(3,)`` one that broadcasts against it, either way round.
    """
    for op in ops(dtype):
        if isinstance(op, UnaryUfuncInfo):
            sample = next(iter(op.sample_inputs("cpu", dtype, requires_grad=True)), None)
            if (
                sample is None
                or not isinstance(sample.input, torch.Tensor)
                or not sample.input.ndim
            ):
                continue
            input = _emptied(sample.input)
            yield Case(f"{op_name(op)} (empty input)", op, input, tuple(sample.args), sample.kwargs)
        elif isinstance(op, BinaryUfuncInfo):
            for position in (0, 1):
                full = (torch.rand(3, dtype=dtype) + 0.5).requires_grad_()
                pair = [torch.empty(0, 3, dtype=dtype, requires_grad=True), full]
                if position:
                    pair.reverse()
                yield Case(f"{op_name(op)} (empty input {position})", op, pair[0], (pair[1],), {})


def _emptied(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``tensor`` without its first dimension's elements."""
    empty = torch.empty((0, *tensor.shape[1:]), dtype=tensor.dtype)
    return empty.requires_grad_(tensor.requires_grad)


def ours(gradcheck: Callable[..., Any], case: Case, fast: bool | None = None) -> Outcome:
    """The fixture's verdict on the case, as a user calls it."""
    started = time.perf_counter()
    try:
        gradcheck(case.call, case.input, *case.args, forward_kwargs=case.kwargs, fast=fast)
    except AssertionError as error:  # GradcheckFailure and its kinds
        return Outcome(Verdict.FAIL, error, time.perf_counter() - started)
    except Exception as error:
        return Outcome(Verdict.ERROR, error, time.perf_counter() - started)
    return Outcome(Verdict.PASS, None, time.perf_counter() - started)


def ours_flat(gradcheck: Callable[..., Any], case: Case) -> Outcome:
    """The fixture's verdict on exactly the function torch's check gets (see :func:`theirs`)."""
    started = time.perf_counter()
    try:
        gradcheck(case.torch_function(), *case.differentiable())
    except AssertionError as error:
        return Outcome(Verdict.FAIL, error, time.perf_counter() - started)
    except Exception as error:
        return Outcome(Verdict.ERROR, error, time.perf_counter() - started)
    return Outcome(Verdict.PASS, None, time.perf_counter() - started)


def theirs(case: Case, fast: bool | None = None) -> Outcome:
    """``torch.autograd.gradcheck``'s verdict, in the mode the fixture picks by default."""
    inputs = case.differentiable()
    if fast is None:
        fast = sum(t.numel() for t in inputs) > FAST_MODE_ABOVE
    started = time.perf_counter()
    try:
        torch.autograd.gradcheck(case.torch_function(), tuple(inputs), fast_mode=fast)
    except GradcheckError as error:
        return Outcome(Verdict.FAIL, error, time.perf_counter() - started)
    except Exception as error:
        return Outcome(Verdict.ERROR, error, time.perf_counter() - started)
    return Outcome(Verdict.PASS, None, time.perf_counter() - started)


# --- planted bugs -------------------------------------------------------------------------


class Plant(enum.Enum):
    """A bug planted in the backward of the first input's gradient."""

    ELEMENT = "one element off"
    SCALE = "scaled by 1.1"
    SIGN = "sign flipped"
    SWAP = "two elements swapped"

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        flat = grad.clone().reshape(-1)
        if self is Plant.ELEMENT:
            flat[flat.numel() // 2] += 0.5 + flat.abs().max()
        elif self is Plant.SCALE:
            flat = 1.1 * flat
        elif self is Plant.SIGN:
            flat = -flat
        else:
            first, second = _swapped(flat)
            flat[[first, second]] = flat[[second, first]]
        return flat.reshape(grad.shape)


def _swapped(flat: torch.Tensor) -> tuple[int, int]:
    """Two elements of ``flat`` that differ most: the largest and the smallest."""
    return int(flat.argmax()), int(flat.argmin())


class Planted(torch.autograd.Function):
    """The op, with a backward that computes the true gradient and then plants ``plant``."""

    @staticmethod
    def forward(ctx, plant, call, *tensors):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in tensors]
            output = call(*leaves)
        ctx.plant, ctx.leaves, ctx.output = plant, leaves, output
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        grads = torch.autograd.grad(
            ctx.output, ctx.leaves, grad, allow_unused=True, retain_graph=True
        )
        grads = [
            torch.zeros_like(t) if g is None else g for g, t in zip(grads, ctx.leaves, strict=True)
        ]
        grads[0] = ctx.plant.apply(grads[0])
        return (None, None, *grads)


def planted_case(case: Case, plant: Plant) -> Case:
    """``case`` with its op routed through :class:`Planted`."""
    inner = case.torch_function()
    leaves = pytree.tree_leaves((case.input, case.args, case.kwargs))
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]

    def call(input: Any, *args: Any, **kwargs: Any) -> Any:
        filled = pytree.tree_leaves((input, args, kwargs))
        return Planted.apply(plant, inner, *(filled[p] for p in positions))

    return dataclasses.replace(case, name=f"{case.name} ({plant.value})", wrapped=call)


def plantable(case: Case) -> bool:
    """Whether a bug planted in the first input's gradient shows: one floating output,
    and a gradient of the first input that is not zero for a random cotangent."""
    try:
        inputs = [t.detach().requires_grad_() for t in case.differentiable()]
        output = case.torch_function()(*inputs)
    except Exception:
        return False
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return False
    if not inputs or inputs[0].numel() < 2 or not output.requires_grad or not output.numel():
        return False
    generator = torch.Generator().manual_seed(0)
    cotangent = torch.randn(output.shape, dtype=output.dtype, generator=generator)
    (grad,) = torch.autograd.grad(output, inputs[:1], cotangent, allow_unused=True)
    if grad is None or not bool(torch.isfinite(grad).all()):
        return False
    scale = float(grad.abs().max())
    return scale > 1e-2 and math.isfinite(scale) and bool((grad.max() - grad.min()) > 1e-2)


def first_input_name(case: Case) -> str:
    """How the fixture names the first tensor that requires grad (``input input[0]``)."""
    for path, leaf in pytree.tree_flatten_with_path(((case.input, *case.args), case.kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            group, key, rest = path[0], path[1], path[2:]
            if group.idx == 1:
                head = str(key.key)
            else:
                head = "input" if key.idx == 0 else f"inputs[{key.idx}]"
            return f"input {head}{pytree.keystr(rest)}"
    raise ValueError(f"{case.name}: no input requires grad")


def names_the_plant(case: Case, plant: Plant, outcome: Outcome) -> bool:
    """Whether the fixture's failure names the planted Function, the first input and, for
    one element off, the element."""
    error = outcome.error
    source = getattr(error, "source", None)
    if source is None or source.name != Planted.__qualname__:
        return False
    if getattr(error, "tensor", None) != first_input_name(case):
        return False
    if plant is not Plant.ELEMENT:
        return True
    first = case.differentiable()[0]
    expected = tuple(
        int(i) for i in torch.unravel_index(torch.tensor(first.numel() // 2), first.shape)
    )
    return tuple(error.index) == expected
