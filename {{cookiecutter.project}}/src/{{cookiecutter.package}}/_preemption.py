"""Stopping training on a signal: after the step under way, with a checkpoint of that step.

SIGINT (Ctrl-C), SIGTERM (``docker stop``, Kubernetes, SLURM's preemption and time
limit) and SIGUSR1 (SLURM's ``--signal=USR1@SECONDS``, sent ahead of the time limit)
do not kill ``train``: `stop_signals` only records the first one, and the training
loop asks `StopAgreement` after every optimizer step whether to stop. A signal that
arrives while the checkpoint is being written changes nothing, since the handler only
records. DataLoader workers leave these signals to the training process, which ends
them once it has stopped (`_lifetime.obey_only_parent_sigterm` says why).

Under ``torchrun`` the processes may receive a signal at different steps (torchrun
forwards SIGTERM and SIGINT to its workers one after the other; SLURM signals each
process itself; an operator may signal one). So after every step they agree: each
contributes the number of the signal it received, 0 for none, to an all-reduce (max)
over a gloo group of CPU tensors, which never waits for a GPU; the result is read one
step later, so the exchange overlaps that step, and all stop after the same step with
the same signal. Without ``torchrun`` nothing is exchanged.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "StopAgreement", "StopSignal", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """The first of `STOP_SIGNALS` this process received since `stop_signals` began."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None

    def record(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(number)


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignal]:
    """Record `STOP_SIGNALS` instead of dying of them, until the block ends (main thread only)."""
    stop = StopSignal()
    previous = {number: signal.signal(number, stop.record) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class StopAgreement:
    """After each step: the signal to stop on, the same in every process; None to go on.

    ``stop`` None (``train()`` called from Python, without `stop_signals`) never stops.
    With ``distributed`` every process must ask after the same steps, and `close` once
    it stops asking. The exchange of one step is only waited for at the next: it
    overlaps that step instead of stalling every step (blocking, it made a CPU step
    of the example model 1.3-1.5x slower; see ``benchmarks/stop_agreement.py``), so
    under torchrun training stops one step later than a lone process would, in every
    process at the same step.
    """

    def __init__(self, stop: StopSignal | None, *, distributed: bool) -> None:
        self.stop = stop
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[torch.Tensor, dist.Work] | None = None

    def _received(self) -> signal.Signals | None:
        return None if self.stop is None else self.stop.received

    def signal(self) -> signal.Signals | None:
        if self._group is None:
            return self._received()
        received = self._received()
        number = torch.tensor([0 if received is None else int(received)])
        work = dist.all_reduce(number, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        previous, self._pending = self._pending, (number, work)
        if previous is None:
            return None
        return self._wait(previous)

    @staticmethod
    def _wait(exchange: tuple[torch.Tensor, dist.Work]) -> signal.Signals | None:
        number, work = exchange
        work.wait()
        return signal.Signals(int(number)) if number.item() else None

    def close(self) -> None:
        """Wait for the exchange still under way (every process started it)."""
        if self._pending is not None:
            exchange, self._pending = self._pending, None
            self._wait(exchange)
