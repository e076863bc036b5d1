"""A check's child process, run to a deadline: killed with its process group when the
deadline passes, and read for the user's lines it was running then.

:func:`run_to_deadline` starts the child in a session of its own (so its own children
die with it), sends its stdout and stderr to a file, and when the deadline passes asks
it for its stack (``SIGUSR1``, which the child hands to :mod:`faulthandler` with
:func:`dump_stack_on_request`) before it kills the group. :func:`stack_locations`
reads the user's lines out of that dump, innermost first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .control_flow import TORCH_DIR, Location

__all__ = ["STACK_WAIT", "Outcome", "dump_stack_on_request", "run_to_deadline", "stack_locations"]

# How long a child that passed its deadline gets to write its stack: faulthandler
# writes it from the signal handler, within milliseconds even when Python is stuck in C.
STACK_WAIT = 1.0
# POSIX only: elsewhere a child is killed alone and gives no stack.
_POSIX = os.name == "posix"
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STANDARD_LIBRARY = os.path.dirname(os.__file__) + os.sep


@dataclass(frozen=True)
class Outcome:
    """How the child ended: its exit status, or ``None`` when the deadline killed it
    (then ``stack`` holds the user's lines it was running, innermost first)."""

    pid: int
    returncode: int | None
    stack: tuple[Location, ...] = ()


def run_to_deadline(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    output: Path,
    stack: Path,
    deadline: float,
) -> Outcome:
    """Run ``command`` for at most ``deadline`` seconds, its output to ``output``.

    The child's whole process group is killed when it passes the deadline, and when the
    caller is interrupted (Ctrl+C) while it waits; ``stack`` is where the child's
    :func:`dump_stack_on_request` writes.
    """
    with output.open("wb") as sink:
        child = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=_POSIX,
        )
    try:
        return Outcome(child.pid, child.wait(timeout=deadline))
    except subprocess.TimeoutExpired:
        if _POSIX:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STACK_WAIT)  # it exits only if it had no handler yet
        return Outcome(child.pid, None, tuple(stack_locations(stack)))
    finally:
        _kill_group(child)


def _kill_group(child: subprocess.Popen) -> None:
    if _POSIX:
        # The child leads its own session: its group id is its pid. The group outlives a
        # leader that exited while a grandchild it started still runs.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    elif child.poll() is None:
        child.kill()
    child.wait()


def dump_stack_on_request(file: IO[str]) -> None:
    """In the child: write every thread's stack to ``file`` on ``SIGUSR1``."""
    if _POSIX:
        faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)


def stack_locations(dump: Path, *, stop_at: str | None = None) -> list[Location]:
    """The user's lines in a faulthandler dump, innermost first, of the first thread that
    was in user code, down to the first frame of the plugin (what called the model).

    A frame of the file ``stop_at`` ends them even before a user line: the file where the
    process's own life starts (a forked process's outer frames are its parent's).
    """
    try:
        text = dump.read_text(errors="replace")
    except OSError:
        return []
    locations: list[Location] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("Thread ", "Current thread ")):
            if locations:
                break
            continue
        if not line.startswith('File "'):
            continue
        path, _, rest = line[len('File "') :].partition('", line ')
        number = rest.split(" ", 1)[0]
        path_here = os.path.abspath(path)
        if path_here.startswith(_HERE):
            if locations or path_here == stop_at:
                break
            continue
        if number.isdigit() and not path.startswith((TORCH_DIR, _STANDARD_LIBRARY)):
            locations.append(Location(path, int(number)))
    return locations
