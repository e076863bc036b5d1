"""Prove that forward and backward of a model are bitwise reproducible, and say where not.

:func:`check_determinism` runs a model (or function) forward and backward several
times, each from the same parameters, buffers, RNG states and inputs, pulls a
fixed random cotangent back through every floating-point output, and compares
outputs, parameter gradients, input gradients and updated buffers bit for bit.
Only when two runs differ does it pay for localization: it reruns under a
``TorchDispatchMode`` that fingerprints every aten op of forward and backward
and a ``TorchFunctionMode`` that records data-dependent Python decisions, and
reports the first op or branch where the runs part.

:func:`deterministic_mode` is the environment the ``autograd_determinism``
fixture gives a test: deterministic algorithms, deterministic cuDNN, seeded
RNGs, all undone afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..gpus import version_tuple
from . import calls, control_flow, global_state

DEFAULT_SEED = 0

# torch checked CUBLAS_WORKSPACE_CONFIG under deterministic mode until
# pytorch/pytorch#161749 removed the check (torch 2.10): since CUDA 11 torch gives
# every handle/stream its own cuBLAS workspace, which is what cuBLAS needs.
CUBLAS_CONFIG_CHECKED_BEFORE = (2, 10)
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")

NO_DETERMINISTIC_IMPLEMENTATION = "does not have a deterministic implementation"
CUBLAS_NOT_DETERMINISTIC = "it uses CuBLAS"

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SITE_KEY = "determinism_check_forward_site"
_LISTED_DIFFERENCES = 5
_RANDOM_OPS = frozenset(
    {
        *("bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "exponential_"),
        *("geometric_", "cauchy_", "log_normal_", "random_", "rand", "randn", "randint"),
        *("randperm", "rand_like", "randn_like", "randint_like", "multinomial"),
        *("native_dropout", "poisson", "rrelu_with_noise"),
    }
)


class DeterminismError(AssertionError):
    """Two runs from identical starting conditions gave different results."""


class NondeterministicOpError(DeterminismError):
    """An op has no deterministic implementation, so deterministic mode refused to run it."""


# --- the environment of the fixture --------------------------------------------------


def cublas_workspace_action(
    torch_version: str, cuda_built: bool, cuda_initialized: bool, configured: str | None
) -> str | None:
    """What the installed torch needs done about ``CUBLAS_WORKSPACE_CONFIG``.

    ``None``: nothing (torch no longer checks it, no CUDA, or it is already set to a
    deterministic value). ``"set"``: set it now, CUDA has not started yet.
    ``"too late"``: set it, and warn: CUDA already started, and if cuBLAS ran too, its
    handle keeps the workspace it was created with.
    """
    if not cuda_built or configured in DETERMINISTIC_CUBLAS_CONFIGS:
        return None
    if version_tuple(torch_version)[:2] >= CUBLAS_CONFIG_CHECKED_BEFORE:
        return None
    return "too late" if cuda_initialized else "set"


def _configure_cublas_workspace() -> None:
    action = cublas_workspace_action(
        torch.__version__,
        torch.version.cuda is not None,
        torch.cuda.is_initialized(),
        os.environ.get(CUBLAS_WORKSPACE_VARIABLE),
    )
    if action is not None:
        os.environ[CUBLAS_WORKSPACE_VARIABLE] = DETERMINISTIC_CUBLAS_CONFIGS[0]
    if action == "too late":
        warnings.warn(
            f"torch {torch.__version__} needs {CUBLAS_WORKSPACE_VARIABLE}="
            f"{DETERMINISTIC_CUBLAS_CONFIGS[0]} (or {DETERMINISTIC_CUBLAS_CONFIGS[1]}) before "
            "cuBLAS starts, and CUDA had already started when the autograd_determinism "
            "fixture set it: if cuBLAS ran before, matmuls may stay nondeterministic. Set it "
            f"in the environment that runs pytest: {CUBLAS_WORKSPACE_VARIABLE}="
            f"{DETERMINISTIC_CUBLAS_CONFIGS[0]} pytest ...",
            stacklevel=3,
        )


def seed_everything(seed: int = DEFAULT_SEED) -> None:
    """Seed Python's ``random``, torch on CPU and every CUDA device, and NumPy if imported."""
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


@contextlib.contextmanager
def deterministic_mode(seed: int = DEFAULT_SEED) -> Iterator[None]:
    """Deterministic algorithms and cuDNN, filled uninitialized memory, seeded RNGs.

    Everything is put back on exit, also when the block raises.
    """
    before = global_state.snapshot()
    cublas_config = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
    try:
        _configure_cublas_workspace()
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        seed_everything(seed)
        yield
    finally:
        global_state.restore(before)
        if cublas_config is None:
            os.environ.pop(CUBLAS_WORKSPACE_VARIABLE, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VARIABLE] = cublas_config


