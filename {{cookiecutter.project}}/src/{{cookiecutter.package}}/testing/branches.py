"""Find inputs on the other side of each data-dependent branch the given point reaches.

``gradcheck(..., branches="all")`` checks gradients at the given point and, for each
branch decision that point reaches, at a point where that decision goes the other
way. A branch on a comparison (``if h.mean() > 0``, ``while err > tol``) has a decided
quantity, its margin: ``h.mean() - 0``. :func:`other_sides` records each comparison's
margin during one forward, then for each branch searches along the margin's own
direction, its gradient: a Newton step to just beyond the boundary; while not crossed,
a secant step where the margin is as straight as its gradient says, else the gradient
taken again where the search stands (re-linearising where the margin is curved), and
doubling the step where it only flattens; once crossed, bisection back toward the
boundary (regula falsi, then in log scale across orders of magnitude). The point kept
lies far enough beyond the boundary, by the margin's slope there, that finite
differences do not cross back.

The search spends at most ``FORWARD_PASSES`` forward passes per decision, however far
the boundary is; the distance moved is reported (relative to the inputs' norm), as
information. Where no other side is found, the result says why: the budget was spent;
the branch is on a tensor that is no comparison (``if mask.any()``); the margin has no
gradient to follow, or is not finite (a comparison with ``inf``); it comes no nearer its
boundary along its gradient (a saturated probability); the model refused the moved
inputs (it raises: a solver's assertion), whose exception is never the verdict; or the
other side lies at inputs so large that their rounding changes a finite-difference step
of ``eps`` (at 1e5 and above for ``eps=1e-6`` in float64), where no check can be trusted.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

import torch

from .control_flow import UNKNOWN_LOCATION, DecisionMode, Location, user_location
from .failures import raised

__all__ = ["FORWARD_PASSES", "BranchSide", "other_sides"]

# Forward passes the search spends per decision at most (re-linearising counts one, with
# its backward). A margin as straight as its gradient says is crossed in one pass (the
# template's models: 1 to 4), a curved one in a few re-linearisations (an adaptive
# computation loop: 3 to 11); doubling then reaches a boundary 2**k times farther than
# the last linear guess in k passes, so the ~20 left reach one a million times farther,
# with about 6 to bisect back. It is little next to the check itself, which evaluates
# the model twice per checked element in slow mode.
FORWARD_PASSES = 32

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
# How far beyond the boundary a moved point must lie, in units of the change one finite
# difference step (eps in one element) makes to the margin; the search aims at twice
# that, and a crossing within _NEAR of it is kept without bisecting.
_CLEARANCE = 1000.0
_NEAR = 4.0
# The margin is curved where a step changed it by less than this fraction of what its
# gradient predicted: the linear guess is remade where the search stands.
_CURVED = 0.5
# A gradient remade this close in direction (cosine) to the line's says the margin only
# flattens along the line: the search doubles its step on that line instead.
_PARALLEL = 0.99
# Bisection stops once the crossing is bracketed within this fraction of the step (or
# within the clearance); it halves in log scale while the bracket spans more than
# _LOG_SCALE times, and regula falsi keeps this fraction of the bracket off its ends, so
# that each step narrows the bracket by at least that much.
_TIGHT = 0.25
_LOG_SCALE = 4.0
_OFF_THE_ENDS = 1 / 8
# A point is checked only where the inputs' rounding changes a finite-difference step of
# eps by at most this fraction of itself (or twice as much as at the given point): a
# hundredth of the default rtol, so no rounded step moves a numerical gradient near it.
_RESOLUTION = 1e-5


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
    budget: int = FORWARD_PASSES
    moved: float | None = None  # how far the inputs moved, relative to their norm
    reason: str = ""
    values: tuple[torch.Tensor, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def source(self) -> str:
        return self.location.source

    @property
    def where(self) -> str:
        """The decision's line, and which decision there (``models.py:20 (#2)``)."""
        return f"{self.location}" + (f" (#{self.occurrence})" if self.occurrence > 1 else "")

    def __str__(self) -> str:
        where = self.where
        other = not self.at_point
        passes = f"{self.forward_passes} of {self.budget} forward passes"
        if self.found:
            return (
                f"{where}: {self.at_point} at the point, {other} with the inputs moved by "
                f"{self.moved:.3g} of their norm ({passes})"
            )
        return (
            f"{where}: {self.at_point} at the point; {other} not checked: {self.reason} ({passes})"
        )


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
    budget: int = FORWARD_PASSES,
) -> list[BranchSide]:
    """For each branch decision ``evaluate(values)`` makes, inputs on its other side.

    ``values`` are the float64 tensors ``evaluate`` takes; only those at ``movable``
    (the inputs, not the parameters) are moved. ``eps`` is the finite-difference step
    the moved point must stay clear of the boundary by; ``budget`` the forward passes
    each decision's search may spend.
    """
    values = [value.detach() for value in values]
    leaves = [value.clone().requires_grad_(True) for value in values]
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
                    branch.location,
                    branch.occurrence,
                    branch.outcome,
                    False,
                    0,
                    budget,
                    reason=reason,
                )
            )
            continue
        gradients = torch.autograd.grad(branch.margin, moving, retain_graph=True, allow_unused=True)
        search = _Search(evaluate, values, movable, branch, eps, budget)
        sides.append(search.run(_dense(gradients, [values[i] for i in movable])))
    return sides


