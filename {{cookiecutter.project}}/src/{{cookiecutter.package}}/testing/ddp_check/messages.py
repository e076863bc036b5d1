"""What passes between the test's process and the processes of a launch.

Each process gets the :class:`Job` when it starts and keeps its files where
:class:`Files` says. The test's process sends it commands (:class:`Train`,
:class:`Go`, :class:`Time` to the ranks; :class:`Reference`, :class:`Explain`,
:class:`Alone` to the single process; :class:`Exit` to all) and it answers with
events, each saying which process sent it (``rank``: a rank, or :data:`REFERENCE`), in
which step (0: its start-up) and phase. Both are pickled with plain pickle, tensors by
value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..control_flow import Decision, Location
from ..parameter_use import Reach

REFERENCE = -1  # the role of the process that runs alone on the concatenated batch


def role_name(role: int) -> str:
    return "the single process" if role == REFERENCE else f"rank {role}"


@dataclass
class Job:
    """What every process needs: the model, the batches, how to compute and step."""

    target: Any
    batches: list[tuple]
    kwargs: dict[str, Any]
    concatenated: tuple
    loss_fn: Callable[[Any], torch.Tensor] | None
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None
    backend: str
    timeout: float
    temp_root: Path | None  # where each launch makes its folder (None: the system's)
    timing_rounds: int  # blocks of timed steps per DDP configuration, when a cost is measured

    @property
    def world_size(self) -> int:
        return len(self.batches)


class Files:
    """Where one process of a launch keeps its files in the launch's folder."""

    def __init__(self, folder: Path, role: int) -> None:
        self.store = folder / ("single" if role == REFERENCE else "ranks")  # its FileStore
        self.stack = folder / f"stack{role}.txt"  # faulthandler's dump, on SIGUSR1
        self.error = folder / f"error{role}.pickle"  # its Raised event, if it raised


# --- commands, from the test's process ------------------------------------------------


@dataclass(frozen=True)
class Train:
    """To the ranks: ``steps`` steps under DDP with ``options``, then every rank's batch
    through the trained model (the same-sample forwards)."""

    options: Mapping[str, Any]
    steps: int


@dataclass(frozen=True)
class Go:
    """To the ranks, after each step's forward: every rank's is in, and their collectives
    match; on with the backward."""


@dataclass(frozen=True)
class Time:
    """To the ranks: timed steps of each DDP configuration ``(options, touch every
    parameter)``."""

    configurations: tuple[tuple[Mapping[str, Any], bool], ...]


@dataclass(frozen=True)
class Reference:
    """To the single process: ``steps`` steps on the concatenated batch, then which
    parameters one flipped decision would leave unused."""

    steps: int


@dataclass(frozen=True)
class Explain:
    """To the single process: what would make ``rank``'s batch use the parameters
    ``names`` (no rank used them)."""

    rank: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Alone:
    """To the single process: each rank's batch through a whole forward in its group of
    one, where every collective returns at once."""


@dataclass(frozen=True)
class Exit:
    """To every process: the launch is over."""


Command = Train | Go | Time | Reference | Explain | Alone | Exit


# --- events, from the processes -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Event:
    rank: int
    step: int
    phase: str


@dataclass(frozen=True, kw_only=True)
class Ready(Event):
    """Started and joined its process group."""


@dataclass(frozen=True, kw_only=True)
class Idle(Event):
    """Done with its commands so far."""


@dataclass(frozen=True, kw_only=True)
class Raised(Event):
    """It raised ``type_name: message`` at the user's ``location`` (``frames``: the user's
    last lines, outermost first); its last event."""

    type_name: str
    message: str
    location: Location | None
    frames: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class StepEvent(Event):
    """An event of a rank's step, with the decisions it made since its last one."""

    decisions: tuple[Decision, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CollectiveCalled(StepEvent):
    """The user's code calls the collective ``op`` at ``location`` (before it runs)."""

    op: str
    location: Location


@dataclass(frozen=True, kw_only=True)
class PhaseDone(StepEvent):
    """A rank finished the phase."""


@dataclass(frozen=True, kw_only=True)
class ForwardDone(PhaseDone):
    reached: tuple[str, ...]  # the parameters the loss's graph reaches


@dataclass(frozen=True, kw_only=True)
class BackwardDone(PhaseDone):
    grads: dict[str, torch.Tensor | None]  # after the all-reduce


@dataclass(frozen=True, kw_only=True)
class SamplesDone(PhaseDone):
    """Every rank's batch through this rank's trained model: the decisions of each
    (``logs[batch]``), and the rank's parameters and buffers (``state``)."""

    logs: tuple[tuple[Decision, ...], ...]
    state: dict[str, torch.Tensor | None]


@dataclass(frozen=True, kw_only=True)
class Timed(PhaseDone):
    """Seconds per timed step, ``wall[configuration]`` and ``cpu[configuration]``."""

    wall: tuple[tuple[float, ...], ...]
    cpu: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, kw_only=True)
class ReferenceStep(Event):
    """The single process's gradients and decisions of one step."""

    grads: dict[str, torch.Tensor | None]
    decisions: tuple[Decision, ...]


@dataclass(frozen=True, kw_only=True)
class ReferenceDone(Event):
    """The single process's run is over: whether the forward draws random numbers, the
    gradients' dtype, and the parameters one flipped decision would leave unused."""

    random: bool
    dtype: torch.dtype
    at_risk: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Explained(Event):
    reasons: Mapping[str, Reach]  # each parameter no rank used: what would reach it


@dataclass(frozen=True, kw_only=True)
class AloneRuns(Event):
    """For each rank's batch, the collectives a whole forward calls and its decisions."""

    runs: tuple[tuple[tuple[tuple[str, Location], ...], tuple[Decision, ...]], ...]
