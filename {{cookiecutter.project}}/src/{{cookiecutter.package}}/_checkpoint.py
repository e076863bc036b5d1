"""Training checkpoints that a kill at any moment cannot corrupt.

A checkpoint is written to a temporary file in the same directory, flushed to
disk, and only then renamed over the old one (`BackgroundSaver` does the flush and
the rename in a thread, while training goes on): a rename within one file system is
atomic, so ``latest.pt`` is always either the previous complete checkpoint or the
new complete one. A kill during the write leaves at most a stray temporary file,
which `remove_incomplete` deletes on the next start.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch

FORMAT = 3
LATEST = "latest.pt"


class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, or not written by this training command."""


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _write_temporary(state: dict[str, Any], path: Path) -> tuple[BinaryIO, str]:
    """``state`` written into a new temporary file next to ``path``; the file is left open."""
    fd, temporary = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    file = os.fdopen(fd, "wb")
    try:
        torch.save(state, file)
        file.flush()
    except BaseException:
        _discard(file, temporary)
        raise
    return file, temporary


def _discard(file: BinaryIO, temporary: str) -> None:
    file.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)


def _commit(file: BinaryIO, temporary: str, path: Path) -> None:
    """Flush ``temporary`` to disk, then rename it over ``path``."""
    try:
        os.fsync(file.fileno())
        file.close()
        os.replace(temporary, path)
    except BaseException:
        _discard(file, temporary)
        raise
    # Without this the rename itself may not survive a power cut.
    directory_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


class BackgroundSaver:
    """Saves checkpoints so that ``path`` only ever holds a complete one; the wait for the
    disk (``fsync``, then the rename) runs in a thread.

    ``torch.save`` happens in the caller's thread, so the state is captured before
    training changes it; only the flush to disk, which takes milliseconds and holds
    no lock that training needs, overlaps the next steps. Until it is done the old
    ``latest.pt`` stays in place. The next `save` (and `wait`) waits for the previous
    one and raises its error, if any.
    """

    def __init__(self) -> None:
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict[str, Any], path: Path) -> None:
        self.wait()
        file, temporary = _write_temporary(state, path)
        self._pending = threading.Thread(
            target=self._commit, args=(file, temporary, path), name="checkpoint-fsync"
        )
        self._pending.start()

    def _commit(self, file: BinaryIO, temporary: str, path: Path) -> None:
        try:
            _commit(file, temporary, path)
        except BaseException as error:
            self._error = error

    def wait(self) -> None:
        """Return once the last checkpoint is on disk under its name."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def remove_incomplete(path: Path) -> list[Path]:
    """Delete temporary files that a killed `save_atomic` of ``path`` left behind."""
    leftovers = sorted(path.parent.glob(f"{_temporary_prefix(path)}*.tmp"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    return leftovers


def load(path: Path, map_location: torch.device | str) -> dict[str, Any]:
    """Read a checkpoint written by `save_atomic`; `CheckpointError` says what is wrong with it.

    ``weights_only=True``: a checkpoint is data, and loading one must never run code.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason})") from error
    if not isinstance(state, dict) or not isinstance(state.get("format"), int):
        raise CheckpointError(f"{path} is not a checkpoint written by this training command")
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"{path} was written by another version of this training command (checkpoint "
            f"format {state['format']}; this one reads format {FORMAT}): start a new --run-dir"
        )
    return state


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random number generators' states of this process: Python, torch CPU, and ``device``.

    Python's Mersenne Twister state (625 integers) is kept as one tensor: pickled as
    a tuple, its integers are most of the objects a checkpoint holds, and each one
    costs ``torch.save`` a Python call.
    """
    version, words, gauss = random.getstate()
    return {
        "python": {"version": version, "words": torch.tensor(words), "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["words"].tolist()), python["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
