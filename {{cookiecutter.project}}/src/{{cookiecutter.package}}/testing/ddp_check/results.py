"""What ``ddp_check`` raises and returns: its failures, the cost of the search, the result.

The types at the bottom of the check: this module imports none of the check's others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..control_flow import Decision, Location
from ..failures import CheckFailure
from ..parameter_use import SiteOutcomes

__all__ = [
    "CollectiveMismatch",
    "Cost",
    "DdpCheckFailure",
    "DdpResult",
    "GradientMismatch",
    "RankFailed",
    "RanksDisagree",
    "StaticGraphUnsafe",
    "UnusedParameters",
    "rank_steps",
]


class DdpCheckFailure(CheckFailure):
    """The model misbehaves under DistributedDataParallel; the subclasses say how."""

    check = "ddp_check"


class UnusedParameters(DdpCheckFailure):
    """Parameters without a gradient on some ranks and ``find_unused_parameters=False``.

    ``unused`` maps each parameter to the ``(rank, step)`` pairs that left it out,
    ``reasons`` to the decision and outcomes that did, ``cost`` is what
    ``find_unused_parameters=True`` costs per step (None when it was not measured),
    ``ddp_error`` DDP's own message when a rank raised it.
    """

    def __init__(
        self,
        message: str,
        unused: Mapping[str, tuple[tuple[int, int], ...]],
        reasons: Mapping[str, str],
        cost: Cost | None,
        ddp_error: str | None,
    ) -> None:
        super().__init__(message)
        self.unused = dict(unused)
        self.parameters = tuple(unused)
        self.reasons = dict(reasons)
        self.cost = cost
        self.ddp_error = ddp_error


class CollectiveMismatch(DdpCheckFailure):
    """Ranks called collectives differently.

    ``calls[rank]`` lists the ``(op, location)`` each rank called under DDP before the
    check stopped them; ``location`` is the line of the first call that differs;
    ``counts[rank]`` how often each rank's batch calls it in a whole forward (run alone,
    in a process group of one, where a collective never waits), or under DDP where that
    run was not possible; ``divergence`` the first decision where the ranks part.
    """

    def __init__(
        self,
        message: str,
        step: int,
        location: Location | None,
        calls: Mapping[int, tuple[tuple[str, Location], ...]],
        counts: Mapping[int, int],
        divergence: tuple[int, Decision | None, Decision | None] | None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.location = location
        self.calls = dict(calls)
        self.counts = dict(counts)
        self.divergence = divergence


class RanksDisagree(DdpCheckFailure):
    """Two ranks decided differently for the same batch (``batch``: whose it was).

    ``ranks`` are the two ranks, ``divergence`` the first decision where they part,
    ``differing_state`` the buffers and parameters whose values differ between them.
    """

    def __init__(
        self,
        message: str,
        batch: int,
        ranks: tuple[int, int],
        divergence: tuple[int, Decision | None, Decision | None],
        differing_state: Sequence[str],
    ) -> None:
        super().__init__(message)
        self.batch = batch
        self.ranks = ranks
        self.divergence = divergence
        self.differing_state = tuple(differing_state)


class GradientMismatch(DdpCheckFailure):
    """A gradient after the all-reduce differs: between ranks (``against`` is a rank) or
    from the one process on the concatenated batch (``against`` is ``"one process"``)."""

    def __init__(
        self, message: str, step: int, name: str, against: int | str, rtol: float, atol: float
    ) -> None:
        super().__init__(message)
        self.step = step
        self.name = name
        self.against = against
        self.rtol = rtol
        self.atol = atol


class StaticGraphUnsafe(DdpCheckFailure):
    """``static_graph=True``, but the parameters used change between steps or ranks."""

    def __init__(self, message: str, changing: Sequence[str]) -> None:
        super().__init__(message)
        self.changing = tuple(changing)


class RankFailed(DdpCheckFailure):
    """A rank raised (``how="raised"``), died (``"died"``) or did not finish in time
    (``"timed out"``) at ``step`` (0: while starting), in ``phase`` (``"forward"``,
    ``"backward"``, ...); ``location`` is the user's line
    it was at, where known; ``error`` the exception raised, as ``"Type: message"``; ``pids``
    are every process the check started (none is left)."""

    def __init__(
        self,
        message: str,
        rank: int,
        how: str,
        step: int,
        location: Location | None,
        pids: Sequence[int],
        error: str | None = None,
        phase: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.how = how
        self.step = step
        self.phase = phase
        self.location = location
        self.pids = tuple(pids)
        self.error = error


# --- results --------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """Per-step time of DDP with ``find_unused_parameters=True`` and without it (with every
    parameter touched where some would be unused): wall clock and the process's CPU
    time, each the median over the steps of the slowest rank's time."""

    with_search: float  # wall seconds per step, find_unused_parameters=True
    without_search: float  # wall seconds per step, find_unused_parameters=False
    cpu_with_search: float  # the same in CPU seconds, the stable figure on a busy machine
    cpu_without_search: float
    touched: bool  # whether the run without it touched every parameter (the rewrite)
    steps: int

    @property
    def extra(self) -> float:
        return self.with_search - self.without_search

    @property
    def cpu_extra(self) -> float:
        return self.cpu_with_search - self.cpu_without_search

    def __str__(self) -> str:
        baseline = "with the rewrite that touches every parameter" if self.touched else "without it"
        return (
            f"{self.with_search * 1e3:.3f} ms per step with it against "
            f"{self.without_search * 1e3:.3f} ms {baseline} ({self.extra * 1e3:+.3f} ms; CPU "
            f"time {self.cpu_with_search * 1e3:.3f} against {self.cpu_without_search * 1e3:.3f} "
            f"ms, {self.cpu_extra * 1e3:+.3f} ms; medians of {self.steps} steps of the slowest "
            "rank)"
        )


