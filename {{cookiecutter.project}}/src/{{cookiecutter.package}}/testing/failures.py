"""The base class of every check's failures, and the model's own exceptions in one line.

Each check has one failure class of its own, derived from :class:`CheckFailure`,
that names the check (``check``); everything it raises derives from that class, so
a code path the checks share (the floor) raises the failure of the check that
runs it, never another check's. :func:`raised` words an exception the model raised
where a check probed it (a finite-difference input, a moved point), for the report
that says what the check did instead.
"""

from __future__ import annotations

import traceback

from .control_flow import display_path

__all__ = ["CheckFailure", "raised"]


class CheckFailure(AssertionError):
    """A check found the model wrong; the message says what and where.

    An ``AssertionError``, so pytest reports it as a failed assertion.
    """

    check: str = "check"  # the check's name as users call it, e.g. "compile_check"


def raised(error: BaseException) -> str:
    """``AssertionError: underflow in dt (raised at solvers.py:40)``: type, first line, place."""
    lines = str(error).strip().splitlines()
    frames = traceback.extract_tb(error.__traceback__)
    where = (
        f" (raised at {display_path(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    )
    return f"{type(error).__name__}: {lines[0] if lines else ''}{where}"