def _dense(gradients: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list:
    return [
        torch.zeros_like(value) if g is None else g.detach()
        for g, value in zip(gradients, like, strict=True)
    ]


class _NoVerdict(enum.Enum):
    """Why a moved input says nothing about the decision searched for."""

    REFUSED = enum.auto()  # the model raised
    NOT_MADE = enum.auto()  # the forward made no such decision there
    NO_COMPARISON = enum.auto()  # the decision there is on no comparison
    NOT_FINITE = enum.auto()  # the compared value is not finite there


@dataclass(frozen=True)
class _Trial:
    """The decision searched for, at the inputs moved by ``t`` along a line."""

    t: float
    values: list[torch.Tensor]
    margin: float | None = None  # positive on the point's side; None: no verdict there
    crossed: bool = False
    no_verdict: _NoVerdict | None = None
    detail: str = ""  # the exception raised, or the value compared


class _Search:
    """One decision's search for its other side, counting the forward passes it spends."""

    def __init__(self, evaluate, values, movable, branch: _Branch, eps: float, budget: int):
        self.evaluate, self.values, self.movable = evaluate, values, movable
        self.branch, self.eps, self.budget = branch, eps, budget
        # Margins are signed so that positive is the point's side, the target negative.
        self.sign = 1.0 if branch.outcome else -1.0
        self.norm = sum(float(values[i].square().sum()) for i in movable) ** 0.5 or 1.0
        self.passes = 0
        self.blocked: _Trial | None = None  # the nearest moved input with no verdict

    def side(self, found: bool, *, moved: float | None = None, reason: str = "", values=None):
        branch = self.branch
        return BranchSide(
            branch.location,
            branch.occurrence,
            branch.outcome,
            found,
            self.passes,
            self.budget,
            moved=moved,
            reason=reason,
            values=None if values is None else tuple(values),
        )

    def distance(self, moved: Sequence[torch.Tensor]) -> float:
        """How far ``moved`` is from the point, relative to the inputs' norm."""
        squares = sum(float((moved[i] - self.values[i]).square().sum()) for i in self.movable)
        return squares**0.5 / self.norm

    def run(self, gradients: list[torch.Tensor]) -> BranchSide:
        margin = self.sign * float(self.branch.margin.detach())
        squared = sum(float(g.square().sum()) for g in gradients)
        if not math.isfinite(margin) or not math.isfinite(squared):
            what = (
                "compared value" if not math.isfinite(margin) else "gradient of the compared value"
            )
            value = self.sign * margin if not math.isfinite(margin) else squared
            reason = f"the {what} is {value} at the point: no finite step crosses to the other side"
            return self.side(False, reason=reason)
        if squared == 0.0:
            return self.side(False, reason="the gradient of the compared value is zero here")
        base = _Trial(0.0, list(self.values), margin)
        while True:
            outcome = self.line(base, gradients)
            if isinstance(outcome, BranchSide):
                return outcome
            base, gradients = outcome

    def line(self, base: _Trial, gradients: list[torch.Tensor]):
        """Search along the gradient from ``base``: the side found or not, or where to
        search next (the base and gradient of a new line)."""
        squared = sum(float(g.square().sum()) for g in gradients)
        # Along this line the margin falls by 1 per unit of t, to first order.
        direction = [-self.sign * g / squared for g in gradients]
        clearance = _clearance(gradients, self.eps)
        target = -2 * clearance
        low, high, cap = replace(base, t=0.0), None, None
        straight = False  # the margin only flattens along this line: double, do not remake
        secant = True  # regula falsi in the bracket, until the far side looks saturated
        t = base.margin - target  # the Newton step
        while self.passes < self.budget:
            trial = self.tried(base, direction, t)
            if trial.margin is None or (not trial.crossed and trial.margin >= low.margin):
                cap = _nearer(cap, trial)  # too far along this line: no verdict, or no nearer
                if trial.margin is None:
                    self.note_blocked(trial)
            elif trial.crossed and trial.margin <= -clearance:
                if trial.margin >= -_NEAR * clearance:
                    return self.found(trial)
                secant = secant and high is None
                high = _nearer(high, trial)
            else:  # nearer the boundary, not beyond it by this line's clearance
                if trial.crossed and self.passes < self.budget:
                    # The gradient here says how near finite differences come to crossing
                    # back, and where to go on from if they do.
                    remade = self.linearised(trial)
                    if remade is not None:
                        if -trial.margin >= _clearance(remade, self.eps):
                            return self.found(trial)
                        return trial, remade
                slope = (low.margin - trial.margin) / (trial.t - low.t)
                low = trial
                if high is None and cap is None:
                    if slope >= _CURVED:
                        t = trial.t + (trial.margin - target) / slope  # the secant step
                        continue
                    if not straight and self.passes < self.budget - 1:
                        remade = self.linearised(trial)
                        if remade is not None and _cosine(remade, gradients) < _PARALLEL:
                            return trial, remade
                        straight = True
                    t = 2 * trial.t
                    continue
            upper = min((p for p in (high, cap) if p is not None), key=lambda p: p.t)
            if upper.t - low.t <= max(_TIGHT * upper.t, clearance):
                return self.found(high) if high is not None else self.unfound(low, "", cap)
            if secant and upper is high:
                # Regula falsi toward the target, kept off the bracket's ends.
                width = high.t - low.t
                t = low.t + (low.margin - target) * width / (low.margin - high.margin)
                off = _OFF_THE_ENDS * width
                t = min(max(t, low.t + off), high.t - off)
            else:
                t = _bisected(low.t, upper.t, clearance)
        if high is not None:
            return self.found(high)
        return self.unfound(
            low, f"not found within the budget of {self.budget} forward passes", cap
        )

    def note_blocked(self, trial: _Trial) -> None:
        """Keep ``trial`` if it is the nearest input the model gave no verdict on."""
        if self.blocked is None or self.distance(trial.values) < self.distance(self.blocked.values):
            self.blocked = trial

    def tried(self, base: _Trial, direction: list[torch.Tensor], t: float) -> _Trial:
        moved = list(base.values)
        for index, step in zip(self.movable, direction, strict=True):
            moved[index] = base.values[index] + t * step
        self.passes += 1
        try:
            with torch.no_grad():
                recorded = _record(self.evaluate, moved)
        except Exception as error:  # the model refuses this input: no verdict on it
            return _Trial(t, moved, no_verdict=_NoVerdict.REFUSED, detail=raised(error))
        for other in recorded:
            if _key(other) == _key(self.branch):
                if other.margin is None:
                    return _Trial(t, moved, no_verdict=_NoVerdict.NO_COMPARISON)
                margin = self.sign * float(other.margin)
                if not math.isfinite(margin):
                    detail = f"{float(other.margin)}"
                    return _Trial(t, moved, no_verdict=_NoVerdict.NOT_FINITE, detail=detail)
                return _Trial(t, moved, margin, other.outcome != self.branch.outcome)
        return _Trial(t, moved, no_verdict=_NoVerdict.NOT_MADE)

    def linearised(self, trial: _Trial) -> list[torch.Tensor] | None:
        """The margin's gradient at ``trial`` (one forward pass and its backward), or
        None where it has none to follow."""
        self.passes += 1
        leaves = [value.clone().requires_grad_(True) for value in trial.values]
        try:
            with torch.enable_grad():
                recorded = _record(self.evaluate, leaves)
        except Exception:  # refused there: the line goes on without a new gradient
            return None
        for other in recorded:
            if _key(other) == _key(self.branch) and other.margin is not None:
                if not other.margin.requires_grad:
                    return None
                moving = [leaves[i] for i in self.movable]
                grads = torch.autograd.grad(other.margin, moving, allow_unused=True)
                gradients = _dense(grads, [trial.values[i] for i in self.movable])
                squared = sum(float(g.square().sum()) for g in gradients)
                return gradients if math.isfinite(squared) and squared > 0 else None
        return None

    def found(self, trial: _Trial) -> BranchSide:
        """The side at ``trial``, unless its inputs are too large to resolve a step of eps."""
        moved = self.distance(trial.values)
        resolution = _resolution(trial.values, self.movable, self.eps)
        if resolution > max(_RESOLUTION, 2 * _resolution(self.values, self.movable, self.eps)):
            reason = (
                f"its other side, with the inputs moved by {moved:.3g} of their norm, is at "
                f"inputs so large that a finite-difference step of eps={self.eps:g} is "
                f"rounded by {resolution:.2g} of itself there: finite differences cannot "
                "check it"
            )
            return self.side(False, moved=moved, reason=reason)
        return self.side(True, moved=moved, values=trial.values)

    def unfound(self, low: _Trial, spent: str, cap: _Trial | None) -> BranchSide:
        """Why no other side was found: the budget ``spent`` (empty: not), the nearest
        input the model gave no verdict on, or ``cap``, where the margin came no nearer
        its boundary than at ``low``."""
        blocked = self.blocked
        reasons = [spent] if spent else []
        if blocked is not None:
            reasons.append(self.no_verdict(blocked))
        elif not spent and cap is not None:
            distance = self.distance(low.values)
            reasons.append(
                "along its gradient the compared value comes no nearer its boundary than "
                + (
                    f"{low.margin:.3g}, with the inputs moved by {distance:.3g} of their norm"
                    if distance
                    else f"at the point ({low.margin:.3g} from it)"
                )
            )
        if spent and blocked is None:
            reasons[0] += (
                f": the compared value is still {low.margin:.3g} short of its boundary with "
                f"the inputs moved by {self.distance(low.values):.3g} of their norm"
            )
        return self.side(False, reason="; ".join(reasons))

    def no_verdict(self, blocked: _Trial) -> str:
        """Why the model says nothing about the decision at ``blocked``."""
        distance = self.distance(blocked.values)
        toward = f"the inputs moved toward its other side by {distance:.3g} of their norm"
        if blocked.no_verdict is _NoVerdict.REFUSED:
            return f"the model refused {toward} ({blocked.detail}); this side is not checked"
        if blocked.no_verdict is _NoVerdict.NOT_MADE:
            branch = self.branch
            decision = f"decision #{branch.occurrence} at {branch.location}"
            return f"with {toward}, the forward made no {decision}"
        if blocked.no_verdict is _NoVerdict.NOT_FINITE:
            return f"with {toward}, the compared value is {blocked.detail}"
        return f"with {toward}, the decision there is on no comparison"


def _clearance(gradients: Sequence[torch.Tensor], eps: float) -> float:
    """How far beyond its boundary a margin with these gradients must be: finite
    differences of step ``eps`` change it by at most a thousandth of that."""
    return _CLEARANCE * eps * max(float(g.abs().max()) for g in gradients)


def _nearer(kept: _Trial | None, trial: _Trial) -> _Trial:
    return trial if kept is None or trial.t < kept.t else kept


def _resolution(values: Sequence[torch.Tensor], movable: Sequence[int], eps: float) -> float:
    """How much rounding the inputs changes a step of ``eps``, relative to it."""
    return max(
        (
            float(values[i].abs().max()) * torch.finfo(values[i].dtype).eps / 2 / eps
            for i in movable
            if values[i].numel()
        ),
        default=0.0,
    )


def _cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    dot = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    norms = sum(float(x.square().sum()) for x in a) * sum(float(y.square().sum()) for y in b)
    return dot / norms**0.5


def _bisected(low: float, high: float, scale: float) -> float:
    """Between ``low`` and ``high``: the middle, in log scale (from ``scale`` where
    ``low`` is 0) while they are orders of magnitude apart."""
    bottom = max(low, scale)
    if bottom > 0 and high > _LOG_SCALE * bottom:
        return (bottom * high) ** 0.5
    return (low + high) / 2
