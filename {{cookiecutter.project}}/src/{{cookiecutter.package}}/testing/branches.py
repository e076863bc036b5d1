"""Find inputs on the other side of each data-dependent branch, near the given point.

``gradcheck(..., branches="all")`` checks gradients at the given point and, for each
branch decision that point reaches, at a nearby point where that decision goes the
other way. A branch on a comparison (``if h.mean() > 0``, ``while err > tol``) has a
decided quantity, its margin: ``h.mean() - 0``. :func:`other_sides` records each
comparison's margin during one forward, then for each branch moves the inputs along
the gradient of its margin (a Newton step across the boundary, on to a point as far
beyond it as needed for finite differences not to cross back), doubling the step
when the boundary is farther than the linear guess and bisecting once it is
crossed, within a bounded number of forward passes per decision and within
``MAX_DISTANCE`` of the inputs' norm: a point farther away is another input, not the
other side of this one. Branches on a tensor that is no comparison (``if mask.any()``)
have no margin to move along, and a margin that is not finite (a comparison with
``inf``) has no finite distance to cross: both are reported as such, not searched. A
moved input the model refuses (it raises: a solver's assertion) ends that decision's
search, and the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from .control_flow import UNKNOWN_LOCATION, DecisionMode, Location, user_location
from .failures import raised

__all__ = ["MAX_DISTANCE", "BranchSide", "other_sides"]

# The other side of a branch is looked for within this distance of the point, relative
# to the norm of the inputs moved: a point as far away as the inputs are large is a
# different input, whose gradients say nothing about this one's branch.
MAX_DISTANCE = 1.0

# Each comparison, with the sign that makes "True" mean "margin > 0".
_COMPARISONS: dict[Any, int] = {}
for _names, _sign in (
    (("gt", "ge", "greater", "greater_equal"), 1),
    (("lt", "le", "less", "less_equal"), -1),
):
    for _name in _names:
        for _owner in (torch, torch.Tensor):
            if hasattr(_owner, _name):
                _COMPARISONS[getattr(_owner, _name)] = _sign
for _dunder, _sign in (("__gt__", 1), ("__ge__", 1), ("__lt__", -1), ("__le__", -1)):
    _COMPARISONS[getattr(torch.Tensor, _dunder)] = _sign
_BRANCH_OPS = frozenset({"Tensor.__bool__", "torch.is_nonzero"})
# How far beyond the boundary a moved point lies, in units of the change one finite
# difference step (eps in one element) makes to the margin.
_CLEARANCE = 1000.0
_BISECTIONS = 6


@dataclass(frozen=True)
class _Branch:
    location: Location
    occurrence: int  # 1 for the first decision at that line in the forward
    outcome: bool
    margin: torch.Tensor | None  # True iff margin > 0 (>= 0); None: no comparison


class _BranchRecorder(DecisionMode):
    def __init__(self) -> None:
        super().__init__()
        self.margins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.branches: list[_Branch] = []
        self._seen: dict[Location, int] = {}

    def computed(self, func: Any, args: tuple, kwargs: dict | None, result: Any) -> None:
        sign = _COMPARISONS.get(func)
        if sign is not None and isinstance(result, torch.Tensor) and result.numel() == 1:
            left, right = args[0], args[1] if len(args) > 1 else (kwargs or {})["other"]
            # The result tensor is kept with its margin so its id stays unique.
            self.margins[id(result)] = (result, (sign * (left - right)).reshape(()))

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        if op not in _BRANCH_OPS:
            return
        location = user_location(frame) or UNKNOWN_LOCATION
        occurrence = self._seen.get(location, 0) + 1
        self._seen[location] = occurrence
        recorded = self.margins.get(id(args[0]))
        margin = recorded[1] if recorded is not None and recorded[0] is args[0] else None
        self.branches.append(_Branch(location, occurrence, bool(result), margin))


@dataclass(frozen=True)
class BranchSide:
    """The other side of one branch decision: found (with the moved inputs) or why not."""

    location: Location
    occurrence: int
    at_point: bool
    found: bool
    forward_passes: int
    moved: float | None = None  # how far the inputs moved, relative to their norm
    reason: str = ""
    values: tuple[torch.Tensor, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def source(self) -> str:
        return self.location.source

    def __str__(self) -> str:
        where = f"{self.location}" + (f" (#{self.occurrence})" if self.occurrence > 1 else "")
        other = not self.at_point
        if self.found:
            return (
                f"{where}: {self.at_point} at the point, {other} with the inputs moved by "
                f"{self.moved:.3g} of their norm (at most {MAX_DISTANCE:g}; "
                f"{self.forward_passes} forward passes)"
            )
        return f"{where}: {self.at_point} at the point; {other} not checked: {self.reason}"


def _key(branch: _Branch) -> tuple[Location, int]:
    return branch.location, branch.occurrence


def _record(evaluate: Callable[[Sequence[torch.Tensor]], Any], values) -> list[_Branch]:
    with _BranchRecorder() as recorder:
        evaluate(values)
    return recorder.branches


def other_sides(
    evaluate: Callable[[Sequence[torch.Tensor]], Any],
    values: Sequence[torch.Tensor],
    movable: Sequence[int],
    *,
    eps: float,
    max_forward_passes: int = 16,
) -> list[BranchSide]:
    """For each branch decision ``evaluate(values)`` makes, inputs on its other side.

    ``values`` are the float64 tensors ``evaluate`` takes; only those at ``movable``
    (the inputs, not the parameters) are moved. ``eps`` is the finite-difference step
    the moved point must stay clear of the boundary by.
    """
    leaves = [value.detach().clone().requires_grad_(True) for value in values]
    with torch.enable_grad():
        branches = _record(evaluate, leaves)
    moving = [leaves[index] for index in movable]
    sides = []
    for branch in branches:
        if branch.margin is None or not branch.margin.requires_grad or not moving:
            reason = (
                "no input requires grad: there is nothing to move"
                if not moving
                else "the branch is on no comparison of a value that depends on the inputs"
                if branch.margin is None
                else "the compared value does not depend on the inputs"
            )
            sides.append(
                BranchSide(
                    branch.location, branch.occurrence, branch.outcome, False, 0, reason=reason
                )
            )
            continue
        gradients = torch.autograd.grad(branch.margin, moving, retain_graph=True, allow_unused=True)
        sides.append(_search(evaluate, values, movable, branch, gradients, eps, max_forward_passes))
    return sides


def _search(evaluate, values, movable, branch, gradients, eps, max_passes) -> BranchSide:
    gradients = [
        torch.zeros_like(values[i]) if g is None else g.detach()
        for i, g in zip(movable, gradients, strict=True)
    ]
    squared = sum(float(g.square().sum()) for g in gradients)
    common = (branch.location, branch.occurrence, branch.outcome)
    margin = float(branch.margin.detach())
    if not math.isfinite(margin) or not math.isfinite(squared):
        what = "compared value" if not math.isfinite(margin) else "gradient of the compared value"
        value = margin if not math.isfinite(margin) else squared
        return BranchSide(
            *common,
            False,
            0,
            reason=f"the {what} is {value} at the point: no finite step crosses to the other side",
        )
    if squared == 0.0:
        return BranchSide(
            *common, False, 0, reason="the gradient of the compared value is zero here"
        )
    largest = max(float(g.abs().max()) for g in gradients)
    clearance = _CLEARANCE * eps * largest
    # Along d, to first order the margin changes by -sign(margin) per unit of t, and the
    # inputs move by t / |gradient|: t_max is MAX_DISTANCE of the inputs' norm.
    direction = [-(1.0 if margin > 0 else -1.0) * g / squared for g in gradients]
    norm = sum(float(values[i].square().sum()) for i in movable) ** 0.5 or 1.0
    t_max = MAX_DISTANCE * norm * squared**0.5
    passes = 0
    refusal: list[str] = []

    def moved_to(t: float) -> list[torch.Tensor]:
        moved = list(values)
        for index, step in zip(movable, direction, strict=True):
            moved[index] = values[index] + t * step
        return moved

    def flipped(t: float) -> bool | None:
        nonlocal passes
        passes += 1
        try:
            with torch.no_grad():
                recorded = _record(evaluate, moved_to(t))
        except Exception as error:  # the model refuses this input: no verdict on it
            refusal.append(f"{t / t_max * MAX_DISTANCE:.3g} of their norm ({raised(error)})")
            return None
        for other in recorded:
            if _key(other) == _key(branch):
                return other.outcome != branch.outcome
        return None  # the decision is not made there

    high = abs(margin) + max(clearance, min(abs(margin), 10 * clearance))
    if high > t_max:
        reason = (
            f"by the slope of the compared value its other side is about "
            f"{high / t_max * MAX_DISTANCE:.3g} of the inputs' norm away, beyond "
            f"MAX_DISTANCE={MAX_DISTANCE:g}: not reached, not searched"
        )
        return BranchSide(*common, False, 0, reason=reason)
    low = 0.0
    while passes < max_passes:
        outcome = flipped(high)
        if outcome:
            break
        if outcome is None:
            reason = (
                f"the model refused the inputs moved toward its other side by {refusal[0]}; "
                "this side is not checked"
                if refusal
                else f"with the inputs moved toward its other side, the forward made no "
                f"decision #{branch.occurrence} at {branch.location}"
            )
            return BranchSide(*common, False, passes, reason=reason)
        if high >= t_max:
            reason = (
                f"not reached within MAX_DISTANCE={MAX_DISTANCE:g} of the inputs' norm "
                f"({passes} forward passes)"
            )
            return BranchSide(*common, False, passes, reason=reason)
        low, high = high, min(high * 2, t_max)
    else:
        reason = f"no input on the other side found within {max_passes} forward passes"
        return BranchSide(*common, False, passes, reason=reason)
    # Crossed between low and high: bisect toward the boundary, then step beyond it.
    for _ in range(_BISECTIONS):
        if passes >= max_passes - 1 or high - low <= max(clearance, 0.25 * high):
            break
        middle = (low + high) / 2
        outcome = flipped(middle)
        if outcome:
            high = middle
        elif outcome is None:
            break  # refused or not made there: the crossing found so far stands
        else:
            low = middle
    final = moved_to(high)
    distance = sum(float((final[i] - values[i]).square().sum()) for i in movable) ** 0.5
    return BranchSide(
        *common,
        True,
        passes,
        moved=distance / norm,
        values=tuple(value.detach() for value in final),
    )
