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
- :func:`site_outcomes`: how each line's branch decisions went over several forwards;
- :func:`find_unused_parameters_needed`: whether ``DistributedDataParallel`` needs
  ``find_unused_parameters=True`` for a model, said only when the probe can show it
  (what the ``train`` command and ``ddp_check`` ask).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from . import calls
from .calls import graph_nodes
from .control_flow import (
    UNKNOWN_LOCATION,
    Decision,
    DecisionMode,
    Location,
    user_location,
    without_torch_function_modes,
)
from .failures import CheckFailure
from .subject import Subject
from .trees import named_leaves

__all__ = [
    "BRANCH_OPS",
    "MAX_FLIPS",
    "ConditionalUse",
    "Cut",
    "FindUnusedAdvice",
    "Reach",
    "SiteOutcomes",
    "UseRecorder",
    "conditional_parameters",
    "explain_unreached",
    "find_unused_parameters_needed",
    "flip_order",
    "located",
    "reached_parameters",
    "site_outcomes",
]

# The decisions that pick one of two sides: these can be turned the other way.
BRANCH_OPS = frozenset({"Tensor.__bool__", "torch.is_nonzero", "torch.equal", "torch.allclose"})
# Branch decisions turned the other way, at most, per probe: each flip is one forward,
# and the first decision of each (line, outcome) pair is tried first, so a handful
# covers every branch of a typical forward.
MAX_FLIPS = 32
# Calls whose output's shape depends on the input's values: what follows may use a
# parameter or not (an expert given no rows) without any branch decision to turn.
_DATA_SHAPED_CALLS: dict[Any, str] = {
    torch.nonzero: "torch.nonzero",
    torch.Tensor.nonzero: "Tensor.nonzero",
    torch.argwhere: "torch.argwhere",
    torch.masked_select: "torch.masked_select",
    torch.Tensor.masked_select: "Tensor.masked_select",
    torch.unique: "torch.unique",
    torch.Tensor.unique: "Tensor.unique",
    torch.unique_consecutive: "torch.unique_consecutive",
    torch.repeat_interleave: "torch.repeat_interleave",
}
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
        # (call, line) of each call whose output's shape the data decided.
        self.data_shaped: list[tuple[str, Location]] = []
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
        shaped = _DATA_SHAPED_CALLS.get(func)
        if shaped is None and func is torch.Tensor.__getitem__ and _boolean_index(args[1]):
            shaped = "indexing with a boolean mask"
        if shaped is not None:
            where = user_location(sys._getframe(1)) or UNKNOWN_LOCATION
            self.data_shaped.append((shaped, where))
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


def _boolean_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


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


@dataclass(frozen=True)
class ConditionalUse:
    """What :func:`conditional_parameters` found on one batch."""

    reached: list[str]  # the parameters the forward reached, in their order
    decided: dict[str, Reach]  # parameters whose being reached one branch decision turns
    flips: int  # branch decisions turned the other way
    recorder: UseRecorder  # the forward as it ran, unflipped


