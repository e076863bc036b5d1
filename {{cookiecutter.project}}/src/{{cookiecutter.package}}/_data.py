"""The training data: batches that can be resumed at any step, from DataLoader workers or not.

`EpochBatches` is the sampler: each epoch's order comes from ``seed`` and the epoch
number alone (`DistributedSampler`, which also shares it out between processes),
and it starts at a chosen step of that epoch. A checkpoint stores that position
(epoch, step); a resumed run skips the steps already trained without drawing any
random number, so the batches that follow are the same.

It yields `BatchKey` s (which samples, and where in the run they are), never data;
`SyntheticBatches` turns a key into tensors, in the main process or in a worker.
Randomness of a batch (here, the input noise) comes from a generator seeded by the
key, not from the worker's global generators: which worker loads a batch, and how
many batches that worker has loaded before (persistent workers keep their state
across epochs, a resumed run starts new ones), then changes nothing. The workers'
global generators are still seeded (`seed_worker`), for code that uses them, but
they are not in a checkpoint: randomness from them repeats from a run's start, not
across a resume. Workers leave the signals that stop training to the training
process, and end with it (`_lifetime`); `close` ends them on every way out of training.
"""

from __future__ import annotations

import math
import multiprocessing.connection
import random
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ._lifetime import obey_only_parent_sigterm, starting_workers

__all__ = [
    "BatchKey",
    "EpochBatches",
    "InProcessBatches",
    "SyntheticBatches",
    "WorkerBatches",
    "close",
    "dead_workers",
    "loader",
    "seed_worker",
    "start_worker",
]


@dataclass(frozen=True)
class BatchKey:
    """One batch: its samples' indices, and its place in the run (epoch, step, process)."""

    epoch: int
    step: int
    rank: int
    indices: torch.Tensor

    def seed(self, run_seed: int) -> int:
        """A seed for this batch's own generator: the same batch gets the same numbers."""
        return random.Random(f"{run_seed}/{self.epoch}/{self.rank}/{self.step}").getrandbits(63)


