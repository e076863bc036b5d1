"""Train the example dynamic model (`DynamicNet`) on synthetic data, with metrics and checkpoints.

    <project>-train --device cuda --batch-size 64 --epochs 10
    <project>-train --run-dir runs/a --checkpoint-every 100 --workers 2 --precision bf16
    <project>-train --run-dir runs/a --resume          # after a crash or kill
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
``--workers`` either run used.

Under ``torchrun`` every process trains a copy of the model on its share of each
epoch (DistributedSampler) and DistributedDataParallel averages the gradients:
NCCL on GPUs, gloo on the CPU. `DynamicNet` skips its residual block for some
batches, so in those steps the block's parameters get no gradient on that process.
DDP has to be told (``find_unused_parameters=True``): otherwise that step's gradient
reduction never finishes and the next step fails ("Expected to have finished
reduction in the prior iteration").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from . import _checkpoint
from ._command import command_name
from ._data import EpochBatches, SyntheticBatches, loader
from ._metrics import EpochMetrics, MetricsLog, tensorboard_missing
from ._progress import Progress
from .gpus import cuda_unavailable_reason
from .models import DynamicNet

__all__ = ["Config", "Launch", "UsageError", "build_parser", "main", "synthetic_data", "train"]

PACKAGE = __package__
IN_FEATURES = 16
CLASSES = 4
PRECISIONS = ("32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Settings that make the data set: a checkpoint trained on other data is another run.
DATA_SETTINGS = ("seed", "samples")
# Settings a run can be resumed with when they change, though not bit for bit.
# (--workers and --checkpoint-every change nothing in the numbers.)
SCHEDULE_SETTINGS = ("batch_size", "lr", "noise", "precision", "world_size")


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


def default_run_dir(now: datetime | None = None) -> Path:
    """``runs/<date-time>`` for a run started now, with ``-2``, ``-3``... if that is taken."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    candidate, number = Path("runs", stamp), 1
    while candidate.exists():
        number += 1
        candidate = Path("runs", f"{stamp}-{number}")
    return candidate


def prepare_run_dir(config: Config, launch: Launch) -> Config:
    """Check ``--run-dir``/``--resume`` before any work; the config with the run folder,
    created (by rank 0, the only process that writes there)."""
    if config.run_dir is None:
        if config.resume:
            raise UsageError("argument --resume: needs --run-dir DIR, the folder of the run")
        config = Config(**{**vars(config), "run_dir": default_run_dir()})
    directory, checkpoint = config.run_dir, config.checkpoint
    assert directory is not None
    assert checkpoint is not None
    if config.resume:
        if not directory.is_dir():
            raise UsageError(f"argument --run-dir: {directory} does not exist (nothing to resume)")
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
    return config


def load_resumable(
    config: Config, launch: Launch, device: torch.device, log: TextIO
) -> dict[str, Any]:
    """The checkpoint to resume, checked against this run's settings."""
    assert config.checkpoint is not None
    try:
        state = _checkpoint.load(config.checkpoint, map_location=device)
    except _checkpoint.CheckpointError as error:
        raise UsageError(f"argument --resume: {error}") from None
    settings = run_settings(config, launch)
    for name in DATA_SETTINGS:
        if state["run"][name] != settings[name]:
            raise UsageError(
                f"argument --{name}: {config.checkpoint} was trained with --{name} "
                f"{state['run'][name]}, this run has {settings[name]}, which makes another data "
                "set; use the same value, or a new --run-dir"
            )
    if launch.rank == 0:
        for name in SCHEDULE_SETTINGS:
            if state["run"][name] != settings[name]:
                print(
                    f"warning: {config.checkpoint} was trained with {name.replace('_', ' ')} "
                    f"{state['run'][name]} and this run uses {settings[name]}: training "
                    "continues, but not bit for bit as an uninterrupted run would",
                    file=log,
                )
    return state


def run_settings(config: Config, launch: Launch) -> dict[str, Any]:
    return {
        "seed": config.seed,
        "samples": config.samples,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "noise": config.noise,
        "precision": config.precision,
        "world_size": launch.world_size,
    }


