"""The base class of every check's failures, and the model's own exceptions in one line.

Each check has one failure class of its own, derived from :class:`CheckFailure`,
that names the check (``check``); everything it raises derives from that class, so
a code path the checks share (the floor) raises the failure of the check that
runs it, never another check's. When a check finds several problems,
:func:`most_fundamental` gives the one to raise, the others listed in its message.
:func:`raised` words an exception the model raised
where a check probed it (a finite-difference input, a moved point), for the report
that says what the check did instead.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

from .control_flow import display_path

__all__ = ["CheckFailure", "most_fundamental", "quoted", "raised"]


class CheckFailure(AssertionError):
    """A check found the model wrong; the message says what and where.

    An ``AssertionError``, so pytest reports it as a failed assertion.
    """

    check: str = "check"  # the check's name as users call it, e.g. "compile_check"


def quoted(error: BaseException) -> str:
    """``Type: first line of the message``: how a failure quotes the error torch raised."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def raised(error: BaseException) -> str:
    """``AssertionError: underflow in dt (raised at solvers.py:40)``: :func:`quoted`, and
    the line that raised it (the model's own exception, where a check probed it)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (raised at {display_path(frames[-1].filename)}:{frames[-1].lineno})"
    return quoted(error) + (where if frames else "")


def most_fundamental(found: Sequence[CheckFailure]) -> CheckFailure | None:
    """The first of ``found`` (the caller lists the most fundamental first: what makes
    the others follow, or hides them), its message ending in ``also:`` and each other
    failure, by type; ``None`` when nothing was found.

    One failure is raised so that ``pytest.raises(ParametersNotInOptimizer)`` and the
    report's first line name the problem to fix first; the others are in its message,
    where pytest prints them, so one run shows them all.
    """
    if not found:
        return None
    first, *others = found
    if others:
        listed = [f"  {type(other).__name__}: {other}".replace("\n", "\n    ") for other in others]
        first.args = ("\n".join([str(first), "also:", *listed]), *first.args[1:])
    return first