class EpochBatches(Sampler[BatchKey]):
    """This process's batches of epoch `epoch`, from step `start` on (see `set_position`)."""

    def __init__(
        self, samples: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self._order = DistributedSampler(
            range(samples),  # only its length is used
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=seed,
        )
        self.batch_size = batch_size
        self.rank = rank
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        """Make the next iteration yield epoch ``epoch``'s batches from step ``start`` on."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """Steps in a whole epoch."""
        return math.ceil(len(self._order) / self.batch_size)

    def __iter__(self) -> Iterator[BatchKey]:
        for step, indices in enumerate(self._batches_of(self.epoch)):
            if step >= self.start:
                yield BatchKey(self.epoch, step, self.rank, indices)

    def key(self, epoch: int, step: int) -> BatchKey:
        """The key of step ``step`` (from 0) of epoch ``epoch`` (from 0)."""
        return BatchKey(epoch, step, self.rank, self._batches_of(epoch)[step])

    def _batches_of(self, epoch: int) -> tuple[torch.Tensor, ...]:
        self._order.set_epoch(epoch)
        return torch.tensor(list(self._order)).split(self.batch_size)


class SyntheticBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Inputs (plus Gaussian noise of std ``noise``, drawn per batch) and labels of a key."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, *, noise: float, seed: int):
        self.inputs, self.labels = inputs, labels
        self.noise, self.seed = noise, seed

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, key: BatchKey) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.inputs[key.indices]
        if self.noise:
            generator = torch.Generator().manual_seed(key.seed(self.seed))
            inputs = inputs + self.noise * torch.randn(inputs.shape, generator=generator)
        return inputs, self.labels[key.indices]


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: seed Python's and NumPy's generators like torch's (as PyTorch's
    reproducibility notes recommend); torch's is already the loader's base seed + worker id."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def start_worker(worker_id: int) -> None:
    """``worker_init_fn``: `seed_worker`; the worker ends with the training process and
    leaves the stop signals to it (`_lifetime.obey_only_parent_sigterm`)."""
    obey_only_parent_sigterm()
    seed_worker(worker_id)


class InProcessBatches:
    """The batches of ``batches`` made in this process, each epoch as the sampler says.

    What a ``DataLoader`` with no workers does with a sampler of whole batches
    (``batch_size=None``): the same keys, the same tensors, pinned if asked. It
    leaves out the loader's per-batch bookkeeping (a profiler range, the fetcher,
    the pin-memory check): about 45 µs a batch on the CPU, 4% of a training step of
    the example model.
    """

    def __init__(self, dataset: SyntheticBatches, batches: EpochBatches, *, pin_memory: bool):
        self.dataset, self.batches, self.pin_memory = dataset, batches, pin_memory

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for key in self.batches:
            inputs, labels = self.dataset[key]
            yield (
                (inputs.pin_memory(), labels.pin_memory()) if self.pin_memory else (inputs, labels)
            )


class DeadWorkerSignal:
    """The training process's SIGCHLD handler: DataLoader's, only while a batch is fetched.

    DataLoader's handler (installed once a process, by its first iterator with workers)
    raises "DataLoader worker ... is killed by signal" wherever the main thread then is:
    inside ``Thread.start`` (whose thread then dies printing a KeyError), a checkpoint
    write, or the report of the failure that the death caused first (a second
    traceback). Here it runs where DataLoader's own code waits for a batch, which it
    interrupts at once; a SIGCHLD that comes elsewhere is run at the next fetch. Python
    runs handlers in the main thread only, between bytecodes.
    """

    def __init__(self) -> None:
        self._dataloaders: Callable[[int, Any], Any] | None = None
        self._fetching = False
        self._pending = False

    def install(self) -> None:
        """Wrap DataLoader's handler, once it is there (signals are the main thread's)."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGCHLD)
        if current is not self and callable(current):
            self._dataloaders = current
            signal.signal(signal.SIGCHLD, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self._fetching and self._dataloaders is not None:
            self._dataloaders(signum, frame)
        else:
            self._pending = True

    def batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """``iterator``'s batches, each fetched with the handler on."""
        while True:
            self._fetching = True
            try:
                if self._pending and self._dataloaders is not None:
                    self._pending = False
                    self._dataloaders(signal.SIGCHLD, None)  # raises if a worker died
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self._fetching = False
            yield batch


_dead_worker_signal = DeadWorkerSignal()  # SIGCHLD is the process's: one handler


class WorkerBatches(DataLoader):
    """A DataLoader whose workers start with SIGTERM blocked (`_lifetime.starting_workers`)
    and whose dead workers are reported through `_dead_worker_signal`."""

    def __iter__(self) -> Any:
        with starting_workers():
            iterator = super().__iter__()
        _dead_worker_signal.install()
        return _dead_worker_signal.batches(iterator)


def loader(
    dataset: SyntheticBatches, batches: EpochBatches, *, workers: int, seed: int, pin_memory: bool
) -> WorkerBatches | InProcessBatches:
    """The batches of ``batches``: from ``workers`` worker processes, or made in this one.

    With ``workers`` > 0, a ``DataLoader`` whose sampler yields whole batches (so no
    collation per sample) and whose workers persist from epoch to epoch; their seeds
    come from a generator seeded by ``seed``, never from the global one (which the
    DataLoader would otherwise draw from at every epoch). With no workers the same
    batches come from `InProcessBatches`.
    """
    if workers == 0:
        return InProcessBatches(dataset, batches, pin_memory=pin_memory)
    return WorkerBatches(
        dataset,
        sampler=batches,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=True,
        worker_init_fn=start_worker,
        generator=torch.Generator().manual_seed(seed),
    )


@dataclass(frozen=True)
class DeadWorker:
    """A worker process that ended before its loader did, and how."""

    index: int
    pid: int
    exitcode: int  # negative: killed by that signal

    def __str__(self) -> str:
        if self.exitcode < 0:
            how = f"was killed by {signal.Signals(-self.exitcode).name}"
            if self.exitcode == -signal.SIGKILL:
                how += " (the OOM killer's signal: dmesg says if it was memory)"
        else:
            how = f"exited with status {self.exitcode}"
        return f"DataLoader worker {self.index} (pid {self.pid}) {how}"


# A killed worker's sockets close while the kernel tears it down, a moment before its
# exit status can be read: training may fail first on the closed connection (a
# ConnectionResetError or EOFError while it receives a batch). Milliseconds, more on a
# loaded machine. DataLoader's own errors about a worker come after its status is there.
WORKER_EXIT_GRACE_S = 1.0
CLOSED_CONNECTION = (OSError, EOFError)


def dead_workers(
    batches: WorkerBatches | InProcessBatches, error: BaseException
) -> list[DeadWorker]:
    """The workers of ``batches`` that have ended while it still runs (read before `close`,
    which ends the others). DataLoader's own ``error`` says "exited unexpectedly" or "is
    killed by signal", or training met the closed connection, depending on when it
    noticed: after a closed connection, a worker that is ending is waited for,
    `WORKER_EXIT_GRACE_S` at most."""
    workers = getattr(getattr(batches, "_iterator", None), "_workers", [])
    sentinels = [process.sentinel for process in workers]
    waits = bool(workers) and isinstance(error, CLOSED_CONNECTION)
    ending = multiprocessing.connection.wait(sentinels, WORKER_EXIT_GRACE_S) if waits else []
    found = []
    for index, process in enumerate(workers):
        if process.sentinel in ending:
            process.join()  # it is ending: its status comes in moments
        if process.exitcode not in (None, 0):
            found.append(DeadWorker(index, process.pid, process.exitcode))
    return found


def close(batches: WorkerBatches | InProcessBatches) -> None:
    """End ``batches``' worker processes now, whatever state training stopped in.

    A loader with persistent workers keeps its iterator, and a traceback that holds the
    loop's frame keeps it alive, so its workers would otherwise run until the
    interpreter's exit handlers end them. DataLoader has no public way to end them:
    this is what it does itself when its iterator is collected (the workers are told
    to finish, joined, and sent SIGTERM if they do not within 5 s).
    """
    iterator = getattr(batches, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