@dataclass(frozen=True)
class DdpResult:
    """What ``ddp_check`` ran and saw; ``str()`` is its report."""

    subject: str
    world_size: int
    backend: str
    device: str
    steps: int
    options: tuple[tuple[str, Any], ...]
    outcomes: tuple[tuple[int, tuple[SiteOutcomes, ...]], ...]  # per rank
    unused: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # name -> (rank, step)s
    find_unused_needed: bool
    static_graph_safe: bool
    at_risk: tuple[str, ...]  # parameters one flipped decision would leave unused
    compared: str  # what the gradients were compared with, in words
    startup_seconds: float
    step_seconds: float
    cost: Cost | None

    def __str__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in self.options) or "defaults"
        lines = [
            f"ddp_check {self.subject}: {self.world_size} ranks ({self.backend}, "
            f"{self.device}), {self.steps} steps, DDP options: {options}: {self.compared}; same "
            f"decisions on every rank for the same samples; start-up {self.startup_seconds:.2f} "
            f"s, {self.step_seconds * 1e3:.1f} ms per checked step"
        ]
        for rank, sites in self.outcomes:
            for site in sites:
                lines.append(f"  rank {rank}: {site}")
        if self.unused:
            groups: dict[str, list[str]] = {}
            for name, pairs in self.unused:
                groups.setdefault(rank_steps(pairs), []).append(name)
            where = "; ".join(f"{', '.join(names)} on {ranks}" for ranks, names in groups.items())
            lines.append(f"  find_unused_parameters=True is needed: unused {where}")
        else:
            lines.append("  every parameter was used on every rank in every step")
            if self.at_risk:
                lines.append(
                    "  but one decision the other way leaves "
                    + ", ".join(self.at_risk)
                    + " unused: DDP would then need find_unused_parameters=True"
                )
        if self.cost is not None:
            lines.append(f"  find_unused_parameters=True: {self.cost}")
        lines.append(
            "  static_graph=True would be safe (the same parameters are used on every rank "
            "in every step)"
            if self.static_graph_safe
            else "  static_graph=True would not be safe: the parameters used change between "
            "ranks or steps"
        )
        return "\n".join(lines)


def rank_steps(pairs: Sequence[tuple[int, int]]) -> str:
    """``(rank, step)`` pairs as ``rank 1 (steps 1, 2, 3)``, each rank once."""
    by_rank: dict[int, list[int]] = {}
    for rank, step in pairs:
        by_rank.setdefault(rank, []).append(step)
    return ", ".join(
        f"rank {rank} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
        for rank, steps in sorted(by_rank.items())
    )
