"""Replay the step that ``train --detect-nonfinite`` stopped before, under ``finite_check``.

    <project>-replay runs/a/nonfinite-step-41            # the rank whose origin was found
    <project>-replay runs/a/nonfinite-step-41 --rank 1 --device cpu

The bundle (`_finite_steps`) holds the state before the step (``checkpoint.pt``, read
and verified as ``--resume`` reads a checkpoint) and ``step.json`` (the step, each
process's samples, losses and origins). The replay puts the weights and that
process's random number generators back, makes the batch again from the run's
settings (the same samples, the same noise: `_data.SyntheticBatches`), and runs
the step's loss forward and backward under `testing.finite_check.finite_check`, which
names the op, the line and the values where the first NaN or inf was born. Exit
status 1 when the step is not finite again (the check's report on stderr), 0 when it
is (then it did not reproduce: a random op, a value from outside torch, or a gradient
average over several processes), 2 for a bad command line or a damaged bundle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _checkpoint
from ._checkpoint import TrainingState
from ._command import CommandError, command_name, reports_errors
from ._data import BatchKey, SyntheticBatches
from ._files import read_text
from ._finite_steps import BUNDLE_FORMAT, CHECKPOINT, RECORD
from .testing.finite_check import FiniteCheckFailure, finite_check
from .train import (
    AUTOCAST_DTYPES,
    PRECISIONS,
    Launch,
    UsageError,
    add_device_argument,
    build_model,
    directory_path,
    non_negative_int,
    resolve_device,
    step_loss,
    synthetic_data,
)

__all__ = ["BundleError", "TrainingStep", "main"]

PACKAGE = __package__


class BundleError(CommandError):
    """A bundle folder that is incomplete, damaged or not one bundle; names the file and field."""

    status = 2


class TrainingStep(nn.Module):
    """A training step's loss as a module of the batch, as ``train`` computes it."""

    def __init__(
        self, model: nn.Module, precision: str, device: torch.device, micro_batch: int
    ) -> None:
        super().__init__()
        self.model, self.precision, self.device_type = model, precision, device.type
        self.micro_batch = micro_batch  # the run's --batch-size: its --accumulate's parts

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        autocast: Any = torch.autocast(
            self.device_type,
            dtype=AUTOCAST_DTYPES.get(self.precision, torch.float32),
            enabled=self.precision != "32",
        )
        return step_loss(self.model, inputs, labels, autocast, self.micro_batch)


