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

Here are the entry point and its options; :mod:`.results` holds what the check raises
and returns, :mod:`.messages` what passes between the test's process and the others,
:mod:`.launch` and :mod:`.process_tree` start and end those processes,
:mod:`.worker` is their side and :mod:`.checker` the analysis in the test's process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import calls, options
from ..comparison import same_value
from ..parameter_use import FindUnusedAdvice, find_unused_parameters_needed
from ..trees import StructuresDiffer, map_tensors, merge_leaves, named_leaves
from .checker import Checker
from .launch import START_METHODS, choose_start_method
from .messages import Job
from .results import (
    CollectiveMismatch,
    Cost,
    DdpCheckFailure,
    DdpResult,
    GradientMismatch,
    RankFailed,
    RanksDisagree,
    StaticGraphUnsafe,
    UnusedParameters,
)

__all__ = [
    "CollectiveMismatch",
    "Cost",
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

CHECK = "ddp_check"
# Two ranks: the fewest that can disagree, and what one test's CPU can run side by side.
DEFAULT_WORLD_SIZE = 2
# Three steps: DDP reports a reduction left unfinished at the next step's forward, and
# a third lets the parameters' use change after two optimizer steps.
DEFAULT_STEPS = 3
# Seconds one launch of the ranks may take, and the process group's own timeout: the
# ranks of a small test model start and step in well under a second each, so this
# only bounds a rank that hangs for a reason the check cannot see coming.
DEFAULT_TIMEOUT = 60.0
# Blocks of timed steps per DDP configuration when a cost is measured (read at each
# call: a benchmark may set it).
TIMING_ROUNDS = 3
BACKENDS = ("gloo", "nccl")
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
    ddp_options = {name: value for name, value in given.items() if value is not None}
    job = Job(
        target=model_or_fn,
        batches=batches,
        kwargs=kwargs,
        concatenated=_concatenate(batches),
        loss_fn=loss_fn,
        optimizer=optimizer,
        backend=backend,
        timeout=float(timeout),
        temp_root=None if temp_root is None else Path(temp_root),
        timing_rounds=TIMING_ROUNDS,
    )
    method = choose_start_method(start_method, job)
    return Checker(job, ddp_options, steps, method, (rtol, atol)).run()


def _rank_batches(inputs_per_rank: tuple, world_size: int | None) -> list[tuple]:
    """Each rank's positional inputs."""
    options.whole_number(CHECK, "world_size", world_size, minimum=1, optional=True)
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

    def join(position: int, leaves: tuple[Any, ...]) -> Any:
        if isinstance(leaves[0], torch.Tensor) and leaves[0].dim():
            return torch.cat([leaf.detach() for leaf in leaves])
        if all(same_value(leaf, leaves[0]) for leaf in leaves):
            return leaves[0]
        raise ValueError(
            f"ddp_check: input leaf {position} differs between ranks and is not a batched "
            "tensor: values that are not batched along dimension 0 must be the same on "
            "every rank (put them in forward_kwargs)"
        )

    try:
        return merge_leaves(batches, join)
    except StructuresDiffer:
        raise ValueError(
            "ddp_check: the ranks' inputs must have the same structure (the same number and "
            "nesting of inputs)"
        ) from None


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
        raise options.refuse(CHECK, "temp_root", temp_root, "None or an existing folder")
    options.choice(CHECK, "backend", backend, BACKENDS)
    options.whole_number(
        CHECK,
        "steps",
        steps,
        minimum=2,
        why="DDP reports a reduction left unfinished at the next step",
    )
    options.number(CHECK, "timeout", timeout, why="seconds")
    options.choice(CHECK, "start_method", start_method, START_METHODS)
    options.function(CHECK, "loss_fn", loss_fn, "a loss_fn(output)", optional=True)
    options.function(
        CHECK, "optimizer", optimizer, "an optimizer(parameters) -> Optimizer", optional=True
    )
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
