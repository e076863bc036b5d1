"""The processes of one launch, from the test's process: started, heard, ended.

:class:`RankProcesses` starts one process per rank and the single process
(:data:`.messages.REFERENCE`), sends them commands and reads their events through
pipes; a process that raised, died or stayed silent past the deadline ends the launch
(:class:`RanksEnded`, with the :class:`.results.RankFailed` that says where). Every
process is ended on every path, with everything it started (:mod:`.process_tree`).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import pickle
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import decisions
from ..control_flow import Location
from ..parameter_use import located
from ..processes import STACK_WAIT, stack_locations
from . import worker
from .messages import (
    REFERENCE,
    CollectiveCalled,
    Command,
    Event,
    Exit,
    Files,
    Idle,
    Job,
    Raised,
    role_name,
)
from .process_tree import end_process
from .results import DdpCheckFailure, RankFailed

__all__ = ["START_METHODS", "RankProcesses", "RanksEnded", "choose_start_method"]

START_METHODS = (None, "fork", "spawn")
# How long a rank gets to exit after the last command before it is killed.
EXIT_WAIT = 5.0
# A rank's stack is read down to its first frame of the worker: a forked rank's outer
# frames are the test's.
WORKER_FILE = os.path.abspath(worker.__file__)


def choose_start_method(requested: str | None, job: Job) -> str:
    """Fork where that is safe, spawn otherwise; a spawn needs everything to pickle."""
    method = requested
    why = f"start_method={requested!r}"
    if method is None:
        # CUDA does not survive a fork: a forked rank cannot use it once this process
        # has, and NCCL ranks use it, so they are spawned whatever this process did.
        forkable = "fork" in multiprocessing.get_all_start_methods()
        if job.backend == "nccl":
            method, why = "spawn", "NCCL ranks use CUDA, so they are spawned, not forked"
        elif not forkable or torch.cuda.is_initialized():
            method = "spawn"
            why = (
                "CUDA is initialized in this process, so the ranks cannot be forked and are spawned"
            )
        else:
            method = "fork"
    if method != "fork":
        try:
            pickle.dumps(job)
        except Exception as error:
            raise TypeError(
                f"ddp_check: {why}: the model, inputs, loss_fn and optimizer must then pickle, "
                f"and they do not ({type(error).__name__}: {error}). Define the model's class "
                "and any function at module level (a lambda or a class defined in a test does "
                "not pickle)"
            ) from error
    return method


class RanksEnded(Exception):
    """A launch ended early: a rank failed, died or hung, or the check saw enough."""

    def __init__(self, failure: DdpCheckFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class RankProcesses:
    """The rank processes (and the single process) of one launch, and their pipes;
    ``counted``: whether the ranks' decisions count for the test under ``--decisions``."""

    def __init__(self, job: Job, method: str, *, counted: bool = True) -> None:
        self.job = job
        self.context = multiprocessing.get_context(method)
        # A forked child has its own copy of everything. A spawned one gets the job as
        # plain pickled bytes: handed over as objects, torch would move its tensors to
        # memory shared by every process, and each rank's optimizer would step them all.
        self.payload: Job | bytes = job if method == "fork" else pickle.dumps(job)
        self.roles = [*range(job.world_size), REFERENCE]
        self.folder = Path(tempfile.mkdtemp(prefix="ddp_check-", dir=job.temp_root))
        # pytest --decisions: the ranks count their training steps' decisions for the test
        # (``counted``: a launch that trains the same steps again counts nothing).
        self.decisions = decisions.for_child(self.folder / "decisions") if counted else None
        self.processes: dict[int, Any] = {}
        self.connections: dict[int, Any] = {}  # each process's events, to read
        self.commands: dict[int, Any] = {}  # each process's commands, to write
        self.silent: set[int] = set()  # processes whose pipe is closed
        self.idle: set[int] = set()  # processes done with their commands so far
        self.last: dict[int, Event] = {}
        self.pids: list[int] = []
        self.failed = False
        self.closed = False
        self.started_tracker = False

    def start(self) -> float:
        """Start every process; the seconds until all have joined their process groups."""
        if self.context.get_start_method() == "fork":
            # DDP's constructor reads a torch._dynamo setting, and importing dynamo takes
            # seconds: imported here once, every forked process has it.
            importlib.import_module("torch._dynamo")
        else:
            self.started_tracker = not _resource_tracker_running()
        started = time.perf_counter()
        for role in self.roles:
            # What travels through the pipes is pickled here with plain pickle, tensors
            # by value: multiprocessing's own pickler would hand a tensor over as a file
            # descriptor that the receiver fetches from the sender later, which fails once
            # the sender is dead (a rank's last gradients before it was killed).
            events, events_end = self.context.Pipe(duplex=False)
            commands_end, commands = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=worker.child_main,
                args=(self.payload, role, str(self.folder), (events_end, commands_end)),
                kwargs={
                    "parent": os.getpid(),
                    "counted": None if role == REFERENCE else self.decisions,
                },
                name=f"ddp_check {role_name(role)}",
                daemon=True,
            )
            with warnings.catch_warnings():
                # Python 3.12 warns about fork() in a process with threads. The children
                # run torch and this module only, and torch resets its thread pools after
                # a fork (as for DataLoader workers).
                warnings.filterwarnings(
                    "ignore", r"This process .* is multi-threaded", DeprecationWarning
                )
                process.start()
            events_end.close()
            commands_end.close()
            self.processes[role], self.connections[role] = process, events
            self.commands[role] = commands
            self.pids.append(process.pid)
        deadline = time.monotonic() + self.job.timeout
        ready: set[int] = set()
        while len(ready) < len(self.roles):
            ready.add(self.next(deadline, "starting").rank)
        self.idle.update(self.roles)
        return time.perf_counter() - started

    def send(self, role: int, command: Command) -> None:
        self.idle.discard(role)
        with contextlib.suppress(OSError):
            self.commands[role].send_bytes(pickle.dumps(command))

    def to_ranks(self, command: Command) -> None:
        for role in self.roles:
            if role != REFERENCE:
                self.send(role, command)

    def next(self, deadline: float, doing: str) -> Event:
        """The next event from any process; a rank that raised, died or is silent past the
        deadline ends the launch (:class:`RanksEnded`)."""
        try:
            return self._next(deadline, doing)
        except RanksEnded:
            self.failed = True
            raise

    def _next(self, deadline: float, doing: str) -> Event:
        while True:
            for role, connection in self.connections.items():
                if role in self.silent or not connection.poll():
                    continue
                try:
                    event = pickle.loads(connection.recv_bytes())
                except (EOFError, OSError):  # its end of the pipe is closed: it died
                    self.silent.add(role)
                    continue
                if isinstance(event, Raised):
                    raise RanksEnded(self._raised(event))
                if isinstance(event, Idle):
                    self.idle.add(role)
                    continue
                self.last[role] = event
                return event
            for role, process in self.processes.items():
                if role in self.silent and process.is_alive():
                    process.join(EXIT_WAIT)  # the pipe closes a moment before the process ends
                if not process.is_alive() and not (
                    role not in self.silent and self.connections[role].poll()  # last words first
                ):
                    self.silent.add(role)
                    raise RanksEnded(self._died(role, process.exitcode, doing))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RanksEnded(self._hung(doing))
            waitables = [
                item
                for role in self.roles
                if role not in self.silent
                for item in (self.connections[role], self.processes[role].sentinel)
            ]
            multiprocessing.connection.wait(waitables, timeout=remaining)

    def drain(self, within: float) -> list[RankFailed]:
        """The errors the processes still raise within ``within`` seconds."""
        deadline = time.monotonic() + within
        raised: dict[int, RankFailed] = {}
        while True:
            open_ends = {
                connection: role
                for role, connection in self.connections.items()
                if role not in self.silent
            }
            remaining = deadline - time.monotonic()
            if not open_ends or remaining <= 0:
                break
            for connection in multiprocessing.connection.wait(list(open_ends), remaining):
                role = open_ends[connection]  # type: ignore[index]
                try:
                    event = pickle.loads(connection.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self.silent.add(role)
                    continue
                if isinstance(event, Raised):
                    raised[role] = self._raised(event)
        for role in self.silent - set(raised):
            with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
                raised[role] = self._raised(self._error_file(role))
        return list(raised.values())

    def _where(self, role: int) -> str:
        last = self.last.get(role)
        if last is None:
            return "before it reported anything"
        if isinstance(last, CollectiveCalled):
            return f"in step {last.step}'s {last.phase}, in {last.op} at {located(last.location)}"
        if last.step == 0:
            return "after its start-up"
        return f"after step {last.step}'s {last.phase}"

    def _error_file(self, role: int) -> Raised:
        """What ``role`` raised, from its file (``OSError`` when it wrote none)."""
        return pickle.loads(Files(self.folder, role).error.read_bytes())

    def _raised(self, event: Raised) -> RankFailed:
        location = event.location
        at = f" at {located(location)}" if location else ""
        error = f"{event.type_name}: {event.message}"
        return RankFailed(
            f"{role_name(event.rank)} raised in step {event.step} ({event.phase}){at}:\n"
            f"  {error}" + "".join(f"\n  {line}" for line in event.frames),
            event.rank,
            "raised",
            event.step,
            location,
            self.pids,
            error=error,
            phase=event.phase,
        )

    def _died(self, role: int, exitcode: int | None, doing: str) -> RankFailed:
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
            return self._raised(self._error_file(role))
        how = (
            f"killed by {signal.Signals(-exitcode).name}"
            if exitcode is not None and exitcode < 0
            else f"exited with code {exitcode}"
        )
        last = self.last.get(role)
        location = last.location if isinstance(last, CollectiveCalled) else None
        return RankFailed(
            f"{role_name(role)} died ({how}) during {doing}, {self._where(role)}; every other "
            "process of the check was ended",
            role,
            "died",
            last.step if last is not None else 0,
            location,
            self.pids,
        )

    def _hung(self, doing: str) -> RankFailed:
        silent = [role for role in self.roles if role not in self.silent | self.idle]
        stacks = self.stacks(silent)
        lines, location = [], None
        for role in silent:
            frames = stacks.get(role, [])
            if frames and location is None:
                location = frames[0]
            shown = [located(frames[0]), *map(str, frames[1:4])] if frames else []
            at = f"; its stack, innermost first: {', '.join(shown)}" if shown else ""
            lines.append(f"  {role_name(role)}: {self._where(role)}{at}")
        first = next((role for role in silent if stacks.get(role)), silent[0] if silent else 0)
        last = self.last.get(first)
        return RankFailed(
            f"the processes did not finish {doing} within timeout={self.job.timeout:g} s and "
            "were killed:\n" + "\n".join(lines),
            first,
            "timed out",
            last.step if last is not None else 0,
            location,
            self.pids,
        )

    def stacks(self, roles: Sequence[int]) -> dict[int, list[Location]]:
        """Each live process's user lines, innermost first (faulthandler, on SIGUSR1)."""
        for role in roles:
            process = self.processes[role]
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGUSR1)
        time.sleep(STACK_WAIT)
        return {
            role: stack_locations(Files(self.folder, role).stack, stop_at=WORKER_FILE)
            for role in roles
        }

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        # A check's own failure leaves the ranks idle; anything else (KeyboardInterrupt, an
        # error of the check) may have come in the middle of a step.
        self.close(at_once=kind is not None and not issubclass(kind, DdpCheckFailure))

    def close(self, *, at_once: bool = False) -> None:
        """End every process and all it started (asked to exit after a launch that went
        well, killed at once otherwise), reap it, and remove the launch's folder."""
        if self.closed:
            return
        self.closed = True
        try:
            if not (self.failed or at_once):
                for role in self.roles:
                    self.send(role, Exit())
                deadline = time.monotonic() + EXIT_WAIT
                for process in self.processes.values():
                    process.join(max(0.0, deadline - time.monotonic()))
        finally:  # a second KeyboardInterrupt in the wait above ends them too
            for process in self.processes.values():
                end_process(process)
            for connection in (*self.connections.values(), *self.commands.values()):
                connection.close()
            try:
                decisions.merge_children(self.decisions)  # every process has ended
            finally:
                shutil.rmtree(self.folder, ignore_errors=True)
                if self.started_tracker:
                    _stop_resource_tracker()


