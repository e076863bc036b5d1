"""Check the gradients of a whole dynamic model numerically: inputs and every parameter.

``gradcheck(model, x)`` compares the gradients autograd computes with finite
differences, for the inputs that require grad and every trainable parameter of the
modules the callable reaches (:mod:`.calls`). It computes in float64 end to end
(:mod:`.float64`; an op without a float64 kernel through an equivalent, else in float32,
and the check then in float32's arithmetic): the modules hold float64 copies of their parameters and
buffers while it runs and get their own tensors back afterwards, so the model and
tensors passed in keep their dtype, values, device, ``requires_grad``, ``.grad`` and
hooks. Parameter gradient hooks run on the copies: they are part of the checked
gradient. Outputs are taken as torch's check takes them (conjugate views resolved,
complex ones as real pairs, those autograd does not connect to the checked tensors
left out), empty tensors anywhere. Slow mode and second order use
``torch.autograd.gradcheck``/``gradgradcheck``, with tolerances from the arithmetic of
the finite differences unless given (:mod:`.tolerances`), so that a gradient 1% wrong
is caught whatever its scale, and every result says how small an error it could have
missed; when a check fails, this module finds the element that is wrong and says why:

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

The package's rooms, imports running downwards: this module (the entry point, the
other sides of branches), :mod:`.localization` (where a wrong gradient enters),
:mod:`.screen` (one check, fast or slow), :mod:`.diagnosis` (which element and why),
:mod:`.problem` (the model as a function of float64 tensors), :mod:`.tolerances` (the
tolerances and the sensitivity they leave), :mod:`.weights` (the
check's random weights and directions), :mod:`.results` (failures and the result).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import options
from ..branches import BranchSide, other_sides
from ..calls import forward_kwargs_of, reject_unknown_keywords
from ..failures import most_fundamental
from ..float64 import CannotStayFloat64
from .diagnosis import ELEMENTWISE_LIMIT
from .localization import localized
from .problem import JITTER_ATTEMPTS, Problem
from .results import (
    BranchBoundary,
    ErrorSource,
    GradcheckFailure,
    GradcheckResult,
    NonDifferentiablePoint,
    OutputJump,
    RefusedProbe,
    Sensitivity,
    SourceKind,
    WrongGradient,
)
from .screen import Check
from .tolerances import Requested

# Above this many checked elements (inputs and parameters together) fast=None picks
# fast mode: slow mode would cost two forward passes per element.
FAST_MODE_ABOVE = 2048

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


def gradcheck(
    model_or_fn: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: Mapping[str, Any] | None = None,
    params: bool | Iterable[str] = True,
    gradgrad: bool = False,
    fast: bool | None = None,
    eps: float = 1e-6,
    atol: float | None = None,
    rtol: float | None = None,
    avoid_boundaries: bool = False,
    branches: str = "point",
    **unknown: Any,
) -> GradcheckResult:
    """Check the gradients of ``model_or_fn(*inputs, **forward_kwargs)`` numerically.

    Checked: every floating-point (or complex) tensor in ``inputs``/``forward_kwargs``
    that requires grad and every parameter that requires grad of the modules the
    callable reaches (a module, a bound method of one, a ``functools.partial``, a
    closure, default argument or global holding modules or containers of modules):
    all of them (``params=True``), none (``params=False``) or the ones named in
    ``params``. Parameter gradient hooks are part of the checked gradient.
    ``gradgrad=True`` checks second-order gradients as well. ``fast`` forces fast mode
    (``True``) or slow mode (``False``); ``None`` picks fast mode above
    ``FAST_MODE_ABOVE`` checked elements. ``eps`` is the finite-difference step;
    ``atol``/``rtol`` the tolerances, ``None`` for "from the arithmetic" (see
    :mod:`.tolerances`): the result's ``sensitivity`` says, per tensor, the smallest
    relative error of its gradient the first-order check catches.
    ``avoid_boundaries=True`` retries at up to ``JITTER_ATTEMPTS`` points moved by
    seeded noise of relative size ``JITTER_SCALE`` when the point is on a branch
    boundary or a kink. ``branches="all"`` checks, besides
    the point, a point on the other side of each branch decision the point reaches
    (see :mod:`.branches`); where none is found within ``FORWARD_PASSES`` forward passes
    per decision, the result says why, and that alone is no failure; every side is
    checked even when the point fails, and the failure raised is the point's (else the
    first side's) with the others after ``also:``. Options are keyword-only; any
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
    _validate_options(model_or_fn, params, gradgrad, fast, eps, atol, rtol, avoid_boundaries)
    options.choice("gradcheck", "branches", branches, BRANCH_CHOICES)
    started = time.perf_counter()
    problem = Problem(model_or_fn, inputs, kwargs, params)
    elements = sum(checked.numel for checked in problem.checked)
    if fast is None:
        use_fast = elements > FAST_MODE_ABOVE
        relation = ">" if use_fast else "<="
        reason = f"{elements:,} elements {relation} FAST_MODE_ABOVE={FAST_MODE_ABOVE:,}"
    else:
        use_fast, reason = fast, f"fast={fast}"
    orders = (1, 2) if gradgrad else (1,)
    check = Check(problem, fast=use_fast, reason=reason, requested=Requested(eps, atol, rtol))
    with _rngs_kept(problem.generators) as states:
        problem.start_from(states)
        try:
            moved, sides, found, sensitivity = _run(
                problem, check, orders, avoid_boundaries, branches
            )
        except (GradcheckFailure, CannotStayFloat64):
            raise
        except Exception as error:
            explained = problem.explain(error)
            if explained is None:
                raise
            raise explained from None
        failure = most_fundamental(
            [_reported(problem, check, each, i == 0) for i, each in enumerate(found)]
        )
        if failure is not None:
            raise failure
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
        substituted=tuple(str(s) for s in problem.substituted.values()),
        narrowed=tuple(str(n) for n in problem.narrowed.values()),
        tolerances=_tolerances(check, sensitivity),
        sensitivity=sensitivity,
        refused=tuple(check.refused),
        held_buffers=problem.held_buffers,
    )


