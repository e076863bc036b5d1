"""Whose code a frame runs (the user's, a library's, torch's, this plugin's), and the user's way in.

A report points at the user's own line. When what failed sits in a library
(transformers, torchdiffeq, torch_geometric), the user needs both: the innermost
frame in the user's own files, and the library frames under it that lead from
that line to the one that failed. :func:`call_path` takes any stack (a traceback,
torch's ``real_stack`` of a traced frame, the frames of torch's own reports) and
returns that :class:`CallPath`; frames of torch and of this plugin are left out, as
they are the machinery, not the code under test.

A library is any file imported from a ``site-packages`` or ``dist-packages`` folder
or from the standard library; the user's files are all others (the project's
``src``, its tests, a notebook's cells are not, as ``<...>`` names no file).
"""

from __future__ import annotations

import enum
import functools
import os
import re
import sysconfig
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType, TracebackType

from .control_flow import TORCH_DIR, Location

__all__ = [
    "CallPath",
    "Origin",
    "call_path",
    "frames_in_text",
    "origin",
    "stack_frames",
    "traceback_frames",
]

_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple(
    sorted(
        {
            os.path.abspath(path) + os.sep
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (path := sysconfig.get_paths().get(key))
        }
    )
)
_PACKAGE_FOLDERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# Library frames listed under the user's line: the first ones show the way in, the
# last ones the line that failed; a deep stack (a decoder's layers, a solver's steps)
# keeps both ends.
_SHOWN_FIRST, _SHOWN_LAST = 2, 3
# 'File "path", line N' as Python's and torch's formatted tracebacks write it.
_FORMATTED_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


class Origin(enum.Enum):
    """Whose code a file holds."""

    USER = "user"
    LIBRARY = "library"
    TORCH = "torch"
    PLUGIN = "plugin"
    NONE = "none"  # "<string>", "<frozen ...>": no file to point at


@functools.cache
def origin(filename: str) -> Origin:
    """Whose code ``filename`` holds (see the module's docstring)."""
    if not filename or filename.startswith("<"):
        return Origin.NONE
    path = os.path.abspath(filename)
    if path.startswith(TORCH_DIR):
        return Origin.TORCH
    if path.startswith(_PLUGIN_DIR):
        return Origin.PLUGIN
    if any(folder in path for folder in _PACKAGE_FOLDERS) or path.startswith(_LIBRARY_DIRS):
        return Origin.LIBRARY
    return Origin.USER


@dataclass(frozen=True)
class CallPath:
    """The user's line and the library lines under it that lead to what failed.

    ``user`` is the innermost frame in the user's files (``None`` when the stack has
    none); ``library`` the library frames called from it, outermost first, so the
    last one is where the library failed. :attr:`innermost` is that line, or the
    user's own when no library is involved.
    """

    user: Location | None
    library: tuple[Location, ...] = ()

    @property
    def innermost(self) -> Location | None:
        return self.library[-1] if self.library else self.user

    def __bool__(self) -> bool:
        return self.innermost is not None

    def lines(self, indent: str = "  ") -> list[str]:
        """``at <user line>: `code``` and one ``in <library line>`` line per library frame."""
        shown: list[Location | None] = list(self.library)
        if len(shown) > _SHOWN_FIRST + _SHOWN_LAST + 1:
            hidden = len(shown) - _SHOWN_FIRST - _SHOWN_LAST
            shown = [*shown[:_SHOWN_FIRST], None, *shown[-_SHOWN_LAST:]]
        else:
            hidden = 0
        lines = [f"{indent}at {_with_source(self.user)}"] if self.user else []
        for location in shown:
            if location is None:
                lines.append(f"{indent}  ... {hidden} more library frame(s)")
            else:
                lines.append(f"{indent}  in {_with_source(location)}")
        return lines

    def __str__(self) -> str:
        return " -> ".join(str(location) for location in (self.user, *self.library) if location)


def _with_source(location: Location) -> str:
    return f"{location}: `{location.source}`" if location.source else str(location)


def call_path(frames: Iterable[tuple[str, int]]) -> CallPath:
    """The :class:`CallPath` of a stack given outermost frame first, as ``(filename, line)``."""
    kept = [
        (origin(filename), Location(filename, line))
        for filename, line in frames
        if line and origin(filename) in (Origin.USER, Origin.LIBRARY)
    ]
    users = [position for position, (kind, _) in enumerate(kept) if kind is Origin.USER]
    if not users:
        return CallPath(None, tuple(location for _, location in kept))
    last = users[-1]
    return CallPath(kept[last][1], tuple(location for _, location in kept[last + 1 :]))


def stack_frames(frame: FrameType | None) -> list[tuple[str, int]]:
    """``(filename, line)`` of ``frame`` and its callers, outermost first (no source read)."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno or 0))
        frame = frame.f_back
    return frames[::-1]


def traceback_frames(error: BaseException | TracebackType | None) -> list[tuple[str, int]]:
    """``(filename, line)`` of each frame of a traceback, outermost first."""
    tb = error.__traceback__ if isinstance(error, BaseException) else error
    return [(summary.filename, summary.lineno or 0) for summary in traceback.extract_tb(tb)]


def frames_in_text(text: str) -> list[tuple[str, int]]:
    """The frames of a traceback torch formatted into a message (``File "...", line N``)."""
    return [(found["file"], int(found["line"])) for found in _FORMATTED_FRAME.finditer(text)]
