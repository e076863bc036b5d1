"""Per-epoch training metrics: ``metrics.csv`` in the run folder, and TensorBoard events.

One CSV row per finished epoch (`FIELDS`), flushed as it is written, so a notebook
or ``tail -f`` can read a run while it trains. A resumed run appends to the same
file; rows of epochs that the checkpoint it resumes from does not hold (written
after that checkpoint by the run that was killed) are dropped first, so every epoch
appears once. TensorBoard gets the same numbers as scalars (``train/loss`` ...) at
the run's global step, with events of the lost steps purged the same way.
"""

from __future__ import annotations

import csv
import os
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "METRICS", "EpochMetrics", "MetricsLog", "tensorboard_missing"]

METRICS = "metrics.csv"


@dataclass(frozen=True)
class EpochMetrics:
    epoch: int  # 1 for the first epoch
    step: int  # optimizer steps since the run started, at the end of this epoch
    loss: float  # mean training loss over the epoch's samples
    samples_per_s: float
    lr: float
    seconds: float  # the epoch's wall-clock time (both parts of an epoch split by a resume)


FIELDS = tuple(field.name for field in fields(EpochMetrics))


def tensorboard_missing() -> str | None:
    """Why TensorBoard events cannot be written here, or None when they can."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        return "the tensorboard package is not installed (pip install tensorboard)"
    return None


def _kept_rows(path: Path, epochs: int) -> list[list[str]] | None:
    """The data rows of ``path`` for epochs 1..``epochs``, or None when all rows are kept."""
    with path.open(newline="") as file:
        rows = list(csv.reader(file))[1:]
    kept = [row for row in rows if row and int(row[0]) <= epochs]
    return None if len(kept) == len(rows) else kept


class MetricsLog:
    """Appends `EpochMetrics` to ``run_dir/metrics.csv`` (and TensorBoard when asked)."""

    def __init__(self, run_dir: Path, *, epochs_done: int, step: int, tensorboard: bool) -> None:
        self.path = run_dir / METRICS
        if self.path.exists() and self.path.stat().st_size:
            kept = _kept_rows(self.path, epochs_done)
            if kept is not None:
                self._rewrite(kept)
        else:
            self._rewrite([])
        self._file = self.path.open("a", newline="")
        self._csv = csv.writer(self._file)
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir), purge_step=step + 1 if step else None)

    def _rewrite(self, rows: list[list[str]]) -> None:
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        with temporary.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(FIELDS)
            writer.writerows(rows)
        os.replace(temporary, self.path)

    def write(self, metrics: EpochMetrics) -> None:
        self._csv.writerow(astuple(metrics))
        self._file.flush()
        if self._writer is not None:
            for name in FIELDS[2:]:
                self._writer.add_scalar(f"train/{name}", getattr(metrics, name), metrics.step)
            self._writer.add_scalar("train/epoch", metrics.epoch, metrics.step)
            self._writer.flush()

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()
