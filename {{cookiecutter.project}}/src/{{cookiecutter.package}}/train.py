"""Train the example dynamic model (`DynamicNet`) on synthetic data, with metrics and checkpoints.

    <project>-train --device cuda --batch-size 64 --epochs 10
    <project>-train --run-dir runs/a --checkpoint-every 100 --workers 2 --precision bf16
    <project>-train --run-dir runs/a --resume          # after a stop, a crash or a kill
                                                       # (and --epochs N, if not the default)
    torchrun --nproc_per_node 2 -m <package>.train --device cuda

Each run has a folder (``--run-dir``, default ``runs/<date-time>``) holding
``metrics.csv`` (one row per epoch), TensorBoard events with ``--tensorboard``, and
``latest.pt``, the checkpoint, written at every epoch's end and every
``--checkpoint-every`` steps. The data set is generated from ``--seed`` (nothing is
downloaded) and read through a ``DataLoader`` with ``--workers N`` processes, or made
in this process with ``--workers 0``. Each epoch's data order depends only on
``--seed`` and the epoch number, each batch's noise only on its place in the run,
and a checkpoint holds the model, the optimizer, the fp16 gradient scaler, every
random number generator and the position in the epoch, so ``--resume`` continues
exactly where the last checkpoint stopped, even mid-epoch: the final weights are
bitwise equal to those of an uninterrupted run with the same settings, whatever
``--workers`` either run used. A checkpoint ends with a SHA-256 digest of all its bytes,
which ``--resume`` verifies before reading it, then checks every value (`_checkpoint`).

Stopping, and what launch scripts rely on (``<project>-launch slurm`` among them):

- SIGINT (Ctrl-C), SIGTERM (``docker stop``, Kubernetes, SLURM's preemption and time
  limit) and SIGUSR1 (SLURM's ``--signal=USR1@SECONDS``) stop training after the
  optimizer step under way; ``latest.pt`` then holds exactly that step, stderr ends
  with two lines, ``stopped by SIGTERM at epoch 2, step 8/32 (step 40 of the run);
  checkpoint runs/a/latest.pt`` and ``resume with: <the command>``, and the process
  exits with 128 + the signal's number (130, 143, 138). Further signals while the
  checkpoint is written change nothing.
- A signal at any other moment of the command is safe too (see `_preemption`). During
  start-up the run stops before its first step, with the same exit status, and either
  ``stopped by SIGTERM before training began: no checkpoint was written, so there is
  nothing to resume`` and ``start again with: <the command>``, or, resuming, the
  checkpoint's position and ``resume with:``. A signal during the last step of the run
  lets it finish, and one after it (during the exit) stops nothing: exit status 0, and
  ``SIGUSR1 after the run had finished: nothing to stop`` (or ``during the run's last
  step``) on stderr. Only the interpreter's start and the imports before `main` runs
  are not covered: there SIGTERM and SIGUSR1 kill, as they would any program, before
  anything of the run exists.
- ``--run-dir <the same folder> --resume`` continues bit for bit and first prints
  ``resumed <folder> at epoch E, step S/N (step G of the run)`` on stdout. The run's
  data and schedule settings (``--seed``, ``--samples``, ``--batch-size``, ``--lr``,
  ``--noise``, ``--precision``, ``--accumulate``) are its checkpoint's unless given; one given with
  another value is refused (``--seed``, ``--samples``: another data set) or warned about
  (the others: not bit for bit). ``--epochs`` is not kept in the checkpoint: give it
  again unless it is the default (the printed ``resume with:`` command does, as it does
  ``--device``, ``--workers`` and the other flags a checkpoint does not keep). After a
  SIGKILL or a crash nothing is printed, and that same command resumes.
- Under ``torchrun`` all processes stop after the same step (one step after the first
  process saw the signal). torchrun forwards SIGTERM and SIGINT to its processes
  (SIGKILL follows after its ``--shutdown-timeout``, 30 s), then exits 1 itself with
  its own traceback. SIGUSR1 kills torchrun and leaves its processes training,
  unless torchrun was started with ``--signals-to-handle
  SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``, which makes it forward SIGUSR1 too.
- One process writes a run folder at a time: rank 0 holds an ``fcntl`` lock on
  ``.lock`` in it from before its first write to its exit (the kernel drops it when
  the process dies, however); a second ``train`` there exits 1 with one line naming
  the folder and the holder's PID.

With ``--detect-nonfinite`` every step's loss, weights and gradients are looked at
(one device read a step) before the optimizer step; the first step that is not finite
stops the run with where its first NaN or inf was born, the batch's samples, and a
bundle in the run folder that ``<project>-replay`` runs again under ``finite_check``
(`_finite_steps`). Without it, a NaN shows as an epoch whose mean loss is not finite.

Failures the user can act on are one ``error:`` line naming the file, the entry or the
value (`_command.reports_errors`): exit status 2 for a bad command line or a checkpoint
that cannot be resumed (damaged, of another model or version), 1 for a locked or
read-only run folder, a full disk, a link planted in the folder, a malformed
``metrics.csv``.

Under ``torchrun`` every process trains a copy of the model on its share of each
epoch (DistributedSampler) and DistributedDataParallel averages the gradients:
NCCL on GPUs, gloo on the CPU. `DynamicNet` skips its residual block for some
batches, so in those steps the block's parameters get no gradient on that process.
DDP has to be told (``find_unused_parameters=True``): otherwise that step's gradient
reduction never finishes and the next step fails ("Expected to have finished
reduction in the prior iteration"). That costs a search of the graph at every step,
so it is turned off only for a model whose every parameter is used whichever way each
of its branch decisions goes on the first batch, and whose parameter use depends on
nothing else the probe cannot turn (``testing.parameter_use.find_unused_parameters_needed``);
rank 0 prints the answer and its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import gc
import math
import os
import random
import re
import shlex
import sys
import time
import traceback
from collections.abc import Collection, Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from signal import Signals
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from . import _checkpoint, _data
from ._checkpoint import Position, ProcessState, RunSettings, TrainingState
from ._command import CommandError, command_name, first_line, reports_errors
from ._data import EpochBatches, SyntheticBatches, loader
from ._files import UNLOCKED, FolderLock, remove_incomplete
from ._finite_steps import (
    CHECKPOINT,
    RECORD,
    FiniteSteps,
    GeneratorsAtStep,
    NotFiniteStep,
    OverflowSkips,
    RankRecord,
    StepLook,
    StepRecord,
    bundle_folder,
    locate,
    write_bundle,
)
from ._lifetime import end_with_parent
from ._metrics import EpochMetrics, MetricsLog, RunningMean, tensorboard_missing
from ._preemption import CommandPhase, StopAgreement, StopSignal, stop_signals
from ._progress import Progress
from .gpus import cuda_unavailable_reason
from .models import DynamicNet
from .testing.control_flow import display_path, first_divergence, record_decisions
from .testing.nonfinite import non_finite_text
from .testing.parameter_use import find_unused_parameters_needed

__all__ = [
    "Config",
    "Launch",
    "Stopped",
    "UsageError",
    "build_parser",
    "main",
    "synthetic_data",
    "train",
]

PACKAGE = __package__
IN_FEATURES = 16
CLASSES = 4
PRECISIONS = ("32", "bf16", "fp16")
NONFINITE_MODES = ("stop", "off")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch._dynamo's counters of graph breaks: resumed ones, and those that compile nothing.
_BREAK_COUNTERS = ("graph_break", "unimplemented")
# Where dynamo's reason text quotes the user's line.
_DYNAMO_CODE = re.compile(r'# File "([^"]+)", line (\d+), in [^,]+, code: (.*)')
# Sample indices the stop at a non-finite step shows; its bundle holds them all.
_SAMPLES_SHOWN = 8
# Settings that make the data set: a checkpoint trained on other data is another run.
DATA_SETTINGS = ("seed", "samples")
# Settings a run can be resumed with when they change, though not bit for bit.
# (--workers and --checkpoint-every change nothing in the numbers.)
SCHEDULE_SETTINGS = ("batch_size", "lr", "noise", "precision", "world_size", "accumulate")
# The flags a checkpoint keeps (in its RunSettings): --resume takes those not given from it.
STORED_FLAGS = tuple(name for name in (*DATA_SETTINGS, *SCHEDULE_SETTINGS) if name != "world_size")
# torch.compile's modes (see its docstring); all but default are the inductor backend's.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# What --compile-backend and --compile-mode mean when not given (`TrainParser`).
COMPILE_DEFAULTS = {"compile_backend": "inductor", "compile_mode": "default"}


class UsageError(Exception):
    """A command-line value that cannot work here; reported like an argparse error."""


@dataclass(frozen=True)
class Config:
    device: str = "auto"
    batch_size: int = 64
    epochs: int = 10
    lr: float = 1e-3
    seed: int = 0
    samples: int = 8192
    noise: float = 0.05
    run_dir: Path | None = None
    resume: bool = False
    checkpoint_every: int | None = None
    workers: int = 0
    precision: str = "32"
    tensorboard: bool = False
    take_over_lock: str | None = None
    detect_nonfinite: str = "off"
    accumulate: int = 1
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str = "default"

    @property
    def checkpoint(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / _checkpoint.LATEST


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a ``torchrun`` launch (one process alone without it)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    torchrun: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Launch:
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return cls()
        world_size = int(environ["WORLD_SIZE"])
        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=world_size,
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            torchrun=True,
        )


def synthetic_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class labels made from ``seed`` alone, the same on every device.

    The inputs' magnitudes vary over a factor of about 12, so `DynamicNet` skips its
    residual block for some batches and runs it (up to four times) for others. The labels come
    from a fixed random teacher, so there is something to learn.
    """
    generator = torch.Generator().manual_seed(seed)
    scale = torch.empty(samples, 1).uniform_(-1.0, 1.5, generator=generator).exp()
    inputs = torch.randn(samples, IN_FEATURES, generator=generator) * scale
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=generator)
    labels = (torch.tanh(inputs) @ teacher).argmax(dim=1)
    return inputs, labels


