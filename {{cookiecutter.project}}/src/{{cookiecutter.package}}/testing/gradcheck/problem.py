"""The model under check as a function of float64 tensors: the checked inputs and
parameters as float64 copies (:class:`Checked`), the evaluations torch's check makes
(:class:`Problem`), a probe the model refuses (:class:`ProbeRefused`), the parameters'
gradient hooks run on the copies, the buffers the forward writes held at the point.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..calls import reentrant_checkpoint
from ..comparison import bitwise_equal
from ..control_flow import UNKNOWN_LOCATION, Location, display_path, probing, user_location
from ..failures import quoted, raised
from ..float64 import CannotStayFloat64, Float64Mode, Narrowing, Substitution, Widening, writes
from ..naming import describe_callable, element_name, op_name
from ..parts import State, definition
from ..subject import Slot, Subject
from ..trees import flatten_arguments, named_leaves
from ..trees import leaves as tree_leaves
from .results import GradcheckFailure
from .weights import EVALUATION_SEED

__all__ = [
    "JITTER_ATTEMPTS",
    "JITTER_SCALE",
    "Checked",
    "NoFloatingOutput",
    "ProbeRefused",
    "Probes",
    "Problem",
    "hook_name",
    "unravel",
]

# avoid_boundaries=True: how far, and how many times, the point is moved.
JITTER_SCALE = 1e-3
JITTER_ATTEMPTS = 3


@dataclass
class Checked:
    """One tensor whose gradient is checked, as a float64 (real view, if complex) copy."""

    name: str
    value: torch.Tensor
    is_complex: bool
    hooks: tuple[_Hook, ...] = ()

    @property
    def numel(self) -> int:
        return self.value.numel()

    def as_user(self, value: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(value) if self.is_complex else value

    def index(self, flat: int) -> tuple[int, ...]:
        return unravel(flat, tuple(self.value.shape))

    def element(self, flat: int) -> str:
        index = self.index(flat)
        part = ""
        if self.is_complex:
            index, part = index[:-1], (" (real part)", " (imaginary part)")[index[-1]]
        return element_name(self.name, index) + part


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def _float64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 (complex128) copy holding the values; a conjugate or negative view resolved."""
    dtype = torch.complex128 if tensor.is_complex() else torch.float64
    return tensor.detach().resolve_conj().resolve_neg().to(dtype=dtype, copy=True).contiguous()


def _checked_copy(name: str, tensor: torch.Tensor) -> Checked:
    copy = _float64_copy(tensor)
    if copy.is_complex():
        return Checked(name, torch.view_as_real(copy).clone(), True)
    return Checked(name, copy, False)


class NoFloatingOutput(TypeError):
    """Raised inside torch's check; re-raised as a plain TypeError without torch's frames."""


