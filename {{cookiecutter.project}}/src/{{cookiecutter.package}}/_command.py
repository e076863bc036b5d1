"""What the commands (``doctor``, ``train``) share at their edge: the name they were started
by, and the one place where a failure the user can act on becomes one line.

Loading this module does not import torch.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["CommandError", "command_name", "first_line", "reports_errors"]


class CommandError(Exception):
    """A failure the user can act on (a file, a folder, a value), not a bug.

    Its text is the whole report: one line naming the file, field or value. The
    command prints it as ``<command>: error: <text>`` and exits with `status`.
    """

    status = 1


def first_line(error: BaseException) -> str:
    """An exception's message in one line: its first, or the exception's type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def command_name(module: str) -> str:
    """The installed script's name (``dynamic-model-doctor`` for ``<package>.doctor``) when
    that script started this process, else ``python -m <module>``."""
    suffix = "-" + module.rpartition(".")[2]
    started_as = Path(sys.argv[0]).name if sys.argv else ""
    return started_as if started_as.endswith(suffix) else f"python -m {module}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and the interpreter flushes stdout
    once more at exit, which would raise again (what Python's documentation on SIGPIPE
    recommends)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def reports_errors(module: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a command's ``main``: a `CommandError` it raises becomes one
    ``<command>: error: ...`` line on stderr and its status; a reader that went away
    (``<command> | head``) ends the command quietly with 128 + SIGPIPE, and Ctrl-C
    with ``<command>: interrupted`` and 128 + SIGINT, as shells report a program
    killed by those signals."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def reporting(*args: object, **kwargs: object) -> int:
            try:
                status = main(*args, **kwargs)
                sys.stdout.flush()  # here, not at exit, where a closed pipe can't be caught
                return status
            except BrokenPipeError:
                _silence_stdout()
                return 128 + signal.SIGPIPE
            except CommandError as error:
                print(f"{command_name(module)}: error: {error}", file=sys.stderr)
                return error.status
            except KeyboardInterrupt:  # Ctrl-C where the command does not handle it itself
                print(f"{command_name(module)}: interrupted", file=sys.stderr)
                return 128 + signal.SIGINT

        return reporting

    return decorate
