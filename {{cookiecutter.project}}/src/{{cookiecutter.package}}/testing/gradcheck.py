"""Check the gradients of a whole dynamic model numerically: inputs and every parameter.

``gradcheck(model, x)`` compares the gradients autograd computes with finite
differences, for the inputs that require grad and every trainable parameter of the
modules the callable reaches (:mod:`.calls`). It computes in float64 end to end
(:mod:`.float64`; an op without a float64 kernel runs in float32, and the check then
takes float32's tolerances): the modules hold float64 copies of their parameters and
buffers while it runs and get their own tensors back afterwards, so the model and
tensors passed in keep their dtype, values, device, ``requires_grad``, ``.grad`` and
hooks. Parameter gradient hooks run on the copies: they are part of the checked
gradient. Outputs are taken as torch's check takes them (conjugate views resolved,
complex ones as real pairs, those autograd does not connect to the checked tensors
left out), empty tensors anywhere. Slow mode and second order use
``torch.autograd.gradcheck``/``gradgradcheck``; when a check fails, this module finds
the element that is wrong and says why:

- a wrong gradient: where it enters (a gradient hook, a custom autograd Function or
  the smallest submodule wrong on its own, each checked on its own at the inputs it
  got, :mod:`.parts`), then what it reaches: the tensor and element (``parameter
  fc2.weight[3, 1]``), the output element, the numerical and analytical values, the
  other wrong tensors;
- a branch boundary: the finite differences took another branch of a data-dependent
  decision (``if h.mean() > 0``) than the point itself, found by recording each
  evaluation's decisions with :mod:`.control_flow`: an input or a parameter crossed
  it, the decision went the other way or a loop ran a different number of times;
- a kink: the one-sided differences disagree (relu, abs, max, clamp evaluated exactly
  where they switch); a jump when the outputs change as much over half the step;
- a refused input: the model raised at every finite-difference input near the point
  (an exception at one is never the verdict: the step shrinks first).

Cost. Slow mode compares every element: two forward passes per checked element, and
one backward pass per output element. Fast mode (first order) takes one backward
pass for the gradient of a random weighting of the outputs, and two forward passes
per checked tensor for its derivative along a random direction, whatever
the tensor's size; a tensor whose derivatives disagree, or differ by more than a
single wrong element of 1% of its largest gradient element would make them, is
searched by bisection and rechecked element by element, so a failure still names an
element. With ``fast=None`` fast mode is used above ``FAST_MODE_ABOVE`` checked
elements. A failing check's diagnosis makes at most ``DIAGNOSIS_MULTIPLE`` times the
evaluations of the check itself (plus ``DIAGNOSIS_FLOOR``).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.gradcheck import GradcheckError
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .branches import BranchSide, other_sides
from .calls import (
    REENTRANT_CHECKPOINT,
    forward_kwargs_of,
    reached_modules,
    reentrant_checkpoint,
    reject_data_less,
    reject_unknown_keywords,
)
from .comparison import bitwise_equal
from .control_flow import (
    UNKNOWN_LOCATION,
    Decision,
    DecisionLog,
    Location,
    display_path,
    first_divergence,
    probing,
    record_decisions,
    user_location,
)
from .failures import CheckFailure, quoted, raised
from .float64 import CannotStayFloat64, Float64Mode, Narrowing, Widening, writes
from .naming import describe_callable, element_name, input_names
from .parts import FunctionCall, ModuleCall, Parts, State, definition, record_parts
from .trees import named_leaves

# Above this many checked elements (inputs and parameters together) fast=None picks
# fast mode: slow mode would cost two forward passes per element.
FAST_MODE_ABOVE = 2048
# A failing tensor up to this size is rechecked element by element; a larger one is
# first narrowed down by bisection over random directions.
ELEMENTWISE_LIMIT = 1024
# Fast mode flags a tensor for an element-wise search when its directional derivatives
# disagree by this fraction of its largest gradient element (times the direction's
# smallest weight, see _Check._screen): a single element wrong by 1% of that is found
# with a margin of 4x.
SCREENING_FRACTION = 0.0025
# The diagnosis compares each output element separately up to this many output
# elements (one backward pass each); above, one random weighting of the outputs.
OUTPUT_ELEMENTS_LIMIT = 1024
# The seed of the check's own random numbers (output weights, directions, moved points).
# Each evaluation of the function starts from the generator states the check started
# with, so dropout drops the same units in every evaluation.
EVALUATION_SEED = 1234
# avoid_boundaries=True: how far, and how many times, the point is moved.
JITTER_SCALE = 1e-3
JITTER_ATTEMPTS = 3

# A failing check's diagnosis (which element, why, where the error enters) makes at
# most this many times the evaluations the check made before it failed (a passing
# check's cost) plus DIAGNOSIS_FLOOR: the element search comes first; the other
# tensors' elements and the parts checked on their own get what is left.
DIAGNOSIS_MULTIPLE = 20
DIAGNOSIS_FLOOR = 64
# When a wrong first-order gradient is found, at most this many parts of the forward
# (custom autograd Functions, submodules) are checked on their own, each in fast mode.
LOCALIZATION_PARTS = 16
# Where an op has no float64 kernel and runs in float32 (float64.Narrowing), the check
# takes the step and tolerances of a float32 gradient check: with eps=1e-3 the rounding
# of a float32 result (about 1e-7 of its size, divided by eps) and the truncation error
# of the central difference (about eps², 1e-6) both stay near 1e-4 of the gradient, a
# tenth of the tolerances; a wrong gradient off by 5% (or a wrong element) still fails.
FLOAT32_TOLERANCES = (1e-3, 1e-3, 1e-2)  # eps, atol, rtol
# When the model raises at a finite-difference input (a solver's assertion), the step
# shrinks this many times by STEP_SHRINK before the point is reported as uncheckable.
STEP_RETRIES = 2
STEP_SHRINK = 10.0

# A part's evaluation counts as at least this share of one of the whole model.
_SMALLEST_SHARE = 1 / 64
_BISECTION_BLOCK = 16
_ANALYTICAL_ENTRIES_LIMIT = 1 << 23

__all__ = [
    "ELEMENTWISE_LIMIT",
    "FAST_MODE_ABOVE",
    "BranchBoundary",
    "ErrorSource",
    "GradcheckFailure",
    "GradcheckResult",
    "NonDifferentiablePoint",
    "OutputJump",
    "RefusedProbe",
    "SourceKind",
    "WrongGradient",
    "gradcheck",
]


class GradcheckFailure(CheckFailure):
    """The gradient check failed; the message says which element and why."""

    check = "gradcheck"


class SourceKind(enum.Enum):
    """The kind of place where a wrong gradient enters."""

    FUNCTION = "custom autograd Function"
    MODULE = "submodule"
    HOOK = "gradient hook"


@dataclass(frozen=True)
class ErrorSource:
    """Where a wrong gradient enters: the smallest part found wrong on its own.

    ``name`` is the Function's class, the module's name and class, or the hook;
    ``location`` the line of the Function's ``backward`` (of the hook); ``applied_at``
    the user's line that applied the Function and ``module`` the module it ran in;
    ``tensor``, ``index``, ``numerical`` and ``analytical`` the part's own wrong element
    (its input, named as its forward names it).
    """

    kind: SourceKind
    name: str
    location: Location
    applied_at: Location | None = None
    module: str = ""
    tensor: str = ""
    index: tuple[int, ...] = ()
    numerical: float = 0.0
    analytical: float = 0.0

    def __str__(self) -> str:
        if self.kind is SourceKind.FUNCTION:
            applied = f", applied at {self.applied_at}" if self.applied_at else ""
            where = f" in {self.module}" if self.module else ""
            backward = f"its backward at {self.location}"
            return f"the {self.kind.value} {self.name} ({backward}){applied}{where}"
        if self.kind is SourceKind.HOOK:
            return f"the {self.kind.value} {self.name} of {self.tensor}"
        return f"the {self.kind.value} {self.name}" if self.module else self.name


class WrongGradient(GradcheckFailure):
    """Autograd's gradient differs from the finite differences at ``tensor[index]``.

    ``source`` says where the error enters when the check narrowed it down to a
    custom autograd Function, a submodule or a gradient hook (``None`` otherwise).
    """

    def __init__(
        self,
        message: str,
        *,
        tensor: str,
        index: tuple[int, ...],
        order: int,
        numerical: float,
        analytical: float,
        source: ErrorSource | None = None,
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.order = tensor, index, order
        self.numerical, self.analytical = numerical, analytical
        self.source = source
        self.output = "output"  # the output element it was compared on


class RefusedProbe(GradcheckFailure):
    """The model raised at every finite-difference input near the point, down to the
    smallest step: the gradient cannot be checked there (not a wrong gradient)."""

    def __init__(self, message: str, *, tensor: str, error: BaseException) -> None:
        super().__init__(message)
        self.tensor, self.error = tensor, error


class BranchBoundary(GradcheckFailure):
    """The point is within eps of a data-dependent decision: the gradient is not checkable there."""

    def __init__(
        self, message: str, *, tensor: str, index: tuple[int, ...], decision: Decision | None
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.decision = tensor, index, decision


class NonDifferentiablePoint(GradcheckFailure):
    """One-sided differences disagree at ``tensor[index]``: the function has a kink there."""

    def __init__(
        self, message: str, *, tensor: str, index: tuple[int, ...], left: float, right: float
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.left, self.right = tensor, index, left, right


class OutputJump(NonDifferentiablePoint):
    """The outputs jump at ``tensor[index]`` (by ``change`` over one step): a discontinuity."""

    def __init__(
        self,
        message: str,
        *,
        tensor: str,
        index: tuple[int, ...],
        left: float,
        right: float,
        change: float,
    ) -> None:
        super().__init__(message, tensor=tensor, index=index, left=left, right=right)
        self.change = change


@dataclass(frozen=True)
class GradcheckResult:
    """What a passing check covered: ``str()`` of it is the line ``pytest -v`` shows."""

    function: str
    tensors: tuple[tuple[str, int], ...]
    orders: tuple[int, ...]
    fast: bool
    mode_reason: str
    moved: int
    seconds: float
    widened: tuple[str, ...] = ()
    branches: tuple[BranchSide, ...] = ()  # with branches="all": each decision's other side
    # Ops without a float64 kernel, run in float32; then the step and tolerances used.
    narrowed: tuple[str, ...] = ()
    tolerances: tuple[float, float, float] = (1e-6, 1e-5, 1e-3)  # eps, atol, rtol
    # Inputs the model raised at, and the smaller step checked with instead.
    refused: tuple[str, ...] = ()
    # Buffers the forward changes: restored before each evaluation, their writes held.
    held_buffers: tuple[str, ...] = ()

    @property
    def elements(self) -> int:
        return sum(numel for _, numel in self.tensors)

    def __str__(self) -> str:
        order = " and ".join(("first", "second")[o - 1] for o in self.orders)
        moved = f", at a point moved {self.moved}x off a boundary" if self.moved else ""
        return (
            f"gradcheck {self.function}: {order} order passed in {self.seconds:.2f} s, "
            f"{_mode_text(self.fast, self.mode_reason)}, {len(self.tensors)} tensor(s) "
            f"({', '.join(name for name, _ in self.tensors)}){moved}{_widened_text(self.widened)}"
            f"{_narrowed_text(self.narrowed, self.tolerances)}{_refused_text(self.refused)}"
            f"{_held_text(self.held_buffers)}{_branches_text(self.branches)}"
        )


def _branches_text(branches: Sequence[BranchSide]) -> str:
    if not branches:
        return ""
    return "; branches: " + "; ".join(str(side) for side in branches)


def _narrowed_text(narrowed: Sequence[str], tolerances: tuple[float, float, float]) -> str:
    if not narrowed:
        return ""
    eps, atol, rtol = tolerances
    return (
        f"; computed in float32 where no float64 kernel exists: {', '.join(narrowed)}; "
        f"checked with eps={eps:g}, atol={atol:g}, rtol={rtol:g}"
    )


def _refused_text(refused: Sequence[str]) -> str:
    return "; " + "; ".join(refused) if refused else ""


def _held_text(held: Sequence[str]) -> str:
    if not held:
        return ""
    return (
        f"; buffers the forward changes ({', '.join(held)}): restored before each evaluation, "
        f"and what the forward writes into them outside autograd held at its value at the point"
    )


def _widened_text(widened: Sequence[str]) -> str:
    if not widened:
        return ""
    return f"; computed in float64 where the forward asks for less: {', '.join(widened)}"


def gradcheck(
    model_or_function: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: Mapping[str, Any] | None = None,
    params: bool | Iterable[str] = True,
    gradgrad: bool = False,
    fast: bool | None = None,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    avoid_boundaries: bool = False,
    branches: str = "point",
    **unknown: Any,
) -> GradcheckResult:
    """Check the gradients of ``model_or_function(*inputs, **forward_kwargs)`` numerically.

    Checked: every floating-point (or complex) tensor in ``inputs``/``forward_kwargs``
    that requires grad and every parameter that requires grad of the modules the
    callable reaches (a module, a bound method of one, a ``functools.partial``, a
    closure, default argument or global holding modules or containers of modules):
    all of them (``params=True``), none (``params=False``) or the ones named in
    ``params``. Parameter gradient hooks are part of the checked gradient.
    ``gradgrad=True`` checks second-order gradients as well. ``fast`` forces fast mode
    (``True``) or slow mode (``False``); ``None`` picks fast mode above
    ``FAST_MODE_ABOVE`` checked elements. ``avoid_boundaries=True`` retries at up to
    ``JITTER_ATTEMPTS`` points moved by seeded noise of relative size ``JITTER_SCALE``
    when the point is on a branch boundary or a kink. ``branches="all"`` checks, besides
    the point, a nearby point on the other side of each branch decision the point
    reaches (see :mod:`.branches`); where none is found within the bound, the result
    says so, and that alone is no failure. Options are keyword-only; any
    other keyword is a ``TypeError``: the forward's keyword arguments go in
    ``forward_kwargs``.

    Everything computes in float64 (see :mod:`.float64`); the model and the tensors
    passed in are left as they were. Raises a :class:`GradcheckFailure` (an
    ``AssertionError``) naming the element on failure, ``TypeError``/``ValueError`` for
    arguments it cannot check (an integer input an op fails on: a ``TypeError`` naming
    it). torch's default dtype and its random number generators are as they were before
    (every evaluation starts from the generators' states at the start); the check takes
    no snapshot of the rest of torch's settings, which the plugin restores after each
    test.
    """
    __tracebackhide__ = True
    reject_unknown_keywords("gradcheck", unknown, _OPTIONS)
    kwargs = forward_kwargs_of("gradcheck", forward_kwargs)
    if not isinstance(params, (bool, str, bytes)) and isinstance(params, Iterable):
        params = list(params)
    _validate_options(model_or_function, params, gradgrad, fast, eps, atol, rtol, avoid_boundaries)
    if branches not in BRANCH_CHOICES:
        raise ValueError(
            f"gradcheck: branches={branches!r} is not allowed: expected one of "
            f"{', '.join(map(repr, BRANCH_CHOICES))}"
        )
    started = time.perf_counter()
    problem = _Problem(model_or_function, inputs, kwargs, params)
    elements = sum(checked.numel for checked in problem.checked)
    if fast is None:
        use_fast = elements > FAST_MODE_ABOVE
        relation = ">" if use_fast else "<="
        reason = f"{elements:,} elements {relation} FAST_MODE_ABOVE={FAST_MODE_ABOVE:,}"
    else:
        use_fast, reason = fast, f"fast={fast}"
    orders = (1, 2) if gradgrad else (1,)
    check = _Check(problem, fast=use_fast, reason=reason, eps=eps, atol=atol, rtol=rtol)
    with _rngs_kept(problem.generators) as states:
        problem.start_from(states)
        try:
            moved, sides = _run(problem, check, orders, avoid_boundaries, branches)
        except WrongGradient as failure:
            if failure.order != 1:
                raise
            raise _localized(problem, check, failure) from None
        except _OnTheOtherSide as other:
            failure = other.failure
            if isinstance(failure, WrongGradient) and failure.order == 1:
                failure = _localized(problem, check, failure, other.side.values)
            raise other.reported(failure) from None
        except (GradcheckFailure, CannotStayFloat64):
            raise
        except Exception as error:
            explained = problem.explain(error)
            if explained is None:
                raise
            raise explained from None
    return GradcheckResult(
        function=problem.description,
        tensors=tuple((c.name, c.numel) for c in problem.checked),
        orders=orders,
        fast=use_fast,
        mode_reason=reason,
        moved=moved,
        seconds=time.perf_counter() - started,
        widened=tuple(str(w) for w in problem.widened.values()),
        branches=sides,
        narrowed=tuple(str(n) for n in problem.narrowed.values()),
        tolerances=(check.eps, check.atol, check.rtol),
        refused=tuple(check.refused),
        held_buffers=problem.held_buffers,
    )


def _run(
    problem: _Problem,
    check: _Check,
    orders: tuple[int, ...],
    avoid_boundaries: bool,
    branches: str,
) -> tuple[int, tuple[BranchSide, ...]]:
    """Check each order at the point (moved off boundaries on request), then the other
    sides of its branches; how often the point moved, and the sides."""
    __tracebackhide__ = True
    moved = 0
    with problem.installed():
        while True:
            try:
                for order in orders:
                    check.run(order)
                break
            except (BranchBoundary, NonDifferentiablePoint) as failure:
                if not avoid_boundaries:
                    raise
                if moved == JITTER_ATTEMPTS:
                    note = f"(still so after moving the point {moved} times: avoid_boundaries=True)"
                    failure.args = (f"{failure}\n{note}",)
                    raise
                moved += 1
                problem.jitter(moved)
        sides = _check_other_sides(problem, check, orders) if branches == "all" else ()
    return moved, sides


@contextlib.contextmanager
def _rngs_kept(generators: Sequence[torch.Generator]) -> Iterator[list[torch.Tensor]]:
    """The generators' states as they were before the block (yielded): the check resets
    them to these states before each evaluation, and puts them back afterwards."""
    states = [generator.get_state() for generator in generators]
    try:
        yield states
    finally:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)


_OPTIONS = ("params", "gradgrad", "fast", "eps", "atol", "rtol", "avoid_boundaries", "branches")
BRANCH_CHOICES = ("point", "all")


def _localized(
    problem: _Problem,
    check: _Check,
    failure: WrongGradient,
    point: Sequence[torch.Tensor] | None = None,
) -> WrongGradient:
    """``failure`` told from where the error enters to what it reaches.

    Narrowed down within the diagnosis budget, cheapest first: a gradient hook of the
    wrong parameter (the check without it passes); else each custom autograd Function
    the forward applied, checked on its own at the inputs it got there; else the
    submodules, from the outermost down, to the smallest one wrong on its own. Each
    part is checked in fast mode, then diagnosed like the whole.
    """
    started = time.perf_counter()
    search = _Localization(problem, check)
    at_point = [checked.value for checked in problem.checked]
    if point is not None:  # the other side of a branch, where the failure was found
        for checked, value in zip(problem.checked, point, strict=True):
            checked.value = value
    try:
        source, part = search.run(failure)
    finally:
        for checked, value in zip(problem.checked, at_point, strict=True):
            checked.value = value
    if search.checked_parts == 0 and source is None:
        return failure
    lines = str(failure).splitlines()
    what = lines[0].split(" with respect to ")[0]
    diagnosis = round(
        problem.evaluations + search.part_evaluations - check._run_started - check.spent
    )
    narrowed = (
        f"  narrowed down in {time.perf_counter() - started:.2f} s by checking parts on their "
        f"own ({search.summary()}); the diagnosis made {diagnosis:,} "
        f"evaluations, {diagnosis / max(check.spent, 1):.1f}x the {check.spent:,} of the check"
    )
    if source is None:
        body = [lines[0], *lines[1:-1], narrowed + "; no part is wrong on its own", lines[-1]]
        message = "\n".join(body)
    else:
        element = lines[0].split(" with respect to ", 1)[1]
        head = [f"{what}: the error enters in {source}"]
        if part is not None:
            head.append(f"  on its own, at the inputs it got there: {part}")
        head.append(f"  it reaches {element}:")
        message = "\n".join([*head, *lines[1:-1], narrowed, lines[-1]])
    localized = WrongGradient(
        message,
        tensor=failure.tensor,
        index=failure.index,
        order=failure.order,
        numerical=failure.numerical,
        analytical=failure.analytical,
        source=source,
    )
    localized.output = failure.output
    return localized


class _Localization:
    """Checks the parts of a failing model on their own, within the diagnosis budget."""

    def __init__(self, problem: _Problem, check: _Check) -> None:
        self.problem, self.check = problem, check
        remaining = check.diagnosis_budget() - problem.evaluations
        self.budget = max(remaining, check.spent + DIAGNOSIS_FLOOR)
        self.started = problem.evaluations
        # The parts' own evaluations, each counted as the share of a whole evaluation its
        # checked elements are of the model's (a part's forward is that much smaller).
        self.part_evaluations = 0.0
        self.elements = sum(c.numel for c in problem.checked) or 1
        self.functions = self.modules = self.hooks = 0
        self.checked_parts = 0

    def summary(self) -> str:
        """What was checked on its own: ``1 autograd Function call and 3 module calls``."""
        parts = ["the model without its gradient hooks"] if self.hooks else []
        for count, what in (
            (self.functions, "autograd Function call"),
            (self.modules, "module call"),
        ):
            if count:
                parts.append(f"{count} {what}" + ("s" if count > 1 else ""))
        return " and ".join(parts) or "no part"

    @property
    def evaluations(self) -> float:
        """What the narrowing has cost so far, in evaluations of the whole model."""
        return self.part_evaluations + self.problem.evaluations - self.started

    @property
    def exhausted(self) -> bool:
        return self.checked_parts >= LOCALIZATION_PARTS or self.evaluations >= self.budget

    def run(self, failure: WrongGradient) -> tuple[ErrorSource | None, str | None]:
        """Where the error enters, and the part's own wrong derivative (as text)."""
        hook = self._hook(failure)
        if hook is not None:
            return hook, None
        problem = self.problem
        point = [c.value.detach().requires_grad_() for c in problem.checked]
        with problem.installed(), record_parts(problem.module_names()) as parts:
            problem.evaluate(point)
        found = self._functions(parts) or self._modules(parts)
        return found or (None, None)

    def _part(self, function, args: tuple, kwargs: dict, params, hooks: bool = True):
        """The failure of ``function`` checked on its own; ``None`` when it passes or cannot
        be checked on its own (an exception, a boundary: inconclusive).

        Fast mode first; where it passes, slow mode too if it fits in the budget: one
        random direction misses an error orthogonal to it (two swapped elements of equal
        sign in it), every element does not.
        """
        self.checked_parts += 1
        part = None
        try:
            part = _Problem(function, args, kwargs, params)
            part.hooks_enabled = hooks
            with part.installed():
                if not part.repeats_itself():
                    return None  # it keeps state between calls (a cache): no function to check
                for fast in (True, False):
                    slow_cost = 2 * sum(c.numel for c in part.checked) + 2
                    if not fast and slow_cost > self.budget - self.evaluations - part.evaluations:
                        break
                    self._check(part, fast=fast, reason="a part checked on its own", part=True)
        except WrongGradient as failure:
            return failure
        except Exception:  # the part cannot be checked on its own: no verdict
            return None
        finally:
            if part is not None:
                share = sum(c.numel for c in part.checked) / self.elements
                self.part_evaluations += part.evaluations * min(1.0, max(share, _SMALLEST_SHARE))
        return None

    def _check(self, problem: _Problem, *, fast: bool, reason: str, part: bool = False) -> None:
        """First order of ``problem`` with the failing check's step and tolerances."""
        check = _Check(
            problem,
            fast=fast,
            reason=reason,
            eps=self.check.eps,
            atol=self.check.atol,
            rtol=self.check.rtol,
        )
        check.part = part
        check.run(1)

    def _hook(self, failure: WrongGradient) -> ErrorSource | None:
        """The wrong parameter's gradient hooks, when the check passes without them."""
        problem = self.problem
        checked = next((c for c in problem.checked if c.name == failure.tensor), None)
        if checked is None or not checked.hooks:
            return None
        self.hooks += 1
        self.checked_parts += 1
        problem.hooks_enabled = False
        try:
            with problem.installed():
                self._check(problem, fast=True, reason="the model without its gradient hooks")
        except Exception:  # still wrong without them (or not checkable): not the hooks
            return None
        finally:
            problem.hooks_enabled = True
        hooks = ", ".join(hook.description for hook in checked.hooks)
        return ErrorSource(SourceKind.HOOK, hooks, checked.hooks[0].location, tensor=checked.name)

    def _whole_model(self, call: ModuleCall, level: list[ModuleCall]) -> bool:
        """Whether ``call`` is the model the check ran: the callable itself, or the one
        module a function called at the top (``lambda x: model(x)``) holding every
        parameter checked. Checked on its own it would only repeat the check."""
        if call.module is self.problem.function:
            return True
        if call.parent is not None or any(other.module is not call.module for other in level):
            return False
        checked = {id(tensor) for tensor in self.problem.user_parameters()}
        return checked <= _parameter_ids(call.module)

    def _functions(self, parts: Parts) -> tuple[ErrorSource, str] | None:
        seen: set[tuple] = set()
        for call in parts.functions:
            key = (call.function, call.location, call.module.name if call.module else None)
            if key in seen or not _differentiable(call.args, call.kwargs):
                continue
            seen.add(key)
            if self.exhausted:
                return None
            self.functions += 1
            failure = self._part(_applier(call), call.args, call.kwargs, False)
            if failure is not None:
                source = ErrorSource(
                    SourceKind.FUNCTION,
                    call.function.__qualname__.replace(".<locals>", ""),
                    call.backward_location,
                    applied_at=call.location if call.location.line else None,
                    module=call.module.describe() if call.module else "",
                    tensor=failure.tensor,
                    index=failure.index,
                    numerical=failure.numerical,
                    analytical=failure.analytical,
                )
                return source, _derivative_text(failure)
        return None

    def _modules(self, parts: Parts) -> tuple[ErrorSource, str | None] | None:
        """The smallest module call wrong on its own, descending from the outermost."""
        checked_names = {c.name.removeprefix("parameter ") for c in self.problem.checked}
        found: tuple[ModuleCall, WrongGradient | None] | None = None
        level = parts.modules
        while level and not self.exhausted:
            wrong = None
            seen: set[int] = set()
            for call in level:
                if id(call.module) in seen:
                    continue
                seen.add(id(call.module))
                if self._whole_model(call, level):
                    wrong = (call, None)  # the whole model: known to be wrong
                    break
                if self.exhausted:
                    break
                prefix = f"{call.name}." if call.name else ""
                params = [
                    name.removeprefix(prefix)
                    for name, _ in call.module.named_parameters(prefix=call.name)
                    if name in checked_names
                ]
                if not params and not _differentiable(call.args, call.kwargs):
                    continue
                self.modules += 1
                failure = self._part(call.module, call.args, call.kwargs, params)
                if failure is not None:
                    wrong = (call, failure)
                    break
            if wrong is None:
                break
            found = wrong
            level = wrong[0].children
        if found is None:
            return None
        call, failure = found
        children = ", ".join(sorted({child.name for child in call.children}))
        if failure is None:  # the model itself
            if not self.modules:
                return None  # nothing smaller was checked: nothing to add
            name = (
                f"the forward of {call.describe()} itself: none of its submodules ({children}) "
                f"is wrong on its own, nor any autograd Function"
            )
        else:
            within = f" (none of its submodules {children} is, nor any autograd Function)"
            name = call.describe() + ": wrong on its own" + (within if children else "")
            hooks = [
                _hook_name(hook)
                for hooks in (call.module._backward_hooks, call.module._backward_pre_hooks)
                for hook in hooks.values()
            ]
            if hooks:
                name += f", with its backward hook(s) {', '.join(hooks)}"
        source = ErrorSource(
            SourceKind.MODULE,
            name,
            UNKNOWN_LOCATION,
            module=call.name,
            tensor=failure.tensor if failure else "",
            index=failure.index if failure else (),
            numerical=failure.numerical if failure else 0.0,
            analytical=failure.analytical if failure else 0.0,
        )
        return source, _derivative_text(failure) if failure else None


def _parameter_ids(module: nn.Module) -> set[int]:
    return {id(parameter) for parameter in module.parameters()}


def _differentiable(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor that requires grad is among the arguments."""
    return any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad
        for leaf in pytree.tree_leaves((args, kwargs))
    )


def _applier(call: FunctionCall) -> Callable[..., Any]:
    """``call.function.apply`` as a function named like it, its inputs named like the forward's."""
    function = call.function

    def apply(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)

    apply.__qualname__ = f"{function.__qualname__}.apply".replace(".<locals>", "")
    named = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in call.input_names()
    ]
    rest = [inspect.Parameter("inputs", inspect.Parameter.VAR_POSITIONAL)]
    apply.__signature__ = inspect.Signature(named + rest)  # type: ignore[attr-defined]
    return apply


def _derivative_text(failure: WrongGradient) -> str:
    """``d output[0, 1] / d input x[1, 2]: numerical 0.1, analytical 0.2``."""
    element = element_name(failure.tensor, failure.index)
    return (
        f"d {failure.output} / d {element}: numerical {failure.numerical:.6g}, analytical "
        f"{failure.analytical:.6g}"
    )


class _OnTheOtherSide(Exception):
    """A failure found on the other side of a branch; ``gradcheck`` narrows it down there."""

    def __init__(self, failure: GradcheckFailure, side: BranchSide) -> None:
        super().__init__(str(failure))
        self.failure, self.side = failure, side

    def reported(self, failure: GradcheckFailure) -> GradcheckFailure:
        side = self.side
        failure.args = (
            f"on the other side of the branch at {side.location} ({side.source}): "
            f"{not side.at_point} there, {side.at_point} at the given point; the inputs "
            f"moved by {side.moved:.3g} of their norm:\n{failure}",
        )
        return failure


def _check_other_sides(
    problem: _Problem, check: _Check, orders: tuple[int, ...]
) -> tuple[BranchSide, ...]:
    """Check the gradients on the other side of each branch decision the point reaches."""
    __tracebackhide__ = True
    at_point = [checked.value for checked in problem.checked]
    movable = sorted({slot for _, slot in problem._input_slots})
    sides = other_sides(problem.evaluate, at_point, movable, eps=check.eps)
    for side in sides:
        if not side.found:
            continue
        for checked, value in zip(problem.checked, side.values, strict=True):
            checked.value = value
        try:
            for order in orders:
                check.run(order)
        except GradcheckFailure as failure:
            raise _OnTheOtherSide(failure, side) from None
        finally:
            for checked, value in zip(problem.checked, at_point, strict=True):
                checked.value = value
    return tuple(sides)


def _validate_options(function, params, gradgrad, fast, eps, atol, rtol, avoid_boundaries) -> None:
    __tracebackhide__ = True
    if not callable(function):
        raise TypeError(
            f"gradcheck: model_or_function must be an nn.Module or a callable, "
            f"got {type(function).__name__} {function!r}"
        )
    for name, value in (("gradgrad", gradgrad), ("avoid_boundaries", avoid_boundaries)):
        if not isinstance(value, bool):
            raise TypeError(f"gradcheck: {name} must be True or False, got {value!r}")
    if fast is not None and not isinstance(fast, bool):
        raise TypeError(f"gradcheck: fast must be None, True or False, got {fast!r}")
    if not (isinstance(params, bool) or _is_name_list(params)):
        raise TypeError(
            f"gradcheck: params must be True, False or a list of parameter names, got {params!r}"
        )
    for name, value, smallest in (("eps", eps, None), ("atol", atol, 0.0), ("rtol", rtol, 0.0)):
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
        if not ok or (value <= 0 if smallest is None else value < smallest):
            allowed = "a finite number > 0" if smallest is None else "a finite number >= 0"
            raise ValueError(f"gradcheck: {name} must be {allowed}, got {value!r}")


def _is_name_list(value: Any) -> bool:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return False
    return all(isinstance(item, str) for item in value)


def _mode_text(fast: bool, reason: str) -> str:
    if fast:
        return (
            f"fast mode ({reason}: one random direction per tensor, screened for single wrong "
            "elements; fast=False checks every element)"
        )
    return f"slow mode ({reason}: every element)"


# --- the function under check, on float64 copies --------------------------------------


@dataclass
class _Checked:
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
        return _unravel(flat, tuple(self.value.shape))

    def element(self, flat: int) -> str:
        index = self.index(flat)
        part = ""
        if self.is_complex:
            index, part = index[:-1], (" (real part)", " (imaginary part)")[index[-1]]
        return element_name(self.name, index) + part


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def _float64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 (complex128) copy holding the values; a conjugate or negative view resolved."""
    dtype = torch.complex128 if tensor.is_complex() else torch.float64
    return tensor.detach().resolve_conj().resolve_neg().to(dtype=dtype, copy=True).contiguous()


def _checked_copy(name: str, tensor: torch.Tensor) -> _Checked:
    copy = _float64_copy(tensor)
    if copy.is_complex():
        return _Checked(name, torch.view_as_real(copy).clone(), True)
    return _Checked(name, copy, False)


class _NoFloatingOutput(TypeError):
    """Raised inside torch's check; re-raised as a plain TypeError without torch's frames."""


@dataclass(frozen=True)
class _Place:
    """Where a module keeps a parameter or buffer (``owner[key]``), and the user's tensor."""

    owner: dict[str, Any]
    key: str
    tensor: torch.Tensor


class _Problem:
    """``model_or_function`` as a function of the checked float64 tensors.

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
        self.roots = reached_modules(function)
        self.checked: list[_Checked] = []
        self._input_slots: list[tuple[int, int]] = []
        self.output_names: list[str] | None = None
        self.output_dtypes: list[torch.dtype] = []
        self._mode = Float64Mode()
        self.widened: dict[Any, Widening] = self._mode.widened
        self.narrowed: dict[Any, Narrowing] = self._mode.narrowed
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
        names = input_names(function, len(inputs))
        if all(type(value) in _LEAVES for value in (*inputs, *kwargs.values())):
            # Flat arguments (the common case): what pytree would find, without its cost.
            self._keywords: list[str] | None = list(kwargs)
            named_leaves = [
                *((f"input {name}", value) for name, value in zip(names, inputs, strict=True)),
                *((f"input {key}", value) for key, value in kwargs.items()),
            ]
        else:
            paths_and_leaves, self._spec = pytree.tree_flatten_with_path((inputs, kwargs))
            flat = all(len(path) == 2 for path, _ in paths_and_leaves)
            flat = flat and len(paths_and_leaves) == len(inputs) + len(kwargs)
            self._keywords = list(kwargs) if flat else None
            named_leaves = [
                ("input " + _input_name(path, names), leaf) for path, leaf in paths_and_leaves
            ]
        named_parameters = self._named("_parameters")
        named_buffers = self._named("_buffers")
        reject_data_less(
            "gradcheck",
            [
                *((n, t) for n, t in named_leaves if isinstance(t, torch.Tensor)),
                *((f"parameter {n}", t) for n, t in named_parameters),
                *((f"buffer {n}", t) for n, t in named_buffers),
            ],
        )
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
        self._parameter_places, self._buffer_places = self._places()
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

    def _modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Every module reached, by its full name, shared ones under each of their names."""
        for prefix, root in self.roots:
            for name, module in root.named_modules(remove_duplicate=False):
                yield _joined(prefix, name), module

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
        for name, module in self._modules():
            names.setdefault(id(module), name)
        return names

    def _named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """Each tensor in the ``kind`` dict (``_parameters``, ``_buffers``) of the modules, once."""
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for prefix, module in self._modules():
            for key, tensor in getattr(module, kind).items():
                if tensor is not None and id(tensor) not in found:
                    found[id(tensor)] = (_joined(prefix, key), tensor)
        return list(found.values())

    def _places(self) -> tuple[list[_Place], list[_Place]]:
        parameters: list[_Place] = []
        buffers: list[_Place] = []
        seen: set[int] = set()
        for _, module in self._modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for places, tensors in ((parameters, module._parameters), (buffers, module._buffers)):
                places.extend(_Place(tensors, k, t) for k, t in tensors.items() if t is not None)
        return parameters, buffers

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Float64 everywhere for the block: default dtype, widening mode, module tensors."""
        attributes = [
            (module, {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
            for module in {id(m): m for _, m in self._modules()}.values()
        ]
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            yield
        finally:
            torch.set_default_dtype(default_dtype)
            for place in (*self._parameter_places, *self._buffer_places):
                place.owner[place.key] = place.tensor
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
            args, kwargs = pytree.tree_unflatten(leaves, self._spec)
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
            self.widen = bool(self.widened or self.narrowed)
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
        there becomes :class:`_ProbeRefused`, which says which input it refused."""
        try:
            return self.evaluate(values)
        except _CHECK_ERRORS:
            raise
        except Exception as error:
            raise self._refused(values, error) from error

    def _refused(self, values: Sequence[torch.Tensor], error: Exception) -> _ProbeRefused:
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
            return _ProbeRefused(error, probe=probe, tensor=checked.name, step=abs(step))
        return _ProbeRefused(error, probe="the point", tensor=self.checked[0].name, step=0.0)

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
            raise _NoFloatingOutput(
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
        for name, module in self._modules():
            for hooks in (module._backward_hooks, module._backward_pre_hooks):
                found.extend(f"{name or 'the model'}: {_hook_name(h)}" for h in hooks.values())
        return found


class _ProbeRefused(Exception):
    """The model raised at a finite-difference input (``probe``), not at the point."""

    def __init__(self, error: Exception, *, probe: str, tensor: str, step: float) -> None:
        super().__init__(probe)
        self.error, self.probe, self.tensor, self.step = error, probe, tensor, step

    @property
    def what(self) -> str:
        return raised(self.error)


class _Probes:
    """The function torch's check calls: the first call is at the point, the model's
    exceptions at the later ones (finite-difference inputs) are refusals."""

    def __init__(self, problem: _Problem) -> None:
        self.problem, self.first = problem, True

    def __call__(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first:
            self.first = False
            return self.problem.evaluate(values)
        try:
            return self.problem.evaluate(values)
        except _CHECK_ERRORS:
            raise
        except Exception as error:  # as _Problem.probe, one call less per evaluation
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
        leaves = [
            leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
        ]
        sources = [self.sources[id(leaf)] for leaf in leaves if id(leaf) in self.sources]
        try:
            result = func(*args, **kwargs)
        except Exception:
            if sources and self.found is None:
                dtype = next(leaf.dtype for leaf in leaves if id(leaf) in self.sources)
                location = user_location(sys._getframe(1)) or UNKNOWN_LOCATION
                self.found = (_op_name(func), sources[0], dtype, location)
            raise
        if sources:
            for leaf in pytree.tree_leaves(result):
                if isinstance(leaf, torch.Tensor) and not (
                    leaf.is_floating_point() or leaf.is_complex()
                ):
                    self.sources[id(leaf)] = sources[0]
                    self.keep.append(leaf)
        return result


def _op_name(func: Any) -> str:
    owner = getattr(func, "__objclass__", None)
    name = getattr(func, "__name__", repr(func))
    if owner is not None and issubclass(torch.Tensor, owner):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"{module.replace('torch._C._nn', 'torch.nn.functional')}.{name}" if module else name


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
    _NoFloatingOutput,
    CannotStayFloat64,
    GradcheckFailure,
    _ProbeRefused,
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
        _Hook(_defined_only(h), _hook_name(h), definition(h))
        for h in (parameter._backward_hooks or {}).values()
    ]
    for hook in (getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values():
        hooks.append(
            _Hook(
                _defined_only(_after_accumulation(hook)),
                _hook_name(hook) + " (post-accumulate)",
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


def _hook_name(hook: Any) -> str:
    code = getattr(hook, "__code__", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    if code is None:
        return name
    where = f"{display_path(code.co_filename)}:{code.co_firstlineno}"
    return f"{name.replace('.<locals>', '')} ({where})"


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


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
    leaves = pytree.tree_leaves(output)
    kinds = [
        f"{leaf.dtype} tensor" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        for leaf in leaves
    ]
    return f"{type(output).__name__} of [{', '.join(kinds)}]" if leaves else repr(output)


def _input_name(path: tuple, positional: list[str]) -> str:
    # Paths into ((args...), {kwargs}): (0, position, ...) or (1, name, ...).
    group, key, rest = path[0], path[1], path[2:]
    head = positional[key.idx] if group.idx == 0 else str(key.key)
    return head + pytree.keystr(rest)


# --- running torch's checks -------------------------------------------------------------


def _random_weights(like: torch.Tensor, generator: torch.Generator, *, normalized: bool = True):
    """Random weights between 0.5 and 1.5 shaped like ``like``; summing to 1 if ``normalized``.

    Directions and output projections sum to 1, so that torch's tolerance ``atol`` means
    the same for a weighted sum as for one element. The output weights of a second-order
    check stand for a loss's gradient and are not scaled down, like ``gradgradcheck``'s.
    """
    weights = torch.rand(like.shape, generator=generator, dtype=torch.float64) + 0.5
    return (weights / weights.sum() if normalized else weights).to(like.device)


def _weighted_sum(weights: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor]):
    """``Σ (w · output).sum()`` over the outputs that have weights (0 when none has)."""
    return sum((w * o).sum() for w, o in zip(weights, outputs, strict=True) if w is not None)


def _random_direction(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A unit vector shaped like ``like``: random signs, random magnitudes in [1, 2).

    No element is much smaller than another (a wrong element shows undiluted by the
    others), and no two are equal (two swapped elements of the gradient do not cancel).
    """
    signs = torch.randint(0, 2, like.shape, generator=generator, dtype=torch.float64) * 2 - 1
    weights = signs * (1 + torch.rand(like.shape, generator=generator, dtype=torch.float64))
    return (weights / weights.norm().clamp_min(1e-300)).to(like.device)


class _Check:
    """One check of a problem's gradients at its point, in fast or slow mode.

    ``eps``, ``atol`` and ``rtol`` start as given and change only as the result says:
    a smaller step where the model refused a finite-difference input, float32's
    tolerances where an op ran in float32.
    """

    def __init__(
        self, problem: _Problem, *, fast: bool, reason: str, eps: float, atol: float, rtol: float
    ) -> None:
        self.problem, self.fast, self.reason = problem, fast, reason
        self.eps, self.atol, self.rtol = eps, atol, rtol
        self.refused: list[str] = []
        self.part = False  # a part of a model checked on its own, while narrowing down
        self._loosened = False
        self._refusals: list[_ProbeRefused] = []
        # The evaluations the check itself made: the diagnosis is bounded by a multiple.
        self.spent = 0
        self.budget_end = 0

    def run(self, order: int) -> None:
        __tracebackhide__ = True
        while True:
            try:
                return self._run(order)
            except _ProbeRefused as refused:
                self._shrink_step(refused)
            except GradcheckFailure:
                if not self._loosen():
                    raise

    def diagnosis_budget(self) -> int:
        """The evaluation count (``problem.evaluations``) at which a diagnosis stops."""
        if not self.budget_end:
            self.spent = self.problem.evaluations - self._run_started
            self.budget_end = (
                self.problem.evaluations + DIAGNOSIS_MULTIPLE * self.spent + DIAGNOSIS_FLOOR
            )
        return self.budget_end

    def _loosen(self) -> bool:
        """After a failure: whether an op ran in float32, so float32's tolerances apply."""
        if self._loosened or not self.problem.narrowed:
            return False
        self._loosened = True
        eps, atol, rtol = FLOAT32_TOLERANCES
        self.eps, self.atol, self.rtol = (
            max(self.eps, eps),
            max(self.atol, atol),
            max(self.rtol, rtol),
        )
        self.budget_end = 0
        return True

    def _shrink_step(self, refused: _ProbeRefused) -> None:
        """The model raised at a finite-difference input: retry with a smaller step."""
        __tracebackhide__ = True
        self._refusals.append(refused)
        if len(self._refusals) > STEP_RETRIES:
            raise RefusedProbe(
                self._refused_message(), tensor=refused.tensor, error=refused.error
            ) from None
        self.eps /= STEP_SHRINK
        self.budget_end = 0
        self.refused.append(
            f"the model raised at {refused.probe} ({refused.what}): checked with "
            f"eps={self.eps:g} instead"
        )

    def _refused_message(self) -> str:
        first, last = self._refusals[0], self._refusals[-1]
        steps = ", ".join(f"{r.step:g}" for r in self._refusals[:-1])
        return "\n".join(
            [
                f"cannot check the gradient of {self.problem.description} here: the model "
                f"raises at the finite-difference inputs near the point, down to eps={self.eps:g}",
                f"  with {last.probe}: {last.what}",
                f"  it raised with eps={steps} too (first with {first.probe}); at the point itself "
                "it runs: this is not a wrong gradient",
                "  the point is within eps of inputs the model refuses (an assertion, a solver "
                "that gives up): check at inputs farther from them",
                self._footer(),
            ]
        )

    def _footer(self) -> str:
        return (
            f"checked {self.problem.description} in float64 (eps={self.eps:g}, "
            f"atol={self.atol:g}, rtol={self.rtol:g}), {_mode_text(self.fast, self.reason)}"
        )

    def _run(self, order: int) -> None:
        __tracebackhide__ = True
        problem = self.problem
        self._run_started = problem.evaluations
        self.budget_end = 0
        generator = torch.Generator().manual_seed(EVALUATION_SEED) if self.fast else None
        if self.fast and order == 1:
            try:
                self._screen(generator)
            except RuntimeError:
                self._reject_reentrant_checkpoint()
                if not self._widen_from_now_on():
                    raise
                self._run(order)
            except _NoFloatingOutput as error:
                raise TypeError(str(error)) from None
            return
        if self.fast:
            function, inputs = self._directional(order, generator)
        else:
            function = _Probes(problem)
            inputs = [c.value.clone().requires_grad_() for c in problem.checked]
        options = {"eps": self.eps, "atol": self.atol, "rtol": self.rtol}
        try:
            if self.fast or order == 1:
                torch.autograd.gradcheck(function, inputs, **options)
            else:
                torch.autograd.gradgradcheck(_Probes(problem), inputs, **options)
        except (GradcheckError, RuntimeError) as error:
            if not isinstance(error, GradcheckError):
                self._reject_reentrant_checkpoint()
            if self._widen_from_now_on():
                return self._run(order)
            if not isinstance(error, GradcheckError):
                raise
            raise _Diagnosis(self, order, str(error)).failure() from None
        except _NoFloatingOutput as error:
            raise TypeError(str(error)) from None
        except CannotStayFloat64 as error:
            raise CannotStayFloat64(str(error)) from None

    def _reject_reentrant_checkpoint(self) -> None:
        """After torch raised: a ``ValueError`` saying why, if the forward holds a reentrant
        checkpoint (torch's own message names no way out)."""
        __tracebackhide__ = True
        if self.problem.reentrant_checkpoint():
            raise ValueError(REENTRANT_CHECKPOINT.format(check="gradcheck")) from None

    def _widen_from_now_on(self) -> bool:
        """After a failure without Float64Mode: whether to check again with it.

        The first evaluation decides whether the forward needs the mode (it costs a
        Python call per torch call); a branch it did not take may still narrow a dtype,
        so a check that fails without the mode is run again with it.
        """
        if self.problem.widen is not False:
            return False
        self.problem.widen = True
        return True

    def _screen(self, generator: torch.Generator) -> None:
        """Fast mode, first order: one random direction per checked tensor.

        For ``s = w · outputs`` (random output weights ``w``) one backward pass gives
        ``∇s`` for every tensor; two forward passes per tensor give the derivative of
        ``s`` along ``u``, a direction of random signs and magnitudes between 1 and 2
        (normalized). Along such a direction a single wrong element of error ``δ`` shifts
        the derivative by at least ``δ·min|u|``, whatever the other elements, so besides
        torch's tolerance (``atol + rtol·|numerical|``) a tensor is flagged when the two
        differ by more than ``SCREENING_FRACTION`` of its largest gradient element times
        ``min|u|``, plus the rounding error of the differences. A flagged tensor is
        searched by bisection and its suspects rechecked element by element with
        ``atol``/``rtol``: only an element that fails there fails the check.
        """
        __tracebackhide__ = True
        problem = self.problem
        point = [c.value.detach().requires_grad_() for c in problem.checked]
        outputs = problem.evaluate(point)
        # Like torch's check: outputs autograd does not connect to the checked tensors (a
        # saved mean, a detached statistic) are left out; all of them when none is connected,
        # so that a detached forward still shows.
        kept = [o.requires_grad for o in outputs]
        if not any(kept):
            kept = [True] * len(outputs)
        weights = [
            _random_weights(o, generator) if keep else None
            for o, keep in zip(outputs, kept, strict=True)
        ]
        total = _weighted_sum(weights, outputs)
        analytical: Sequence[torch.Tensor | None] = [None] * len(point)
        if isinstance(total, torch.Tensor) and total.requires_grad:
            analytical = torch.autograd.grad(total, point, allow_unused=True)
        failed, flagged = [], []
        for index, (checked, gradient) in enumerate(zip(problem.checked, analytical, strict=True)):
            if not checked.numel:
                continue  # an empty tensor has no derivative to check
            direction = _random_direction(checked.value, generator)
            sides = []
            for sign in (1, -1):
                values = [v.detach() for v in point]
                values[index] = torch.add(values[index], direction, alpha=sign * self.eps)
                sides.append(_weighted_sum(weights, problem.probe(values)))
            plus, minus = (float(side) for side in sides)
            numerical = (plus - minus) / (2 * self.eps)
            along = 0.0 if gradient is None else float((gradient * direction).sum())
            difference = abs(along - numerical)
            if difference > self.atol + self.rtol * abs(numerical):
                failed.append(index)
            elif gradient is not None:
                # The rounding error of the central difference, a few units in the last place.
                rounding = 2 * torch.finfo(torch.float64).eps * (abs(plus) + abs(minus)) / self.eps
                largest = float(gradient.abs().max()) if gradient.numel() else 0.0
                smallest = float(direction.abs().min())
                if difference > SCREENING_FRACTION * largest * smallest + rounding:
                    flagged.append(index)
        if (failed or flagged) and self._widen_from_now_on():
            return self._screen(torch.Generator().manual_seed(EVALUATION_SEED))
        if failed:
            message = f"Jacobian mismatch for output 0 with respect to input {failed[0]}"
            raise _Diagnosis(self, 1, message, suspects=failed + flagged).failure()
        if flagged:
            wrong = _Diagnosis(self, 1, "", suspects=flagged).wrong_in(flagged)
            if wrong is not None:
                raise wrong

    def _directional(self, order: int, generator: torch.Generator):
        """A function of one scalar per checked tensor: its derivatives are fast mode's checks."""
        checked = self.problem.checked
        directions = [_random_weights(c.value, generator) for c in checked]
        if order == 2:
            projections = [_random_weights(c.value, generator) for c in checked]
        weights: list[torch.Tensor] = []

        def evaluate(steps) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
            moved = [float(t.detach()) for t in steps]
            at_point = not any(moved)
            if at_point:
                # Where torch differentiates: x + t * u, with t in the graph.
                values = [
                    torch.addcmul(c.value, t, u)
                    for c, t, u in zip(checked, steps, directions, strict=True)
                ]
            else:
                # A finite difference: torch moves one step, and needs no graph back to it.
                values = [
                    c.value if m == 0.0 else torch.add(c.value, u, alpha=m)
                    for c, m, u in zip(checked, moved, directions, strict=True)
                ]
                if order == 2:
                    values = [v.detach().requires_grad_() for v in values]
            evaluate = self.problem.evaluate if at_point else self.problem.probe
            outputs = evaluate(values)
            if not weights:
                weights.extend(
                    _random_weights(o, generator, normalized=order == 1) for o in outputs
                )
            sums = [(w * o).sum() for w, o in zip(weights, outputs, strict=True)]
            return values, sums, at_point

        def first(*steps):
            return tuple(evaluate(steps)[1])

        def second(*steps):
            values, sums, at_point = evaluate(steps)
            differentiable = [s for s in sums if s.requires_grad]
            if not differentiable:
                return tuple(torch.zeros((), dtype=torch.float64, device=v.device) for v in values)
            grads = torch.autograd.grad(
                sum(differentiable), values, create_graph=at_point, allow_unused=True
            )
            return tuple(
                (g * p).sum() if g is not None else torch.zeros((), dtype=v.dtype, device=v.device)
                for g, p, v in zip(grads, projections, values, strict=True)
            )

        steps = [
            torch.zeros((), dtype=torch.float64, device=c.value.device, requires_grad=True)
            for c in checked
        ]
        return (first if order == 1 else second), steps


# --- diagnosing a failure ---------------------------------------------------------------


_MISMATCH = re.compile(r"output (\d+) with respect to input (\d+)")
_CONTINUOUS = type("Continuous", (), {"__repr__": lambda self: "<number>"})()


def _is_discrete(value: Any) -> bool:
    if isinstance(value, (bool, int)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_discrete(item) for item in value)
    return False


def _branch_divergence(a: DecisionLog, b: DecisionLog):
    """Where two runs took different branches: ``(decision at the point, other)`` or None.

    Decisions that returned a float (``.item()`` of a float tensor) change with every
    perturbation; they count only by where they were made, not by their value.
    """

    def branches(log: DecisionLog) -> list[Decision]:
        return [
            d if _is_discrete(d.value) else Decision(d.index, d.op, _CONTINUOUS, d.location)
            for d in log
        ]

    found = first_divergence(branches(a), branches(b))
    if found is None:
        return None
    k = found[0]
    return (a[k - 1] if k <= len(a) else None, b[k - 1] if k <= len(b) else None, k)


def _short_value(decision: Decision | None) -> str:
    return "no decision" if decision is None else repr(decision.value)[:40]


def _moved_numbers(a: DecisionLog, b: DecisionLog) -> list[tuple[Decision, Decision]]:
    return [
        (x, y)
        for x, y in zip(a, b, strict=False)
        if not _is_discrete(x.value) and x.op == y.op and repr(x.value) != repr(y.value)
    ]


class _FindingKind(enum.Enum):
    """What the finite differences of one element show."""

    WRONG = "wrong"  # a wrong gradient
    BOUNDARY = "boundary"  # the steps cross a branch boundary
    KINK = "kink"  # one-sided differences disagree
    JUMP = "jump"  # the outputs jump: a discontinuity


@dataclass
class _Finding:
    kind: _FindingKind
    checked: _Checked
    element: int
    row: int
    numerical: float
    analytical: float
    allowed: float
    severity: float
    divergence: tuple | None = None
    side: str = ""
    moved_log: DecisionLog | Sequence[Decision] = ()
    one_sided: tuple[float, float] = (0.0, 0.0)
    moved: list = field(default_factory=list)
    jump: float = 0.0  # for a jump: how much the output changed over one step


class _Diagnosis:
    """Finds, element by element, where and why a failed check's Jacobians disagree."""

    def __init__(
        self, check: _Check, order: int, torch_message: str, suspects: Sequence[int] = ()
    ) -> None:
        self.check, self.problem, self.order = check, check.problem, order
        self.torch_message = torch_message
        # Fast mode's screen names the tensors whose directional derivatives disagree:
        # only those are searched (each by bisection), and only those can be "also wrong".
        self.suspects = list(suspects)
        self.eps, self.atol, self.rtol = check.eps, check.atol, check.rtol
        self.generator = torch.Generator().manual_seed(EVALUATION_SEED + 1)
        self.budget = check.diagnosis_budget()
        self.searched: set[int] = set()  # tensors whose every element was examined
        self.point = [c.value for c in self.problem.checked]
        self.weights: list[torch.Tensor] = []
        values = [v.detach().requires_grad_() for v in self.point]
        with record_decisions() as self.base_log:
            outputs = self._target(values, graph=True)
        # Like torch: first order compares only the outputs autograd connects to the inputs.
        self.included = [o.requires_grad or order == 2 for o in outputs]
        self.names = self._output_names()
        flat = self._flat(outputs)
        self.base = flat.detach()
        self.rows = self._rows(flat.numel())
        self.analytical = self._analytical(flat, values)

    # the function whose Jacobian is diagnosed: the outputs, or (second order) the gradients
    def _target(self, values: list[torch.Tensor], graph: bool) -> tuple[torch.Tensor, ...]:
        # graph=True at the point; a finite-difference input otherwise.
        outputs = (self.problem.evaluate if graph else self.problem.probe)(values)
        if self.order == 1:
            return outputs
        if not self.weights:
            self.weights = [_random_weights(o, self.generator, normalized=False) for o in outputs]
        total = sum(
            (w * o).sum() for w, o in zip(self.weights, outputs, strict=True) if o.requires_grad
        )
        if not isinstance(total, torch.Tensor) or not total.requires_grad:
            return tuple(torch.zeros_like(v) for v in values)
        grads = torch.autograd.grad(total, values, create_graph=graph, allow_unused=True)
        return tuple(
            torch.zeros_like(v) if g is None else g for g, v in zip(grads, values, strict=True)
        )

    def _output_names(self) -> list[str]:
        if self.order == 1:
            return list(self.problem.output_names or [])
        return [f"(gradient of {c.name}" for c in self.problem.checked]

    def _flat(self, outputs) -> torch.Tensor:
        parts = [
            o.reshape(-1).to(torch.float64)
            for o, keep in zip(outputs, self.included, strict=True)
            if keep
        ]
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=outputs[0].device)
        return torch.cat(parts)

    def _rows(self, size: int) -> torch.Tensor | None:
        """``None``: compare every output element; else one random weighting of them."""
        entries = size * sum(c.numel for c in self.problem.checked)
        if size <= OUTPUT_ELEMENTS_LIMIT and entries <= _ANALYTICAL_ENTRIES_LIMIT:
            return None
        # Weights of mean 1, not summing to 1: each element counts as much as in a sum.
        return _random_weights(self.base, self.generator, normalized=False).reshape(1, -1)

    def _analytical(self, flat: torch.Tensor, values) -> list[torch.Tensor]:
        """Per checked tensor, the rows of the analytical Jacobian: (rows, elements)."""
        count = flat.numel() if self.rows is None else 1
        result = [
            torch.zeros(count, c.numel, dtype=torch.float64, device=c.value.device)
            for c in self.problem.checked
        ]
        if not flat.requires_grad:
            return result
        for row in range(count):
            target = flat[row] if self.rows is None else (flat * self.rows[0]).sum()
            grads = torch.autograd.grad(target, values, retain_graph=True, allow_unused=True)
            for tensor, grad in zip(result, grads, strict=True):
                if grad is not None:
                    tensor[row] = grad.reshape(-1)
        return result

    def _project(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.rows is None else self.rows @ flat

    def _evaluate(self, index: int, step: torch.Tensor) -> tuple[torch.Tensor, DecisionLog]:
        values = [v.detach().requires_grad_(self.order == 2) for v in self.point]
        values[index] = (self.point[index] + step).requires_grad_(self.order == 2)
        with record_decisions() as log:
            outputs = self._target(values, graph=False)
        return self._flat(outputs).detach(), log

    def failure(self) -> GradcheckFailure:
        if not any(self.included):
            return GradcheckFailure(self._detached())
        hint = _MISMATCH.search(self.torch_message)
        first = int(hint.group(2)) if hint else 0
        count = len(self.problem.checked)
        order = [first] + [i for i in range(count) if i != first] if first < count else range(count)
        if self.suspects:
            order = self.suspects
        explained: list[_Finding] = []
        for index in order:
            if explained and self.over_budget:
                break  # the point is on a boundary or kink: enough to say so
            findings = self._examine(index)
            wrong = [f for f in findings if f.kind is _FindingKind.WRONG]
            if wrong:
                also = self._also_wrong([i for i in order if i != index])
                return self._wrong(wrong, findings, index, also)
            explained.extend(findings)
        boundaries = [f for f in explained if f.kind is _FindingKind.BOUNDARY]
        if boundaries:
            return self._boundary(boundaries, explained)
        if explained:
            return self._kink(explained)
        return GradcheckFailure(self._unexplained())

    def _also_wrong(self, indices: list[int]) -> list[str]:
        """``name (k of n elements)`` of the other tensors with wrong elements, within budget.

        In a mixture of experts a bug in one expert shows in the input's gradient first;
        the expert's own parameters are what the message must name. A part checked on
        its own needs one wrong element only.
        """
        if self.check.part:
            return []
        found = []
        for index in indices:
            if self.over_budget:
                break
            wrong = [f for f in self._examine(index) if f.kind is _FindingKind.WRONG]
            if wrong:
                checked = self.problem.checked[index]
                counted = index in self.searched
                found.append(
                    f"{checked.name} ({len(wrong)} of {checked.numel} elements)"
                    if counted
                    else checked.element(wrong[0].element)
                )
        return found

    def wrong_in(self, indices: Iterable[int]) -> WrongGradient | None:
        """The wrong gradient of the first of these tensors that has one, else ``None``."""
        indices = list(indices)
        for position, index in enumerate(indices):
            findings = self._examine(index)
            wrong = [f for f in findings if f.kind is _FindingKind.WRONG]
            if wrong:
                also = self._also_wrong(indices[position + 1 :])
                return self._wrong(wrong, findings, index, also)
        return None

    @property
    def over_budget(self) -> bool:
        return self.problem.evaluations >= self.budget

    def _examine(self, index: int) -> list[_Finding]:
        checked = self.problem.checked[index]
        elements: Iterable[int] = range(checked.numel)
        # Slow mode examined every element already: its diagnosis may too. Fast mode's
        # cost is a few evaluations, so its diagnosis bisects down to a small block.
        limit = _BISECTION_BLOCK if self.check.fast else ELEMENTWISE_LIMIT
        if checked.numel > limit:
            elements = self._bisect(index)
        else:
            self.searched.add(index)
        findings = []
        for element in elements:
            finding = self._element(index, int(element))
            if finding is not None:
                findings.append(finding)
        return findings

    def _bisect(self, index: int) -> torch.Tensor:
        """Narrow a large tensor down to a block where the directional derivatives disagree most."""
        checked = self.problem.checked[index]
        candidates = torch.arange(checked.numel)
        analytical = self.analytical[index]
        while candidates.numel() > _BISECTION_BLOCK:
            halves = candidates.chunk(2)
            scores = []
            for half in halves:
                # A wrong element shows undiluted by the others (see _random_direction).
                direction = torch.zeros(checked.numel, dtype=torch.float64)
                direction[half] = _random_direction(half, self.generator).cpu()
                direction = direction.to(checked.value.device)
                step = (self.eps * direction).reshape(checked.value.shape)
                plus, _ = self._evaluate(index, step)
                minus, _ = self._evaluate(index, -step)
                numerical = self._project(plus - minus) / (2 * self.eps)
                scores.append(float((analytical @ direction - numerical).abs().max()))
            candidates = halves[0] if scores[0] >= scores[1] else halves[1]
        return candidates

    def _element(self, index: int, element: int) -> _Finding | None:
        checked = self.problem.checked[index]
        step = torch.zeros(checked.numel, dtype=torch.float64, device=checked.value.device)
        step[element] = self.eps
        step = step.reshape(checked.value.shape)
        plus, plus_log = self._evaluate(index, step)
        minus, minus_log = self._evaluate(index, -step)
        difference = plus - minus
        numerical = self._project(difference) / (2 * self.eps)
        analytical = self.analytical[index][:, element]
        if self.rows is None:
            allowed = self.atol + self.rtol * numerical.abs()
        else:
            allowed = self.atol + self.rtol * (self.rows.abs() @ difference.abs()) / (2 * self.eps)
        ratio = (analytical - numerical).abs() / allowed
        row = int(ratio.argmax()) if ratio.numel() else 0
        if not ratio.numel() or float(ratio[row]) <= 1.0:
            return None
        finding = _Finding(
            _FindingKind.WRONG,
            checked,
            element,
            row,
            float(numerical[row]),
            float(analytical[row]),
            float(allowed[row]),
            float(ratio[row]),
        )
        for side, log in (("+", plus_log), ("-", minus_log)):
            divergence = _branch_divergence(self.base_log, log)
            if divergence is not None:
                finding.kind, finding.divergence = _FindingKind.BOUNDARY, divergence
                finding.side, finding.moved_log = side, log
                return finding
        right = self._project(plus - self.base) / self.eps
        left = self._project(self.base - minus) / self.eps
        gap = (right - left).abs() > self.atol + self.rtol * torch.maximum(right.abs(), left.abs())
        if bool(gap.any()):
            kink_row = int(((right - left).abs() * gap).argmax())
            finding.kind, finding.row = _FindingKind.KINK, kink_row
            # A kink's one-sided changes halve with the step; a jump's stay as they are.
            half_plus, _ = self._evaluate(index, step / 2)
            half_minus, _ = self._evaluate(index, -step / 2)
            for full, half in (
                (plus - self.base, half_plus - self.base),
                (self.base - minus, self.base - half_minus),
            ):
                full_change = float(self._project(full)[kink_row])
                half_change = float(self._project(half)[kink_row])
                jumped = abs(full_change) > max(
                    self.atol, 10 * self.eps * abs(analytical[kink_row])
                )
                if jumped and abs(half_change) > 0.75 * abs(full_change):
                    finding.kind, finding.jump = _FindingKind.JUMP, full_change
            finding.one_sided = (float(left[kink_row]), float(right[kink_row]))
            finding.numerical = float(numerical[kink_row])
            finding.analytical = float(analytical[kink_row])
            return finding
        finding.moved = _moved_numbers(self.base_log, plus_log)
        return finding

    # --- messages

    def _output_element(self, row: int) -> str:
        if self.rows is not None:
            what = ("output", "gradient")[self.order - 1]
            return (
                f"(v · {what}s) for random weights v of the {self.base.numel():,} {what} elements"
            )
        outputs = [
            (name, shape)
            for name, shape, keep in zip(
                self.names, self._output_shapes(), self.included, strict=True
            )
            if keep
        ]
        for name, shape in outputs:
            size = math.prod(shape)
            if row < size:
                element = element_name(name, _unravel(row, shape))
                return element + ")" if self.order == 2 else element
            row -= size
        return "output"

    def _output_shapes(self) -> list[tuple[int, ...]]:
        if self.order == 2:
            return [tuple(c.value.shape) for c in self.problem.checked]
        values = [v.detach() for v in self.point]
        return [tuple(o.shape) for o in self.problem.evaluate(values)]

    def _footer(self) -> str:
        c = self.check
        lines = []
        if self.order == 2:
            lines.append(
                "second order: the gradients of (w · outputs) for random weights w, "
                "differentiated again (the first-order check passed)"
            )
        low = [
            f"{name} is {dtype}"
            for name, dtype in zip(
                self.problem.output_names or [], self.problem.output_dtypes, strict=True
            )
            if dtype not in (torch.float64, torch.complex128)
        ]
        if low:
            lines.append(
                f"note: {', '.join(low)}: the forward casts to a lower precision, "
                f"which finite differences with eps={c.eps:g} cannot resolve"
            )
        if self.problem.widened:
            lines.append(
                "computed in float64 where the forward asks for less: "
                + ", ".join(str(w) for w in self.problem.widened.values())
            )
        mode = _mode_text(c.fast, c.reason)
        if c.fast:
            mode += "; the failing tensor was then rechecked element by element"
        lines.append(
            f"checked {self.problem.description} in float64 (eps={c.eps:g}, "
            f"atol={c.atol:g}, rtol={c.rtol:g}), {mode}"
        )
        return "\n".join(lines)

    def _wrong(
        self, wrong: list[_Finding], findings: list[_Finding], index: int, also: Sequence[str] = ()
    ) -> WrongGradient:
        worst = max(wrong, key=lambda f: f.severity)
        checked = worst.checked
        what = ("first", "second")[self.order - 1]
        lines = [
            f"wrong {what}-order gradient of {self.problem.description} with respect to "
            f"{checked.element(worst.element)}",
            f"  d {self._output_element(worst.row)} / d {checked.element(worst.element)}: "
            f"numerical {worst.numerical:.6g}, analytical {worst.analytical:.6g} (difference "
            f"{abs(worst.numerical - worst.analytical):.3g}, allowed {worst.allowed:.3g})",
        ]
        if index in self.searched:
            lines.append(
                f"  {len(wrong)} of {checked.numel} elements of {checked.name} are wrong"
                + self._pattern(wrong)
            )
        for point, moved in worst.moved[:1]:
            lines.append(
                f"  note: {point.op} at {point.location} (decision #{point.index}) returned "
                f"{point.value!r} at the point and {moved.value!r} with this element moved: "
                f"autograd does not see through Python numbers, so this dependence is missing "
                f"from the analytical gradient"
            )
        others = len(findings) - len(wrong)
        if others:
            lines.append(f"  ({others} other elements sit at a branch boundary or a kink)")
        if also:
            lines.append(f"  also wrong: {', '.join(also)}")
        if checked.hooks:
            lines.append(
                f"  {checked.name} has gradient hook(s) "
                f"{', '.join(h.description for h in checked.hooks)}: the gradient training sees "
                f"goes through them, so they are part of the checked (analytical) gradient; a "
                f"hook that scales or changes the gradient makes it differ from the derivative"
            )
        module_hooks = self.problem.module_hooks()
        if module_hooks:
            lines.append(
                f"  module backward hooks are part of the checked gradient too: "
                f"{', '.join(module_hooks)}"
            )
        lines.append(self._footer())
        failure = WrongGradient(
            "\n".join(lines),
            tensor=checked.name,
            index=checked.index(worst.element),
            order=self.order,
            numerical=worst.numerical,
            analytical=worst.analytical,
        )
        failure.output = self._output_element(worst.row)
        return failure

    def _pattern(self, wrong: list[_Finding]) -> str:
        numerical = torch.tensor([f.numerical for f in wrong], dtype=torch.float64)
        analytical = torch.tensor([f.analytical for f in wrong], dtype=torch.float64)
        if not bool(analytical.any()):
            return (
                "; the analytical gradient is 0 there: the backward misses this dependence "
                "(a missing term, a .detach() or a Python number in between)"
            )
        if not bool(numerical.any()):
            return ""
        factor = float((analytical * numerical).sum() / (numerical * numerical).sum())
        if bool(
            ((analytical - factor * numerical).abs() <= 1e-3 * numerical.abs() + self.atol).all()
        ):
            if abs(factor + 1) < 1e-3:
                return "; the analytical gradient has the wrong sign in all of them"
            return (
                f"; in all of them the analytical gradient is {factor:.4g} times the numerical one"
            )
        return ""

    def _boundary(self, boundaries: list[_Finding], explained: list[_Finding]) -> BranchBoundary:
        first = boundaries[0]
        at_point, moved, k = first.divergence
        decision = at_point or moved
        where = (
            f"decision #{decision.index} ({decision.location})" if decision else f"decision #{k}"
        )
        element = first.checked.element(first.element)
        ended = f"no decision #{k} (that run made only {k - 1})"
        tensors = sorted({f.checked.name for f in boundaries})
        moved_text = f"{element} {first.side} eps"
        location = decision.location if decision else UNKNOWN_LOCATION
        before = sum(d.location == location for d in self.base_log)
        after = sum(d.location == location for d in first.moved_log)
        if before != after:
            change = "changes how many times a loop runs"
            how = (
                f"  the decision at {location} was made {before} time(s) at the point and "
                f"{after} time(s) with {moved_text}: a loop over the data (a while condition, "
                f"routing to experts, a list built from tensor values) ran a different number of "
                f"times; no if went the other way"
            )
        else:
            change = "sends that decision the other way (an if, a comparison)"
            how = (
                f"  the same decision, with another outcome: {_short_value(at_point)} at the point"
            )
            how += f", {_short_value(moved)} with {moved_text}"
        lines = [
            f"cannot check the gradient of {self.problem.description} here: the point is within "
            f"eps of a branch boundary at {where}: moving {element} by {first.side}eps {change}",
            f"  at the point: {at_point or ended}",
            f"  with {moved_text} ({self.eps:g}): {moved or ended}",
            how,
            "  the finite differences compare two different branches, so they say nothing about "
            "the gradient: this is not a wrong gradient",
            f"  {len(boundaries)} examined elements cross a boundary (in {', '.join(tensors)})",
            "  move the point off the boundary: pass avoid_boundaries=True (retries at points "
            f"moved by {JITTER_SCALE:g} of each tensor's size), or check at other inputs",
            self._footer(),
        ]
        return BranchBoundary(
            "\n".join(lines),
            tensor=first.checked.name,
            index=first.checked.index(first.element),
            decision=decision,
        )

    def _kink(self, kinks: list[_Finding]) -> NonDifferentiablePoint:
        jumps = [f for f in kinks if f.kind is _FindingKind.JUMP]
        first = (jumps or kinks)[0]
        left, right = first.one_sided
        element = first.checked.element(first.element)
        lines = self._jump_lines(jumps, element) if jumps else self._kink_lines(kinks, element)
        lines.append(self._footer())
        found = dict(tensor=first.checked.name, index=first.checked.index(first.element))
        if jumps:
            return OutputJump("\n".join(lines), **found, left=left, right=right, change=first.jump)
        return NonDifferentiablePoint("\n".join(lines), **found, left=left, right=right)

    def _kink_lines(self, kinks: list[_Finding], element: str) -> list[str]:
        first = kinks[0]
        left, right = first.one_sided
        matches = (
            "the left-hand derivative"
            if abs(first.analytical - left) <= first.allowed
            else "the right-hand derivative"
            if abs(first.analytical - right) <= first.allowed
            else "neither one-sided derivative"
        )
        return [
            f"cannot check the gradient of {self.problem.description} at {element}: the function "
            f"is not differentiable there (one-sided differences disagree: a kink, such as relu, "
            f"abs, max or clamp exactly where it switches)",
            f"  d {self._output_element(first.row)} / d {element}: from the left {left:.6g}, "
            f"from the right {right:.6g}, central {first.numerical:.6g}; analytical "
            f"{first.analytical:.6g} ({matches})",
            f"  {len(kinks)} examined elements are at a kink; this is not a wrong gradient",
            "  move the point: pass avoid_boundaries=True, or check at inputs away from the kink",
        ]

    def _jump_lines(self, jumps: list[_Finding], element: str) -> list[str]:
        first = jumps[0]
        left, right = first.one_sided
        return [
            f"cannot check the gradient of {self.problem.description} at {element}: the outputs "
            f"jump there (a discontinuity, such as argmax or top-k routing at a tie, a "
            f"comparison, rounding or sorting: not a kink)",
            f"  {self._output_element(first.row)} changes by {first.jump:.6g} when {element} "
            f"moves by eps ({self.eps:g}), and by about as much when it moves by eps/2: the "
            f"change does not shrink with the step, so the one-sided differences ({left:.6g} "
            f"from the left, {right:.6g} from the right) grow without bound as eps shrinks",
            f"  {len(jumps)} examined elements are at a jump; this is not a wrong gradient",
            "  move the point: pass avoid_boundaries=True, or check at inputs away from the tie",
        ]

    def _detached(self) -> str:
        names = ", ".join(self.problem.output_names or [])
        return (
            f"wrong first-order gradient of {self.problem.description}: autograd connects none "
            f"of its floating-point outputs ({names}) to the checked tensors, so their analytical "
            f"gradient is 0, yet the outputs change when the checked tensors do: the forward "
            f"detaches them (.detach(), .data, torch.no_grad(), a Python number or NumPy in "
            f"between)\n{self._footer()}"
        )

    def _unexplained(self) -> str:
        names = {str(i): c.name for i, c in enumerate(self.problem.checked)}
        mapping = ", ".join(f"input {i} = {name}" for i, name in names.items())
        if self.check.fast:
            mapping = "torch checked one scalar step per tensor: " + mapping
        return (
            f"gradient check of {self.problem.description} failed, but no single element was "
            f"found wrong when rechecked one by one\n"
            f"torch.autograd.gradcheck said: {self.torch_message.strip()[:2000]}\n"
            f"({mapping})\n{self._footer()}"
        )
