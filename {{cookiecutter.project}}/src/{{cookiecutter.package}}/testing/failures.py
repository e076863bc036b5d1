"""The base class of every check's failures.

Each check has one failure class of its own, derived from :class:`CheckFailure`,
that names the check (``check``); everything it raises derives from that class, so
a code path the checks share (the floor) raises the failure of the check that
runs it, never another check's.
"""

from __future__ import annotations

__all__ = ["CheckFailure", "quoted"]


class CheckFailure(AssertionError):
    """A check found the model wrong; the message says what and where.

    An ``AssertionError``, so pytest reports it as a failed assertion.
    """

    check: str = "check"  # the check's name as users call it, e.g. "compile_check"


def quoted(error: BaseException) -> str:
    """``Type: first line of the message``: how a failure quotes the error torch raised."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
