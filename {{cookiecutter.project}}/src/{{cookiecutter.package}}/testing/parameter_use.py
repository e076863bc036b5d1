"""Which trainable parameters a forward reaches, and which decisions of the data decide it.

A parameter is *reached* when the autograd graph of the forward's outputs leads back
to it: that is what gives it a gradient, and what
``DistributedDataParallel(find_unused_parameters=True)`` searches the graph for at
every step. In a dynamic model it depends on the data: a block used only on one side
of ``if h.mean() > 0:`` is reached for some batches and not for others.

- :func:`reached_parameters`: the parameters the graph of some outputs reaches;
- :class:`UseRecorder`: a :class:`.control_flow.DecisionMode` that records the
  forward's decisions, the user's line where each parameter was first used, and the
  places that cut a parameter off the graph (``.detach()``, ``.data``, a use under
  ``torch.no_grad()``); it can also run the forward with one branch decision turned
  the other way (``flip=k``), which is how :func:`explain_unreached` finds the outcome
  under which a parameter would be reached;
- :func:`explain_unreached`: for each parameter a forward did not reach, why: the
  branch decision whose other outcome reaches it, or the cut, or that nothing the
  forward decided leads to it;
- :func:`conditional_parameters`: the parameters whose use one branch decision
  decides, either way (what ``find_unused_parameters`` depends on);
- :func:`site_outcomes`: how each line's branch decisions went over several forwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from .calls import graph_nodes
from .control_flow import UNKNOWN_LOCATION, Decision, DecisionMode, Location, user_location
from .trees import named_leaves

__all__ = [
    "BRANCH_OPS",
    "Cut",
    "Reach",
    "SiteOutcomes",
    "UseRecorder",
    "conditional_parameters",
    "explain_unreached",
    "flip_order",
    "located",
    "reached_parameters",
    "site_outcomes",
]

# The decisions that pick one of two sides: these can be turned the other way.
BRANCH_OPS = frozenset({"Tensor.__bool__", "torch.is_nonzero", "torch.equal", "torch.allclose"})
# Calls that return a tensor cut off from the graph of their input.
_CUTTING_CALLS: dict[Any, str] = {
    torch.Tensor.detach: ".detach()",
    torch.Tensor.detach_: ".detach_()",
    torch.Tensor.data.__get__: ".data",  # type: ignore[attr-defined]
}


def located(location: Location) -> str:
    """``models.py:54 `if h.mean() > 0:``` : the line, and its code where it can be read."""
    source = location.source
    return f"{location} `{source}`" if source else str(location)


def _graph_parameters(roots: Iterable[Any], wanted: dict[int, str]) -> set[str]:
    """The names (from ``wanted``, by id) of the leaf tensors the graphs of ``roots`` reach."""
    roots = [root for root in roots if isinstance(root, torch.Tensor) and root.requires_grad]
    found = {wanted[id(root)] for root in roots if root.grad_fn is None and id(root) in wanted}
    for node in graph_nodes(roots):
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None and id(variable) in wanted:
            found.add(wanted[id(variable)])
    return found


def reached_parameters(outputs: Any, parameters: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of ``parameters`` the autograd graph of ``outputs`` reaches, in their order.

    The same search DDP makes with ``find_unused_parameters=True``: from each output's
    ``grad_fn`` back to the leaves.
    """
    wanted = {id(tensor): name for name, tensor in parameters}
    found = _graph_parameters((leaf for _, leaf in named_leaves(outputs, "")), wanted)
    return [name for name, _ in parameters if name in found]


@dataclass(frozen=True)
class Cut:
    """A place where the forward cut parameters off the graph: ``.detach()`` or no_grad."""

    how: str  # ".detach()", ".data", "torch.no_grad()"
    location: Location
    parameters: frozenset[str]

    def __str__(self) -> str:
        if self.how == "torch.no_grad()":
            return f"used with gradients off (torch.no_grad()) at {located(self.location)}"
        return f"cut off the graph by {self.how} at {located(self.location)}"


