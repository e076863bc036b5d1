"""Training checkpoints that a kill at any moment cannot corrupt.

A checkpoint is written to a temporary file in the same directory, flushed to
disk, and only then renamed over the old one: a rename within one file system is
atomic, so ``latest.pt`` is always either the previous complete checkpoint or the
new complete one. A kill during the write leaves at most a stray temporary file,
which `remove_incomplete` deletes on the next start.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
LATEST = "latest.pt"


class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, or not written by this training command."""


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` so that ``path`` only ever holds a complete checkpoint."""
    directory = path.parent
    fd, temporary = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    # Without this the rename itself may not survive a power cut.
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint written by this training command")
    return state


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random number generators' states of this process: Python, torch CPU, and ``device``."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