class RunningMean:
    """The mean of an epoch's per-batch losses, summed on the device, read only on demand.

    A step only keeps its detached loss: adding it to a total at once would cost an op
    per step, and reading it would wait for the GPU. Every `FOLD` steps of the epoch
    those losses are summed (in float64) into one partial sum. The partial sums fall
    on the same steps whether or not the epoch was interrupted, and `state` holds the
    losses not summed yet, so a resumed epoch ends with the same bits.
    """

    FOLD = 1024

    def __init__(self, device: torch.device, state: Mapping[str, Any] | None = None) -> None:
        self.device = device
        self._partials: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self.count = 0
        if state is not None:
            self._partials = list(state["partials"].to(device).unbind())
            self._losses = list(state["losses"].to(device).unbind())
            self._sizes = state["sizes"].tolist()
            self.count = state["samples"]

    def add(self, batch_mean: torch.Tensor, batch_size: int) -> None:
        self._losses.append(batch_mean.detach())
        self._sizes.append(batch_size)
        self.count += batch_size
        if len(self._losses) == self.FOLD:
            self._partials.append(self._pending_sum())
            self._losses, self._sizes = [], []

    def _pending_sum(self) -> torch.Tensor:
        if not self._losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        sizes = torch.tensor(self._sizes, dtype=torch.float64, device=self.device)
        return (torch.stack(self._losses).double() * sizes).sum()

    def total(self) -> torch.Tensor:
        """The sum of batch loss x batch size so far (a float64 tensor on the device)."""
        return torch.stack([*self._partials, self._pending_sum()]).sum()

    def value(self) -> float:
        return self.total().item() / max(self.count, 1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this mean (on the CPU)."""
        empty = torch.zeros(0, dtype=torch.float64)
        return {
            "partials": torch.stack(self._partials).cpu() if self._partials else empty,
            "losses": torch.stack(self._losses).cpu() if self._losses else empty.float(),
            "sizes": torch.tensor(self._sizes, dtype=torch.int64),
            "samples": self.count,
        }


def process_states(
    launch: Launch, device: torch.device, running: RunningMean
) -> list[dict[str, Any]]:
    """Every process's random number generators and epoch loss so far, indexed by rank."""
    state = {"rng": _checkpoint.rng_state(device), "loss": running.state()}
    if not launch.torchrun:
        return [state]
    states: list[Any] = [None] * launch.world_size
    dist.all_gather_object(states, state)
    return states


@dataclass
class Position:
    """Where training stands: epochs finished, steps done in the next one, steps in all."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0


def train(
    config: Config,
    launch: Launch,
    device: torch.device,
    resumed: dict[str, Any] | None = None,
    log: TextIO | None = None,
) -> float | None:
    """Train for the epochs ``resumed`` has not done yet; the last epoch's mean loss.

    ``config.run_dir`` must exist (`prepare_run_dir`).
    """
    log = sys.stderr if log is None else log
    assert config.checkpoint is not None, "no run folder: see prepare_run_dir"
    assert config.run_dir is not None
    torch.manual_seed(config.seed)
    model = DynamicNet(in_features=IN_FEATURES, out_features=CLASSES).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
    position, loss, mine = Position(), None, None
    elapsed = 0.0  # of the epoch under way, before this process
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        for group in optimizer.param_groups:  # the saved state carries the old --lr
            group["lr"] = config.lr
        if scaler is not None and resumed["scaler"] is not None:
            scaler.load_state_dict(resumed["scaler"])
        position = Position(resumed["epoch"], resumed["step"], resumed["global_step"])
        loss, elapsed = resumed["loss"], resumed["epoch_seconds"]
        if len(resumed["processes"]) == launch.world_size:
            mine = resumed["processes"][launch.rank]
            _checkpoint.set_rng_state(mine["rng"], device)
    if launch.rank == 0:
        for leftover in _checkpoint.remove_incomplete(config.checkpoint):
            print(f"removed {leftover}, an incomplete checkpoint of a killed run", file=log)

    inputs, labels = synthetic_data(config.samples, config.seed)
    batches = EpochBatches(
        config.samples,
        config.batch_size,
        seed=config.seed,
        rank=launch.rank,
        world_size=launch.world_size,
    )
    steps = len(batches)
    if position.step >= steps:  # resumed with a larger --batch-size: the epoch is over
        position.step = steps
    data = loader(
        SyntheticBatches(inputs, labels, noise=config.noise, seed=config.seed),
        batches,
        workers=config.workers,
        seed=config.seed,
        pin_memory=device.type == "cuda",
    )
    network: torch.nn.Module = model
    if launch.torchrun:
        network = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=True,
        )
    autocast = (
        contextlib.nullcontext()
        if config.precision == "32"
        else torch.autocast(device.type, dtype=AUTOCAST_DTYPES[config.precision])
    )
    progress = metrics = None
    if launch.rank == 0:
        progress = Progress(config.epochs, steps, stream=log)
        metrics = MetricsLog(
            config.run_dir,
            epochs_done=position.epoch,
            step=position.global_step,
            tensorboard=config.tensorboard,
        )

    saver = _checkpoint.BackgroundSaver()

    def save_checkpoint(running: RunningMean, started: float) -> None:
        processes = process_states(launch, device, running)
        if launch.rank != 0:
            return
        saver.save(
            {
                "format": _checkpoint.FORMAT,
                "epoch": position.epoch,
                "step": position.step,
                "global_step": position.global_step,
                "epoch_seconds": time.perf_counter() - started if position.step else 0.0,
                "loss": loss,
                "run": run_settings(config, launch),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": None if scaler is None else scaler.state_dict(),
                "processes": processes,
            },
            config.checkpoint,
        )

    try:
        while position.epoch < config.epochs:
            if mine is not None and position.step:
                running = RunningMean(device, mine["loss"])
            else:
                running, elapsed = RunningMean(device), 0.0
            started = time.perf_counter() - elapsed
            if progress is not None:
                progress.start_epoch(position.epoch + 1, elapsed)
            batches.set_position(position.epoch, position.step)
            network.train()
            for batch_inputs, batch_labels in data:
                batch_inputs = batch_inputs.to(device, non_blocking=True)
                batch_labels = batch_labels.to(device, non_blocking=True)
                with autocast:
                    batch_loss = F.cross_entropy(network(batch_inputs), batch_labels)
                optimizer.zero_grad(set_to_none=True)
                if scaler is None:
                    batch_loss.backward()
                    optimizer.step()
                else:
                    scaler.scale(batch_loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                running.add(batch_loss, batch_labels.shape[0])
                position.step += 1
                position.global_step += 1
                if progress is not None:
                    progress.update(position.step, running.count * launch.world_size, running.value)
                if (
                    config.checkpoint_every is not None
                    and position.global_step % config.checkpoint_every == 0
                    and position.step < steps
                ):
                    save_checkpoint(running, started)
            totals = torch.stack(
                [running.total(), torch.tensor(float(running.count), device=device).double()]
            )
            if launch.torchrun:
                dist.all_reduce(totals)
            loss = (totals[0] / totals[1]).item()
            seconds = time.perf_counter() - started
            samples = int(totals[1].item())
            position.epoch, position.step, mine = position.epoch + 1, 0, None
            if metrics is not None:
                metrics.write(
                    EpochMetrics(
                        epoch=position.epoch,
                        step=position.global_step,
                        loss=loss,
                        samples_per_s=round(samples / seconds, 1),
                        lr=optimizer.param_groups[0]["lr"],
                        seconds=round(seconds, 4),
                    )
                )
            save_checkpoint(running, started)
            if progress is not None:
                progress.end_epoch(samples, loss)
    finally:
        saver.wait()
        if metrics is not None:
            metrics.close()
    return loss


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name(f"{PACKAGE}.train"),
        description="Train the example dynamic model (DynamicNet) on synthetic data.",
        epilog=f"Several GPUs: torchrun --nproc_per_node N -m {PACKAGE}.train --device cuda ...",
    )
    parser.add_argument(
        "--device",
        metavar="{auto,cpu,cuda,cuda:N}",
        type=device_name,
        default="auto",
        help="auto (a GPU when CUDA is usable, else the CPU), cpu, cuda or cuda:N (default: auto)",
    )
    parser.add_argument(
        "--batch-size",
        metavar="N",
        type=positive_int,
        default=64,
        help="samples per step and process (default: 64)",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    config = Config(**vars(parser.parse_args(argv)))
    launch = Launch.from_environment()
    try:
        if config.tensorboard and (missing := tensorboard_missing()) is not None:
            raise UsageError(f"argument --tensorboard: {missing}")
        device = resolve_device(config.device, launch)
        check_precision(config.precision, device)
        config = prepare_run_dir(config, launch)
        resumed = load_resumable(config, launch, device, sys.stderr) if config.resume else None
    except UsageError as error:
        parser.error(str(error))
    if resumed is not None and resumed["epoch"] >= config.epochs:
        if launch.rank == 0:
            print(
                f"{config.checkpoint} has already trained {resumed['epoch']} epochs; nothing to do"
            )
        return 0
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launch.torchrun:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    try:
        loss = train(config, launch, device, resumed)
    except KeyboardInterrupt:
        if launch.rank == 0:
            print(f"interrupted; the last checkpoint is {config.checkpoint}", file=sys.stderr)
        return 130
    finally:
        if launch.torchrun:
            # DDP's reducer sits in reference cycles: collect it while the process group
            # and the interpreter are alive, or gloo's threads die at interpreter exit.
            gc.collect()
            dist.destroy_process_group()
    if launch.rank == 0:
        where = str(device)
        if launch.torchrun:
            where = f"{launch.world_size} processes on {device.type} ({backend})"
        print(f"trained {config.epochs} epochs on {where}: loss {loss:.4f}, run {config.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