class UseRecorder(DecisionMode):
    """Records a forward's decisions, parameter uses and cuts; may turn decision ``flip``.

    ``parameters`` are the ``(name, tensor)`` pairs to follow. ``flip`` is the index
    (from 1) of a branch decision (:data:`BRANCH_OPS`) to turn the other way: the
    forward then runs the code of the other side on the same data. ``decisions`` holds
    what the forward did, the flipped decision included.
    """

    def __init__(
        self, parameters: Sequence[tuple[str, torch.Tensor]], flip: int | None = None
    ) -> None:
        super().__init__()
        self._names = {id(tensor): name for name, tensor in parameters}
        self.flip = flip
        self.decisions: list[Decision] = []
        self.first_use: dict[str, Location] = {}
        self.cuts: list[Cut] = []
        self._flip_now = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs)
        if self._flip_now:
            self._flip_now = False
            return not result
        return result

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        index = len(self.decisions) + 1
        if index == self.flip and op in BRANCH_OPS:
            self._flip_now = True
            result = not result
        location = user_location(frame) or UNKNOWN_LOCATION
        self.decisions.append(Decision(index, op, result, location))

    def computed(self, func: Any, args: tuple, kwargs: dict | None, result: Any) -> None:
        used = [name for name in map(self._names.get, map(id, _shallow(args, kwargs))) if name]
        how = _CUTTING_CALLS.get(func)
        if not used and how is None:
            return
        location = user_location(sys._getframe(1)) or UNKNOWN_LOCATION
        for name in used:
            self.first_use.setdefault(name, location)
        if used and not torch.is_grad_enabled():
            self.cuts.append(Cut("torch.no_grad()", location, frozenset(used)))
        if how is not None and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            cut_off = _graph_parameters([args[0]], self._names)
            if cut_off:
                self.cuts.append(Cut(how, location, frozenset(cut_off)))