def _field(record: Any, name: str, kind: type, where: str, path: Path) -> Any:
    value = record.get(name) if isinstance(record, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        shown = "missing" if value is None else repr(value)[:60]
        raise BundleError(
            f"{path}: {where}{name} is {shown}, expected {kind.__name__}: not a bundle "
            "written by train --detect-nonfinite"
        )
    return value


def read_record(path: Path) -> dict[str, Any]:
    """``step.json``, every field the replay uses checked."""
    text = read_text(path)
    if text is None:
        raise BundleError(
            f"{path} is missing: not a bundle, or one whose writing was cut short (its "
            f"{RECORD} is written last)"
        )
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise BundleError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None
    if _field(record, "format", int, "", path) != BUNDLE_FORMAT:
        raise BundleError(
            f"{path}: format is {record['format']}, and this replay reads {BUNDLE_FORMAT}"
        )
    for name in ("epoch", "step", "global_step"):
        if _field(record, name, int, "", path) < 0:
            raise BundleError(f"{path}: {name} is {record[name]}, expected an integer >= 0")
    if _field(record, "precision", str, "", path) not in PRECISIONS:
        raise BundleError(
            f"{path}: precision is {record['precision']!r}, expected one of {', '.join(PRECISIONS)}"
        )
    for number, rank in enumerate(_field(record, "ranks", list, "", path)):
        where = f"ranks[{number}]."
        _field(rank, "rank", int, where, path)
        indices = _field(rank, "indices", list, where, path)
        if not indices or not all(type(i) is int and i >= 0 for i in indices):
            raise BundleError(f"{path}: {where}indices must be a list of sample indices >= 0")
        if rank.get("origin") is not None:
            _field(rank, "origin", list, where, path)
    if not record["ranks"]:
        raise BundleError(f"{path}: ranks is empty: no process's batch to replay")
    return record


def chosen_rank(record: dict[str, Any], asked: int | None, path: Path) -> dict[str, Any]:
    """The rank asked for, else the first whose origin was found, else the first."""
    by_rank = {rank["rank"]: rank for rank in record["ranks"]}
    if asked is not None:
        if asked not in by_rank:
            raise UsageError(
                f"argument --rank: {asked} is not in {path} (ranks {', '.join(map(str, by_rank))})"
            )
        return by_rank[asked]
    found = [rank for rank in record["ranks"] if rank.get("origin")]
    return (found or record["ranks"])[0]


def load_state(path: Path, record: dict[str, Any]) -> TrainingState:
    state = _checkpoint.load(path)
    with torch.device("meta"):
        _checkpoint.check_fits(state, build_model(), path)
    at = (state.position.epoch, state.position.step, state.position.global_step)
    recorded = (record["epoch"], record["step"], record["global_step"])
    if at != recorded:
        raise BundleError(
            f"{path} stands at epoch, step, step of the run {at}, and {RECORD} at {recorded}: "
            "the two files are not of one bundle"
        )
    return state


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name(f"{PACKAGE}.replay"),
        description="Replay a step that train --detect-nonfinite stopped before, under "
        "finite_check.",
    )
    parser.add_argument(
        "bundle", metavar="BUNDLE", type=directory_path, help="the nonfinite-step-N folder"
    )
    parser.add_argument(
        "--rank",
        metavar="N",
        type=non_negative_int,
        help="the process whose batch to replay (default: the first whose origin was found)",
    )
    add_device_argument(parser)
    return parser


@reports_errors(f"{PACKAGE}.replay")
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    folder: Path = args.bundle
    if not folder.is_dir():
        parser.error(f"argument BUNDLE: {folder} is not a folder")
    record = read_record(folder / RECORD)
    try:
        rank = chosen_rank(record, args.rank, folder / RECORD)
        device = resolve_device(args.device, Launch())
    except UsageError as error:
        parser.error(str(error))
    state = load_state(folder / CHECKPOINT, record)
    if rank["rank"] >= len(state.processes):
        raise BundleError(
            f"{folder / CHECKPOINT} holds {len(state.processes)} process(es), and "
            f"{RECORD} names rank {rank['rank']}"
        )
    run = state.run
    if max(rank["indices"]) >= run.samples:
        raise BundleError(
            f"{folder / RECORD}: rank {rank['rank']}'s samples go up to {max(rank['indices'])}, "
            f"and the run's data set has {run.samples}"
        )
    model = build_model().to(device)
    model.load_state_dict(state.model)
    model.train()
    key = BatchKey(record["epoch"], record["step"], rank["rank"], torch.tensor(rank["indices"]))
    data = SyntheticBatches(*synthetic_data(run.samples, run.seed), noise=run.noise, seed=run.seed)
    inputs, labels = (tensor.to(device) for tensor in data[key])
    _checkpoint.set_rng_state(state.processes[rank["rank"]].rng, device)
    where = (
        f"step {record['global_step'] + 1} of the run (epoch {record['epoch'] + 1}), "
        f"rank {rank['rank']}'s {len(rank['indices'])} samples, on {device}"
    )
    try:
        result = finite_check(
            TrainingStep(model, record["precision"], device, run.batch_size), inputs, labels
        )
    except FiniteCheckFailure as failure:
        print(f"{type(failure).__name__}: {failure}", file=sys.stderr)
        print(f"reproduced: {where} is not finite", file=sys.stderr)
        return 1
    print(result)
    print(
        f"not reproduced: {where} is finite on this replay (the stop saw loss "
        f"{rank.get('loss')}): a random op, a value from outside torch, or only the gradient "
        "average over several processes was not finite"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