def resolve_device(requested: str, launch: Launch) -> torch.device:
    """The device for ``--device requested``; `UsageError` when it is not usable here."""
    if requested == "cpu":
        return torch.device("cpu")
    reason = cuda_unavailable_reason()
    if requested == "auto":
        if reason is not None or launch.local_world_size > torch.cuda.device_count():
            return torch.device("cpu")
        return torch.device("cuda", launch.local_rank)
    if reason is not None:
        raise UsageError(
            f"argument --device: {requested} asked for, but CUDA is not usable: {reason}"
        )
    count = torch.cuda.device_count()
    if requested == "cuda":
        if launch.local_rank >= count:
            raise UsageError(
                f"argument --device: cuda: torchrun started {launch.local_world_size} processes "
                f"on this node, but only {count} CUDA device(s) are visible"
            )
        return torch.device("cuda", launch.local_rank)
    if launch.torchrun:
        raise UsageError(
            f"argument --device: {requested} names one GPU, but under torchrun each process "
            "uses its own (cuda:LOCAL_RANK): pass --device cuda and pick GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    index = int(requested.partition(":")[2])
    if index >= count:
        raise UsageError(
            f"argument --device: {requested} does not exist: {count} CUDA device(s) visible "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def check_precision(precision: str, device: torch.device) -> None:
    """`UsageError` when ``--precision`` cannot run on ``device``."""
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(
            f"argument --precision: fp16 needs a CUDA device (its gradients are scaled by "
            f"torch.amp.GradScaler), and this run uses {device}; on the CPU use bf16"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(
            f"argument --precision: bf16: {torch.cuda.get_device_name(device)} ({device}) does "
            "not support bfloat16; use fp16 or 32"
        )


def default_run_dir(now: datetime | None = None, *, create: bool) -> Path:
    """``runs/<date-time>`` for a run started now, with ``-2``, ``-3``... if that is taken.

    With ``create`` the folder is made here, exclusively: two runs started in the same
    second never share one (a check before creating would let both through)."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    candidate, number = Path("runs", stamp), 1
    if not create:
        return candidate
    try:
        candidate.parent.mkdir(exist_ok=True)
        while True:
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                number += 1
                candidate = Path("runs", f"{stamp}-{number}")
    except OSError as error:
        raise UsageError(
            f"argument --run-dir: none given, and the default {candidate} cannot be created: "
            f"{error.strerror}"
        ) from None


def prepare_run_dir(config: Config, launch: Launch, held: contextlib.ExitStack) -> Config:
    """Check ``--run-dir``/``--resume`` before any work; the config with the run folder,
    created and locked (`FolderLock`, held until ``held`` closes) by rank 0, the only
    process that writes there. The lock comes before the checks of what the folder
    holds: another run may be writing it."""
    if config.run_dir is None:
        if config.resume:
            raise UsageError("argument --resume: needs --run-dir DIR, the folder of the run")
        # only rank 0 writes there; the other processes never look at it
        directory = default_run_dir(create=launch.rank == 0)
        config = Config(**{**vars(config), "run_dir": directory})
    directory, checkpoint = config.run_dir, config.checkpoint
    assert directory is not None
    assert checkpoint is not None
    if config.resume:
        if not directory.is_dir():
            raise UsageError(f"argument --run-dir: {directory} does not exist (nothing to resume)")
        if launch.rank == 0:
            held.enter_context(FolderLock.acquire(directory, take_over=config.take_over_lock))
        if not checkpoint.exists():
            raise UsageError(
                f"argument --resume: no checkpoint in {directory} ({checkpoint.name} is missing)"
            )
        return config
    if checkpoint.exists():
        raise UsageError(
            f"argument --run-dir: {directory} already holds a run ({checkpoint.name}): "
            "pass --resume to continue it, or choose another folder"
        )
    if launch.rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(
                f"argument --run-dir: cannot create {directory}: {error.strerror}"
            ) from None
        held.enter_context(FolderLock.acquire(directory, take_over=config.take_over_lock))
    return config


def build_model() -> DynamicNet:
    return DynamicNet(in_features=IN_FEATURES, out_features=CLASSES)


def with_stored_settings(config: Config, run: RunSettings, left_out: Collection[str]) -> Config:
    """``config`` with the settings of ``run`` (a checkpoint's) in place of the flags in
    ``left_out``, those the command line did not give."""
    return dataclasses.replace(
        config, **{name: getattr(run, name) for name in STORED_FLAGS if name in left_out}
    )


def load_resumable(
    config: Config,
    launch: Launch,
    device: torch.device,
    log: TextIO,
    left_out: Collection[str] = (),
) -> TrainingState:
    """The checkpoint to resume, checked against this run's model and settings: those of
    the flags in ``left_out`` (not given) are the checkpoint's own (`with_stored_settings`),
    the others are compared with it. When it is refused, the refusal says how to resume
    from the previous one, if that one is intact."""
    assert config.checkpoint is not None

    def checked(path: Path) -> TrainingState:
        state = _checkpoint.load(path)
        with torch.device("meta"):  # the shapes, without the memory or the random numbers
            _checkpoint.check_fits(state, build_model(), path)
        return state

    try:
        state = checked(config.checkpoint)
    except _checkpoint.CheckpointError as error:
        previous = config.checkpoint.with_name(_checkpoint.PREVIOUS)
        try:
            kept = checked(previous) if previous.exists() else None
        except _checkpoint.CheckpointError:
            kept = None
        offer = ""
        if kept is not None:
            kept_config = with_stored_settings(config, kept.run, left_out)
            at = where(kept.position, len(epoch_batches(kept_config, launch)))
            move = shlex.join(["mv", str(previous), str(config.checkpoint)])
            offer = (
                f"; {previous} is intact, at {at}: to resume from it, run {move}, then "
                "this command again"
            )
        raise UsageError(f"argument --resume: {error}{offer}") from None
    settings = run_settings(with_stored_settings(config, state.run, left_out), launch)
    for name in DATA_SETTINGS:
        if getattr(state.run, name) != getattr(settings, name):
            raise UsageError(
                f"argument --{name}: {config.checkpoint} was trained with --{name} "
                f"{getattr(state.run, name)}, this run has {getattr(settings, name)}, which "
                "makes another data set; use the same value, or a new --run-dir"
            )
    if launch.rank == 0:
        if (unverified := _checkpoint.UNVERIFIED.get(state.format)) is not None:
            print(
                f"warning: {config.checkpoint} is a checkpoint of format {state.format}, "
                f"written by an earlier version of this command: {unverified}",
                file=log,
            )
        for name in SCHEDULE_SETTINGS:
            if getattr(state.run, name) != getattr(settings, name):
                print(
                    f"warning: {config.checkpoint} was trained with {name.replace('_', ' ')} "
                    f"{getattr(state.run, name)} and this run uses {getattr(settings, name)}: "
                    "training continues, but not bit for bit as an uninterrupted run would",
                    file=log,
                )
    return state


def run_settings(config: Config, launch: Launch) -> RunSettings:
    return RunSettings(
        seed=config.seed,
        samples=config.samples,
        batch_size=config.batch_size,
        lr=config.lr,
        noise=config.noise,
        precision=config.precision,
        world_size=launch.world_size,
        accumulate=config.accumulate,
    )


def epoch_batches(config: Config, launch: Launch) -> EpochBatches:
    """This process's share of every epoch, in the batches of its optimizer steps:
    ``--accumulate`` micro-batches of ``--batch-size`` each (`micro_batches`)."""
    return EpochBatches(
        config.samples,
        config.batch_size * config.accumulate,
        seed=config.seed,
        rank=launch.rank,
        world_size=launch.world_size,
    )


def process_states(
    launch: Launch, device: torch.device, running: RunningMean
) -> list[ProcessState]:
    """Every process's random number generators and epoch loss so far, indexed by rank."""
    state = ProcessState(rng=_checkpoint.rng_state(device), loss=running.state())
    if not launch.torchrun:
        return [state]
    states: list[Any] = [None] * launch.world_size
    dist.all_gather_object(states, state)
    return states


def _break_site(reason: str) -> str:
    """`` at models.py:105: `if h.abs().mean() < 0.5:` `` from dynamo's reason, if it says."""
    code = _DYNAMO_CODE.search(reason)
    return f" at {display_path(code[1])}:{code[2]}: `{code[3].strip()}`" if code else ""


def step_under_way(position: Position, steps: int) -> str:
    """``epoch 2, step 9/32 (step 41 of the run)``: the step after ``position``."""
    epoch, step, of_run = position.epoch + 1, position.step + 1, position.global_step + 1
    return f"epoch {epoch}, step {step}/{steps} (step {of_run} of the run)"


@dataclass(frozen=True)
class MicroBatch:
    """One forward and backward of an optimizer step: its samples, and their share of
    the step's (``labels`` / all the step's labels, exactly 1 for the whole batch)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    share: float


def micro_batches(inputs: torch.Tensor, labels: torch.Tensor, size: int) -> list[MicroBatch]:
    """An optimizer step's batch cut into micro-batches of ``size`` (``--batch-size``; the
    last one of an epoch may be smaller, and there may be fewer)."""
    total = labels.shape[0]
    return [
        MicroBatch(x, y, y.shape[0] / total)
        for x, y in zip(inputs.split(size), labels.split(size), strict=True)
    ]


def micro_loss(
    network: torch.nn.Module, micro: MicroBatch, autocast: contextlib.AbstractContextManager[Any]
) -> torch.Tensor:
    """A micro-batch's mean loss times its share: the step's loss is their sum, the mean
    over all its samples, so its gradient is that of one forward over the whole batch
    (for a model whose forward treats each sample alike: see `decisions_differ`)."""
    with autocast:
        loss = F.cross_entropy(network(micro.inputs), micro.labels)
    return loss if micro.share == 1 else loss * micro.share


def step_loss(
    network: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    autocast: contextlib.AbstractContextManager[Any],
    micro_batch: int,
) -> torch.Tensor:
    """An optimizer step's loss, over micro-batches of ``micro_batch`` as training
    computes it: what training minimizes and ``replay`` checks."""
    return functools.reduce(
        torch.add,
        (
            micro_loss(network, micro, autocast)
            for micro in micro_batches(inputs, labels, micro_batch)
        ),
    )


def decisions_differ(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, micro_batch: int
) -> str | None:
    """Where the micro-batches of a step decide otherwise than one forward over its
    whole batch would (the first such decision, in words), or None when they agree.

    A model that decides from a whole batch (`DynamicNet` loops while the batch's mean
    activation is large) decides per micro-batch under ``--accumulate``: the step's
    gradient is then not that of the whole batch. Run on a copy of the model (its
    buffers, batch norm's running statistics say, stay as they are) without gradients,
    the generators put back after it (a dropout draws nothing from the run's)."""
    copy = deepcopy(model)
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        with record_decisions() as whole:
            copy(inputs)
        for index, micro in enumerate(micro_batches(inputs, labels, micro_batch)):
            with record_decisions() as part:
                copy(micro.inputs)
            found = first_divergence(whole, part)
            if found is not None:
                number, in_whole, in_part = found
                decision = in_part or in_whole
                assert decision is not None
                return (
                    f"micro-batch {index + 1} ({micro.labels.shape[0]} samples) decided "
                    f"{'nothing' if in_part is None else in_part.value} at decision #{number}, "
                    f"{decision.location} (`{decision.location.source}`), where the whole "
                    f"batch ({labels.shape[0]} samples) decided "
                    f"{'nothing' if in_whole is None else in_whole.value}"
                )
    return None


def where(position: Position, steps: int) -> str:
    """``epoch 2, step 8/32 (step 40 of the run)``: 8 of the 32 steps of epoch 2 are done."""
    step = min(position.step, steps)
    return (
        f"epoch {position.epoch + 1}, step {step}/{steps} (step {position.global_step} of the run)"
    )


class Stopped(Exception):
    """Training stopped on ``signal`` at ``position``, where ``checkpoint`` now stands
    (None: stopped before training began, and no checkpoint was ever written)."""

    def __init__(
        self,
        signal: Signals,
        position: Position,
        steps: int,
        checkpoint: Path | None,
        *,
        before_training: bool = False,
    ) -> None:
        super().__init__(signal, position, steps, checkpoint)
        self.signal, self.position, self.steps = signal, position, steps
        self.checkpoint, self.before_training = checkpoint, before_training

    @property
    def status(self) -> int:
        """The exit status of a process ended by this signal, as shells report it."""
        return 128 + self.signal

    def __str__(self) -> str:
        if self.checkpoint is None:
            return (
                f"stopped by {self.signal.name} before training began: no checkpoint was "
                "written, so there is nothing to resume"
            )
        before = ", before training resumed" if self.before_training else ""
        return (
            f"stopped by {self.signal.name} at {where(self.position, self.steps)}{before}; "
            f"checkpoint {self.checkpoint}"
        )


class Diverged(CommandError):
    """An epoch's mean loss is NaN or infinite: training stops before checkpointing it."""

    def __init__(self, epoch: int, loss: float, saved_at: int | None, checkpoint: Path) -> None:
        kept = (
            f"{checkpoint} holds step {saved_at} of the run"
            if saved_at is not None
            else "no checkpoint was written"
        )
        super().__init__(
            f"the loss of epoch {epoch} is {loss} (its mean over every step): training "
            f"diverged, so this epoch was not checkpointed and {kept}; a lower --lr, "
            "--precision 32 or gradient clipping are the usual remedies"
        )


class Failure(enum.Enum):
    """What ended a run that `Failed`."""

    RAISED = "raised"  # the training code raised: its traceback says where
    WORKER_DIED = "worker died"  # memory (the OOM killer) or an operator, not code
    PEER_LOST = "peer lost"  # another torchrun process ended first: its own error says why


class Failed(Exception):
    """Training raised ``error`` at ``position``: what the one line about it says."""

    def __init__(
        self,
        error: BaseException,
        position: Position,
        steps: int,
        saved_at: int | None,
        dead_workers: list[_data.DeadWorker],
    ) -> None:
        super().__init__(error, position, steps, saved_at, dead_workers)
        self.error, self.position, self.steps = error, position, steps
        self.saved_at = saved_at  # the global step of the last checkpoint
        self.dead_workers = dead_workers
        self.text = first_line(error)
        self.lost = _PEER_LOST.search(self.text) if dist.is_initialized() else None
        self.kind = (
            Failure.WORKER_DIED
            if dead_workers
            else Failure.PEER_LOST
            if self.lost is not None
            else Failure.RAISED
        )

    @property
    def cause(self) -> str:
        if self.kind is Failure.WORKER_DIED:
            return ", ".join(str(worker) for worker in self.dead_workers)
        if self.kind is Failure.PEER_LOST:
            assert self.lost is not None
            return (
                f"another process of this job ended first ({self.lost[0]}): its own error, "
                "or torchrun's summary, says why"
            )
        return f"{type(self.error).__name__}: {self.text}"

    def __str__(self) -> str:
        during = step_under_way(self.position, self.steps)
        if self.position.step >= self.steps:  # after the epoch's last step, at its end
            epoch, done = self.position.epoch + 1, self.position.global_step
            during = f"the end of epoch {epoch} (step {done} of the run)"
        return f"training failed in {during}: {self.cause}"


# What gloo and NCCL say when a collective loses its peer (the process ended).
_PEER_LOST = re.compile(r"[Cc]onnection (closed|reset) by peer|Broken pipe|NCCL.*(remote|abort)")


class Trainer:
    """One process's training: the model, its optimizer and data, where it stands, and
    what it writes. `train` calls its steps in order; each reads and updates this state."""

    def __init__(
        self,
        config: Config,
        launch: Launch,
        device: torch.device,
        resumed: TrainingState | None,
        log: TextIO,
        stop: StopSignal | None,
    ) -> None:
        assert config.checkpoint is not None, "no run folder: see prepare_run_dir"
        assert config.run_dir is not None
        self.config, self.launch, self.device, self.log = config, launch, device, log
        self.checkpoint = config.checkpoint
        torch.manual_seed(config.seed)
        random.seed(config.seed)  # for the user's code: the example model draws none
        self.model = build_model().to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        self.position, self.loss = Position(), None
        self.elapsed = 0.0  # of the epoch under way, before this process
        self.resumed_process: ProcessState | None = None  # its loss so far, in that epoch
        if resumed is not None:
            self._restore(resumed)
        if launch.rank == 0:
            for leftover in remove_incomplete(self.checkpoint):
                print(f"removed {leftover}, an incomplete checkpoint of a killed run", file=log)

        inputs, labels = synthetic_data(config.samples, config.seed)
        self.batches = epoch_batches(config, launch)
        self.steps = len(self.batches)
        if self.position.step >= self.steps:  # resumed with a larger --batch-size: epoch over
            self.position.step = self.steps
        self.data = loader(
            SyntheticBatches(inputs, labels, noise=config.noise, seed=config.seed),
            self.batches,
            workers=config.workers,
            seed=config.seed,
            pin_memory=device.type == "cuda",
        )
        self.network: torch.nn.Module = self.model
        self.ddp: DistributedDataParallel | None = None
        if launch.torchrun:
            unused = find_unused_parameters_needed(
                self.model, inputs[: config.batch_size].to(device)
            )
            if launch.rank == 0:
                print(f"DistributedDataParallel: {unused}", file=log)
            self.network = self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=unused.needed,
            )
        if config.compile:
            # After DDP's wrapping, as DistributedDataParallel's documentation asks: torch
            # then splits the compiled graphs at DDP's gradient buckets (DDPOptimizer), so
            # their all-reduces overlap the backward. self.model stays the module itself:
            # checkpoints hold its state_dict, without torch.compile's "_orig_mod." prefix.
            mode = None if config.compile_mode == "default" else config.compile_mode
            self.network = torch.compile(self.network, backend=config.compile_backend, mode=mode)
        self.compiling = config.compile  # until this process's first step is done
        # Whether to compare the first step's micro-batch decisions with the whole batch's.
        self.check_decisions = config.accumulate > 1 and launch.rank == 0
        self.autocast = (
            contextlib.nullcontext()
            if config.precision == "32"
            else torch.autocast(device.type, dtype=AUTOCAST_DTYPES[config.precision])
        )
        self.progress: Progress | None = None
        self.metrics: MetricsLog | None = None
        if launch.rank == 0:
            self.progress = Progress(config.epochs, self.steps, stream=log)
            self.metrics = MetricsLog(
                config.run_dir,
                epochs_done=self.position.epoch,
                step=self.position.global_step,
                tensorboard=config.tensorboard,
            )
        self.saver = _checkpoint.BackgroundSaver()
        # the global step of the last checkpoint
        self.saved_at = None if resumed is None else resumed.position.global_step
        self.stops = StopAgreement(stop, distributed=launch.torchrun)
        self.running = RunningMean(device)
        self.started = 0.0
        self.finite_steps: FiniteSteps | None = None
        self.overflows: OverflowSkips | None = None
        self.looked = False  # whether a step of this process was looked at and finite
        if config.detect_nonfinite == "stop":
            parameters = list(self.model.parameters())
            self.finite_steps = FiniteSteps(parameters, device, launch.world_size)
            self.overflows = OverflowSkips() if self.scaler is not None else None

    def _restore(self, state: TrainingState) -> None:
        self.model.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        for group in self.optimizer.param_groups:  # the saved state carries the old --lr
            group["lr"] = self.config.lr
        if self.scaler is not None and state.scaler is not None:
            self.scaler.load_state_dict(state.scaler)
        self.position = dataclasses.replace(state.position)
        self.loss, self.elapsed = state.loss, state.epoch_seconds
        if len(state.processes) == self.launch.world_size:
            self.resumed_process = state.processes[self.launch.rank]
            _checkpoint.set_rng_state(self.resumed_process.rng, self.device)

    def begin_epoch(self) -> None:
        if self.resumed_process is not None and self.position.step:
            self.running = RunningMean(self.device, self.resumed_process.loss)
        else:
            self.running, self.elapsed = RunningMean(self.device), 0.0
        self.started = time.perf_counter() - self.elapsed
        if self.progress is not None:
            self.progress.start_epoch(self.position.epoch + 1, self.elapsed)
        self.batches.set_position(self.position.epoch, self.position.step)
        self.network.train()

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """One optimizer step on ``inputs`` and ``labels``: ``--accumulate`` micro-batches'
        forwards and backwards, their gradients summed, then the finite-step look (at
        the whole step's loss and gradients) and the optimizer's step."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        if self.check_decisions:
            self.check_decisions = False
            differs = decisions_differ(self.model, inputs, labels, self.config.batch_size)
            if differs is not None:
                print(
                    f"warning: --accumulate {self.config.accumulate}: in the first step, "
                    f"{differs}: the model decides per micro-batch, so a step's gradient is "
                    f"not that of one batch of {labels.shape[0]}",
                    file=self.log,
                )
        started = None if self.finite_steps is None else GeneratorsAtStep.take(self.device)
        with self.reporting_compile() if self.compiling else contextlib.nullcontext():
            self.update(inputs, labels, started)
        self.position.step += 1
        self.position.global_step += 1
        if self.progress is not None:
            samples = self.running.count * self.launch.world_size
            self.progress.update(self.position.step, samples, self.running.value)

    def update(
        self, inputs: torch.Tensor, labels: torch.Tensor, started: GeneratorsAtStep | None
    ) -> None:
        """The gradients of the step's batch, looked at, and the optimizer's step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(inputs, labels)
        if self.scaler is None:
            if self.finite_steps is not None:
                self.stop_if_not_finite(loss, inputs, labels, started, gradients=True)
            self.optimizer.step()
        else:
            if self.finite_steps is not None:  # the scaler looks at the gradients itself
                self.stop_if_not_finite(loss, inputs, labels, started, gradients=False)
            scale = self.scaler.get_scale() if self.overflows is not None else 0.0
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.overflows is not None:
                self.overflows.step(scale, self.scaler.get_scale())
                if self.overflows.endless:
                    self.stop_not_finite(loss, inputs, labels, started, gradients=True)
        self.running.add(loss, labels.shape[0])

    @contextlib.contextmanager
    def reporting_compile(self) -> Iterator[None]:
        """Around this process's first step under ``--compile``, which compiles: then
        rank 0 says how long that step took, how many graphs torch.compile made and
        where it broke the graph (at every data-dependent branch of a dynamic model,
        and it runs a function whose loop holds one all eagerly)."""
        # Here, not at the top: importing torch._dynamo takes seconds, and only --compile needs it.
        from torch._dynamo.utils import counters

        def seen() -> dict[tuple[str, str], int]:
            # Private surface: torch's own counts of graphs and breaks, by reason; a
            # break that compiles no graph is only in "unimplemented".
            return {
                (kind, reason): count
                for kind in _BREAK_COUNTERS
                for reason, count in counters[kind].items()
            }

        config = self.config
        graphs, before = counters["stats"]["unique_graphs"], seen()
        began = time.perf_counter()
        yield
        seconds = time.perf_counter() - began
        self.compiling = False
        if self.launch.rank != 0:
            return
        made = counters["stats"]["unique_graphs"] - graphs
        # One line a break: the same break is counted under both counters.
        breaks = list(
            dict.fromkeys(
                f"  graph break{_break_site(reason)}: {reason.strip().splitlines()[0]}"
                for (kind, reason), count in seen().items()
                if count > before.get((kind, reason), 0)
            )
        )
        lines = [
            f"torch.compile (backend {config.compile_backend}, mode {config.compile_mode}): "
            f"the first step took {seconds:.1f} s, compiling included; {made} graph(s) "
            f"compiled, {len(breaks)} graph break(s)",
            *breaks,
        ]
        if not made:
            lines.append("  nothing was compiled: the model runs eagerly, as without --compile")
        if breaks:
            lines.append(
                "  (the compile_check fixture names each break's cause and a rewrite that "
                "removes it)"
            )
        print("\n".join(lines), file=self.log)

    def accumulate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The step's loss (the mean over all its samples); each micro-batch's gradients
        added to the parameters' (scaled, under fp16). Under DDP only the last
        micro-batch's backward all-reduces: the others run under ``no_sync``, which
        leaves their gradients in the parameters' for it to add to."""
        micros = micro_batches(inputs, labels, self.config.batch_size)
        loss: torch.Tensor | None = None
        for index, micro in enumerate(micros):
            last = index == len(micros) - 1
            with contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync():
                part = micro_loss(self.network, micro, self.autocast)
                (part if self.scaler is None else self.scaler.scale(part)).backward()
            loss = part.detach() if loss is None else loss + part.detach()
        assert loss is not None
        return loss

    def stop_if_not_finite(
        self,
        loss: torch.Tensor,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        started: GeneratorsAtStep | None,
        *,
        gradients: bool,
    ) -> None:
        """`stop_not_finite` unless the step's loss, weights and (with ``gradients``)
        gradients are finite on every process."""
        assert self.finite_steps is not None
        if self.finite_steps.finite(loss, gradients=gradients):
            self.looked = True  # a later non-finite weight was made by an optimizer step
            return
        self.stop_not_finite(loss, inputs, labels, started, gradients=gradients)

    def stop_not_finite(
        self,
        loss: torch.Tensor,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        started: GeneratorsAtStep | None,
        *,
        gradients: bool,
    ) -> NoReturn:
        """`NotFiniteStep`, once every process has replayed its batch to find where the
        first NaN or inf was born and rank 0 has written the bundle. Every process calls
        it before the same step."""
        assert self.finite_steps is not None
        assert started is not None
        assert self.config.run_dir is not None
        key = self.batches.key(self.position.epoch, self.position.step)
        started.restore(self.device)
        rng = _checkpoint.rng_state(self.device)  # the step's start, as a checkpoint holds it
        loss_of = functools.partial(
            step_loss, autocast=self.autocast, micro_batch=self.config.batch_size
        )
        origin = locate(self.model, inputs, labels, loss_of)
        mine = RankRecord(
            self.launch.rank, key.indices.tolist(), loss.item(), origin, rng, self.running.state()
        )
        records: list[Any] = [mine]
        if self.launch.torchrun:
            records = [None] * self.launch.world_size
            dist.all_gather_object(records, mine)
        losses = tuple(r.rank for r in records if not math.isfinite(r.loss))
        look = self.finite_steps.what(losses, gradients=gradients)
        folder = bundle_folder(self.config.run_dir, self.position.global_step)
        record = StepRecord(
            epoch=self.position.epoch,
            step=self.position.step,
            global_step=self.position.global_step,
            precision=self.config.precision,
            gradients=look.gradients,
            ranks=records,
        )
        try:
            if self.launch.rank == 0:
                processes = [ProcessState(r.rng, r.running) for r in records]
                write_bundle(folder, self.state(processes), record)
        finally:
            if self.launch.torchrun:
                dist.barrier()  # as at a stop: no process ends its torchrun before the write
        raise NotFiniteStep(self.not_finite_report(look, record, folder))

    def not_finite_report(self, look: StepLook, record: StepRecord, folder: Path) -> str:
        losses = [r for r in record.ranks if r.rank in look.losses]
        seen = ", ".join(
            f"{r.loss}" + (f" on rank {r.rank}" if self.launch.torchrun else "") for r in losses
        )
        what = [f"the loss was {seen}"] if losses else []
        if look.gradients:
            what.append(
                "the gradients were not finite"
                if self.overflows is None or not self.overflows.endless
                else f"GradScaler skipped {self.overflows.in_a_row} steps in a row: no scale "
                "makes these gradients finite"
            )
        during = step_under_way(self.position, self.steps)
        if look.parameters:
            bad = [
                f"{name} holds {non_finite_text(parameter)}"
                for name, parameter in self.model.named_parameters()
                if not bool(torch.isfinite(parameter).all())
            ]
            made = (
                f"the optimizer step of step {self.position.global_step} of the run made "
                "them so from finite gradients (that step's loss and gradients were "
                "finite): a learning rate too large for this model (--lr) or an overflow in "
                "the update"
                if self.looked
                else "they were so when this process started (in the checkpoint it resumed)"
            )
            then = f" Then {' and '.join(what)}." if what else ""
            first = f"training stopped before {during}: {'; '.join(bad)}: {made}.{then}"
        else:
            first = (
                f"training stopped before {during}: {' and '.join(what)}; the step was not "
                "applied, the weights are those before it"
            )
        lines = [first]
        found = [r for r in record.ranks if r.origin is not None]
        for r in found:
            if self.launch.torchrun:
                lines.append(f"On rank {r.rank}:")
            lines += r.origin
        if not found and not look.parameters:
            lines.append(
                "Replaying the batch under an op recorder made no NaN or inf: the step is not "
                "reproducible in one process (a random op, a value from outside torch, or "
                "only the gradient average over the processes overflowed)"
            )
        shown = record.ranks[found[0].rank if found else 0]
        samples = ", ".join(map(str, shown.indices[:_SAMPLES_SHOWN]))
        more = ", ..." if len(shown.indices) > _SAMPLES_SHOWN else ""
        rank = f" on rank {shown.rank}" if self.launch.torchrun else ""
        lines.append(
            f"The batch{rank}: samples [{samples}{more}] ({len(shown.indices)} samples; every "
            f"process's are in {RECORD})"
        )
        if self.overflows is not None and self.overflows.total:
            lines.append(str(self.overflows))
        lines.append(
            f"Repro bundle: {folder} ({CHECKPOINT}: the model, optimizer and generators before "
            f"the step; {RECORD}: the step, the batch's samples, the losses and origins)"
        )
        replay = [*command_name(f"{PACKAGE}.replay").split(), str(folder)]
        if found and found[0].rank:
            replay += ["--rank", str(found[0].rank)]
        lines.append(f"Replay it under finite_check with: {shlex.join(replay)}")
        return "\n".join(lines)

    def checkpoint_if_due(self) -> None:
        every = self.config.checkpoint_every
        if every is not None and self.position.global_step % every == 0:
            self.save()

    def end_epoch(self) -> None:
        """The epoch's loss over every process, its metrics row, and a checkpoint."""
        count = torch.tensor(float(self.running.count), device=self.device).double()
        totals = torch.stack([self.running.total(), count])
        if self.launch.torchrun:
            dist.all_reduce(totals)
        self.loss = (totals[0] / totals[1]).item()
        seconds = time.perf_counter() - self.started
        samples = int(totals[1].item())
        self.position.epoch, self.position.step = self.position.epoch + 1, 0
        self.resumed_process = None
        if self.metrics is not None:
            self.metrics.write(
                EpochMetrics(
                    epoch=self.position.epoch,
                    step=self.position.global_step,
                    loss=self.loss,
                    samples_per_s=round(samples / seconds, 1),
                    lr=self.optimizer.param_groups[0]["lr"],
                    seconds=round(seconds, 4),
                )
            )
        if not math.isfinite(self.loss):
            raise Diverged(self.position.epoch, self.loss, self.saved_at, self.checkpoint)
        self.save()
        if self.progress is not None:
            self.progress.end_epoch(samples, self.loss)

    def save(self) -> None:
        """A checkpoint of this position (written by rank 0; every process takes part)."""
        processes = process_states(self.launch, self.device, self.running)
        self.saved_at = self.position.global_step
        if self.launch.rank == 0:
            self.saver.save(self.state(processes), self.checkpoint)

    def state(self, processes: list[ProcessState]) -> TrainingState:
        """What a checkpoint of this position holds, with every process's ``processes``."""
        epoch_seconds = time.perf_counter() - self.started if self.position.step else 0.0
        return TrainingState(
            position=dataclasses.replace(self.position),
            epoch_seconds=epoch_seconds,
            loss=self.loss,
            run=run_settings(self.config, self.launch),
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scaler=None if self.scaler is None else self.scaler.state_dict(),
            processes=processes,
        )

    def stop_if_signalled_before_training(self) -> None:
        """`Stopped` where the last checkpoint stands (if there is one), if a stop signal
        came during start-up; every process asks, once, before the first step."""
        received = self.stops.now()
        if received is not None:
            checkpoint = None if self.saved_at is None else self.checkpoint
            position = dataclasses.replace(self.position)
            raise Stopped(received, position, self.steps, checkpoint, before_training=True)

    def stop_if_signalled(self) -> None:
        """`Stopped`, once a checkpoint of this position is written, if a stop signal came."""
        received = self.stops.signal()
        if received is None:
            return
        if self.saved_at != self.position.global_step:
            self.save()
        if self.launch.torchrun:
            # Every process exits once the checkpoint is on disk, not before: a process
            # that exits first ends its torchrun, and then srun (--kill-on-bad-exit) or
            # torchrun gives rank 0 only their own short grace to finish writing.
            self.saver.wait()
            dist.barrier()
        raise Stopped(received, dataclasses.replace(self.position), self.steps, self.checkpoint)

    def close(self, *, in_step: bool) -> None:
        """End the data's workers, wait for the last checkpoint to be on disk, close the
        metrics. ``in_step``: training failed, perhaps with other processes inside a
        collective this one will never join, so nothing here may wait for them."""
        try:
            _data.close(self.data)
            if not in_step:
                self.stops.close()
            self.saver.wait()
        finally:
            if self.metrics is not None:
                self.metrics.close()


def train(
    config: Config,
    launch: Launch,
    device: torch.device,
    resumed: TrainingState | None = None,
    log: TextIO | None = None,
    stop: StopSignal | None = None,
) -> float | None:
    """Train for the epochs ``resumed`` has not done yet; the last epoch's mean loss.

    ``config.run_dir`` must exist (`prepare_run_dir`). With ``stop`` (`stop_signals`),
    a stop signal ends training after the step under way with a checkpoint of it, and
    `Stopped`; one that came before, once all is ready for the first step.
    """
    trainer = Trainer(config, launch, device, resumed, sys.stderr if log is None else log, stop)
    in_step = True
    try:
        if stop is not None:
            stop.phase = CommandPhase.TRAINING
        trainer.stop_if_signalled_before_training()
        while trainer.position.epoch < config.epochs:
            trainer.begin_epoch()
            for inputs, labels in trainer.data:
                trainer.step(inputs, labels)
                if trainer.position.step < trainer.steps:  # the epoch's last step ends below
                    trainer.checkpoint_if_due()
                    trainer.stop_if_signalled()
            trainer.end_epoch()
            if trainer.position.epoch < config.epochs:
                trainer.stop_if_signalled()
        if stop is not None:
            stop.phase = CommandPhase.FINISHED
        in_step = False
        if launch.rank == 0 and trainer.overflows is not None and trainer.overflows.total:
            print(trainer.overflows, file=trainer.log)
    except (Stopped, Diverged, NotFiniteStep):  # every process raises it after the same step
        in_step = False
        raise
    except CommandError:  # already its one line (a full disk): reported as it is
        raise
    except Exception as error:
        position = dataclasses.replace(trainer.position)
        dead = _data.dead_workers(trainer.data, error)
        raise Failed(error, position, trainer.steps, trainer.saved_at, dead) from error
    finally:
        trainer.close(in_step=in_step)
    return trainer.loss


def _number(kind: type[int] | type[float], text: str, *, zero: bool) -> Any:
    """``text`` as a finite ``kind`` above 0 (or at least 0 with ``zero``), else the error."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        noun = "integer" if kind is int else "number"
        wanted = f"{'an' if kind is int else 'a'} {noun} >= 0" if zero else f"a positive {noun}"
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, zero=False)


def positive_float(text: str) -> float:
    return _number(float, text, zero=False)


def non_negative_int(text: str) -> int:
    return _number(int, text, zero=True)


def non_negative_float(text: str) -> float:
    return _number(float, text, zero=True)


def seed_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**63-1, got {text!r}")
    return value


def device_name(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def precision_name(text: str) -> str:
    if text not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"must be 32, bf16 or fp16, got {text!r}")
    return text


def directory_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a directory path, got an empty string")
    return Path(text)


def nonfinite_mode(text: str) -> str:
    if text not in NONFINITE_MODES:
        raise argparse.ArgumentTypeError(f"must be stop or off, got {text!r}")
    return text


def lock_holder(text: str) -> str:
    pid, at, host = text.partition("@")
    if text != UNLOCKED and not (pid.isdecimal() and at and host.isprintable() and host):
        raise argparse.ArgumentTypeError(
            f"must be PID@HOST, as the refusal to lock the run folder printed it, or "
            f"{UNLOCKED}; got {text!r}"
        )
    return text


def compile_mode(text: str) -> str:
    if text not in COMPILE_MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(COMPILE_MODES)}, got {text!r}")
    return text


def compile_backend(text: str) -> str:
    """A backend's name; the list is asked for only for another than inductor (it takes
    seconds: it imports them all)."""
    if text != "inductor":
        known = torch.compiler.list_backends(exclude_tags=())
        if text not in known:
            raise argparse.ArgumentTypeError(
                f"must be a torch.compile backend ({', '.join(known)}), got {text!r}"
            )
    return text


class TrainParser(argparse.ArgumentParser):
    """train's parser, with the checks of flags that go together. ``--compile-backend``
    and ``--compile-mode`` default to None, so that their being given shows; None is
    then their default's name. (`parse_command_line` also parses into a namespace whose
    flags not given hold a marker of its own: those are left as they are.)"""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        parsed, rest = super().parse_known_args(args, namespace)
        chosen = dict(COMPILE_DEFAULTS)
        for name in COMPILE_DEFAULTS:
            value = getattr(parsed, name)
            if value is None:
                setattr(parsed, name, chosen[name])
            elif isinstance(value, str):  # given
                if parsed.compile is not True:
                    self.error(f"argument --{name.replace('_', '-')}: needs --compile")
                chosen[name] = value
        if chosen["compile_mode"] != "default" and chosen["compile_backend"] != "inductor":
            self.error(
                f"argument --compile-mode: {chosen['compile_mode']} is a mode of the inductor "
                f"backend, and --compile-backend is {chosen['compile_backend']}"
            )
        return parsed, rest


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        metavar="{auto,cpu,cuda,cuda:N}",
        type=device_name,
        default="auto",
        help="auto (a GPU when CUDA is usable, else the CPU), cpu, cuda or cuda:N (default: auto)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = TrainParser(
        prog=command_name(f"{PACKAGE}.train"),
        description="Train the example dynamic model (DynamicNet) on synthetic data.",
        epilog=f"Several GPUs: torchrun --nproc_per_node N -m {PACKAGE}.train --device cuda ...",
    )
    add_device_argument(parser)
    parser.add_argument(
        "--batch-size",
        metavar="N",
        type=positive_int,
        default=64,
        help="samples per step and process; with --accumulate, per micro-batch (default: 64)",
    )
    parser.add_argument(
        "--epochs", metavar="N", type=positive_int, default=10, help="epochs in all (default: 10)"
    )
    parser.add_argument(
        "--lr",
        metavar="RATE",
        type=positive_float,
        default=1e-3,
        help="Adam learning rate (default: 0.001)",
    )
    parser.add_argument(
        "--seed",
        metavar="N",
        type=seed_value,
        default=0,
        help="makes the data, the initial weights and the data order (default: 0)",
    )
    parser.add_argument(
        "--samples",
        metavar="N",
        type=positive_int,
        default=8192,
        help="size of the synthetic data set (default: 8192)",
    )
    parser.add_argument(
        "--noise",
        metavar="STD",
        type=non_negative_float,
        default=0.05,
        help="std of the Gaussian noise added to each batch's inputs, 0 for none (default: 0.05)",
    )
    parser.add_argument(
        "--run-dir",
        "--checkpoint-dir",
        dest="run_dir",
        metavar="DIR",
        type=directory_path,
        help=f"the run's folder: metrics.csv, {_checkpoint.LATEST}, TensorBoard events "
        "(default: runs/<date-time>; --checkpoint-dir is another name for it)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its last checkpoint",
    )
    parser.add_argument(
        "--checkpoint-every",
        metavar="STEPS",
        type=positive_int,
        help=f"also write {_checkpoint.LATEST} every STEPS optimizer steps (default: at each "
        "epoch's end only)",
    )
    parser.add_argument(
        "--workers",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="DataLoader worker processes, 0 to load in this process (default: 0)",
    )
    parser.add_argument(
        "--precision",
        metavar="{32,bf16,fp16}",
        type=precision_name,
        default="32",
        help="32 (float32), bf16 (autocast, CPU or CUDA) or fp16 (autocast and gradient "
        "scaling, CUDA only) (default: 32)",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard events into the run folder (needs the tensorboard package)",
    )
    parser.add_argument(
        "--detect-nonfinite",
        metavar="{stop,off}",
        nargs="?",
        const="stop",
        default="off",
        type=nonfinite_mode,
        help="stop: look at every step's loss and gradients (one device read a step) and "
        "stop before the first that is not finite, naming the op and line that made it, "
        "with a bundle in the run folder that replays the step; alone, means stop "
        "(default: off)",
    )
    parser.add_argument(
        "--accumulate",
        metavar="N",
        type=positive_int,
        default=1,
        help="micro-batches of --batch-size per optimizer step, their gradients summed: "
        "steps of N x --batch-size samples in the memory of one micro-batch (default: 1)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the model through torch.compile (the first step compiles; rank 0 says "
        "how long it took)",
    )
    parser.add_argument(
        "--compile-backend",
        metavar="NAME",
        type=compile_backend,
        help="torch.compile's backend, with --compile: inductor, or aot_eager, eager... "
        "(default: inductor)",
    )
    parser.add_argument(
        "--compile-mode",
        metavar="{" + ",".join(COMPILE_MODES) + "}",
        type=compile_mode,
        help="torch.compile's mode, with --compile and the inductor backend (default: default)",
    )
    parser.add_argument(
        "--take-over-lock",
        metavar="PID@HOST",
        type=lock_holder,
        help="write --run-dir although PID on HOST, on another machine, holds its lock (a "
        "crashed node's lock lasts until it restarts on NFSv3), or 'unlocked' where its "
        "filesystem has no locks; the refusal prints the value",
    )
    return parser


def resume_command(
    config: Config,
    launch: Launch,
    environ: Mapping[str, str] = os.environ,
    *,
    checkpoint: bool = True,
) -> str:
    """The command line that continues this run: ``--run-dir``, ``--resume`` and the
    settings that differ from the defaults and that the checkpoint does not keep
    (`STORED_FLAGS`), behind the same launcher. Without ``checkpoint`` (none was
    written), the one that starts it again: every setting, without ``--resume``. In a
    SLURM job, which comes back by itself when requeued, the ``launch slurm`` line that
    continues the folder in a new job once this one has ended."""
    stored = STORED_FLAGS if checkpoint else ()

    def flags(*left_out: str) -> list[str]:
        args = []
        for field in dataclasses.fields(Config):
            value = getattr(config, field.name)
            once = ("run_dir", "resume", "take_over_lock")  # a taken-over lock is this run's
            if field.name in (*once, *stored, *left_out) or value == field.default:
                continue
            flag = "--" + field.name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args

    module = f"{PACKAGE}.train"
    run_dir = ["--run-dir", str(config.run_dir)]
    if launch.torchrun and "SLURM_JOB_ID" in environ:
        # launch slurm sets --device and --resume itself, and takes --run-dir as its own.
        launcher = command_name(f"{PACKAGE}.launch")
        return (
            f"{launcher} slurm <this job's options> {shlex.join(run_dir)} -- "
            f"{shlex.join(flags('device'))} (a requeued job resumes by itself)"
        )
    args = [*flags(), *run_dir, *(["--resume"] if checkpoint else [])]
    if not launch.torchrun:
        return f"{command_name(module)} {shlex.join(args)}"
    if launch.world_size != launch.local_world_size:  # several nodes: their rendezvous
        return f"torchrun with this job's options on every node, -m {module} {shlex.join(args)}"
    launcher = f"torchrun --standalone --nproc_per_node {launch.local_world_size}"
    return f"{launcher} -m {module} {shlex.join(args)}"


def parse_command_line(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[Config, frozenset[str]]:
    """The config the command line asks for, and the names of the settings it did not
    give (left at their defaults; --resume takes those the checkpoint keeps from it)."""
    defaults = vars(parser.parse_args([]))
    unset = object()
    given = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(defaults, unset))))
    left_out = frozenset(name for name, value in given.items() if value is unset)
    values = {name: defaults[name] if name in left_out else value for name, value in given.items()}
    return Config(**values), left_out


def ends_with_main() -> bool:
    """Whether this process ends once `main` returns: started as ``python -m`` of this
    module (torchrun's processes too) or as the installed command, not `main` called
    from Python."""
    module = f"{PACKAGE}.train"
    return __name__ == "__main__" or command_name(module) != f"python -m {module}"


@reports_errors(f"{PACKAGE}.train")
def main(argv: list[str] | None = None) -> int:
    """The train command; stop signals are recorded from its first line (`_preemption`):
    one that comes once the run is complete stops nothing, and is reported so."""
    with stop_signals(then_ignore=ends_with_main()) as stop:
        parser = build_parser()
        config, left_out = parse_command_line(parser, argv)
        launch = Launch.from_environment()
        # A killed torchrun takes its processes with it (and they their workers).
        if launch.torchrun:
            end_with_parent(os.getppid())
        with contextlib.ExitStack() as held:
            try:
                if config.tensorboard and (missing := tensorboard_missing()) is not None:
                    raise UsageError(f"argument --tensorboard: {missing}")
                device = resolve_device(config.device, launch)
                check_precision(config.precision, device)
                config = prepare_run_dir(config, launch, held)
                resumed = None
                if config.resume:
                    resumed = load_resumable(config, launch, device, sys.stderr, left_out)
                    config = with_stored_settings(config, resumed.run, left_out)
                    check_precision(config.precision, device)  # the checkpoint's, perhaps
            except UsageError as error:
                parser.error(str(error))
            status = run(config, launch, device, resumed, stop)
    if status == 0 and (late := stop.nothing_to_stop()) is not None:
        print(f"rank {launch.rank}: {late}" if launch.rank else late, file=sys.stderr)
    return status


def run(
    config: Config,
    launch: Launch,
    device: torch.device,
    resumed: TrainingState | None,
    stop: StopSignal | None = None,
) -> int:
    """Train as `main` was asked to, in this process's place of the launch; the exit
    status. ``stop``: the stop signals `main` records."""
    if resumed is not None:
        if resumed.position.epoch >= config.epochs:
            if stop is not None:
                stop.phase = CommandPhase.FINISHED
            if launch.rank == 0:
                print(
                    f"{config.checkpoint} has already trained {resumed.position.epoch} epochs; "
                    "nothing to do"
                )
            return 0
        if launch.rank == 0:
            steps = len(epoch_batches(config, launch))
            print(f"resumed {config.run_dir} at {where(resumed.position, steps)}", flush=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launch.torchrun:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    try:
        loss = train(config, launch, device, resumed, stop=stop)
    except Stopped as stopped:
        if launch.rank == 0:
            print(stopped, file=sys.stderr)
            if stopped.checkpoint is None:
                again = resume_command(config, launch, checkpoint=False)
                print(f"start again with: {again}", file=sys.stderr)
            else:
                print(f"resume with: {resume_command(config, launch)}", file=sys.stderr)
        return stopped.status
    except (Diverged, NotFiniteStep) as ended:
        if launch.rank == 0:
            print(f"{command_name(f'{PACKAGE}.train')}: error: {ended}", file=sys.stderr)
        return ended.status
    except Failed as failed:
        if failed.kind is Failure.RAISED:  # the user's code: its traceback says where
            traceback.print_exception(failed.error)
        rank = f"rank {launch.rank}: " if launch.torchrun else ""
        resume = ""
        if launch.rank == 0 and failed.saved_at is not None and config.checkpoint is not None:
            resume = (
                f"; the last checkpoint, {config.checkpoint}, holds step {failed.saved_at} of "
                f"the run: resume with {resume_command(config, launch)}"
            )
        print(f"{command_name(f'{PACKAGE}.train')}: error: {rank}{failed}{resume}", file=sys.stderr)
        return 1
    finally:
        if launch.torchrun:
            # DDP's reducer sits in reference cycles: collect it while the process group
            # and the interpreter are alive, or gloo's threads die at interpreter exit.
            gc.collect()
            dist.destroy_process_group()
    if launch.rank == 0:
        hardware = str(device)
        if launch.torchrun:
            hardware = f"{launch.world_size} processes on {device.type} ({backend})"
        print(
            f"trained {config.epochs} epochs on {hardware}: loss {loss:.4f}, run {config.run_dir}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