# --- naming the pieces of nested inputs and outputs ----------------------------------


def _named_leaves(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of nested tuples, lists, dicts and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named_leaves(item, f"{name}[{key!r}]")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for field_name, item in zip(value._fields, value, strict=True):
            yield from _named_leaves(item, f"{name}.{field_name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _named_leaves(item, f"{name}[{index}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _named_leaves(getattr(value, field.name), f"{name}.{field.name}")
    else:
        yield name, value


def _map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor in nested containers replaced by ``function(tensor)``."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, Mapping):
        items = {key: _map_tensors(item, function) for key, item in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(item, function) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, function) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _map_tensors(getattr(value, f.name), function)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


def _comparable(value: Any) -> bool:
    return value is None or isinstance(
        value, torch.Tensor | bool | int | float | complex | str | bytes
    )


# --- bitwise comparison --------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers with the same bits (NaN and -0.0 kept apart)."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.resolve_conj().resolve_neg()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_floating_point():
        return tensor.view(_INTEGER_OF_SIZE[tensor.element_size()])
    return tensor


@functools.cache
def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp``, which this process has loaded already; None without one."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return memcmp


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bits in every element."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    a_bits, b_bits = _bits(a), _bits(b)
    memcmp = _memcmp()
    if (
        memcmp is not None
        and a_bits.device.type == "cpu"
        and type(a_bits) is torch.Tensor
        and type(b_bits) is torch.Tensor
        and a_bits.is_contiguous()
        and b_bits.is_contiguous()
    ):
        # The comparison is what the check adds to the passes: memcmp reads the two
        # gradients several times faster than torch.equal does on one thread.
        size = a_bits.numel() * a_bits.element_size()
        return size == 0 or memcmp(a_bits.data_ptr(), b_bits.data_ptr(), size) == 0
    return torch.equal(a_bits, b_bits)


def _format_number(value: Any) -> str:
    return f"{value:.9g}" if isinstance(value, float) else repr(value)


def describe_tensor_difference(name: str, a: torch.Tensor, b: torch.Tensor, run: int) -> str:
    """One line: how many elements differ, the largest difference, the first differing one."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return (
            f"{name}: {a.dtype} {tuple(a.shape)} on {a.device} in run 1, "
            f"{b.dtype} {tuple(b.shape)} on {b.device} in run {run}"
        )
    a, b = a.detach(), b.detach()
    differs = _bits(a) != _bits(b)
    if differs.dim() > a.dim():  # complex: real and imaginary part
        differs = differs.any(dim=-1)
    parts = [f"{int(differs.sum())} of {a.numel()} elements differ"]
    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        x, y = a[differs].to(wide), b[differs].to(wide)
        nan_in_one = x.isnan() ^ y.isnan()
        numbers = ~(x.isnan() | y.isnan())
        if numbers.any():
            largest = float((x[numbers] - y[numbers]).abs().max())
            parts.append(
                f"largest absolute difference {largest:.3g}"
                if largest
                else "equal values with different bits (0.0 and -0.0)"
            )
        if nan_in_one.any():
            parts.append(f"{int(nan_in_one.sum())} NaN in one run only")
    else:
        gap = (a[differs].long() - b[differs].long()).abs().max()
        parts.append(f"largest absolute difference {int(gap)}")
    first = tuple(int(i) for i in differs.nonzero()[0])
    parts[-1] += (
        f" (first at {list(first)}: {_format_number(a[first].item())} in run 1, "
        f"{_format_number(b[first].item())} in run {run})"
    )
    return f"{name}: " + ", ".join(parts)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bitwise_equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and repr(a) == repr(b)  # repr: NaN equals NaN, -0.0 is not 0.0


def _describe_difference(name: str, a: Any, b: Any, run: int) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return describe_tensor_difference(name, a, b, run)
    return f"{name}: {_summary(name, a)} in run 1, {_summary(name, b)} in run {run}"


def _summary(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if value is None and name.startswith("grad of "):
        return "None (the backward pass did not reach it)"
    return repr(value)


def _differences(
    reference: dict[str, Any], other: dict[str, Any], run: int
) -> list[tuple[str, str | None]]:
    """``(name, description)`` of each entry that differs; only the first is described."""
    found: list[tuple[str, str | None]] = []
    for name in [*reference, *(n for n in other if n not in reference)]:
        if name not in reference or name not in other:
            where = "run 1" if name in reference else f"run {run}"
            found.append((name, f"{name}: present only in {where}"))
        elif not _same(reference[name], other[name]):
            first = not found
            a, b = reference[name], other[name]
            found.append((name, _describe_difference(name, a, b, run) if first else None))
    return found


# --- one run from the starting conditions --------------------------------------------


@dataclasses.dataclass
class _RunResult:
    outputs: Any
    values: dict[str, Any]


class _Subject:
    """The model or function under test, with the state every run starts from."""

    def __init__(self, target: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.roots = calls.reached_modules(target)
        self.input_names = calls.input_names(target, len(args))
        modules = [
            (f"{prefix}.{name}" if prefix and name else prefix or name, module)
            for prefix, root in self.roots
            for name, module in root.named_modules(remove_duplicate=False)
        ]
        # Buffers and frozen parameters are copied: forwards update them (running
        # statistics, momentum encoders), not always with a bump of the version counter,
        # so they are compared by value. Trainable parameters are not copied, which
        # would cost as much as a backward's gradients: autograd refuses in-place
        # changes to them, and the ones made anyway (under no_grad) bump the counter.
        self._parameter_state: list[_Slot] = []
        self._buffer_state: list[_Slot] = []
        self.parameters: list[tuple[str, torch.Tensor]] = []
        copies: dict[int, torch.Tensor | None] = {}
        for prefix, submodule in modules:
            for slots, tensors in (
                (self._parameter_state, submodule._parameters),
                (self._buffer_state, submodule._buffers),
            ):
                for key, tensor in tensors.items():
                    if tensor is None:
                        continue
                    name = f"{prefix}.{key}" if prefix else key
                    if id(tensor) not in copies:
                        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
                        copies[id(tensor)] = None if trainable else tensor.detach().clone()
                        if trainable:
                            self.parameters.append((name, tensor))
                    slots.append(_Slot(tensors, key, name, tensor, copies[id(tensor)]))
        calls.reject_data_less(
            "autograd_determinism",
            [
                *(
                    (n, t)
                    for n, t in self._named_inputs(args, kwargs)
                    if isinstance(t, torch.Tensor)
                ),
                *((f"parameter {slot.name}", slot.tensor) for slot in self._parameter_state),
                *((f"buffer {slot.name}", slot.tensor) for slot in self._buffer_state),
            ],
        )
        self.graph_checked = False
        self._versions = [slot.tensor._version for slot in self._parameter_state]
        self._rngs = global_state.rng_states()
        self._ran = False  # whether a run may have changed the state since the last reset
        self._differentiate_all_inputs = not self.parameters and not any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for _, t in _named_leaves((args, kwargs), "")
        )

    def reset(self) -> None:
        """Parameters, buffers and RNG states as they were when the check started."""
        if not self._ran:
            return
        with torch.no_grad():
            for position, slot in enumerate(self._parameter_state):
                slot.put_back()
                if slot.tensor._version == self._versions[position]:
                    continue
                if slot.saved is None:
                    self._versions[position] = slot.tensor._version  # reported once
                    raise DeterminismError(
                        f"The forward changed the trainable parameter {slot.name} in place "
                        "(under torch.no_grad() or through .data), so the next run cannot "
                        "start from the same value, and the model keeps the change. Change "
                        "it outside the forward, or keep the value in a buffer."
                    )
                slot.tensor.copy_(slot.saved)
                self._versions[position] = slot.tensor._version
            for slot in self._buffer_state:
                slot.put_back()
                if not bitwise_equal(slot.tensor, slot.saved):
                    slot.tensor.copy_(slot.saved)
        for rng in self._rngs:
            rng.set_state(rng.raw)
        self._ran = False

    def fresh_inputs(self) -> tuple[tuple, dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """Copies of the inputs (aliasing kept) and the ones to differentiate, by name."""
        self._ran = True
        copies: dict[int, torch.Tensor] = {}
        differentiated: list[tuple[str, torch.Tensor]] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in copies:
                clone = tensor.detach().clone()
                if (tensor.requires_grad or self._differentiate_all_inputs) and (
                    clone.is_floating_point() or clone.is_complex()
                ):
                    clone.requires_grad_(True)
                copies[id(tensor)] = clone
            return copies[id(tensor)]

        args = _map_tensors(self.args, copy)
        kwargs = _map_tensors(self.kwargs, copy)
        seen: set[int] = set()
        for name, leaf in self._named_inputs(args, kwargs):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in seen:
                seen.add(id(leaf))
                differentiated.append((name, leaf))
        return args, kwargs, differentiated

    def _named_inputs(self, args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """``("input x[0]", leaf)`` for each leaf of the inputs, named as :mod:`.calls` says."""
        named = [*zip(self.input_names, args, strict=True), *kwargs.items()]
        for key, value in named:
            yield from _named_leaves(value, f"input {key}")

    def changed_buffers(self) -> dict[str, Any]:
        """Copies of the buffers the run changed (in place or by assignment)."""
        changed = {}
        for slot in self._buffer_state:
            current = slot.owner.get(slot.key)
            if current is not slot.tensor or not bitwise_equal(current, slot.saved):
                changed[f"buffer {slot.name} after the run"] = (
                    current.detach().clone() if isinstance(current, torch.Tensor) else current
                )
        return changed


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a module keeps one parameter or buffer, the tensor and its starting value."""

    owner: dict[str, Any]
    key: str
    name: str
    tensor: torch.Tensor
    saved: torch.Tensor | None  # None for trainable parameters (see _Subject)

    def put_back(self) -> None:
        if self.owner.get(self.key) is not self.tensor:
            self.owner[self.key] = self.tensor


class _Cotangents:
    """One fixed random cotangent per differentiated output, the same in every run."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.samples: dict[tuple, torch.Tensor] = {}  # by (output name, shape, dtype, device)

    def __call__(self, name: str, output: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(output.shape), output.dtype, output.device)
        if key not in self.samples:
            generator = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))
            dtype = (
                output.dtype
                if output.dtype in (torch.float64, torch.complex128)
                else (torch.complex64 if output.is_complex() else torch.float32)
            )
            sample = torch.randn(output.shape, generator=generator, dtype=dtype)
            self.samples[key] = sample.to(device=output.device, dtype=output.dtype)
        return self.samples[key]


def _run_once(
    subject: _Subject,
    cotangents: _Cotangents,
    recording: contextlib.AbstractContextManager[Any] | None = None,
) -> _RunResult:
    """One forward and backward from the starting conditions, under ``recording`` if given."""
    subject.reset()
    args, kwargs, differentiated_inputs = subject.fresh_inputs()
    try:
        with recording or contextlib.nullcontext():
            outputs = subject.target(*args, **kwargs)
            leaves = list(_named_leaves(outputs, "output"))
            if not subject.graph_checked:
                subject.graph_checked = True
                if calls.reentrant_checkpoint(t for _, t in leaves):
                    raise ValueError(
                        calls.REENTRANT_CHECKPOINT.format(check="autograd_determinism")
                    )
            wrt = [*subject.parameters, *differentiated_inputs]
            grads = _gradients(leaves, wrt, cotangents)
    except RuntimeError as error:
        if NO_DETERMINISTIC_IMPLEMENTATION in str(error) or CUBLAS_NOT_DETERMINISTIC in str(error):
            raise _NondeterministicOpRaised(error) from error
        raise
    values: dict[str, Any] = {
        name: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        for name, leaf in leaves
        if _comparable(leaf)
    }
    values.update(grads)
    values.update(subject.changed_buffers())
    return _RunResult(_map_tensors(outputs, torch.Tensor.detach), values)


def _gradients(
    leaves: list[tuple[str, Any]], wrt: list[tuple[str, torch.Tensor]], cotangents: _Cotangents
) -> dict[str, torch.Tensor | None]:
    """``grad of <name>`` for each tensor in ``wrt``: the cotangents pulled back to it.

    ``torch.autograd.grad`` leaves ``.grad`` alone and runs no post-accumulate hooks
    (an optimizer step in a hook would otherwise change the model mid-check).
    """
    names = [f"grad of {name}" for name, _ in wrt]
    differentiable = [
        (name, t)
        for name, t in leaves
        if isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.is_floating_point() or t.is_complex())
    ]
    if not differentiable or not wrt:
        return dict.fromkeys(names)
    grads = torch.autograd.grad(
        [t for _, t in differentiable],
        [t for _, t in wrt],
        [cotangents(name, t) for name, t in differentiable],
        allow_unused=True,
    )
    return dict(zip(names, grads, strict=True))


class _NondeterministicOpRaised(Exception):
    def __init__(self, error: RuntimeError) -> None:
        super().__init__(str(error))
        self.error = error


# --- localization: op fingerprints and decisions -------------------------------------


def _fingerprint(value: Any) -> Any:
    """A position-sensitive hash of a tensor's bits; integer sums wrap, so it is exact."""
    if isinstance(value, torch.Tensor):
        bits = _bits(value).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device)
        weights = weights * 2654435761 + 40503
        return (
            value.dtype,
            tuple(value.shape),
            int((bits * weights).sum()),
            int((bits ^ weights).sum()),
        )
    if isinstance(value, list | tuple):
        return tuple(_fingerprint(item) for item in value)
    return value if _comparable(value) else type(value).__name__


@dataclasses.dataclass
class _OpRecord:
    op: str
    site: str
    inputs: tuple
    outputs: Any
    explicit_generator: bool


class _ModuleStack:
    """Which module's forward is running, by its name in the model, while active."""

    def __init__(self, roots: list[tuple[str, nn.Module]]) -> None:
        self._names: dict[int, str] = {}
        for prefix, root in reversed(roots):  # the outermost name wins
            for name, module in root.named_modules(remove_duplicate=False):
                self._names[id(module)] = f"{prefix}.{name}" if prefix and name else prefix or name
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        kind = type(module).__name__
        self._stack.append(
            f"{name} ({kind})" if name else f"the model ({kind})" if name == "" else kind
        )

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> _ModuleStack:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter),
            hooks.register_module_forward_hook(self._exit, always_call=True),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()


def _site(modules: _ModuleStack, frame: FrameType | None, what: str) -> str:
    """``what in encoder.1 (Linear) at models.py:45``, leaving out what is unknown."""
    module = modules.current()
    location = control_flow.user_location(frame)
    return " ".join(
        filter(None, [what, f"in {module}" if module else "", f"at {location}" if location else ""])
    )


class _GraphTagger(TorchFunctionMode):
    """Marks each new autograd node with the call that created it (module and user line)."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        pending = [t.grad_fn for _, t in _named_leaves(result, "") if isinstance(t, torch.Tensor)]
        site = None
        while pending:
            node = pending.pop()
            if node is None or _SITE_KEY in node.metadata:
                continue
            if site is None:
                site = _site(self.modules, sys._getframe(1), getattr(func, "__name__", str(func)))
            node.metadata[_SITE_KEY] = site
            pending.extend(next_node for next_node, _ in node.next_functions)
        return result


class _OpRecorder(TorchDispatchMode):
    """Fingerprints inputs and outputs of every aten op, in forward and backward."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.ops: list[_OpRecord] = []
        self.failed_site: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            inputs = _fingerprint((*args, *kwargs.values()))
        try:
            result = func(*args, **kwargs)
        except RuntimeError:
            self.failed_site = self._site(sys._getframe(1))
            raise
        generator = kwargs.get("generator")
        with torch._C.DisableTorchFunction():
            outputs = _fingerprint(result)
        self.ops.append(
            _OpRecord(
                str(func),
                self._site(sys._getframe(1)),
                inputs,
                outputs,
                generator is not None and generator is not torch.default_generator,
            )
        )
        return result

    def _site(self, frame: FrameType | None) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return _site(self.modules, frame, "forward")
        backward = f"backward ({node.name()})"
        location = control_flow.user_location(frame)  # a custom Function's backward
        forward = node.metadata.get(_SITE_KEY)
        if location:
            return f"{backward} at {location}"
        return f"{backward} of {forward}" if forward else backward


@dataclasses.dataclass
class _RecordedRun:
    decisions: control_flow.DecisionLog
    recorder: _OpRecorder
    # Python threads other than this one that were alive or started during the run:
    # the recorders see only this thread's ops.
    threads: tuple[str, ...]
    # torch.initial_seed() after the run: it changes only when the run reseeds.
    seed_after: int


def _recorded_run(subject: _Subject, cotangents: _Cotangents) -> _RecordedRun:
    modules = _ModuleStack(subject.roots)
    recorder = _OpRecorder(modules)
    logs: list[control_flow.DecisionLog] = []
    current = threading.current_thread()
    # Pool threads started before the run still run its work; others (pytest's, xdist's) do not.
    threads = {
        t.name
        for t in threading.enumerate()
        if t is not current and t.name.startswith("ThreadPoolExecutor")
    }

    def started(frame: FrameType, event: str, argument: Any) -> None:
        threads.add(threading.current_thread().name)  # called once as each new thread starts

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        threading.settrace(started)
        try:
            with (
                modules,
                control_flow.record_decisions() as decisions,
                _GraphTagger(modules),
                recorder,
            ):
                logs.append(decisions)
                yield
        finally:
            threading.settrace(None)  # type: ignore[arg-type]

    with contextlib.suppress(_NondeterministicOpRaised):  # recorded as failed_site
        _run_once(subject, cotangents, recording())
    return _RecordedRun(logs[0], recorder, tuple(sorted(threads)), torch.initial_seed())


def _first_op_difference(
    a: list[_OpRecord], b: list[_OpRecord], other_threads: bool = False
) -> str | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        number = index + 1
        if x.op != y.op:
            return (
                f"the runs stop doing the same ops at op #{number}: {x.op} ({x.site}) in run 1, "
                f"{y.op} ({y.site}) in run 2; every op before it computed identical values, "
                "so the branch was decided by something outside torch's ops "
                "(the clock, the OS, a generator or global state the check does not reset)"
            )
        if x.inputs != y.inputs:
            argument = next(
                i for i, (p, q) in enumerate(zip(x.inputs, y.inputs, strict=False)) if p != q
            )
            source = (
                "ops on other threads, which the recorder does not see"
                if other_threads
                else "outside torch's ops (NumPy, Python's random, the clock, the OS, a tensor "
                "built from Python values)"
            )
            return (
                f"first differing op: #{number} {x.op} ({x.site}): its argument {argument} "
                "differs although every earlier op computed identical values, so that data "
                f"came from {source}"
            )
        if x.outputs != y.outputs:
            cause = "so this op itself is not deterministic"
            if x.op.split(".")[1] in _RANDOM_OPS or "dropout" in x.op:
                cause = (
                    "so this random op drew different numbers: it used a generator whose "
                    "state is not reset between runs"
                    + (
                        " (an explicit torch.Generator; seed it from a fixed seed right before "
                        "use, or use the global RNG)"
                        if x.explicit_generator
                        else ""
                    )
                )
            return (
                f"first differing op: #{number} {x.op} ({x.site}): same inputs in both "
                f"runs, different outputs, {cause}"
            )
    if len(a) != len(b):
        return (
            f"run 1 ran {len(a)} ops, run 2 ran {len(b)}; the first {min(len(a), len(b))} matched"
        )
    return None


def _localize(subject: _Subject, cotangents: _Cotangents, attempts: int) -> list[str]:
    """Rerun under the recorders until a rerun differs from the first; say where.

    A rerun whose values differ but whose branches agree is kept, and reruns go on
    (up to ``attempts``) while the forward makes data-dependent decisions, because
    a rerun that also branches differently explains more.
    """
    reference = _recorded_run(subject, cotangents)
    found: list[str] = []
    threads: set[str] = set(reference.threads)
    for attempt in range(2, attempts + 2):
        other = _recorded_run(subject, cotangents)
        threads.update(other.threads)
        divergence = control_flow.first_divergence(reference.decisions, other.decisions)
        op_difference = _first_op_difference(
            reference.recorder.ops, other.recorder.ops, bool(threads)
        )
        if divergence or (op_difference and not found):
            found = [
                "Localized by rerunning under an op recorder until two reruns differed "
                f"(run 1 and run 2 below; {attempt} reruns):"
            ]
            if reference.seed_after != other.seed_after:
                found.append(
                    "the forward reseeds torch's global RNG, with a different seed in each run "
                    f"(torch.initial_seed() after the forward: {reference.seed_after} in run 1, "
                    f"{other.seed_after} in run 2): a seed from os.urandom, the clock or "
                    "torch.seed(). The check resets every generator before each run; the "
                    "reseed undoes that, so each random op after it (dropout, randn) draws "
                    "other numbers. Seed with a fixed value, or not inside the forward"
                )
            if divergence:
                found.append(control_flow.describe_divergence(divergence, run=2))
            if op_difference:
                found.append(op_difference)
        if divergence or (found and not reference.decisions):
            break
    if not found:
        found = [
            f"Not localized: {attempts + 1} reruns under the op recorder agreed with each other "
            "(the nondeterminism depends on timing, or the recorder changed it)"
        ]
    if threads:
        found.append(
            f"other Python threads ran during the runs ({', '.join(sorted(threads))}): the op "
            "recorder sees only the ops of the thread that called the model, so ops on those "
            "threads are missing from the record; ops racing on other threads (a thread pool "
            "writing into a shared tensor, or building parts of the graph, whose backward "
            "then adds up in another order) are the likely cause"
        )
    return found


# --- the check ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeterminismResult:
    """The first run's results (all runs agreed bit for bit).

    ``outputs`` has the structure the model returned, tensors detached.
    ``parameter_grads`` maps parameter names to gradients (``None`` where the
    backward pass did not reach the parameter); ``input_grads`` maps input names
    the same way: the forward's parameter name (``"x"``, ``"x[1]"`` inside a tuple),
    ``"inputs[i]"`` where the signature has none, the key of a ``forward_kwargs``
    entry (``"mask"``); messages call them ``input x``.
    ``buffers`` holds the buffers the forward changed, after the run.
    """

    outputs: Any
    parameter_grads: dict[str, torch.Tensor | None]
    input_grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    runs: int


def _result(subject: _Subject, run: _RunResult, runs: int) -> DeterminismResult:
    parameter_names = {name for name, _ in subject.parameters}
    grads = {
        name.removeprefix("grad of "): value
        for name, value in run.values.items()
        if name.startswith("grad of ")
    }
    buffers = {
        name.removeprefix("buffer ").removesuffix(" after the run"): value
        for name, value in run.values.items()
        if name.startswith("buffer ")
    }
    return DeterminismResult(
        outputs=run.outputs,
        parameter_grads={k: v for k, v in grads.items() if k in parameter_names},
        input_grads={
            k.removeprefix("input "): v for k, v in grads.items() if k not in parameter_names
        },
        buffers=buffers,
        runs=runs,
    )


def _mismatch_report(differences: list[tuple[str, str | None]], label: str) -> list[str]:
    first = differences[0][1]
    lines = [
        f"{label} differs from run 1 although both started from the same parameters, "
        "buffers, RNG states and inputs:",
        f"  {first}",
    ]
    others = [name for name, _ in differences[1:]]
    if others:
        listed = ", ".join(others[:_LISTED_DIFFERENCES])
        more = len(others) - _LISTED_DIFFERENCES
        lines.append(f"  also differ: {listed}" + (f" and {more} more" if more > 0 else ""))
    return lines


def _nondeterministic_op_error(
    subject: _Subject, cotangents: _Cotangents, raised: _NondeterministicOpRaised
) -> NondeterministicOpError:
    message = str(raised.error)
    rerun = _recorded_run(subject, cotangents)
    site = rerun.recorder.failed_site
    if CUBLAS_NOT_DETERMINISTIC in message and NO_DETERMINISTIC_IMPLEMENTATION not in message:
        return NondeterministicOpError(
            f"A cuBLAS op ({site or 'site unknown'}) refused to run deterministically: torch "
            f"{torch.__version__} needs "
            f"{CUBLAS_WORKSPACE_VARIABLE}={DETERMINISTIC_CUBLAS_CONFIGS[0]} "
            "set before CUDA starts. Set it in the environment that runs pytest.\n"
            f"torch said: {message}"
        )
    op = message.split(NO_DETERMINISTIC_IMPLEMENTATION)[0].strip() or "an op"
    lines = [
        f"{op} has no deterministic implementation on this device, and the check runs with "
        "torch.use_deterministic_algorithms(True), so torch refused to run it.",
        f"  where: {site or 'unknown (the op recorder did not see it again)'}",
        "Usual ways out:",
        "  - compute it with ops that are deterministic: scatter_add_/index_add_/index_put_"
        "(accumulate=True) on CUDA have deterministic versions, while put_, "
        "bincount/histc, and the backward of adaptive pooling, interpolate (linear modes), "
        "grid_sample and reflection padding have none; a one-hot matmul or sort + "
        "segment sum replaces scatter-style sums",
        "  - run just this op on the CPU (.cpu(), then .to(device)) where it is deterministic",
        "  - if exact reproducibility of this op does not matter: run it inside "
        "torch.use_deterministic_algorithms(True, warn_only=True) and restore the flag "
        "afterwards; then this test cannot prove the model bitwise reproducible",
        f"torch said: {message.split('. ')[0]}.",
    ]
    return NondeterministicOpError("\n".join(lines))


def check_determinism(
    model_or_function: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: Mapping[str, Any] | None = None,
    runs: int = 3,
    cross_process: bool = False,
    cotangent_seed: int = DEFAULT_SEED,
    **unknown: Any,
) -> DeterminismResult:
    """Run forward and backward ``runs`` times from identical conditions; all must agree.

    Each run calls ``model_or_function(*inputs, **forward_kwargs)``. Every run starts
    from the same parameters and buffers (of the modules the callable reaches: a
    module, a bound method, a ``functools.partial``, closures, defaults and globals
    holding modules), the same global RNG states (Python, NumPy, torch CPU and CUDA)
    and fresh copies of the inputs; the model and inputs are left as they were. A
    fixed random cotangent (seeded by ``cotangent_seed``) is pulled back through every
    floating-point output that requires grad, with ``torch.autograd.grad``, so
    ``.grad`` attributes are not touched. Gradients are taken for every parameter
    that requires grad and every floating-point input that requires grad; when
    nothing requires grad, for every floating-point input.

    ``cross_process=True`` makes the last run happen in a fresh Python process with
    the same thread count (model, function and inputs must be picklable). Options are
    keyword-only; any other keyword is a ``TypeError``: the forward's keyword arguments
    go in ``forward_kwargs``.

    Raises :class:`DeterminismError` naming the first differing tensor, then the first
    aten op or Python decision where the runs part, or :class:`NondeterministicOpError`
    when an op has no deterministic implementation.
    """
    __tracebackhide__ = True
    calls.reject_unknown_keywords(
        "autograd_determinism", unknown, ("runs", "cross_process", "cotangent_seed")
    )
    kwargs = calls.forward_kwargs_of("autograd_determinism", forward_kwargs)
    if not callable(model_or_function):
        raise TypeError(
            "model_or_function must be an nn.Module or a callable, "
            f"got {type(model_or_function).__name__}"
        )
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(
            f"runs must be an integer >= 2 (two runs to compare at least), got {runs!r}"
        )
    if not isinstance(cross_process, bool):
        raise TypeError(f"cross_process must be True or False, got {cross_process!r}")
    subject = _Subject(model_or_function, inputs, kwargs)
    cotangents = _Cotangents(cotangent_seed)
    payload = b""
    try:
        reference = _run_once(subject, cotangents)
        if cross_process:
            payload = _child_payload(subject, cotangents)
        for run in range(2, runs + 1):
            in_child = cross_process and run == runs
            other = _run_in_child(payload) if in_child else _run_once(subject, cotangents)
            differences = _differences(reference.values, other.values, run)
            del other  # freed before the next run, which then reuses its memory
            if differences:
                label = f"Run {run} of {runs}" + (" (in a fresh process)" if in_child else "")
                lines = _mismatch_report(differences, label)
                if in_child:
                    agreed = "the in-process runs agreed, so " if runs > 2 else ""
                    lines.append(
                        f"Only the run in a fresh process differs: {agreed}the cause is state "
                        "that differs between processes (thread pools, memory addresses, hash "
                        "seeds, lazily initialized state)."
                    )
                else:
                    lines.extend(_localize(subject, cotangents, attempts=max(runs, 3)))
                raise DeterminismError("\n".join(lines))
    except _NondeterministicOpRaised as raised:
        raise _nondeterministic_op_error(subject, cotangents, raised) from None
    finally:
        subject.reset()
    return _result(subject, reference, runs)


# --- the cross-process run ------------------------------------------------------------


def _child_payload(subject: _Subject, cotangents: _Cotangents) -> bytes:
    """The pickled request for a run in a fresh process: what to run and from which state."""
    subject.reset()
    start = global_state.snapshot()  # torch settings (thread count included) and RNG states
    payload = {
        "target": subject.target,
        "args": subject.args,
        "kwargs": subject.kwargs,
        "settings": start.settings,
        "rngs": {rng.name: rng.raw for rng in start.rngs},
        "cotangents": cotangents.samples,
        "cotangent_seed": cotangents.seed,
    }
    buffer = io.BytesIO()
    try:
        torch.save(payload, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            "cross_process=True sends the model or function and the inputs to a fresh "
            f"process by pickling, which failed: {error}. Define the model class or function "
            "at module level in an importable module (not inside a test function, not a "
            "lambda) and pass tensors and plain Python values as inputs."
        ) from error
    return buffer.getvalue()


def _run_in_child(payload: bytes) -> _RunResult:
    with tempfile.TemporaryDirectory(prefix="determinism-") as folder:
        request, response = Path(folder, "request.pt"), Path(folder, "response.pt")
        request.write_bytes(payload)
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        finished = subprocess.run(
            [sys.executable, "-m", __name__, str(request), str(response)],
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        if finished.returncode != 0:
            raise DeterminismError(
                f"The cross-process run failed (exit status {finished.returncode}):\n"
                f"{finished.stderr.strip()[-3000:]}"
            )
        loaded = torch.load(response, weights_only=False)
    return _RunResult(loaded["outputs"], loaded["values"])


def _child_main(request: str, response: str) -> None:
    payload = torch.load(request, weights_only=False)
    global_state.restore(global_state.GlobalState(settings=payload["settings"], rngs=()))
    for rng in global_state.rng_states():
        if rng.name in payload["rngs"]:
            rng.set_state(payload["rngs"][rng.name])
    subject = _Subject(payload["target"], payload["args"], payload["kwargs"])
    cotangents = _Cotangents(payload["cotangent_seed"])
    cotangents.samples.update(payload["cotangents"])
    result = _run_once(subject, cotangents)
    torch.save({"outputs": result.outputs, "values": result.values}, response)


if __name__ == "__main__":
    _child_main(*sys.argv[1:3])