def _resource_tracker_running() -> bool:
    # multiprocessing starts its resource tracker process with the first spawned child
    # and keeps it until this process ends; the check ends the one it started. Python
    # has no public API for this: ``_resource_tracker``, ``_pid`` and ``_stop`` are
    # multiprocessing's own (3.8 and later).
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    return getattr(tracker, "_pid", None) is not None


def _stop_resource_tracker() -> None:
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


# --- every process a rank starts ends with it -----------------------------------------
#
# What this relies on (POSIX, and Linux where said):
# - a process made the leader of a new session by setsid(2) leads a process group of
#   its own, with its pid for id, and every process it starts joins that group unless
#   it leaves it (setsid, setpgid), as subprocess.Popen(start_new_session=True) does;
#   killpg(2) reaches every member, and a pid stays taken while a group of that id has a
#   member, so the group of a rank already reaped is still its own;
# - Linux: a process that dies leaves its children to the nearest living ancestor
#   marked PR_SET_CHILD_SUBREAPER (to init without one), so while a rank lives,
#   everything it started, in its group or not, is in its tree of parent pids in /proc;
#   a stopped process (SIGSTOP) starts nothing, and SIGKILL ends it stopped or not;
# - Linux: PR_SET_PDEATHSIG has the kernel signal a process when the thread that
#   started it ends: the test's main thread starts the ranks.