def _shallow(args: tuple, kwargs: dict | None) -> Iterable[Any]:
    """The arguments of a call and the items of list and tuple arguments (``torch.cat``)."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, list | tuple):
            yield from value
        else:
            yield value


@dataclass(frozen=True)
class Reach:
    """Why the forward did not reach a parameter, and what would reach it.

    ``decision`` is the branch decision of the recorded forward whose other outcome
    (``outcome``) reaches it, found by running the forward with that decision
    flipped; ``cut`` is where the forward used it but cut it off the graph; with
    neither, no single branch decision of the forward leads to it (``flips`` tried).
    """

    parameter: str
    decision: Decision | None = None
    outcome: bool | None = None
    first_use: Location | None = None
    cut: Cut | None = None
    flips: int = 0

    def __str__(self) -> str:
        if self.cut is not None:
            if self.first_use is None or self.first_use == self.cut.location:
                return str(self.cut)
            return f"used at {self.first_use}, then {self.cut}"
        if self.decision is not None:
            source = self.decision.location.source
            shown = f"`{source}`" if source else self.decision.op
            return f"reached only when {shown} at {self.decision.location} is {self.outcome}"
        if self.first_use is not None:
            return (
                f"used at {self.first_use}, but the result does not depend on it through "
                "autograd: what it computes is not part of the result, or passes through an "
                "operation without a gradient (an integer or boolean tensor, .item(), .numpy())"
            )
        tried = f" (each of {self.flips} flipped)" if self.flips else ""
        return (
            "never used by the forward, whichever way its branch decisions go"
            f"{tried}: a layer built but not called, or called only on a path that no "
            "single decision of this batch leads to"
        )


def explain_unreached(
    run: Callable[[UseRecorder], Any],
    parameters: Sequence[tuple[str, torch.Tensor]],
    unreached: Sequence[str],
    *,
    max_flips: int,
) -> dict[str, Reach]:
    """Why each parameter named in ``unreached`` is not reached, by name.

    ``run(recorder)`` runs the forward from the same starting state every time, under
    the recorder, and returns its outputs (or the loss); an exception in a run with a
    decision flipped ends that run only. The recorded forward's branch decisions are
    flipped one at a time (:func:`flip_order`), at most ``max_flips`` of them, until
    each parameter is accounted for.
    """
    recorder = UseRecorder(parameters)
    run(recorder)
    reasons: dict[str, Reach] = {}
    for name in unreached:
        cut = next((cut for cut in recorder.cuts if name in cut.parameters), None)
        if cut is not None:
            reasons[name] = Reach(name, first_use=recorder.first_use.get(name), cut=cut)
    waiting = [name for name in unreached if name not in reasons]
    flips = 0
    for decision in flip_order(recorder.decisions)[:max_flips]:
        if not waiting:
            break
        flips += 1
        reached = _reached_when_flipped(run, parameters, decision, waiting)
        for name in reached or ():
            reasons[name] = Reach(name, decision=decision, outcome=not decision.value)
        waiting = [name for name in waiting if name not in reasons]
    for name in waiting:
        reasons[name] = Reach(name, first_use=recorder.first_use.get(name), flips=flips)
    return {name: reasons[name] for name in unreached}


def conditional_parameters(
    run: Callable[[UseRecorder], Any],
    parameters: Sequence[tuple[str, torch.Tensor]],
    *,
    max_flips: int,
) -> tuple[list[str], dict[str, Reach], int]:
    """Which parameters one branch decision decides the use of.

    Returns the parameters the forward reaches as it runs, the :class:`Reach` of each
    parameter whose being reached changes when one branch decision goes the other way
    (``outcome`` is the side that reaches it), and how many decisions were flipped. A
    forward with none is one whose parameters are all used, or all unused, whichever
    way any one of its decisions goes.
    """
    recorder = UseRecorder(parameters)
    reached = set(reached_parameters(run(recorder), parameters))
    decided: dict[str, Reach] = {}
    order = flip_order(recorder.decisions)[:max_flips]
    for decision in order:
        flipped = _reached_when_flipped(run, parameters, decision, [n for n, _ in parameters])
        if flipped is None:
            continue
        for name, _ in parameters:
            if name in decided or (name in reached) == (name in flipped):
                continue
            outcome = decision.value if name in reached else not decision.value
            decided[name] = Reach(name, decision=decision, outcome=bool(outcome))
    return [name for name, _ in parameters if name in reached], decided, len(order)


def _reached_when_flipped(
    run: Callable[[UseRecorder], Any],
    parameters: Sequence[tuple[str, torch.Tensor]],
    decision: Decision,
    names: Sequence[str],
) -> set[str] | None:
    """The parameters of ``names`` reached with ``decision`` flipped; None when that fails."""
    try:
        outputs = run(UseRecorder(parameters, flip=decision.index))
    except Exception:  # the other side cannot run on this data: it tells nothing
        return None
    return set(reached_parameters(outputs, [(n, t) for n, t in parameters if n in names]))


def flip_order(decisions: Sequence[Decision]) -> list[Decision]:
    """Branch decisions, the first of each (line, outcome) pair first, then the others."""
    branches = [d for d in decisions if d.op in BRANCH_OPS]
    seen: set[tuple[Location, bool]] = set()
    first, rest = [], []
    for decision in branches:
        key = (decision.location, bool(decision.value))
        (rest if key in seen else first).append(decision)
        seen.add(key)
    return first + rest


@dataclass(frozen=True)
class SiteOutcomes:
    """How the branch decisions of one line went: ``(outcome, count)`` pairs, True first."""

    location: Location
    outcomes: tuple[tuple[Any, int], ...]

    def __str__(self) -> str:
        seen = ", ".join(f"{value} x{count}" for value, count in self.outcomes)
        return f"{located(self.location)}: {seen}"


def site_outcomes(logs: Iterable[Sequence[Decision]]) -> tuple[SiteOutcomes, ...]:
    """Each line's branch outcomes over several recorded forwards, lines in first-seen order."""
    counts: dict[Location, dict[Any, int]] = {}
    for log in logs:
        for decision in log:
            if decision.op in BRANCH_OPS:
                seen = counts.setdefault(decision.location, {})
                seen[decision.value] = seen.get(decision.value, 0) + 1
    return tuple(
        SiteOutcomes(location, tuple(sorted(seen.items(), key=lambda item: not item[0])))
        for location, seen in counts.items()
    )
