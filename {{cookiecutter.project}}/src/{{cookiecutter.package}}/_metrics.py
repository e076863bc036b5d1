"""Per-epoch training metrics: ``metrics.csv`` in the run folder, and TensorBoard events.

One CSV row per finished epoch (`FIELDS`), flushed as it is written, so a notebook
or ``tail -f`` can read a run while it trains. A resumed run appends to the same
file; rows of epochs that the checkpoint it resumes from does not hold (written
after that checkpoint by the run that was killed) are dropped first, so every epoch
appears once. TensorBoard gets the same numbers as scalars (``train/loss`` ...) at
the run's global step, with events of the lost steps purged the same way.
``metrics.csv`` is never written through a link (see `_files`), and a file there that
this command did not write is refused with the line at fault.

`RunningMean` is the epoch's mean loss while it trains, kept on the device.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ._command import CommandError
from ._files import FileError, open_to_append, read_text, remove_incomplete, write_atomically

__all__ = [
    "FIELDS",
    "METRICS",
    "EpochMetrics",
    "MetricsError",
    "MetricsLog",
    "RunningMean",
    "tensorboard_missing",
]

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


class MetricsError(CommandError):
    """A ``metrics.csv`` that this command did not write as it is: the line and the value."""

    def __init__(self, path: Path, line: int, problem: str) -> None:
        super().__init__(path, line, problem)
        self.path, self.line, self.problem = path, line, problem

    def __str__(self) -> str:
        return (
            f"{self.path} line {self.line}: {self.problem}; this command did not write it "
            "so: repair the line, or move the file away to start a new one"
        )


def tensorboard_missing() -> str | None:
    """Why TensorBoard events cannot be written here, or None when they can."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        return "the tensorboard package is not installed (pip install tensorboard)"
    return None


def _rows(path: Path, text: str) -> list[list[str]]:
    """The data rows of ``text``, the content of ``path``, checked: the header is `FIELDS`
    and each row starts with its epoch number."""
    reader = csv.reader(io.StringIO(text))
    rows: list[list[str]] = []
    try:
        header = next(reader)
        if tuple(header) != FIELDS:
            shown = ",".join(header)
            raise MetricsError(path, 1, f"the header is {shown!r}, not {','.join(FIELDS)!r}")
        for row in reader:
            if row and not row[0].isdecimal():
                raise MetricsError(path, reader.line_num, f"epoch {row[0]!r} is not a whole number")
            if row:
                rows.append(row)
    except csv.Error as error:
        raise MetricsError(path, reader.line_num, f"not CSV ({error})") from None
    return rows


class MetricsLog:
    """Appends `EpochMetrics` to ``run_dir/metrics.csv`` (and TensorBoard when asked)."""

    def __init__(self, run_dir: Path, *, epochs_done: int, step: int, tensorboard: bool) -> None:
        self.path = run_dir / METRICS
        remove_incomplete(self.path)  # a rewrite cut short by a kill; the file itself is whole
        text = read_text(self.path)
        if text and text.strip():
            rows = _rows(self.path, text)
            kept = [row for row in rows if int(row[0]) <= epochs_done]
            if len(kept) != len(rows):
                self._rewrite(kept)
        else:
            self._rewrite([])
        self._file = open_to_append(self.path)
        self._csv = csv.writer(self._file)
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir), purge_step=step + 1 if step else None)

    def _rewrite(self, rows: list[list[str]]) -> None:
        text = io.StringIO()
        writer = csv.writer(text)
        writer.writerow(FIELDS)
        writer.writerows(rows)
        # Not fsynced, like the rows appended later: the checkpoint is what must survive.
        write_atomically(self.path, text.getvalue(), durable=False)

    def write(self, metrics: EpochMetrics) -> None:
        try:
            self._csv.writerow(astuple(metrics))
            self._file.flush()
        except OSError as error:
            raise FileError.of(self.path, "append to", error) from None
        if self._writer is not None:
            for name in FIELDS[2:]:
                self._writer.add_scalar(f"train/{name}", getattr(metrics, name), metrics.step)
            self._writer.add_scalar("train/epoch", metrics.epoch, metrics.step)
            self._writer.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a row that could not be written was reported
            self._file.close()
        if self._writer is not None:
            self._writer.close()


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
