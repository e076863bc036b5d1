"""Run a dynamic model under real ``DistributedDataParallel`` in N processes, and say what breaks.

``ddp_check(model, batch_0, batch_1)`` starts one process per batch (a rank), each
with its own copy of the model and its own batch, joins them in a process group
(gloo on the CPU, NCCL on GPUs when asked), wraps the model in
``DistributedDataParallel`` with the options given (as torch spells them) and runs a
few training steps. One more process runs the same steps alone, in a process group
of one, on the batches concatenated: what DDP promises to compute. The test's own
process never joins a process group: it starts the processes, hears from each rank
at every step through a pipe, and decides. Each rank records its data-dependent
decisions (:mod:`.control_flow`), the parameters its graph reaches at each step
(:mod:`.parameter_use`, the search ``find_unused_parameters=True`` makes) and every
collective the user's code calls, with the user's line, before it is called. So a
failure names the line and the rank, and a job that would hang is reported instead:

- :class:`UnusedParameters`: parameters that get no gradient on some ranks without
  ``find_unused_parameters=True``, each with the decision and each rank's outcome
  that left it out, DDP's own error, and what to do, with what
  ``find_unused_parameters=True`` costs per step on this model, measured against the
  rewrite that touches every parameter;
- :class:`CollectiveMismatch`: collectives called a different number of times or in
  another order on different ranks: the line, each rank's count, and the decision
  where the ranks part (the loop's condition);
- :class:`RanksDisagree`: ranks that decide differently for the same sample, and the
  buffers or parameters that differ between them;
- :class:`GradientMismatch`: gradients after the all-reduce that differ between ranks
  (bit for bit: every rank gets the same reduction), or from the one process on the
  concatenated batch beyond the tolerance it states;
- :class:`StaticGraphUnsafe`: ``static_graph=True`` with parameters used in some steps
  and not in others;
- :class:`RankFailed`: a rank that raised, died or hung, with the user's line (a hung
  rank's stack is read with :mod:`faulthandler` before it is killed).

Every process is ended on every path, the failing and the hanging ones too, and none
outlives the check. A passing model gets a :class:`DdpResult`: the decision outcomes
per rank, whether ``find_unused_parameters`` is needed and ``static_graph=True``
safe, and the start-up and step times.

:func:`.parameter_use.find_unused_parameters_needed` (also importable from here) is
the analysis in one process, for a training command that sets up DDP.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import importlib
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import pickle
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import calls
from .comparison import bitwise_equal, close_mismatch, tolerances_for
from .control_flow import (
    TORCH_DIR,
    Decision,
    Location,
    display_path,
    first_divergence,
    record_decisions,
    user_location,
)
from .failures import CheckFailure
from .naming import describe_callable
from .parameter_use import (
    MAX_FLIPS,
    FindUnusedAdvice,
    Reach,
    SiteOutcomes,
    UseRecorder,
    conditional_parameters,
    explain_unreached,
    find_unused_parameters_needed,
    located,
    reached_parameters,
    site_outcomes,
)
from .subject import Subject
from .trees import map_tensors, named_leaves

__all__ = [
    "CollectiveMismatch",
    "DdpCheckFailure",
    "DdpResult",
    "FindUnusedAdvice",
    "GradientMismatch",
    "RankFailed",
    "RanksDisagree",
    "StaticGraphUnsafe",
    "UnusedParameters",
    "ddp_check",
    "find_unused_parameters_needed",
]

# Two ranks: the fewest that can disagree, and what one test's CPU can run side by side.
DEFAULT_WORLD_SIZE = 2
# Three steps: DDP reports a reduction left unfinished at the next step's forward, and
# a third lets the parameters' use change after two optimizer steps.
DEFAULT_STEPS = 3
# Seconds one launch of the ranks may take, and the process group's own timeout: the
# ranks of a small test model start and step in well under a second each, so this
# only bounds a rank that hangs for a reason the check cannot see coming.
DEFAULT_TIMEOUT = 60.0
# SGD's step for the default optimizer: small enough that a few steps keep the model
# near where the test put it, large enough that the parameters do change.
DEFAULT_LR = 0.01
# Steps timed per DDP configuration when a cost is measured: TIMING_ROUNDS blocks of
# TIMED_STEPS, each after WARMUP_STEPS that let DDP rebuild its buckets, the
# configurations alternating; the median of the slowest rank's times is reported.
TIMING_ROUNDS = 3
TIMED_STEPS = 10
WARMUP_STEPS = 2
# Once the check knows DDP must fail (a parameter unused without
# find_unused_parameters), how long to wait for DDP's own error: it comes at the next
# step's forward, within milliseconds; the wait only bounds a rank stuck in the
# all-reduce the other ranks never join.
DOOMED_GRACE = 5.0
# How long to listen for the other ranks' errors once one rank raised in a step that had
# to fail: DDP raises on every rank that starts its next forward, within milliseconds.
DRAIN_WAIT = 1.0
# How long a hung rank gets to write its stack (faulthandler, on SIGUSR1).
STACK_WAIT = 1.0
# How long a rank gets to exit after the last command before it is killed.
EXIT_WAIT = 5.0
# How long ending the processes a rank started may take: SIGKILL ends a process within
# milliseconds; this only bounds descendants that keep starting new ones.
END_WAIT = 5.0
# Pause between two looks at /proc while processes just killed finish dying.
END_POLL = 0.01
# prctl(2) options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Branch decisions flipped one at a time to find what decides a parameter's use.
BACKENDS = ("gloo", "nccl")
START_METHODS = (None, "fork", "spawn")
_OPTIONS = (
    "forward_kwargs",
    "world_size",
    "backend",
    "steps",
    "loss_fn",
    "optimizer",
    "find_unused_parameters",
    "static_graph",
    "broadcast_buffers",
    "gradient_as_bucket_view",
    "bucket_cap_mb",
    "timeout",
    "rtol",
    "atol",
    "start_method",
    "temp_root",
)
REFERENCE = -1  # the role of the process that runs alone on the concatenated batch


# --- failures -------------------------------------------------------------------------


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
                groups.setdefault(_rank_steps(pairs), []).append(name)
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


def _rank_steps(pairs: Sequence[tuple[int, int]]) -> str:
    by_rank: dict[int, list[int]] = {}
    for rank, step in pairs:
        by_rank.setdefault(rank, []).append(step)
    return ", ".join(
        f"rank {rank} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
        for rank, steps in sorted(by_rank.items())
    )


# --- the check ------------------------------------------------------------------------


def ddp_check(
    model_or_fn: Callable[..., Any],
    /,
    *inputs_per_rank: Any,
    forward_kwargs: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    backend: str = "gloo",
    steps: int = DEFAULT_STEPS,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    find_unused_parameters: bool | None = None,
    static_graph: bool | None = None,
    broadcast_buffers: bool | None = None,
    gradient_as_bucket_view: bool | None = None,
    bucket_cap_mb: float | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    rtol: float | None = None,
    atol: float | None = None,
    start_method: str | None = None,
    temp_root: str | os.PathLike[str] | None = None,
    **unknown: Any,
) -> DdpResult:
    """Train ``model_or_fn`` under ``DistributedDataParallel`` on one batch per rank.

    Each of ``inputs_per_rank`` is one rank's inputs: a tensor (the forward's one
    input) or a tuple of positional inputs; one batch alone is split along dimension 0
    into ``world_size`` (default 2) equal parts. ``forward_kwargs`` go to every rank's
    forward. Each step computes ``loss_fn(output)`` (default: the output when it is a
    scalar, as for a model that returns its loss, else the mean of the squared
    floating-point outputs) and runs ``backward`` and ``optimizer`` (a callable that
    makes an optimizer from a list of parameters; default SGD, lr=0.01).
    ``find_unused_parameters``, ``static_graph``, ``broadcast_buffers``,
    ``gradient_as_bucket_view`` and ``bucket_cap_mb`` go to DDP when given (DDP's own
    defaults otherwise). ``backend``
    is ``"gloo"`` (ranks on the CPU) or ``"nccl"`` (rank ``r`` on ``cuda:r``).
    ``timeout`` bounds each launch of the ranks, in seconds. ``rtol``/``atol`` bound
    the difference from one process on the concatenated batch (by dtype when None).
    ``start_method``: None forks the ranks where that is safe (Linux, gloo, CUDA not yet
    initialized in this process) and spawns them otherwise, which needs the model,
    inputs, ``loss_fn`` and ``optimizer`` to pickle. The processes' files (their
    rendezvous, their errors) go in a folder made in ``temp_root`` (the fixture gives
    pytest's temporary folder; None: the system's) and removed at the end. Raises a
    :class:`DdpCheckFailure` subclass; returns a :class:`DdpResult`.
    """
    __tracebackhide__ = True
    calls.reject_unknown_keywords("ddp_check", unknown, _OPTIONS)
    kwargs = calls.forward_kwargs_of("ddp_check", forward_kwargs)
    batches = _rank_batches(inputs_per_rank, world_size)
    _check_options(
        backend, steps, timeout, start_method, len(batches), loss_fn, optimizer, temp_root
    )
    given = {
        "find_unused_parameters": find_unused_parameters,
        "static_graph": static_graph,
        "broadcast_buffers": broadcast_buffers,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "bucket_cap_mb": bucket_cap_mb,
    }
    options = {name: value for name, value in given.items() if value is not None}
    job = _Job(
        target=model_or_fn,
        batches=batches,
        kwargs=kwargs,
        concatenated=_concatenate(batches),
        loss_fn=loss_fn,
        optimizer=optimizer,
        backend=backend,
        timeout=float(timeout),
        temp_root=None if temp_root is None else Path(temp_root),
    )
    method = _start_method(start_method, job)
    return _Checker(job, options, steps, method, (rtol, atol)).run()


def _rank_batches(inputs_per_rank: tuple, world_size: int | None) -> list[tuple]:
    """Each rank's positional inputs."""
    if world_size is not None and (
        not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
    ):
        raise ValueError(f"ddp_check: world_size must be a whole number >= 1, got {world_size!r}")
    if not inputs_per_rank:
        raise TypeError(
            "ddp_check: give one batch per rank after the model (ddp_check(model, x0, x1)), or "
            "one batch to split"
        )
    batches = [entry if isinstance(entry, tuple) else (entry,) for entry in inputs_per_rank]
    if len(batches) > 1:
        if world_size is not None and world_size != len(batches):
            raise ValueError(
                f"ddp_check: world_size={world_size} but {len(batches)} batches were given: "
                "give one batch per rank, or one batch to split into world_size parts"
            )
        return batches
    count = DEFAULT_WORLD_SIZE if world_size is None else world_size
    (batch,) = batches
    sizes = {
        t.shape[0] for _, t in named_leaves(batch, "") if isinstance(t, torch.Tensor) and t.dim()
    }
    if len(sizes) != 1 or next(iter(sizes)) % count:
        raise ValueError(
            f"ddp_check: one batch is split into world_size={count} equal parts along dimension "
            f"0, but its tensors have sizes {sorted(sizes)} there: give one batch per rank"
        )
    part = next(iter(sizes)) // count
    return [
        map_tensors(lambda t, r=r: t[r * part : (r + 1) * part] if t.dim() else t, batch)
        for r in range(count)
    ]


