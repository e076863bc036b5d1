"""Train the example dynamic model (`DynamicNet`) on synthetic data.

    <project>-train --device cuda --batch-size 64 --epochs 10
    <project>-train --checkpoint-dir runs/a            # then, after a crash or kill:
    <project>-train --checkpoint-dir runs/a --resume
    torchrun --nproc_per_node 2 -m <package>.train --device cuda

The data set is generated from ``--seed`` (nothing is downloaded). Each epoch's
data order depends only on ``--seed`` and the epoch number, and a checkpoint holds
the model, the optimizer and every random number generator, so ``--resume``
continues exactly where the last checkpoint stopped: the final weights are bitwise
equal to those of an uninterrupted run with the same settings.

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
import gc
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from . import _checkpoint
from ._command import command_name
from ._progress import Progress
from .gpus import cuda_unavailable_reason
from .models import DynamicNet

__all__ = ["Config", "Launch", "UsageError", "build_parser", "main", "synthetic_data", "train"]

PACKAGE = __package__
IN_FEATURES = 16
CLASSES = 4
# Settings that make the data set: a checkpoint trained on other data is another run.
DATA_SETTINGS = ("seed", "samples")
# Settings a run can be resumed with when they change, though not bit for bit.
SCHEDULE_SETTINGS = ("batch_size", "lr", "world_size")


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
    checkpoint_dir: Path | None = None
    resume: bool = False

    @property
    def checkpoint(self) -> Path | None:
        return None if self.checkpoint_dir is None else self.checkpoint_dir / _checkpoint.LATEST


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


def prepare_checkpoint_dir(config: Config) -> None:
    """Check ``--checkpoint-dir``/``--resume`` before any work, creating the directory."""
    directory, checkpoint = config.checkpoint_dir, config.checkpoint
    if directory is None or checkpoint is None:
        if config.resume:
            raise UsageError(
                "argument --resume: needs --checkpoint-dir DIR, the directory of the run"
            )
        return
    if config.resume:
        if not directory.is_dir():
            raise UsageError(
                f"argument --checkpoint-dir: {directory} does not exist (nothing to resume)"
            )
        if not checkpoint.exists():
            raise UsageError(
                f"argument --resume: no checkpoint in {directory} ({checkpoint.name} is missing)"
            )
        return
    if checkpoint.exists():
        raise UsageError(
            f"argument --checkpoint-dir: {directory} already holds a run ({checkpoint.name}): "
            "pass --resume to continue it, or choose another directory"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"argument --checkpoint-dir: cannot create {directory}: {error.strerror}"
        ) from None


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
                "set; use the same value, or a new --checkpoint-dir"
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
        "world_size": launch.world_size,
    }


class RunningMean:
    """A mean of per-batch losses kept on the device, read (and synchronized) only on demand."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def add(self, batch_mean: torch.Tensor, batch_size: int) -> None:
        self.total += batch_mean.detach() * batch_size
        self.count += batch_size

    def value(self) -> float:
        return self.total.item() / max(self.count, 1)


def gathered_rng_states(launch: Launch, device: torch.device) -> list[dict[str, Any]]:
    """Every process's random number generator states, indexed by rank."""
    state = _checkpoint.rng_state(device)
    if not launch.torchrun:
        return [state]
    states: list[Any] = [None] * launch.world_size
    dist.all_gather_object(states, state)
    return states


def train(
    config: Config,
    launch: Launch,
    device: torch.device,
    resumed: dict[str, Any] | None = None,
    log: TextIO | None = None,
) -> float | None:
    """Train for the epochs ``resumed`` has not done yet; the last epoch's mean loss."""
    log = sys.stderr if log is None else log
    torch.manual_seed(config.seed)
    model = DynamicNet(in_features=IN_FEATURES, out_features=CLASSES).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    first_epoch, loss = 0, None
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        for group in optimizer.param_groups:  # the saved state carries the old --lr
            group["lr"] = config.lr
        first_epoch, loss = resumed["epoch"], resumed["loss"]
        if len(resumed["rng"]) == launch.world_size:
            _checkpoint.set_rng_state(resumed["rng"][launch.rank], device)
    if config.checkpoint is not None and launch.rank == 0:
        for leftover in _checkpoint.remove_incomplete(config.checkpoint):
            print(f"removed {leftover}, an incomplete checkpoint of a killed run", file=log)

    inputs, labels = (tensor.to(device) for tensor in synthetic_data(config.samples, config.seed))
    sampler = DistributedSampler(
        range(config.samples),  # only its length is used
        num_replicas=launch.world_size,
        rank=launch.rank,
        shuffle=True,
        seed=config.seed,
    )
    steps = math.ceil(len(sampler) / config.batch_size)
    network: torch.nn.Module = model
    if launch.torchrun:
        network = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=True,
        )
    progress = Progress(config.epochs, steps, stream=log) if launch.rank == 0 else None

    for epoch in range(first_epoch, config.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device)
        running = RunningMean(device)
        if progress is not None:
            progress.start_epoch(epoch + 1)
        network.train()
        for step, batch in enumerate(order.split(config.batch_size), start=1):
            batch_loss = F.cross_entropy(network(inputs[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            batch_loss.backward()
            optimizer.step()
            running.add(batch_loss, len(batch))
            if progress is not None:
                progress.update(step, running.count * launch.world_size, running.value)
        totals = torch.stack(
            [running.total, torch.tensor(float(running.count), device=device, dtype=torch.float64)]
        )
        if launch.torchrun:
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        if config.checkpoint is not None:
            rng = gathered_rng_states(launch, device)
            if launch.rank == 0:
                _checkpoint.save_atomic(
                    {
                        "format": _checkpoint.FORMAT,
                        "epoch": epoch + 1,
                        "loss": loss,
                        "run": run_settings(config, launch),
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "rng": rng,
                    },
                    config.checkpoint,
                )
        if progress is not None:
            progress.end_epoch(running.count * launch.world_size, loss)
    return loss


def _positive(kind: type[int] | type[float], text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        noun = "integer" if kind is int else "number"
        raise argparse.ArgumentTypeError(f"must be a positive {noun}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _positive(int, text)


def positive_float(text: str) -> float:
    return _positive(float, text)


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
        "--checkpoint-dir",
        metavar="DIR",
        type=directory_path,
        help=f"write {_checkpoint.LATEST} there after every epoch (atomically)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --checkpoint-dir where it stopped",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    config = Config(**vars(parser.parse_args(argv)))
    launch = Launch.from_environment()
    try:
        prepare_checkpoint_dir(config)
        device = resolve_device(config.device, launch)
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
            saved = f"; the last checkpoint is {config.checkpoint}" if config.checkpoint else ""
            print(f"interrupted{saved}", file=sys.stderr)
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
        saved = f", checkpoint {config.checkpoint}" if config.checkpoint else ""
        print(f"trained {config.epochs} epochs on {where}: loss {loss:.4f}{saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