@dataclass(frozen=True)
class _FailureAt:
    """A failure at the point (``side`` None) or on the other side of a branch."""

    failure: GradcheckFailure
    side: BranchSide | None = None


def _run(
    problem: Problem,
    check: Check,
    orders: tuple[int, ...],
    avoid_boundaries: bool,
    branches: str,
) -> tuple[int, tuple[BranchSide, ...], list[_FailureAt], Sensitivity | None]:
    """Check each order at the point (moved off boundaries on request), then the other
    sides of its branches, even when the point failed: how often the point moved, the
    sides, what failed (the point first) and the point's first-order sensitivity."""
    __tracebackhide__ = True
    moved = 0
    found = []
    with problem.installed():
        while True:
            try:
                for order in orders:
                    check.run(order)
                break
            except (BranchBoundary, NonDifferentiablePoint) as failure:
                if not avoid_boundaries:
                    found.append(_FailureAt(failure))
                    break
                if moved == JITTER_ATTEMPTS:
                    note = f"(still so after moving the point {moved} times: avoid_boundaries=True)"
                    failure.args = (f"{failure}\n{note}",)
                    found.append(_FailureAt(failure))
                    break
                moved += 1
                problem.jitter(moved)
            except GradcheckFailure as failure:
                found.append(_FailureAt(failure))
                break
        sensitivity = check.sensitivity
        sides = ()
        if branches == "all":
            sides, on_other_sides = _check_other_sides(problem, check, orders)
            found += on_other_sides
    return moved, sides, found, sensitivity


def _tolerances(check: Check, sensitivity: Sensitivity | None) -> tuple[float, float, float]:
    """``(eps, atol, rtol)`` of the first order at the point (of the last run without one)."""
    tolerances = check.tolerances if sensitivity is None else sensitivity.tolerances
    return tolerances.eps, tolerances.atol, tolerances.rtol


def _reported(
    problem: Problem, check: Check, found: _FailureAt, localize: bool
) -> GradcheckFailure:
    """``found``'s failure as reported: a first-order wrong gradient narrowed down to
    where it enters when ``localize`` (the first found: each costs a diagnosis), one
    on the other side of a branch saying which side."""
    failure, side = found.failure, found.side
    if localize and isinstance(failure, WrongGradient) and failure.order == 1:
        failure = localized(problem, check, failure, None if side is None else side.values)
    if side is not None:
        which = (
            "the branch" if side.occurrence == 1 else f"decision #{side.occurrence} of the branch"
        )
        failure.args = (
            f"on the other side of {which} at {side.location} ({side.source}): "
            f"{not side.at_point} there, {side.at_point} at the given point; the inputs "
            f"moved by {side.moved:.3g} of their norm:\n{failure}",
        )
    return failure


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


def _check_other_sides(
    problem: Problem, check: Check, orders: tuple[int, ...]
) -> tuple[tuple[BranchSide, ...], list[_FailureAt]]:
    """Check the gradients on the other side of each branch decision the point reaches:
    the sides, and the failure found on each side that failed."""
    __tracebackhide__ = True
    at_point = [checked.value for checked in problem.checked]
    movable = sorted({slot for _, slot in problem._input_slots})
    sides = other_sides(problem.evaluate, at_point, movable, eps=check.eps)
    found = []
    for side in sides:
        if not side.found:
            continue
        for checked, value in zip(problem.checked, side.values, strict=True):
            checked.value = value
        try:
            for order in orders:
                check.run(order)
        except GradcheckFailure as failure:
            found.append(_FailureAt(failure, side))
        finally:
            for checked, value in zip(problem.checked, at_point, strict=True):
                checked.value = value
    return tuple(sides), found


def _validate_options(function, params, gradgrad, fast, eps, atol, rtol, avoid_boundaries) -> None:
    __tracebackhide__ = True
    options.function("gradcheck", "model_or_fn", function, "an nn.Module or a callable")
    options.flag("gradcheck", "gradgrad", gradgrad)
    options.flag("gradcheck", "avoid_boundaries", avoid_boundaries)
    options.flag("gradcheck", "fast", fast, optional=True)
    if not (isinstance(params, bool) or _is_name_list(params)):
        expected = "True, False or a list of parameter names"
        raise options.refuse("gradcheck", "params", params, expected, TypeError)
    options.number("gradcheck", "eps", eps)
    if atol is not None:
        options.number("gradcheck", "atol", atol, zero=True)
    if rtol is not None:
        options.number("gradcheck", "rtol", rtol, zero=True)


def _is_name_list(value: Any) -> bool:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return False
    return all(isinstance(item, str) for item in value)
