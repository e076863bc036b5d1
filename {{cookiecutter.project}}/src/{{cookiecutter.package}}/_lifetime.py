"""Processes that never outlive the run: a DataLoader worker and a ``torchrun`` training
process end when the process that started them ends, however it ends.

The facts relied on (Linux; elsewhere these functions do nothing):

- ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill this process when the
  thread that started it exits, even by SIGKILL, which no cleanup code survives. It
  is not inherited across ``fork`` and applies to the parent at the time of the
  call: a parent that died just before is found by comparing ``getppid()``.
- ``torchrun`` starts its training processes from its main thread and DataLoader
  starts its workers from the training process's main thread, so "the thread that
  started it" is the process's whole life.
- A forked child starts with the signal mask of the thread that forked it, and
  DataLoader's worker loop installs its own SIGTERM handler (it exits quietly on its
  parent's SIGTERM and dies of anyone else's) before ``worker_init_fn`` runs; so the
  workers are started with SIGTERM blocked (`starting_workers`), and it stays blocked
  until `obey_only_parent_sigterm` takes it over.
- A signal blocked in every thread of a process stays pending until one thread takes
  it with ``sigwaitinfo``, which also tells who sent it (``si_pid``). Threads inherit
  the mask of the thread that starts them, so blocking it in the main thread before
  any other thread exists blocks it everywhere.

Why a worker tells its parent's SIGTERM from others: a terminal's Ctrl-C reaches the
whole foreground process group, ``pkill`` and SLURM signal every process of a job
step, and a worker that died of those would fail the training process's DataLoader
(``DataLoader worker ... is killed by signal``) before it could write the checkpoint
of the stop; the training process stops itself and then ends its workers. But its
own SIGTERM (DataLoader's shutdown after a join timeout, multiprocessing's exit
handler, which sends SIGTERM to every worker still running and then waits for each)
must end a worker, or the training process waits for it forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["end_with_parent", "obey_only_parent_sigterm", "starting_workers"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Signals a worker leaves to the training process: it stops, then ends its workers.
_LEFT_TO_PARENT = (signal.SIGINT, signal.SIGUSR1)


def end_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (its parent now) exits; if
    ``parent`` is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc: no search
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it exited before the call took effect
        os._exit(128 + signal.SIGKILL)


def _obey(parent: int) -> None:
    """Take every SIGTERM sent to this process; the parent's ends it, the others are ignored."""
    while True:
        received = signal.sigwaitinfo({signal.SIGTERM})
        if received.si_pid == parent:
            # SIGTERM's default action, as if it had never been blocked: the process ends,
            # and its parent sees it killed by SIGTERM.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)


@contextlib.contextmanager
def starting_workers() -> Iterator[None]:
    """Block SIGTERM in this thread while it starts worker processes, which inherit the
    block; one that arrives meanwhile is taken once the block ends."""
    if not sys.platform.startswith("linux"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def obey_only_parent_sigterm() -> None:
    """For a DataLoader worker, from its ``worker_init_fn`` (its main thread, before any
    other thread starts): it ends with the training process (`end_with_parent`), by
    the training process's SIGTERM, and ignores SIGINT, SIGUSR1 and others' SIGTERM."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        raise RuntimeError("obey_only_parent_sigterm is for a process multiprocessing started")
    for number in _LEFT_TO_PARENT:
        signal.signal(number, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # started so (`starting_workers`)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # DataLoader's handler would take it
    end_with_parent(parent.pid)
    threading.Thread(target=_obey, args=(parent.pid,), name="sigterm", daemon=True).start()
