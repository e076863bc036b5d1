"""A one-line training progress bar on stderr: epoch, steps, running loss, throughput.

On a terminal the line is redrawn in place a few times a second. Anywhere else (a
log file, CI, a pipe) only one line per finished epoch is written, so logs stay
readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    def __init__(
        self,
        epochs: int,
        steps_per_epoch: int,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        min_interval: float = 0.1,
    ) -> None:
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.min_interval = min_interval
        self._epoch = 0
        self._started = 0.0
        self._drawn = 0.0

    def start_epoch(self, epoch: int, elapsed: float = 0.0) -> None:
        """Start epoch ``epoch``, of which ``elapsed`` seconds (before a resume) are done."""
        self._epoch = epoch
        self._drawn = time.perf_counter()
        self._started = self._drawn - elapsed

    def update(self, step: int, samples: int, running_loss: Callable[[], float]) -> None:
        """Redraw after ``step`` steps and ``samples`` samples of this epoch, at most every
        ``min_interval`` seconds. ``running_loss`` is called only when the line is drawn:
        reading a loss off a GPU waits for the GPU, so it should not happen every step.
        """
        if not self.interactive:
            return
        now = time.perf_counter()
        if now - self._drawn < self.min_interval:
            return
        self._drawn = now
        self.stream.write("\r" + self._line(step, samples, running_loss(), now) + "\x1b[K")
        self.stream.flush()

    def end_epoch(self, samples: int, loss: float) -> None:
        line = self._line(self.steps_per_epoch, samples, loss, time.perf_counter())
        self.stream.write(f"\r{line}\x1b[K\n" if self.interactive else f"{line}\n")
        self.stream.flush()

    def _line(self, step: int, samples: int, loss: float, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        filled = BAR_WIDTH * step // max(self.steps_per_epoch, 1)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        width = len(str(self.epochs))
        steps = len(str(self.steps_per_epoch))
        return (
            f"epoch {self._epoch:>{width}}/{self.epochs} [{bar}] "
            f"{step:>{steps}}/{self.steps_per_epoch} loss {loss:.4f} "
            f"{samples / elapsed:,.0f} samples/s {elapsed:.1f}s"
        )