class Problem:
    """``model_or_fn`` as a function of the checked float64 tensors.

    While :meth:`installed` is active, every module the callable reaches holds float64
    tensors in place of its parameters and buffers, so that whatever runs the module
    (the callable, a checkpoint's recomputation in backward) computes in float64; the
    user's tensor objects are put back afterwards, untouched.
    """

    def __init__(self, function, inputs: tuple, kwargs: dict, params) -> None:
        __tracebackhide__ = True
        self.function = function
        self.inputs, self.kwargs = inputs, kwargs
        self.description = describe_callable(function)
        # The modules reached, their parameters and buffers, the inputs' names; data-less
        # tensors refused. It restores nothing: installed() puts the user's tensors back.
        self.subject = Subject(function, inputs, kwargs, failure=GradcheckFailure, restores=False)
        self.roots = self.subject.roots
        self.checked: list[Checked] = []
        self._input_slots: list[tuple[int, int]] = []
        self.output_names: list[str] | None = None
        self.output_dtypes: list[torch.dtype] = []
        self._mode = Float64Mode()
        self.widened: dict[Any, Widening] = self._mode.widened
        self.narrowed: dict[Any, Narrowing] = self._mode.narrowed
        self.substituted: dict[Any, Substitution] = self._mode.substituted
        # Whether evaluations run under Float64Mode: None until the first evaluation (which
        # does) shows whether the forward needs it; True after a check failed without it.
        self.widen: bool | None = None
        self.evaluations = 0
        self.hooks_enabled = True
        # By id: the integer and boolean input tensors, passed as they are ("input i").
        self.integer_inputs: dict[int, str] = {}
        self._at_point = True  # the next evaluation is at the test's own point (see evaluate)
        integer_inputs: list[str] = []

        self._positional = len(inputs)
        names = self.subject.input_names
        if all(type(value) in _LEAVES for value in (*inputs, *kwargs.values())):
            # Flat arguments (the common case): what pytree would find, without its cost.
            self._keywords: list[str] | None = list(kwargs)
            named_leaves = [
                *((f"input {name}", value) for name, value in zip(names, inputs, strict=True)),
                *((f"input {key}", value) for key, value in kwargs.items()),
            ]
        else:
            self._flat = flatten_arguments(inputs, kwargs, names)
            self._keywords = list(kwargs) if self._flat.top_level else None
            named_leaves = [
                (f"input {name}", leaf)
                for name, leaf in zip(self._flat.names, self._flat.leaves, strict=True)
            ]
        named_parameters = _named(self.subject.parameter_slots)
        named_buffers = _named(self.subject.buffer_slots)
        self._leaves: list[Any] = []
        self._states: list[int] = []  # positions of the parts' state objects (parts.State)
        for position, (name, leaf) in enumerate(named_leaves):
            if isinstance(leaf, torch.Tensor):
                if leaf.layout != torch.strided:
                    raise TypeError(
                        f"gradcheck: {name} is a {leaf.layout} tensor; only dense (strided) "
                        f"tensors are supported: pass {name.split()[1]}.to_dense()"
                    )
                if leaf.requires_grad:
                    self._input_slots.append((position, len(self.checked)))
                    self.checked.append(_checked_copy(name, leaf))
                    leaf = None
                elif leaf.is_floating_point() or leaf.is_complex():
                    leaf = _float64_copy(leaf)
                else:
                    integer_inputs.append(f"{name} ({leaf.dtype})")
                    self.integer_inputs[id(leaf)] = name
            elif isinstance(leaf, State):
                self._states.append(position)
            self._leaves.append(leaf)

        # By id of the user's tensor: the checked slot, or the float64 constant.
        self._param_slots: dict[int, int] = {}
        self._constants: dict[int, torch.Tensor] = {}
        wanted = self._wanted_parameters(dict(named_parameters), params)
        for name, parameter in named_parameters:
            if name in wanted:
                self._param_slots[id(parameter)] = len(self.checked)
                self.checked.append(_checked_copy(f"parameter {name}", parameter))
                self.checked[-1].hooks = _gradient_hooks(parameter)
            else:
                self._constants[id(parameter)] = _float64_copy(parameter)
        self._buffers = {
            id(buffer): _float64_copy(buffer)
            if buffer.is_floating_point() or buffer.is_complex()
            else buffer.detach().clone()
            for _, buffer in named_buffers
        }
        self._buffer_names = {id(buffer): name for name, buffer in named_buffers}
        self._parameter_places = _places(self.subject.parameter_slots)
        self._buffer_places = _places(self.subject.buffer_slots)
        if not self.checked:
            raise ValueError(self._nothing_to_check(params, integer_inputs))
        self.generators = _generators(
            [c.value for c in self.checked]
            + [t for t in self._leaves if isinstance(t, torch.Tensor)]
        )
        # (generator, state) to start each evaluation from: empty when the forward draws no
        # random numbers (seen in the first evaluation), so nothing is reseeded.
        self._seeds: list[tuple[torch.Generator, torch.Tensor]] | None = None
        self._evaluated = False
        # Buffers the forward changes (seen in the first evaluation), and the values it
        # wrote into them outside autograd at the point (see _BufferWrites).
        self.held_buffers: tuple[str, ...] = ()
        self._held: list[torch.Tensor | None] | None = None

    def user_parameters(self) -> list[torch.Tensor]:
        """The user's parameter tensors whose gradients are checked."""
        return [
            place.tensor
            for place in self._parameter_places
            if id(place.tensor) in self._param_slots
        ]

    def module_names(self) -> dict[int, str]:
        """The name of each module reached (its first name), by id."""
        names: dict[int, str] = {}
        for name, module in self.subject.named_modules():
            names.setdefault(id(module), name)
        return names

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Float64 everywhere for the block: default dtype, widening mode, module tensors."""
        attributes = [
            (module, {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
            for module in {id(m): m for _, m in self.subject.named_modules()}.values()
        ]
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            yield
        finally:
            torch.set_default_dtype(default_dtype)
            for place in (*self._parameter_places, *self._buffer_places):
                place.put_back()
            for module, saved in attributes:
                for key in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]:
                    if key not in saved:
                        del module.__dict__[key]  # made by the forward during the check
                module.__dict__.update(saved)

    def _wanted_parameters(self, named: dict[str, torch.Tensor], params) -> set[str]:
        __tracebackhide__ = True
        if params is True:
            return {name for name, parameter in named.items() if parameter.requires_grad}
        if params is False:
            return set()
        wanted = list(params)
        unknown = [name for name in wanted if name not in named]
        if unknown:
            raise ValueError(
                f"gradcheck: params names {unknown} that {self.description} does not have; "
                f"its parameters are {sorted(named)}"
            )
        return set(wanted)

    def _nothing_to_check(self, params, integer_inputs: list[str]) -> str:
        lines = ["gradcheck: nothing to check: no input requires grad"]
        if not self.roots:
            lines[0] += (
                f" and {self.description} reaches no nn.Module (neither is one nor holds one "
                f"in its closure, defaults or bound self), so it has no parameters"
            )
        elif params is False:
            lines[0] += " and params=False"
        else:
            lines[0] += f" and no parameter of {self.description} requires grad"
        if integer_inputs:
            lines.append(
                f"integer tensors have no gradient: {', '.join(integer_inputs)}; to check one, "
                f"pass a floating-point copy, e.g. x.double().requires_grad_()"
            )
        lines.append(
            "call .requires_grad_() on the floating-point inputs to check"
            + (", or pass params=True" if self.roots and params is False else "")
        )
        return "\n".join(lines)

    def evaluate(self, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """:meth:`_evaluate`; each evaluation after the first (at the test's point) is one of
        gradcheck's own probes, which ``pytest --decisions`` counts apart."""
        at_point, self._at_point = self._at_point, False
        if at_point or not torch._C._len_torch_function_stack():
            # No torch function mode is active, so nothing records decisions to count
            # apart: the probe's marker would cost an evaluation more than the check does.
            return self._evaluate(values)
        with probing():
            return self._evaluate(values)

    def _evaluate(self, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The floating-point outputs for these checked values; same RNG state every time."""
        self.evaluations += 1
        leaves = self._leaves.copy()
        for position, slot in self._input_slots:
            leaves[position] = self.checked[slot].as_user(values[slot])
        for position in self._states:
            leaves[position] = leaves[position].fresh()
        if self._keywords is None:
            args, kwargs = self._flat.rebuild(leaves)
        else:  # flat arguments: what tree_unflatten would build, without its cost
            args = tuple(leaves[: self._positional])
            kwargs = dict(zip(self._keywords, leaves[self._positional :], strict=True))
        if self._seeds is None:  # the first evaluation starts where the generators are
            self.start_from([generator.get_state() for generator in self.generators])
        else:
            for generator, state in self._seeds:
                generator.set_state(state)
        buffers = self._install(values) if self._parameter_places or self._buffer_places else ()
        if self.widen is False and self._held is None:  # the common case, in fewest calls
            output = self.function(*args, **kwargs)
            if type(output) is torch.Tensor and output.is_floating_point():
                return (output,)
            outputs = self._floating_outputs(output)
        elif self._held is not None:
            at_point = self._holds_point(values)
            writes = _BufferWrites(buffers, None if at_point else self._held)
            with writes:
                outputs = self._call(args, kwargs)
            if at_point:
                self._held = writes.written
        else:
            outputs = self._call(args, kwargs)
        if not self._evaluated:
            return self._first_evaluation(values, outputs, buffers)
        return outputs

    def _call(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        if self.widen is False:
            return self._floating_outputs(self.function(*args, **kwargs))
        with self._mode:
            output = self.function(*args, **kwargs)
        if self.widen is None:
            self.widen = bool(self.widened or self.narrowed or self.substituted)
        return self._floating_outputs(output)

    def _install(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This evaluation's parameters and fresh buffer copies in the modules; the buffers."""
        current: dict[int, torch.Tensor] = {}
        for place in self._parameter_places:
            key = id(place.tensor)
            if key not in current:
                slot = self._param_slots.get(key)
                current[key] = (
                    self._constants[key] if slot is None else self._with_hooks(slot, values[slot])
                )
            place.owner[place.key] = current[key]
        buffers = []
        for place in self._buffer_places:
            key = id(place.tensor)
            if key not in current:
                current[key] = self._buffers[key].clone()  # forwards update buffers in place
                buffers.append(current[key])
            place.owner[place.key] = current[key]
        return buffers

    def _first_evaluation(
        self, values: Sequence[torch.Tensor], outputs: tuple[torch.Tensor, ...], buffers: list
    ) -> tuple[torch.Tensor, ...]:
        """What only the first evaluation shows: random numbers drawn, a reentrant
        checkpoint, buffers the forward changes."""
        self._evaluated = True
        self._seeds = [
            (generator, state)
            for generator, state in self._seeds or ()
            if not torch.equal(generator.get_state(), state)
        ]
        originals = [
            (key, self._buffers[key])
            for key in dict.fromkeys(id(p.tensor) for p in self._buffer_places)
        ]
        changed = [
            self._buffer_names[key]
            for (key, original), now in zip(originals, buffers, strict=True)
            if not bitwise_equal(original, now)
        ]
        if changed:
            # Evaluated again at the point, to record what the forward writes there.
            self.held_buffers = tuple(changed)
            self._held = []
            return self.evaluate(values)
        return outputs

    def repeats_itself(self) -> bool:
        """Whether two evaluations at the point give the same outputs, bit for bit.

        A part of a model called on its own may keep state between calls (a key-value
        cache it appends to): it is then no function of its inputs to check."""
        point = [c.value.detach() for c in self.checked]
        first, second = self.evaluate(point), self.evaluate(point)
        return all(bitwise_equal(a, b) for a, b in zip(first, second, strict=True))

    def start_from(self, states: list[torch.Tensor]) -> None:
        """Each evaluation starts from these generator states, if the forward draws from
        them (the first evaluation shows whether it does)."""
        self._seeds = list(zip(self.generators, states, strict=True))

    def reentrant_checkpoint(self) -> bool:
        """Whether the forward at the point differentiates through a reentrant checkpoint.

        Asked only after torch raised: a graph walk per check would cost every check."""
        point = [c.value.detach().requires_grad_() for c in self.checked]
        try:
            outputs = self.evaluate(point)
        except Exception:
            return False
        return reentrant_checkpoint(outputs)

    def _holds_point(self, values: Sequence[torch.Tensor]) -> bool:
        return all(
            value is checked.value or torch.equal(value.detach(), checked.value)
            for value, checked in zip(values, self.checked, strict=True)
        )

    def probe(self, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """:meth:`evaluate` at a finite-difference input: an exception the model raises
        there becomes :class:`ProbeRefused`, which says which input it refused."""
        try:
            return self.evaluate(values)
        except _CHECK_ERRORS:
            raise
        except Exception as error:
            raise self._refused(values, error) from error

    def _refused(self, values: Sequence[torch.Tensor], error: Exception) -> ProbeRefused:
        for checked, value in zip(self.checked, values, strict=True):
            moved = (value.detach() - checked.value).reshape(-1)
            nonzero = moved.nonzero()
            if not len(nonzero):
                continue
            if len(nonzero) == 1:
                element = int(nonzero[0, 0])
                step = float(moved[element])
                sign = "+" if step > 0 else "-"
                probe = f"{checked.element(element)} {sign} {abs(step):g}"
            else:
                step = float(moved.norm())
                probe = f"{checked.name} moved by {step:g} along a random direction"
            return ProbeRefused(error, probe=probe, tensor=checked.name, step=abs(step))
        return ProbeRefused(error, probe="the point", tensor=self.checked[0].name, step=0.0)

    def explain(self, error: Exception) -> TypeError | None:
        """For an exception of the forward at the point: a ``TypeError`` naming the integer
        or boolean input the failing op got (or a tensor made from it), else ``None``."""
        if not self.integer_inputs:
            return None
        finder = _FailingOp(self.integer_inputs)
        point = [c.value.detach().requires_grad_() for c in self.checked]
        with self.installed(), finder, contextlib.suppress(Exception):
            self.evaluate(point)
        if finder.found is None:
            return None
        op, name, dtype, location = finder.found
        return TypeError(
            f"gradcheck: {name} is a {dtype} tensor, and {op} at {location} fails on it "
            f"({quoted(error)}): integer and boolean inputs are passed to "
            f"the forward as they are, neither differentiated nor converted, and the check "
            f"computes in float64. Convert it where the forward needs floating point "
            f"(.to(x.dtype)), or pass a floating-point tensor (to check its gradient: "
            f"x.double().requires_grad_())"
        )

    def _with_hooks(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """The value a parameter takes in the forward; its gradient runs the user's hooks."""
        checked = self.checked[slot]
        value = checked.as_user(value)
        if not checked.hooks or not value.requires_grad or not self.hooks_enabled:
            return value
        hooked = value.view_as(value)
        for hook in checked.hooks:
            hooked.register_hook(hook.function)
        return hooked

    def _floating_outputs(self, output: Any) -> tuple[torch.Tensor, ...]:
        if type(output) is torch.Tensor and self.output_names is not None:
            if output.is_floating_point():
                return (output,)
            if output.is_complex():
                return (torch.view_as_real(output.resolve_conj()),)
        names, tensors = [], []
        for name, leaf in named_leaves(output, "output"):
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                names.append(name)
                # A conjugate view (x.conj(), fft.ifft's output) has no real view of its own.
                tensors.append(
                    torch.view_as_real(leaf.resolve_conj()) if leaf.is_complex() else leaf
                )
        if not tensors:
            raise NoFloatingOutput(
                f"gradcheck: {self.description} returned {_describe_output(output)}, which holds "
                f"no floating-point tensor: there is nothing to differentiate; return the "
                f"tensor(s) whose gradients should be checked (a tensor, or a tuple, list or "
                f"dict of tensors)"
            )
        if self.output_names is None:
            self.output_names = names
            self.output_dtypes = [t.dtype for t in tensors]
        return tuple(tensors)

    def jitter(self, attempt: int) -> None:
        generator = torch.Generator().manual_seed(EVALUATION_SEED + attempt)
        for checked in self.checked:
            value = checked.value
            scale = float(value.abs().mean()) if value.numel() else 1.0
            noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            checked.value = value + JITTER_SCALE * (scale or 1.0) * noise.to(value.device)

    def module_hooks(self) -> list[str]:
        """``name: hook (file:line)`` for each backward hook on a module reached."""
        found = []
        for name, module in self.subject.named_modules():
            for hooks in (module._backward_hooks, module._backward_pre_hooks):
                found.extend(f"{name or 'the model'}: {hook_name(h)}" for h in hooks.values())
        return found


class ProbeRefused(Exception):
    """The model raised at a finite-difference input (``probe``), not at the point."""

    def __init__(self, error: Exception, *, probe: str, tensor: str, step: float) -> None:
        super().__init__(probe)
        self.error, self.probe, self.tensor, self.step = error, probe, tensor, step

    @property
    def what(self) -> str:
        return raised(self.error)


class Probes:
    """The function torch's check calls: the first call is at the point, the model's
    exceptions at the later ones (finite-difference inputs) are refusals."""

    def __init__(self, problem: Problem, at_point: tuple[torch.Tensor, ...] | None = None) -> None:
        # at_point: the outputs already evaluated at the tensors torch's check calls with.
        self.problem, self.first, self.at_point = problem, True, at_point

    def __call__(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first:
            self.first = False
            if self.at_point is not None:
                return self.at_point
            return self.problem.evaluate(values)
        try:
            return self.problem.evaluate(values)
        except _CHECK_ERRORS:
            raise
        except Exception as error:  # as Problem.probe, one call less per evaluation
            raise self.problem._refused(values, error) from error


class _FailingOp(TorchFunctionMode):
    """Finds the first torch call that raises with an integer input (or a tensor made
    from one) among its arguments: ``(op, input name, dtype, user's line)``."""

    def __init__(self, integer_inputs: dict[int, str]) -> None:
        super().__init__()
        self.sources = dict(integer_inputs)  # by id: the input a tensor comes from
        self.keep: list[torch.Tensor] = []  # keeps the ids of tensors made from one unique
        self.found: tuple[str, str, torch.dtype, Location] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        sources = [self.sources[id(leaf)] for leaf in leaves if id(leaf) in self.sources]
        try:
            result = func(*args, **kwargs)
        except Exception:
            if sources and self.found is None:
                dtype = next(leaf.dtype for leaf in leaves if id(leaf) in self.sources)
                location = user_location(sys._getframe(1)) or UNKNOWN_LOCATION
                self.found = (op_name(func), sources[0], dtype, location)
            raise
        if sources:
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor) and not (
                    leaf.is_floating_point() or leaf.is_complex()
                ):
                    self.sources[id(leaf)] = sources[0]
                    self.keep.append(leaf)
        return result


class _BufferWrites(TorchFunctionMode):
    """Records at the point, and holds everywhere else, what the forward writes into its
    buffers outside autograd.

    Autograd takes a value the forward writes into a buffer under ``torch.no_grad()``
    (spectral norm's power iteration, running statistics used in the output) as a
    constant; finite differences would see it move with the input. At the point each
    such write (in place, or through ``out=``) is recorded; at every other input the
    same write is overwritten with the value recorded, so both see one function.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], held: list | None) -> None:
        super().__init__()
        self.storages = {b.untyped_storage().data_ptr() for b in buffers if b.numel()}
        self.held = held
        self.written: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if writes(func, kwargs):
            target = kwargs.get("out", args[0] if args else None)
            if (
                isinstance(target, torch.Tensor)
                and target.numel()
                and target.untyped_storage().data_ptr() in self.storages
            ):
                self._write(target)
        return result

    def _write(self, target: torch.Tensor) -> None:
        index = len(self.written)
        if self.held is None:  # at the point: record, unless autograd sees the write
            self.written.append(None if target.requires_grad else target.detach().clone())
            return
        self.written.append(None)
        held = self.held[index] if index < len(self.held) else None
        if held is not None and held.shape == target.shape:
            with torch.no_grad():
                target.copy_(held)


# Types pytree treats as leaves that inputs often are: arguments of only these types are
# flat, and need no pytree to flatten or rebuild.
_LEAVES = frozenset(
    {torch.Tensor, nn.Parameter, int, float, bool, complex, str, type(None), torch.dtype}
)


# What the check itself raises from inside an evaluation: never a refusal of the model.
_CHECK_ERRORS = (
    NoFloatingOutput,
    CannotStayFloat64,
    GradcheckFailure,
    ProbeRefused,
)


@dataclass(frozen=True)
class _Hook:
    """A gradient hook of a parameter, as the check runs it on the float64 copy."""

    function: Callable[[torch.Tensor], Any]
    description: str
    location: Location


def _gradient_hooks(parameter: torch.Tensor) -> tuple[_Hook, ...]:
    """The parameter's ``register_hook`` and ``register_post_accumulate_grad_hook`` hooks."""
    hooks = [
        _Hook(_defined_only(h), hook_name(h), definition(h))
        for h in (parameter._backward_hooks or {}).values()
    ]
    for hook in (getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values():
        hooks.append(
            _Hook(
                _defined_only(_after_accumulation(hook)),
                hook_name(hook) + " (post-accumulate)",
                definition(hook),
            )
        )
    return tuple(hooks)


def _defined_only(hook: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    """``hook``, skipped for the undefined gradients torch's check sends through backward."""

    def run(grad: torch.Tensor | None) -> Any:
        return None if grad is None else hook(grad)

    return run


def _after_accumulation(hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """A tensor hook that runs a post-accumulate-grad hook on a stand-in for the parameter.

    The stand-in holds the gradient in ``.grad`` as training would; what the hook
    leaves there is the gradient that is checked.
    """

    def run(grad: torch.Tensor) -> torch.Tensor:
        stand_in = torch.zeros_like(grad)
        stand_in.grad = grad.detach().clone()
        hook(stand_in)
        return grad if stand_in.grad is None else stand_in.grad

    return run


def hook_name(hook: Any) -> str:
    code = getattr(hook, "__code__", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    if code is None:
        return name
    where = f"{display_path(code.co_filename)}:{code.co_firstlineno}"
    return f"{name.replace('.<locals>', '')} ({where})"


def _named(slots: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of the slots once, by its first name."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for slot in slots:
        found.setdefault(id(slot.tensor), (slot.name, slot.tensor))
    return list(found.values())


def _places(slots: list[Slot]) -> list[Slot]:
    """Each place once: a module reached under several names keeps its tensors once."""
    places: dict[tuple[int, str], Slot] = {}
    for slot in slots:
        places.setdefault((id(slot.owner), slot.key), slot)
    return list(places.values())


def _generators(tensors: list[torch.Tensor]) -> list[torch.Generator]:
    """The default generators of the devices in use: what dropout and friends draw from.

    ``torch.manual_seed`` would do, but it also queues a seed for every CUDA device,
    formatting a stack trace each time: a hundred times slower than a forward pass of
    a small model.
    """
    generators = [torch.default_generator]
    for index in sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}):
        generators.append(torch.cuda.default_generators[index])
    return generators


def _describe_output(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a {output.dtype} tensor"
    leaves = tree_leaves(output)
    kinds = [
        f"{leaf.dtype} tensor" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        for leaf in leaves
    ]
    return f"{type(output).__name__} of [{', '.join(kinds)}]" if leaves else repr(output)