def _concatenate(batches: list[tuple]) -> tuple:
    """The ranks' batches as one: tensors joined along dimension 0, other values shared."""
    flat = [torch.utils._pytree.tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    if any(other_spec != spec for _, other_spec in flat):
        raise ValueError(
            "ddp_check: the ranks' inputs must have the same structure (the same number and "
            "nesting of inputs)"
        )
    joined = []
    for position, leaves in enumerate(zip(*(leaves for leaves, _ in flat), strict=True)):
        if isinstance(leaves[0], torch.Tensor) and leaves[0].dim():
            joined.append(torch.cat([leaf.detach() for leaf in leaves]))
        elif all(_same_value(leaf, leaves[0]) for leaf in leaves):
            joined.append(leaves[0])
        else:
            raise ValueError(
                f"ddp_check: input leaf {position} differs between ranks and is not a batched "
                "tensor: values that are not batched along dimension 0 must be the same on "
                "every rank (put them in forward_kwargs)"
            )
    return torch.utils._pytree.tree_unflatten(joined, spec)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bitwise_equal(a, b)
    return type(a) is type(b) and repr(a) == repr(b)


def _check_options(
    backend: str,
    steps: Any,
    timeout: Any,
    start_method: Any,
    world_size: int,
    loss_fn: Any,
    optimizer: Any,
    temp_root: Any,
) -> None:
    if temp_root is not None and not (
        isinstance(temp_root, str | os.PathLike) and Path(temp_root).is_dir()
    ):
        raise ValueError(f"ddp_check: temp_root must be an existing folder, got {temp_root!r}")
    if backend not in BACKENDS:
        raise ValueError(
            f"ddp_check: backend={backend!r} is not allowed: expected one of {BACKENDS}"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(
            f"ddp_check: steps must be a whole number >= 2 (DDP reports a reduction left "
            f"unfinished at the next step), got {steps!r}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"ddp_check: timeout must be a number of seconds > 0, got {timeout!r}")
    if start_method not in START_METHODS:
        raise ValueError(
            f"ddp_check: start_method={start_method!r} is not allowed: expected one of "
            f"{START_METHODS}"
        )
    for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if value is not None and not callable(value):
            raise TypeError(f"ddp_check: {name} must be callable or None, got {value!r}")
    if backend == "nccl":
        reason = _nccl_unavailable(world_size)
        if reason is not None:
            raise ValueError(f"ddp_check: backend='nccl' is not usable here: {reason}")


def _nccl_unavailable(world_size: int) -> str | None:
    if not dist.is_nccl_available():
        return "this torch is built without NCCL"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.cuda.device_count() < world_size:
        return (
            f"{world_size} ranks need {world_size} GPUs (NCCL runs one rank per GPU), "
            f"{torch.cuda.device_count()} visible"
        )
    return None


def _start_method(requested: str | None, job: _Job) -> str:
    """Fork where that is safe, spawn otherwise; a spawn needs everything to pickle."""
    method = requested
    why = f"start_method={requested!r}"
    if method is None:
        # CUDA does not survive a fork: a forked rank cannot use it once this process
        # has, and NCCL ranks use it, so they are spawned whatever this process did.
        forkable = "fork" in multiprocessing.get_all_start_methods()
        if job.backend == "nccl":
            method, why = "spawn", "NCCL ranks use CUDA, so they are spawned, not forked"
        elif not forkable or torch.cuda.is_initialized():
            method = "spawn"
            why = (
                "CUDA is initialized in this process, so the ranks cannot be forked and are spawned"
            )
        else:
            method = "fork"
    if method != "fork":
        try:
            pickle.dumps(job)
        except Exception as error:
            raise TypeError(
                f"ddp_check: {why}: the model, inputs, loss_fn and optimizer must then pickle, "
                f"and they do not ({type(error).__name__}: {error}). Define the model's class "
                "and any function at module level (a lambda or a class defined in a test does "
                "not pickle)"
            ) from error
    return method


@dataclass
class _Job:
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

    @property
    def world_size(self) -> int:
        return len(self.batches)


# --- the test's process: launches, events, decisions ----------------------------------


class _Files:
    """Where one process of a launch keeps its files in the launch's folder."""

    def __init__(self, folder: Path, role: int) -> None:
        self.store = folder / ("single" if role == REFERENCE else "ranks")  # its FileStore
        self.stack = folder / f"stack{role}.txt"  # faulthandler's dump, on SIGUSR1
        self.error = folder / f"error{role}.pickle"  # what it raised, if it did


@dataclass
class _Event:
    kind: str
    rank: int
    step: int
    phase: str
    data: dict[str, Any]


class _Stopped(Exception):
    """A launch ended early: a rank failed, died or hung, or the check saw enough."""

    def __init__(self, failure: DdpCheckFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


@dataclass(frozen=True)
class _Collective:
    op: str
    location: Location


@dataclass
class _RankStep:
    """What one rank reported for one step."""

    decisions: list[Decision] = field(default_factory=list)
    reached: tuple[str, ...] | None = None
    grads: dict[str, torch.Tensor | None] | None = None


class _Launch:
    """The rank processes (and the single process) of one launch, and their pipes."""

    def __init__(self, job: _Job, method: str) -> None:
        self.job = job
        self.context = multiprocessing.get_context(method)
        # A forked child has its own copy of everything. A spawned one gets the job as
        # plain pickled bytes: handed over as objects, torch would move its tensors to
        # memory shared by every process, and each rank's optimizer would step them all.
        self.payload: _Job | bytes = job if method == "fork" else pickle.dumps(job)
        self.roles = [*range(job.world_size), REFERENCE]
        self.folder = Path(tempfile.mkdtemp(prefix="ddp_check-", dir=job.temp_root))
        self.processes: dict[int, Any] = {}
        self.connections: dict[int, Any] = {}  # each process's events, to read
        self.commands: dict[int, Any] = {}  # each process's commands, to write
        self.silent: set[int] = set()  # processes whose pipe is closed
        self.idle: set[int] = set()  # processes done with their commands so far
        self.last: dict[int, _Event] = {}
        self.pids: list[int] = []
        self.failed = False
        self.closed = False
        self.started_tracker = False

    def start(self) -> float:
        """Start every process; the seconds until all have joined their process groups."""
        if self.context.get_start_method() == "fork":
            # DDP's constructor reads a torch._dynamo setting, and importing dynamo takes
            # seconds: imported here once, every forked process has it.
            importlib.import_module("torch._dynamo")
        else:
            self.started_tracker = not _resource_tracker_running()
        started = time.perf_counter()
        for role in self.roles:
            # What travels through the pipes is pickled here with plain pickle, tensors
            # by value: multiprocessing's own pickler would hand a tensor over as a file
            # descriptor that the receiver fetches from the sender later, which fails once
            # the sender is dead (a rank's last gradients before it was killed).
            events, events_end = self.context.Pipe(duplex=False)
            commands_end, commands = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=_child_main,
                args=(self.payload, role, str(self.folder), (events_end, commands_end)),
                kwargs={"parent": os.getpid()},
                name=f"ddp_check {_role_name(role)}",
                daemon=True,
            )
            with warnings.catch_warnings():
                # Python 3.12 warns about fork() in a process with threads. The children
                # run torch and this module only, and torch resets its thread pools after
                # a fork (as for DataLoader workers).
                warnings.filterwarnings(
                    "ignore", r"This process .* is multi-threaded", DeprecationWarning
                )
                process.start()
            events_end.close()
            commands_end.close()
            self.processes[role], self.connections[role] = process, events
            self.commands[role] = commands
            self.pids.append(process.pid)
        deadline = time.monotonic() + self.job.timeout
        ready: set[int] = set()
        while len(ready) < len(self.roles):
            ready.add(self.next(deadline, "starting").rank)
        self.idle.update(self.roles)
        return time.perf_counter() - started

    def send(self, role: int, *command: Any) -> None:
        self.idle.discard(role)
        with contextlib.suppress(OSError):
            self.commands[role].send_bytes(pickle.dumps(command))

    def to_ranks(self, *command: Any) -> None:
        for role in self.roles:
            if role != REFERENCE:
                self.send(role, *command)

    def next(self, deadline: float, doing: str) -> _Event:
        """The next event from any process; a rank that raised, died or is silent past the
        deadline stops the launch (:class:`_Stopped`)."""
        try:
            return self._next(deadline, doing)
        except _Stopped:
            self.failed = True
            raise

    def _next(self, deadline: float, doing: str) -> _Event:
        while True:
            for role, connection in self.connections.items():
                if role in self.silent or not connection.poll():
                    continue
                try:
                    event = _Event(*pickle.loads(connection.recv_bytes()))
                except (EOFError, OSError):  # its end of the pipe is closed: it died
                    self.silent.add(role)
                    continue
                if event.kind == "error":
                    raise _Stopped(self._raised(event))
                if event.kind == "idle":  # done with its commands so far
                    self.idle.add(role)
                    continue
                self.last[role] = event
                return event
            for role, process in self.processes.items():
                if role in self.silent and process.is_alive():
                    process.join(EXIT_WAIT)  # the pipe closes a moment before the process ends
                if not process.is_alive() and not (
                    role not in self.silent and self.connections[role].poll()  # last words first
                ):
                    self.silent.add(role)
                    raise _Stopped(self._died(role, process.exitcode, doing))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Stopped(self._hung(doing))
            waitables = [
                item
                for role in self.roles
                if role not in self.silent
                for item in (self.connections[role], self.processes[role].sentinel)
            ]
            multiprocessing.connection.wait(waitables, timeout=remaining)

    def drain(self, within: float) -> list[RankFailed]:
        """The errors the processes still raise within ``within`` seconds."""
        deadline = time.monotonic() + within
        raised: dict[int, RankFailed] = {}
        while True:
            open_ends = {
                connection: role
                for role, connection in self.connections.items()
                if role not in self.silent
            }
            remaining = deadline - time.monotonic()
            if not open_ends or remaining <= 0:
                break
            for connection in multiprocessing.connection.wait(list(open_ends), remaining):
                role = open_ends[connection]  # type: ignore[index]
                try:
                    event = _Event(*pickle.loads(connection.recv_bytes()))  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self.silent.add(role)
                    continue
                if event.kind == "error":
                    raised[role] = self._raised(event)
        for role in self.silent - set(raised):
            with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
                event = _Event(*pickle.loads(_Files(self.folder, role).error.read_bytes()))
                raised[role] = self._raised(event)
        return list(raised.values())

    def _where(self, role: int) -> str:
        last = self.last.get(role)
        if last is None:
            return "before it reported anything"
        if last.kind == "collective":
            return (
                f"in step {last.step}'s {last.phase}, in {last.data['op']} at "
                f"{located(last.data['location'])}"
            )
        if last.step == 0:
            return "after its start-up"
        return f"after step {last.step}'s {last.phase}"

    def _raised(self, event: _Event) -> RankFailed:
        location = event.data["location"]
        at = f" at {located(location)}" if location else ""
        return RankFailed(
            f"{_role_name(event.rank)} raised in step {event.step} ({event.phase}){at}:\n"
            f"  {event.data['type']}: {event.data['message']}"
            + "".join(f"\n  {line}" for line in event.data["frames"]),
            event.rank,
            "raised",
            event.step,
            location,
            self.pids,
            error=f"{event.data['type']}: {event.data['message']}",
            phase=event.phase,
        )

    def _died(self, role: int, exitcode: int | None, doing: str) -> RankFailed:
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
            return self._raised(_Event(*pickle.loads(_Files(self.folder, role).error.read_bytes())))
        how = (
            f"killed by {signal.Signals(-exitcode).name}"
            if exitcode is not None and exitcode < 0
            else f"exited with code {exitcode}"
        )
        last = self.last.get(role)
        location = last.data.get("location") if last is not None else None
        return RankFailed(
            f"{_role_name(role)} died ({how}) during {doing}, {self._where(role)}; every other "
            "process of the check was ended",
            role,
            "died",
            last.step if last is not None else 0,
            location,
            self.pids,
        )

    def _hung(self, doing: str) -> RankFailed:
        silent = [role for role in self.roles if role not in self.silent | self.idle]
        stacks = self.stacks(silent)
        lines, location = [], None
        for role in silent:
            frames = stacks.get(role, [])
            if frames and location is None:
                location = frames[0]
            shown = [located(frames[0]), *map(str, frames[1:4])] if frames else []
            at = f"; its stack, innermost first: {', '.join(shown)}" if shown else ""
            lines.append(f"  {_role_name(role)}: {self._where(role)}{at}")
        first = next((role for role in silent if stacks.get(role)), silent[0] if silent else 0)
        last = self.last.get(first)
        return RankFailed(
            f"the processes did not finish {doing} within timeout={self.job.timeout:g} s and "
            "were killed:\n" + "\n".join(lines),
            first,
            "timed out",
            last.step if last is not None else 0,
            location,
            self.pids,
        )

    def stacks(self, roles: Sequence[int]) -> dict[int, list[Location]]:
        """Each live process's user lines, innermost first (faulthandler, on SIGUSR1)."""
        for role in roles:
            process = self.processes[role]
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGUSR1)
        time.sleep(STACK_WAIT)
        return {role: _stack_locations(_Files(self.folder, role).stack) for role in roles}

    def __enter__(self) -> _Launch:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        # A check's own failure leaves the ranks idle; anything else (KeyboardInterrupt, an
        # error of the check) may have come in the middle of a step.
        self.close(at_once=kind is not None and not issubclass(kind, DdpCheckFailure))

    def close(self, *, at_once: bool = False) -> None:
        """End every process and all it started (asked to exit after a launch that went
        well, killed at once otherwise), reap it, and remove the launch's folder."""
        if self.closed:
            return
        self.closed = True
        try:
            if not (self.failed or at_once):
                for role in self.roles:
                    self.send(role, "exit")
                deadline = time.monotonic() + EXIT_WAIT
                for process in self.processes.values():
                    process.join(max(0.0, deadline - time.monotonic()))
        finally:  # a second KeyboardInterrupt in the wait above ends them too
            for process in self.processes.values():
                _end_process(process)
            for connection in (*self.connections.values(), *self.commands.values()):
                connection.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.started_tracker:
                _stop_resource_tracker()


def _resource_tracker_running() -> bool:
    # multiprocessing starts its resource tracker process with the first spawned child
    # and keeps it until this process ends; the check ends the one it started. Python
    # has no public API for this: ``_resource_tracker``, ``_pid`` and ``_stop`` are
    # multiprocessing's own (3.8 and later).
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    return getattr(tracker, "_pid", None) is not None


def _stop_resource_tracker() -> None:
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


# --- every process a rank starts ends with it -----------------------------------------
#
# What this relies on (POSIX, and Linux where said):
# - a process made the leader of a new session by setsid(2) leads a process group of
#   its own, with its pid for id, and every process it starts joins that group unless
#   it leaves it (setsid, setpgid), as subprocess.Popen(start_new_session=True) does;
#   killpg(2) reaches every member, and a pid stays taken while a group of that id has a
#   member, so the group of a rank already reaped is still its own;
# - Linux: a process that dies leaves its children to the nearest living ancestor
#   marked PR_SET_CHILD_SUBREAPER (to init without one), so while a rank lives,
#   everything it started, in its group or not, is in its tree of parent pids in /proc;
#   a stopped process (SIGSTOP) starts nothing, and SIGKILL ends it stopped or not;
# - Linux: PR_SET_PDEATHSIG has the kernel signal a process when the thread that
#   started it ends: the test's main thread starts the ranks.


def _lead_own_group(parent: int) -> None:
    """In a process of the check, first thing: lead a session and process group of its
    own, on Linux adopt its orphaned descendants and be killed when the test's process
    dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:  # it died before that
        os._exit(1)


def _living() -> dict[int, tuple[int, int]]:
    """Each live process's parent pid and process group, from /proc (empty without it)."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            # pid (comm) state ppid pgrp ...: the name may hold spaces and parentheses
            state, ppid, group = stat.rpartition(")")[2].split()[:3]
            if state not in ("Z", "X"):  # a zombie has ended, only its exit status is left
                found[int(entry.name)] = (int(ppid), int(group))
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, (ppid, _) in _living().items():
        children.setdefault(ppid, []).append(child)
    found, unvisited = [], [pid]
    while unvisited:
        below = children.get(unvisited.pop(), [])
        found += below
        unvisited += below
    return found


def _end_descendants(pid: int) -> None:
    """Kill every live descendant of ``pid`` until none is left (Linux; elsewhere its
    process group does it)."""
    deadline = time.monotonic() + END_WAIT
    while (found := _descendants(pid)) and time.monotonic() < deadline:
        for descendant in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(descendant, signal.SIGKILL)
        time.sleep(END_POLL)


def _end_process(process: Any) -> None:
    """End a process of the check that leads its own group (:func:`_lead_own_group`) and
    everything it started, and reap it: stopped, so that it starts nothing more, its
    descendants killed, then itself, then what is left of its group, waited for."""
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGSTOP)
        _end_descendants(process.pid)
        process.kill()
    process.join()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + END_WAIT
    while time.monotonic() < deadline and any(
        group == process.pid for _, group in _living().values()
    ):
        time.sleep(END_POLL)


def _role_name(role: int) -> str:
    return "the single process" if role == REFERENCE else f"rank {role}"


def _decision_text(decision: Decision) -> str:
    return f"decision #{decision.index} at {located(decision.location)}"


def _stack_locations(dump: Path) -> list[Location]:
    """The user's lines in a faulthandler dump, innermost first, down to the first frame of
    this module (a forked process keeps its parent's outer frames)."""
    try:
        text = dump.read_text(errors="replace")
    except OSError:
        return []
    here = os.path.abspath(__file__)
    skipped = (TORCH_DIR, os.path.dirname(os.__file__))
    locations = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Thread ") or line.startswith("Current thread "):
            if locations:
                break  # the first thread that was in user code is the one
            continue
        if not line.startswith('File "'):
            continue
        path, _, rest = line[len('File "') :].partition('", line ')
        number = rest.split(" ", 1)[0]
        if os.path.abspath(path) == here:
            break
        if number.isdigit() and not path.startswith(skipped):
            locations.append(Location(path, int(number)))
    return locations


class _Checker:
    """The phases of one check, run from the test's process, and what they found."""

    def __init__(
        self,
        job: _Job,
        options: dict[str, Any],
        steps: int,
        method: str,
        tolerances: tuple[float | None, float | None],
    ) -> None:
        self.job = job
        self.options = options
        self.steps = steps
        self.method = method
        self.rtol, self.atol = tolerances
        self.subject = describe_callable(job.target)
        self.names = [
            name
            for name, _ in Subject(
                job.target, job.batches[0], job.kwargs, failure=DdpCheckFailure
            ).parameters
        ]
        self.ranks = list(range(job.world_size))
        self.record: dict[int, dict[int, _RankStep]] = {}
        self.collectives: dict[tuple[int, str], dict[int, list[_Collective]]] = {}
        self.samples: dict[int, dict[str, Any]] = {}
        self.reference: dict[int, dict[str, Any]] = {}
        self.reference_info: dict[str, Any] | None = None
        self.explained: dict[str, Reach] | None = None
        self.backlog: list[_Event] = []
        self.alone: list[tuple[list[tuple[str, Location]], list[Decision]]] | None = None
        self.mismatch: tuple[int, str, dict[int, list[_Collective]], int] | None = None
        self.doomed = False
        self.step_seconds = math.nan

    def run(self) -> DdpResult:
        __tracebackhide__ = True
        cost = None
        with _Launch(self.job, self.method) as launch:
            try:
                startup = launch.start()
                launch.send(REFERENCE, "reference", self.steps)
                ddp_error = None
                try:
                    self._train(launch)
                except _Stopped as stop:
                    if not self.doomed:
                        raise
                    # DDP raises at the next forward; a rank that waited for the others in the
                    # all-reduce may fail first, on the broken connection: DDP's error is the one
                    # raised in a forward.
                    raised = [stop.failure, *launch.drain(DRAIN_WAIT)]
                    ddp_error = next(
                        (f for f in raised if isinstance(f, RankFailed) and f.phase == "forward"),
                        stop.failure,
                    )
                if self.doomed:
                    launch.close()
                    raise _Stopped(self._unused_failure(ddp_error))
                self._wait_reference(launch, lambda: self.reference_info is not None)
                failure = self._findings()
                if failure is not None:
                    raise _Stopped(failure)
                if self.options.get("find_unused_parameters"):
                    cost = self._cost(launch)
            except _Stopped as stop:
                if self.mismatch is not None:
                    raise self._collective_failure(
                        *self.mismatch, self._alone_runs(launch)
                    ) from None
                raise stop.failure from None
        return self._result(startup, cost)

    def _alone_runs(self, launch: _Launch) -> list | None:
        """The collectives each rank's batch calls in a whole forward, from the single
        process (None when it cannot tell: it failed or hangs too)."""
        launch.send(REFERENCE, "alone")
        try:
            self._wait_reference(launch, lambda: self.alone is not None)
        except _Stopped:
            return None
        return self.alone

    # --- the steps --------------------------------------------------------------------

    def _train(self, launch: _Launch) -> None:
        launch.to_ranks("train", self.options, self.steps)
        deadline = time.monotonic() + self.job.timeout
        started = time.perf_counter()
        for step in range(1, self.steps + 1):
            steps = {rank: _RankStep() for rank in self.ranks}
            self.record[step] = steps

            def forward(event: _Event, steps: dict[int, _RankStep] = steps) -> None:
                steps[event.rank].reached = tuple(event.data["reached"])

            self._collect(launch, step, "forward", deadline, forward)
            self._check_unused(steps)
            launch.to_ranks("go")
            if self.doomed:
                deadline = min(deadline, time.monotonic() + DOOMED_GRACE)

            def backward(event: _Event, steps: dict[int, _RankStep] = steps) -> None:
                steps[event.rank].grads = event.data["grads"]

            self._collect(launch, step, "backward", deadline, backward)
        self.step_seconds = (time.perf_counter() - started) / self.steps

        def samples(event: _Event) -> None:
            self.samples[event.rank] = event.data

        self._collect(launch, self.steps + 1, "same-sample forwards", deadline, samples)

    def _collect(
        self,
        launch: _Launch,
        step: int,
        phase: str,
        deadline: float,
        on_done: Callable[[_Event], None],
    ) -> None:
        """Events until every rank has reported the end of ``phase``; the collectives they
        call meanwhile are checked against each other as they come."""
        calls = self.collectives.setdefault((step, phase), {rank: [] for rank in self.ranks})
        done: set[int] = set()
        doing = f"step {step}'s {phase}" if step <= self.steps else phase
        while len(done) < len(self.ranks):
            event = self._next_of(launch, step, phase, deadline, doing)
            if step in self.record:
                self.record[step][event.rank].decisions.extend(event.data.get("decisions", ()))
            if event.kind == "collective":
                calls[event.rank].append(_Collective(event.data["op"], event.data["location"]))
            elif event.kind == "done":
                on_done(event)
                done.add(event.rank)
            self._check_collectives(step, phase, calls, done)

    def _next_of(
        self, launch: _Launch, step: int, phase: str, deadline: float, doing: str
    ) -> _Event:
        """The next event of a rank's ``phase`` of ``step``; a rank that is already further
        (its next step, while another rank finishes this one) has its events kept for
        later, and the single process's are taken in as they come."""
        for index, event in enumerate(self.backlog):
            if (event.step, event.phase) == (step, phase):
                return self.backlog.pop(index)
        while True:
            event = launch.next(deadline, doing)
            if event.rank == REFERENCE:
                self._absorb_reference(event)
            elif (event.step, event.phase) == (step, phase):
                return event
            else:
                self.backlog.append(event)

    def _absorb_reference(self, event: _Event) -> None:
        if event.kind == "reference":
            self.reference[event.step] = event.data
        elif event.kind == "reference-done":
            self.reference_info = event.data
        elif event.kind == "explained":
            self.explained = event.data["reasons"]
        elif event.kind == "alone":
            self.alone = event.data["runs"]

    def _wait_reference(self, launch: _Launch, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.job.timeout
        while not ready():
            event = launch.next(deadline, "the single process's run")
            if event.rank == REFERENCE:
                self._absorb_reference(event)

    def _check_collectives(
        self, step: int, phase: str, calls: dict[int, list[_Collective]], done: set[int]
    ) -> None:
        """A CollectiveMismatch as soon as the ranks' collectives can no longer match: two
        ranks called different ones at the same position, or a rank finished the phase
        with fewer than another has called."""
        longest = max(len(sequence) for sequence in calls.values())
        for index in range(longest):
            called = {
                call
                for sequence in calls.values()
                if index < len(sequence)
                for call in [sequence[index]]
            }
            short = [rank for rank in done if index >= len(calls[rank])]
            if len(called) > 1 or short:
                self.mismatch = (step, phase, calls, index)
                raise _Stopped(self._collective_failure(step, phase, calls, index))

    def _collective_failure(
        self,
        step: int,
        phase: str,
        calls: dict[int, list[_Collective]],
        index: int,
        alone: list | None = None,
    ) -> CollectiveMismatch:
        first = next(sequence[index] for sequence in calls.values() if index < len(sequence))
        lines = [
            f"the ranks called collectives differently in step {step}'s {phase}: collective "
            f"#{index + 1} is {first.op} at {located(first.location)}"
        ]
        for rank, sequence in calls.items():
            call = sequence[index] if index < len(sequence) else None
            what = (
                f"called {call.op} at {call.location} as #{index + 1}"
                if call is not None
                else f"made no #{index + 1}: it finished with {len(sequence)}"
            )
            lines.append(f"  rank {rank} {what}")
        divergence = self._first_rank_divergence(step)
        counts = {
            rank: sum(1 for call in sequence if call == first) for rank, sequence in calls.items()
        }
        if alone is not None:
            counts = {
                rank: sum(1 for op, at in alone[rank][0] if (op, at) == (first.op, first.location))
                for rank in self.ranks
            }
            lines.append(
                f"Each rank's batch alone (a process group of one, where a collective never "
                f"waits) calls {first.op} at {first.location} "
                + ", ".join(f"{counts[rank]} times on rank {rank}" for rank in self.ranks)
                + "."
            )
            logs = {rank: alone[rank][1] for rank in self.ranks}
            divergence = next(
                (
                    ((0, rank), found)
                    for rank in self.ranks[1:]
                    if (found := first_divergence(logs[0], logs[rank])) is not None
                ),
                divergence,
            )
        if divergence is not None:
            (a, b), (_, left, right) = divergence
            decision = left or right
            assert decision is not None
            lines.append(
                f"The ranks part at {_decision_text(decision)}: rank {a} "
                f"{left.value if left else 'made none'}, rank {b} "
                f"{right.value if right else 'made none'}: a loop or branch decided by each "
                "rank's own data calls the collective a different number of times."
            )
        lines.append(
            "Under DDP this hangs until the process group's timeout (or gloo aborts on "
            "mismatched sizes): every rank must call the same collectives in the same order. "
            "Decide the loop on a value all ranks share (all_reduce the statistic, then loop "
            "on the result), or run the same number of iterations on every rank."
        )
        return CollectiveMismatch(
            "\n".join(lines),
            step,
            first.location,
            {rank: tuple((c.op, c.location) for c in sequence) for rank, sequence in calls.items()},
            counts,
            divergence[1] if divergence is not None else None,
        )

    def _first_rank_divergence(
        self, step: int
    ) -> tuple[tuple[int, int], tuple[int, Decision | None, Decision | None]] | None:
        if step not in self.record:
            return None
        logs = {rank: record.decisions for rank, record in self.record[step].items()}
        for a in self.ranks:
            for b in self.ranks[a + 1 :]:
                found = first_divergence(logs[a], logs[b])
                if found is not None:
                    return (a, b), found
        return None

    # --- unused parameters ----------------------------------------------------------

    def _check_unused(self, steps: dict[int, _RankStep]) -> None:
        if not self.options.get("find_unused_parameters") and any(
            set(record.reached or ()) != set(self.names) for record in steps.values()
        ):
            # DDP cannot finish this step's reduction: it says so at the next forward.
            self.doomed = True

    def _unused(self) -> dict[str, tuple[tuple[int, int], ...]]:
        unused: dict[str, list[tuple[int, int]]] = {}
        for step, steps in self.record.items():
            for rank, record in steps.items():
                if record.reached is None:
                    continue
                for name in self.names:
                    if name not in record.reached:
                        unused.setdefault(name, []).append((rank, step))
        return {name: tuple(pairs) for name, pairs in unused.items()}

    def _unused_reasons(
        self, unused: Mapping[str, tuple[tuple[int, int], ...]], launch: _Launch
    ) -> dict[str, str]:
        """For each unused parameter, the decision and each rank's outcome that left it out;
        for one no rank used, the decision that would (from the single process)."""
        reasons: dict[str, str] = {}
        for name, pairs in unused.items():
            for rank, step in pairs:
                users = [
                    other
                    for other, record in self.record[step].items()
                    if record.reached is not None and name in record.reached
                ]
                if users:
                    reasons[name] = self._divergence_text(step, rank, users[0])
                    break
        never_used = [name for name in unused if name not in reasons]
        if never_used:
            launch.send(REFERENCE, "explain", unused[never_used[0]][0][0], never_used)
            self._wait_reference(launch, lambda: self.explained is not None)
            assert self.explained is not None
            for name in never_used:
                reach = self.explained[name]
                taken = ", which no rank's batch did here" if reach.decision is not None else ""
                reasons[name] = f"unused on every rank: {reach}{taken}"
        return reasons

    def _divergence_text(self, step: int, unused_on: int, used_on: int) -> str:
        logs = {rank: record.decisions for rank, record in self.record[step].items()}
        found = first_divergence(logs[used_on], logs[unused_on])
        if found is None:
            return f"used on rank {used_on}, not on rank {unused_on}, with the same decisions"
        k, used, not_used = found
        decision = used or not_used
        assert decision is not None
        outcomes = ", ".join(
            f"rank {rank} {logs[rank][k - 1].value if k <= len(logs[rank]) else 'no decision'}"
            for rank in self.ranks
        )
        return (
            f"{_decision_text(decision)} in step {step}: {outcomes} (used on rank {used_on}, not "
            f"on rank {unused_on})"
        )

    def _unused_failure(self, ddp_error: DdpCheckFailure | None) -> UnusedParameters:
        """This launch had to fail; a fresh one with find_unused_parameters=True measures
        the remedies and finds the decisions."""
        unused = self._unused()
        remedy = _Checker(
            self.job,
            {**self.options, "find_unused_parameters": True},
            self.steps,
            self.method,
            (self.rtol, self.atol),
        )
        cost, checked = None, ""
        with _Launch(self.job, self.method) as launch:
            try:
                launch.start()
                launch.send(REFERENCE, "reference", self.steps)
                remedy._train(launch)
                remedy._wait_reference(launch, lambda: remedy.reference_info is not None)
                later = remedy._findings()
                checked = (
                    "checked here: the ranks then agree with one process on the concatenated batch"
                    if later is None
                    else "checked here, and then: "
                    f"{type(later).__name__}: {str(later).splitlines()[0]}"
                )
                unused = remedy._unused() or unused
                cost = remedy._cost(launch)
                reasons = remedy._unused_reasons(unused, launch)
            except _Stopped as stop:
                reasons = {}
                checked = f"checked here, and then: {str(stop.failure).splitlines()[0]}"
        lines = [
            f"under DistributedDataParallel(find_unused_parameters=False), {len(unused)} of "
            f"{len(self.names)} parameters of {self.subject} got no gradient on some ranks, so "
            "DDP's gradient reduction cannot finish:"
        ]
        groups: dict[str, list[str]] = {}
        for name, pairs in unused.items():
            why = reasons.get(name, "not reached by the graph of the loss")
            groups.setdefault(f"unused on {_rank_steps(pairs)}: {why}", []).append(name)
        lines.extend(f"  {', '.join(names)}: {text}" for text, names in groups.items())
        error = ddp_error.error if isinstance(ddp_error, RankFailed) else None
        if isinstance(ddp_error, RankFailed) and error:
            lines.append(
                f"DDP's own error (rank {ddp_error.rank}, step {ddp_error.step}): "
                + _first_sentence(error)
            )
        lines.append("Either:")
        lines.append(
            "  - DistributedDataParallel(model, find_unused_parameters=True): DDP then searches "
            "the autograd graph for unused parameters at every step"
            + (f"; on this model: {cost}" if cost is not None else "")
            + (f"; {checked}" if checked else "")
        )
        lines.append(
            "  - or touch every parameter in every step, so that none is ever unused: where the "
            "forward skips a module, add 0.0 * sum(p.sum() for p in module.parameters()) to "
            "its result (what the cost above is measured against)"
        )
        return UnusedParameters("\n".join(lines), unused, reasons, cost, error)

    # --- the comparisons --------------------------------------------------------------

    def _findings(self) -> DdpCheckFailure | None:
        """The first thing wrong in what the ranks and the single process reported."""
        return (
            self._disagreement()
            or self._rank_gradients()
            or self._reference_gradients()
            or self._static_graph()
        )

    def _disagreement(self) -> RanksDisagree | None:
        for batch in self.ranks:
            logs = {rank: self.samples[rank]["logs"][batch] for rank in self.ranks}
            for other in self.ranks[1:]:
                found = first_divergence(logs[0], logs[other])
                if found is None:
                    continue
                _, a, b = found
                decision = a or b
                assert decision is not None
                state = self._differing_state(0, other)
                cause = (
                    f"their state differs: {', '.join(state)} (with broadcast_buffers=False each "
                    "rank keeps its own buffers; with broadcast_buffers=True DDP gives every rank "
                    "rank 0's before each forward)"
                    if state
                    else "their parameters and buffers are equal, so their numerics differ "
                    "(another GPU model, nondeterministic kernels) and the decision sits close to "
                    "its boundary for these samples"
                )
                return RanksDisagree(
                    f"the ranks decide differently for the same samples: on rank {batch}'s batch, "
                    f"run by every rank after the {self.steps} steps, {_decision_text(decision)} "
                    f"is {a.value if a else 'not made'} on rank 0 and "
                    f"{b.value if b else 'not made'} on rank {other}: {cause}. Ranks that branch "
                    "differently on the same data train different models, and DDP averages their "
                    "gradients as if they did not.",
                    batch,
                    (0, other),
                    found,
                    state,
                )
        return None

    def _differing_state(self, a: int, b: int) -> list[str]:
        left, right = self.samples[a]["state"], self.samples[b]["state"]
        return [name for name in left if not bitwise_equal(left[name], right[name])]

    def _rank_gradients(self) -> GradientMismatch | None:
        for step, steps in self.record.items():
            ours = steps[0].grads or {}
            for rank in self.ranks[1:]:
                theirs = steps[rank].grads or {}
                for name in self.names:
                    a, b = ours.get(name), theirs.get(name)
                    if (a is None) != (b is None) or (a is not None and not bitwise_equal(a, b)):
                        return GradientMismatch(
                            f"after the all-reduce of step {step}, the gradient of {name} differs "
                            f"between rank 0 and rank {rank}: an all-reduce gives every rank the "
                            "same bits, so something changed it on one rank afterwards (a hook, "
                            "or clipping by a rank-local norm)",
                            step,
                            name,
                            rank,
                            0.0,
                            0.0,
                        )
        return None

    def _reference_gradients(self) -> GradientMismatch | None:
        assert self.reference_info is not None
        if self.reference_info["random"]:
            return None
        for step in sorted(self.record):
            grads = self.record[step][0].grads or {}
            expected = self.reference[step]["grads"]
            for name in self.names:
                grad, reference = grads.get(name), expected.get(name)
                if grad is None and reference is None:
                    continue
                if grad is None or reference is None:
                    present = reference if grad is None else grad
                    grad = torch.zeros_like(present) if grad is None else grad
                    reference = torch.zeros_like(present) if reference is None else reference
                mismatch = close_mismatch(
                    f"grad of {name}", reference, grad, self.rtol, self.atol, ("one process", "DDP")
                )
                if mismatch is None:
                    continue
                rtol, atol = self._tolerances(grad.dtype)
                return GradientMismatch(
                    f"after the all-reduce of step {step}, DDP's gradient differs from one process "
                    f"on the concatenated batch, which DDP stands for:\n  {mismatch.description}\n"
                    f"  {self._reference_cause(step)}",
                    step,
                    name,
                    "one process",
                    rtol,
                    atol,
                )
        return None

    def _reference_cause(self, step: int) -> str:
        single = self.reference[step]["decisions"]
        logs = {rank: self.record[step][rank].decisions for rank in self.ranks}
        joined = [decision for rank in self.ranks for decision in logs[rank]]
        same = len(single) == len(joined) and all(
            a.op == b.op and a.location == b.location and repr(a.value) == repr(b.value)
            for a, b in zip(single, joined, strict=True)
        )
        if not same:
            for k, decision in enumerate(single, start=1):
                theirs = {rank: log[k - 1] for rank, log in logs.items() if k <= len(log)}
                if any(d.location != decision.location for d in theirs.values()):
                    break  # the ranks are elsewhere in the forward by now
                if any(not d.same_as(decision) for d in theirs.values()) or len(theirs) < len(logs):
                    values = ", ".join(
                        f"rank {rank} {theirs[rank].value if rank in theirs else 'none'}"
                        for rank in self.ranks
                    )
                    return (
                        f"cause: {_decision_text(decision)}: one process {decision.value}, "
                        f"{values}. The forward decides on the whole batch, and under DDP each "
                        "rank decides on its own part: make the decision per sample, or on a "
                        "statistic all_reduced over the ranks."
                    )
            return (
                f"cause: one process made {len(single)} decision(s) on the concatenated batch, "
                "the ranks "
                + ", ".join(f"{len(logs[rank])} on rank {rank}" for rank in self.ranks)
                + ", and they differ: the forward decides on the batch as a whole"
            )
        return (
            "cause: the decisions agree, sample for sample, so the forward mixes samples "
            "(BatchNorm in training mode normalizes over each rank's part: "
            "nn.SyncBatchNorm.convert_sync_batchnorm), or the loss is not a mean over samples"
        )

    def _static_graph(self) -> StaticGraphUnsafe | None:
        if not self.options.get("static_graph") or self._static_graph_safe():
            return None
        unused = self._unused()
        return StaticGraphUnsafe(
            "static_graph=True, but the parameters used change between ranks or steps: "
            + "; ".join(f"{name} unused on {_rank_steps(pairs)}" for name, pairs in unused.items())
            + ". DDP's static graph assumes every step uses the parameters the first one did; "
            "use find_unused_parameters=True instead",
            list(unused),
        )

    def _static_graph_safe(self) -> bool:
        used = {
            frozenset(record.reached or ())
            for steps in self.record.values()
            for record in steps.values()
        }
        return len(used) <= 1

    def _tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        rtol, atol = tolerances_for(dtype)
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)

    # --- the cost, the result ---------------------------------------------------------

    def _cost(self, launch: _Launch) -> Cost:
        touched = bool(self._unused())
        configurations = [
            ({**self.options, "find_unused_parameters": True}, False),
            ({**self.options, "find_unused_parameters": False}, touched),
        ]
        launch.to_ranks("time", configurations)
        deadline = time.monotonic() + self.job.timeout
        per_rank: dict[int, dict[str, list[list[float]]]] = {}
        while len(per_rank) < len(self.ranks):
            event = self._next_of(launch, self.steps + 1, "timed steps", deadline, "timed steps")
            per_rank[event.rank] = event.data
        medians = []
        for clock in ("wall", "cpu"):
            for index in range(len(configurations)):
                times = (rank[clock][index] for rank in per_rank.values())
                medians.append(statistics.median(max(step) for step in zip(*times, strict=True)))
        return Cost(*medians, touched=touched, steps=TIMING_ROUNDS * TIMED_STEPS)

    def _result(self, startup: float, cost: Cost | None) -> DdpResult:
        assert self.reference_info is not None
        unused = self._unused()
        logs = {
            rank: [self.record[step][rank].decisions for step in sorted(self.record)]
            for rank in self.ranks
        }
        rtol, atol = self._tolerances(self.reference_info["dtype"])
        compared = (
            "gradients after the all-reduce equal on every rank bit for bit (the forward draws "
            "random numbers, so one process on the concatenated batch is no reference)"
            if self.reference_info["random"]
            else "gradients after the all-reduce equal on every rank bit for bit and within "
            f"rtol={rtol:g}, atol={atol:g} of one process on the concatenated batch"
        )
        return DdpResult(
            subject=self.subject,
            world_size=self.job.world_size,
            backend=self.job.backend,
            device="cpu" if self.job.backend == "gloo" else "cuda",
            steps=self.steps,
            options=tuple(sorted(self.options.items())),
            outcomes=tuple((rank, site_outcomes(logs[rank])) for rank in self.ranks),
            unused=tuple(unused.items()),
            find_unused_needed=bool(unused),
            static_graph_safe=self._static_graph_safe(),
            at_risk=tuple(self.reference_info["at_risk"]),
            compared=compared,
            startup_seconds=startup,
            step_seconds=self.step_seconds,
            cost=cost,
        )


def _first_sentence(text: str) -> str:
    sentence, dot, rest = text.partition(". ")
    return sentence + dot.strip() + (" ..." if rest else "")


# --- the ranks' processes ---------------------------------------------------------------


class _FunctionModule(nn.Module):
    """A plain function as the module DDP wraps: the modules it reaches are registered, so
    DDP sees their parameters, and the forward calls the function."""

    def __init__(self, function: Callable[..., Any], modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.function = function
        self.reached = nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


# The c10d ops by the name of the torch.distributed call that makes them.
_COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "broadcast_": "broadcast",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
}


class _Spy(TorchDispatchMode):
    """Reports each collective the user's code calls (a c10d op), before it runs."""

    def __init__(self, report: Callable[[str, Location], None]) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            location = user_location(sys._getframe())
            if location is not None:  # not DDP's own (its buffer broadcast)
                name = func.__name__.split(".")[0]
                op = f"dist.{_COLLECTIVES[name]}" if name in _COLLECTIVES else f"c10d.{name}"
                self.report(op, location)
        return func(*args, **(kwargs or {}))


def _child_main(
    payload: _Job | bytes, role: int, folder: str, pipes: tuple[Any, Any], *, parent: int
) -> None:
    """The life of a rank (or of the single process): join the group, serve commands."""
    _lead_own_group(parent)
    job = payload if isinstance(payload, _Job) else pickle.loads(payload)
    files = _Files(Path(folder), role)
    stack_file = open(files.stack, "w")  # noqa: SIM115 (faulthandler writes to it until the end)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _Worker(job, role, pipes, files.error).serve(str(files.store))


class _Exit(Exception):
    """The test's process ended the launch while this process waited for it."""


class _Worker:
    """One child process: a rank of the group, or the single process (``REFERENCE``)."""

    def __init__(self, job: _Job, role: int, pipes: tuple[Any, Any], error_file: Path) -> None:
        self.job = job
        self.role = role
        self.events, self.commands = pipes
        self.error_file = error_file
        self.step = 0
        self.phase = "start-up"
        self.log: Sequence[Decision] | None = None
        self.sent_decisions = 0

    def send(self, kind: str, **data: Any) -> None:
        if self.log is not None:
            data["decisions"] = list(self.log[self.sent_decisions :])
            self.sent_decisions = len(self.log)
        self.events.send_bytes(pickle.dumps((kind, self.role, self.step, self.phase, data)))

    def receive(self) -> tuple:
        try:
            command = pickle.loads(self.commands.recv_bytes())
        except (EOFError, OSError):
            raise _Exit from None
        if command[0] == "exit":
            raise _Exit
        return command

    def serve(self, store: str) -> None:
        code = 0
        try:
            self._setup(store)
            self.send("ready")
            while True:
                command, *args = self.receive()
                getattr(self, f"_{command}")(*args)
                self.send("idle")
        except _Exit:
            pass
        except Exception as error:
            self._report(error)
            code = 1
        _end_descendants(os.getpid())  # DataLoader workers, subprocesses: none outlives it
        # Straight out: no finalizer to wait for (the process group goes with the
        # process, its store with the launch's folder).
        os._exit(code)

    def _report(self, error: BaseException) -> None:
        """Tell the test's process what was raised: in a file first, which it reads when it
        finds this process dead without the event (a send cut short), then in the pipe."""
        here = os.path.abspath(__file__)
        user = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if not frame.filename.startswith(TORCH_DIR) and os.path.abspath(frame.filename) != here
        ]
        lines = str(error).strip().splitlines()
        event = (
            "error",
            self.role,
            self.step,
            self.phase,
            {
                "type": type(error).__name__,
                "message": lines[0] if lines else "",
                "location": Location(user[-1].filename, user[-1].lineno or 0) if user else None,
                "frames": [
                    f"{display_path(frame.filename)}:{frame.lineno} in {frame.name}: {frame.line}"
                    for frame in user[-4:]
                ],
            },
        )
        with contextlib.suppress(Exception):
            written = self.error_file.with_suffix(".partial")
            written.write_bytes(pickle.dumps(event))
            written.replace(self.error_file)  # whole or absent: the reader never sees half
        with contextlib.suppress(Exception):
            self.events.send_bytes(pickle.dumps(event))

    def _setup(self, store: str) -> None:
        # No torch function mode of the test's process (pytest --decisions) in here.
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        # As torchrun does unless told otherwise: one thread per process.
        torch.set_num_threads(1)
        # Every process of the check runs on this machine: loopback only.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # DDP's constructor imports torch._dynamo (seconds): a spawned process pays for it
        # here, in the start-up, rather than in its first step (a forked one has it).
        importlib.import_module("torch._dynamo")

        alone = self.role == REFERENCE
        rank, world_size = (0, 1) if alone else (self.role, self.job.world_size)
        if self.job.backend == "nccl":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(
            self.job.backend,
            store=dist.FileStore(store, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=self.job.timeout),
        )
        target = self.job.target
        if isinstance(target, nn.Module):
            self.module = target.to(self.device)
        else:
            modules = [module.to(self.device) for _, module in calls.reached_modules(target)]
            self.module = _FunctionModule(target, modules)
        self.kwargs = self._on_device(self.job.kwargs)
        batch = self.job.concatenated if alone else self.job.batches[self.role]
        self.subject = Subject(
            target, self._on_device(batch), self.kwargs, failure=DdpCheckFailure, trains=True
        )
        self.parameters = self.subject.parameters

    def _on_device(self, value: Any) -> Any:
        return map_tensors(lambda t: t.to(self.device), value)

    def _loss(self, output: Any) -> torch.Tensor:
        if self.job.loss_fn is not None:
            return self.job.loss_fn(output)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output  # a model that returns its loss
        terms = [
            leaf.float().square().mean()
            for _, leaf in named_leaves(output, "")
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad
        ]
        if not terms:
            raise TypeError(
                "ddp_check: the output holds no floating-point tensor that requires grad, so "
                "there is no loss to differentiate: pass loss_fn"
            )
        return torch.stack(terms).sum()

    def _optimizer(self) -> torch.optim.Optimizer:
        tensors = [tensor for _, tensor in self.parameters]
        if self.job.optimizer is None:
            return torch.optim.SGD(tensors, lr=DEFAULT_LR)
        return self.job.optimizer(tensors)

    def _wrap(self, options: dict[str, Any]) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(self.module, device_ids=device_ids, **options)

    @contextlib.contextmanager
    def _watched(self, phase: str) -> Iterator[Sequence[Decision]]:
        """Decisions recorded and the user's collectives reported while the block runs."""
        self.phase = phase
        spy = _Spy(lambda op, location: self.send("collective", op=op, location=location))
        with record_decisions() as log, spy:
            self.log, self.sent_decisions = log, 0
            try:
                yield log
            finally:
                self.log = None

    def _gradients(self) -> dict[str, torch.Tensor | None]:
        return {name: _cpu(tensor.grad) for name, tensor in self.parameters}

    def _train(self, options: dict[str, Any], steps: int) -> None:
        self.subject.reset()
        network = self._wrap(options)
        optimizer = self._optimizer()
        for step in range(1, steps + 1):
            self.step = step
            inputs = self.subject.fresh_inputs()
            with self._watched("forward"):
                loss = self._loss(network(*inputs.args, **inputs.kwargs))
                self.send("done", reached=reached_parameters(loss, self.parameters))
            self.receive()  # "go": every rank's forward is in, and their collectives match
            with self._watched("backward"):
                loss.backward()
                self.send("done", grads=self._gradients())
            self.phase = "optimizer step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.step = steps + 1
        logs = []
        with torch.no_grad(), self._watched("same-sample forwards"):
            for batch in self.job.batches:
                with record_decisions() as log:
                    network(*self._on_device(batch), **self.kwargs)
                logs.append(list(log))
            state = {f"parameter {name}": _cpu(t) for name, t in self.parameters}
            state.update((f"buffer {name}", _cpu(b)) for name, b in self.module.named_buffers())
            self.send("done", logs=logs, state=state)
        del network
        gc.collect()

    def _time(self, configurations: list[tuple[dict[str, Any], bool]]) -> None:
        """Timed steps of each DDP configuration ``(options, touch every parameter)``, in
        alternating blocks, so that a machine busy in one block costs every one alike."""
        self.phase = "timed steps"
        tensors = [tensor for _, tensor in self.parameters]
        wall: list[list[float]] = [[] for _ in configurations]
        cpu: list[list[float]] = [[] for _ in configurations]
        for _ in range(TIMING_ROUNDS):
            for index, (options, touch_all) in enumerate(configurations):
                self.subject.reset()
                network = self._wrap(options)
                optimizer = self._optimizer()
                for step in range(WARMUP_STEPS + TIMED_STEPS):
                    inputs = self.subject.fresh_inputs()
                    started, cpu_started = time.perf_counter(), time.process_time()
                    loss = self._loss(network(*inputs.args, **inputs.kwargs))
                    if touch_all:  # the rewrite: every parameter in the graph, used or not
                        loss = loss + sum(tensor.sum() for tensor in tensors) * 0.0
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    if step >= WARMUP_STEPS:
                        wall[index].append(time.perf_counter() - started)
                        cpu[index].append(time.process_time() - cpu_started)
                del network
                gc.collect()  # DDP's reducer sits in reference cycles
        self.send("done", wall=wall, cpu=cpu)

    # --- the single process -----------------------------------------------------------

    def _reference(self, steps: int) -> None:
        self.subject.reset()
        optimizer = self._optimizer()
        random = False
        dtype = torch.float32
        for step in range(1, steps + 1):
            self.step = step
            inputs = self.subject.fresh_inputs()
            generator = torch.random.get_rng_state()
            self.phase = "forward"
            with record_decisions() as log:
                loss = self._loss(self.module(*inputs.args, **inputs.kwargs))
            random = random or not torch.equal(generator, torch.random.get_rng_state())
            self.phase = "backward"
            loss.backward()
            grads = self._gradients()
            dtype = next((g.dtype for g in grads.values() if g is not None), dtype)
            self.send("reference", grads=grads, decisions=list(log))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.phase = "flipped decisions"

        def run(recorder: UseRecorder) -> Any:
            self.subject.reset()
            fresh = self.subject.fresh_inputs()
            with recorder:
                return self._loss(self.module(*fresh.args, **fresh.kwargs))

        use = conditional_parameters(run, self.parameters, max_flips=MAX_FLIPS)
        self.send(
            "reference-done",
            random=random,
            dtype=dtype,
            at_risk=[name for name in use.decided if name in use.reached],
        )

    def _explain(self, rank: int, names: list[str]) -> None:
        batch = self._on_device(self.job.batches[rank])

        def run(recorder: UseRecorder) -> Any:
            self.subject.reset()
            inputs = map_tensors(lambda t: t.detach().clone(), batch)
            with recorder:
                return self._loss(self.module(*inputs, **self.kwargs))

        reasons = explain_unreached(run, self.parameters, names, max_flips=MAX_FLIPS)
        self.send("explained", reasons=reasons)

    def _alone(self) -> None:
        """Each rank's batch through the forward here, in a group of one, where every
        collective returns at once: the collectives a whole forward calls, and why."""
        self.phase = "forwards alone"
        runs = []
        for batch in self.job.batches:
            self.subject.reset()
            inputs = map_tensors(lambda t: t.detach().clone(), self._on_device(batch))
            called: list[tuple[str, Location]] = []
            with (
                record_decisions() as log,
                _Spy(lambda op, at, called=called: called.append((op, at))),
            ):
                self.module(*inputs, **self.kwargs)
            runs.append((called, list(log)))
        self.send("alone", runs=runs)


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to("cpu", copy=True)
