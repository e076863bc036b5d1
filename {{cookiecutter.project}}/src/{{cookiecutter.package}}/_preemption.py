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

A stop signal is safe at any moment of ``train``'s `main`, which records them from its
first line (`Phase` says what it does with one at each moment): during start-up it is
kept until the processes agree, once, before the first step (`StopAgreement.now`),
and training stops there; in training, after the step under way; once the run is
complete it stops nothing and is reported as such. What remains is the interpreter's
own start and the imports before `main` runs (about a second or two, for torch): there
SIGTERM and SIGUSR1 still kill with their default action and SIGINT raises
``KeyboardInterrupt``; nothing of the run exists yet. From the moment `main` returns,
in a process that ends with it (``python -m`` or the installed command), the signals
are ignored: the exit status is decided, and the interpreter's exit would otherwise
restore their default action before it ends.
"""

from __future__ import annotations

import contextlib
import enum
import signal
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "Phase", "StopAgreement", "StopSignal", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Phase(enum.Enum):
    """Where the command stands, for a stop signal that comes then."""

    STARTING = enum.auto()  # stops before the first step, once agreed
    TRAINING = enum.auto()  # stops after the step under way; the last step finishes the run
    FINISHED = enum.auto()  # nothing to stop: the run is complete


class StopSignal:
    """The first of `STOP_SIGNALS` this process received since `stop_signals` began, and
    the `Phase` the command was in then (the command moves ``phase`` on)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.phase = Phase.STARTING
        self.received_in: Phase | None = None

    def record(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.received_in = signal.Signals(number), self.phase

    def nothing_to_stop(self) -> str | None:
        """The line for a signal that came when the run was complete (or came during its
        last step, which it let finish); None when none came."""
        if self.received is None:
            return None
        last_step = self.received_in is Phase.TRAINING
        when = "during the run's last step" if last_step else "after the run had finished"
        return f"{self.received.name} {when}: nothing to stop"


@contextlib.contextmanager
def stop_signals(*, then_ignore: bool = False) -> Iterator[StopSignal]:
    """Record `STOP_SIGNALS` instead of dying of them, until the block ends (main thread
    only); then restore the handlers there were, or with ``then_ignore``, for a process
    that ends once the block does, ignore the signals from then on. (``signal.signal``
    runs the handler of a signal already received before it replaces it, so the last
    one is still recorded.)"""
    stop = StopSignal()
    previous = {number: signal.signal(number, stop.record) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_IGN if then_ignore else handler)


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

    def _exchange(self) -> tuple[torch.Tensor, dist.Work]:
        received = self._received()
        number = torch.tensor([0 if received is None else int(received)])
        work = dist.all_reduce(number, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return number, work

    def signal(self) -> signal.Signals | None:
        if self._group is None:
            return self._received()
        previous, self._pending = self._pending, self._exchange()
        if previous is None:
            return None
        return self._wait(previous)

    def now(self) -> signal.Signals | None:
        """The signal to stop on, agreed at once: before the first step, where there is no
        step for the exchange to overlap."""
        assert self._pending is None, "now() comes before the first step's signal()"
        if self._group is None:
            return self._received()
        return self._wait(self._exchange())

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