def conditional_parameters(
    run: Callable[[UseRecorder], Any],
    parameters: Sequence[tuple[str, torch.Tensor]],
    *,
    max_flips: int,
) -> ConditionalUse:
    """Which parameters one branch decision decides the use of.

    ``decided`` holds the :class:`Reach` of each parameter whose being reached changes
    when one branch decision goes the other way (``outcome`` is the side that reaches
    it). A forward with none is one whose parameters are all used, or all unused,
    whichever way any one of its decisions goes.
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
    return ConditionalUse(
        [name for name, _ in parameters if name in reached], decided, len(order), recorder
    )


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


# --- find_unused_parameters for a training command ---------------------------------------


class ParameterUseFailure(CheckFailure):
    """The probe behind :func:`find_unused_parameters_needed` could not run the model."""

    check = "find_unused_parameters_needed"


@dataclass(frozen=True)
class FindUnusedAdvice:
    """Whether DDP needs ``find_unused_parameters=True`` for a model, and why.

    ``reasons``: one line per group of parameters whose use a branch decision decides,
    or that the forward did not use. ``unprobed``: what the forward does that can leave
    a parameter unused without a branch to turn (a number read off a tensor, a shape
    the data decides, more decisions than were turned); with any, the flag stays on.
    """

    needed: bool
    reasons: tuple[str, ...]
    unprobed: tuple[str, ...]
    flips: int  # branch decisions turned the other way to find out

    def __str__(self) -> str:
        if self.reasons:
            also = f"; beyond the probe: {'; '.join(self.unprobed)}" if self.unprobed else ""
            return "find_unused_parameters=True needed: " + "; ".join(self.reasons) + also
        if self.unprobed:
            return (
                "find_unused_parameters=True kept: every parameter is used whichever way "
                f"any one of the forward's {self.flips} branch decision(s) goes, but its use "
                "may depend on what the probe cannot turn: " + "; ".join(self.unprobed)
            )
        return (
            "find_unused_parameters not needed: every parameter is used whichever way any "
            f"one of the forward's {self.flips} branch decision(s) goes"
        )


def find_unused_parameters_needed(
    model: torch.nn.Module, /, *inputs: Any, forward_kwargs: Any = None
) -> FindUnusedAdvice:
    """Whether ``DistributedDataParallel(model)`` needs ``find_unused_parameters=True``.

    Runs the forward on ``inputs`` (one batch, in this process), then once for each of
    its branch decisions turned the other way (up to :data:`MAX_FLIPS`): needed when a
    parameter is unused in one of these runs, since a batch that goes that way would
    leave it without a gradient. Not needed is said only when nothing else in the
    forward can decide a parameter's use: no number read off a tensor (``.item()``,
    ``int()``, a loop count), no shape the data decides (``nonzero``, a boolean mask),
    no branch decision left unturned. The model, its buffers and the RNGs are left as
    they were.
    """
    kwargs = calls.forward_kwargs_of("find_unused_parameters_needed", forward_kwargs)
    subject = Subject(model, inputs, kwargs, failure=ParameterUseFailure)
    parameters = subject.parameters

    def run(recorder: UseRecorder) -> Any:
        subject.reset()
        fresh = subject.fresh_inputs()
        with without_torch_function_modes(), recorder:
            return subject.target(*fresh.args, **fresh.kwargs)

    try:
        use = conditional_parameters(run, parameters, max_flips=MAX_FLIPS)
    finally:
        subject.reset()
    unreached = [n for n, _ in parameters if n not in use.reached and n not in use.decided]
    groups: dict[str, list[str]] = {}
    for name, reach in use.decided.items():
        groups.setdefault(str(reach), []).append(name)
    reasons = [f"{', '.join(names)} {why}" for why, names in groups.items()]
    if unreached:
        reasons.insert(0, f"{', '.join(unreached)} not used by the forward on this batch")
    unprobed = _unprobed(use)
    return FindUnusedAdvice(bool(reasons or unprobed), tuple(reasons), tuple(unprobed), use.flips)


def _unprobed(use: ConditionalUse) -> list[str]:
    """What the forward did that can decide a parameter's use with no branch to turn."""
    found = []
    numbers = [d for d in use.recorder.decisions if d.op not in BRANCH_OPS]
    if numbers:
        first = numbers[0]
        found.append(
            f"{len(numbers)} number(s) read off tensors ({first.op} at {located(first.location)}"
            + (" and more" if len(numbers) > 1 else "")
            + ")"
        )
    if use.recorder.data_shaped:
        call, where = use.recorder.data_shaped[0]
        found.append(f"shapes decided by the data ({call} at {located(where)})")
    branches = len([d for d in use.recorder.decisions if d.op in BRANCH_OPS])
    if branches > use.flips:
        found.append(f"{branches - use.flips} of {branches} branch decisions not turned")
    return found
