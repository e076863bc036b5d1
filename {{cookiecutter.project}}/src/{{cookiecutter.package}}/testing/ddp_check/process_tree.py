"""Every process a rank starts ends with it.

What this relies on (POSIX, and Linux where said):

- a process made the leader of a new session by setsid(2) leads a process group of
  its own, with its pid for id, and every process it starts joins that group unless
  it leaves it (setsid, setpgid), as subprocess.Popen(start_new_session=True) does;
  killpg(2) reaches every member, and a pid stays taken while a group of that id has a
  member, so the group of a rank already reaped is still its own;
- Linux: a process that dies leaves its children to the nearest living ancestor
  marked PR_SET_CHILD_SUBREAPER (to init without one), so while a rank lives,
  everything it started, in its group or not, is in its tree of parent pids in /proc;
  a stopped process (SIGSTOP) starts nothing, and SIGKILL ends it stopped or not;
- Linux: PR_SET_PDEATHSIG has the kernel signal a process when the thread that
  started it ends: the test's main thread starts the ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

# How long ending the processes a rank started may take: SIGKILL ends a process within
# milliseconds; this only bounds descendants that keep starting new ones.
END_WAIT = 5.0
# Pause between two looks at /proc while processes just killed finish dying.
END_POLL = 0.01
# prctl(2) options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def lead_own_group(parent: int) -> None:
    """In a process of the check, first thing: lead a session and process group of its
    own, on Linux adopt its orphaned descendants and be killed when the test's process
    dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:  # it died before that
        os._exit(1)


def _living() -> dict[int, tuple[int, int]]:
    """Each live process's parent pid and process group, from /proc (empty without it)."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            # pid (comm) state ppid pgrp ...: the name may hold spaces and parentheses
            state, ppid, group = stat.rpartition(")")[2].split()[:3]
            if state not in ("Z", "X"):  # a zombie has ended, only its exit status is left
                found[int(entry.name)] = (int(ppid), int(group))
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, (ppid, _) in _living().items():
        children.setdefault(ppid, []).append(child)
    found, unvisited = [], [pid]
    while unvisited:
        below = children.get(unvisited.pop(), [])
        found += below
        unvisited += below
    return found


def end_descendants(pid: int) -> None:
    """Kill every live descendant of ``pid`` until none is left (Linux; elsewhere its
    process group does it)."""
    deadline = time.monotonic() + END_WAIT
    while (found := _descendants(pid)) and time.monotonic() < deadline:
        for descendant in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(descendant, signal.SIGKILL)
        time.sleep(END_POLL)


def end_process(process: Any) -> None:
    """End a process of the check that leads its own group (:func:`lead_own_group`) and
    everything it started, and reap it: stopped, so that it starts nothing more, its
    descendants killed, then itself, then what is left of its group, waited for."""
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGSTOP)
        end_descendants(process.pid)
        process.kill()
    process.join()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + END_WAIT
    while time.monotonic() < deadline and any(
        group == process.pid for _, group in _living().values()
    ):
        time.sleep(END_POLL)
