"""Training checkpoints: what one holds (`TrainingState`), written so that a kill at any
moment cannot corrupt it, and read back only once it has passed every check.

Writing (`BackgroundSaver`): ``torch.save`` into an `AtomicFile` beside ``latest.pt``
(a temporary file with a random name, created exclusively), then, in a thread while
training goes on, ``fsync`` and the rename over ``latest.pt``: a rename within one file
system is atomic, so ``latest.pt`` is always either the previous complete checkpoint or
the new complete one. A kill during the write leaves at most a stray temporary file,
which the next start removes (`_files.remove_incomplete`); a full disk leaves nothing.

Reading (`load`) refuses, with one line naming the file and the entry (`CheckpointError`):
a file that is not the zip archive ``torch.save`` writes; one whose pickle names Python
objects that loading would create or call (found by reading the pickle without running
it; ``torch.load(weights_only=True)`` never runs code either); another format; an entry
missing or of the wrong type; a tensor whose bytes differ from the CRC-32 written with
it (a disk, a copy or an editor changed them); random number generator states that
cannot be set. `check_fits` then compares the weights' names and shapes with the model.

The checksums are for accidents, not attacks: whoever can write the file can write a
matching checksum. Format 4 is format 3 plus the ``checksums`` entry: a format-3
checkpoint still resumes, unverified, and `load` says so (``TrainingState.format``).
"""

from __future__ import annotations

import ctypes
import pickle
import random
import threading
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_type_hints

import torch
import torch.utils._pytree as pytree

from ._command import CommandError
from ._files import AtomicFile

__all__ = [
    "FORMAT",
    "LATEST",
    "BackgroundSaver",
    "CheckpointError",
    "Position",
    "ProcessState",
    "RunSettings",
    "TrainingState",
    "check_fits",
    "load",
    "rng_state",
    "set_rng_state",
]

FORMAT = 4
UNVERIFIED_FORMAT = 3  # format 4 without the checksums: read, but not verified
LATEST = "latest.pt"
# Only the user may read a checkpoint: it is the model, and folders are often shared.
MODE = 0o600


class CheckpointError(CommandError):
    """A checkpoint that is missing, unreadable, damaged, or not written by this training
    command (for this model); the text names the file and what is wrong."""


@dataclass
class Position:
    """Where training stands: epochs finished, steps done in the next one, steps in all."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0


@dataclass(frozen=True)
class RunSettings:
    """The settings that make a run's numbers: a resume compares them with its own."""

    seed: int
    samples: int
    batch_size: int
    lr: float
    noise: float
    precision: str
    world_size: int


@dataclass(frozen=True)
class ProcessState:
    """One process's random number generators (`rng_state`) and its epoch loss so far
    (`RunningMean.state`)."""

    rng: dict[str, Any]
    loss: dict[str, Any]


@dataclass(frozen=True)
class TrainingState:
    """Everything a checkpoint holds: with it, training continues bit for bit."""

    position: Position
    epoch_seconds: float  # of the epoch under way, before the checkpoint
    loss: float | None  # of the last finished epoch
    run: RunSettings
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None  # fp16's torch.amp.GradScaler
    processes: list[ProcessState]  # indexed by rank
    format: int = FORMAT  # as read; UNVERIFIED_FORMAT has no checksums


_NONE = type(None)
_NUMBER = (int, float)
# The entries of a checkpoint and their types, checked before anything is used.
_LAYOUT: dict[str, Any] = {
    "epoch": int,
    "step": int,
    "global_step": int,
    "epoch_seconds": _NUMBER,
    "loss": (*_NUMBER, _NONE),
    "run": {
        name: _NUMBER if kind is float else kind
        for name, kind in get_type_hints(RunSettings).items()
    },
    "model": dict,
    "optimizer": {"state": dict, "param_groups": [{"params": list}]},
    "scaler": (dict, _NONE),
    "processes": [
        {
            "rng": {
                "python": {"version": int, "words": torch.Tensor, "gauss": (float, _NONE)},
                "torch": torch.Tensor,
                "cuda": (torch.Tensor, _NONE),
            },
            "loss": {
                "partials": torch.Tensor,
                "losses": torch.Tensor,
                "sizes": torch.Tensor,
                "samples": int,
            },
        }
    ],
}


def _to_dict(state: TrainingState) -> dict[str, Any]:
    """The checkpoint as saved: plain entries, every tensor on the CPU, and their checksums
    (one walk over the entries: the checkpoint is written in the training loop)."""
    position = state.position
    entries = {
        "epoch": position.epoch,
        "step": position.step,
        "global_step": position.global_step,
        "epoch_seconds": state.epoch_seconds,
        "loss": state.loss,
        "run": asdict(state.run),
        "model": state.model,
        "optimizer": state.optimizer,
        "scaler": state.scaler,
        "processes": [{"rng": p.rng, "loss": p.loss} for p in state.processes],
    }
    leaves, layout = pytree.tree_flatten_with_path(entries)
    on_cpu = [(path, _on_cpu(leaf)) for path, leaf in leaves]
    data = pytree.tree_unflatten([leaf for _, leaf in on_cpu], layout)
    return {"format": FORMAT, **data, "checksums": _checksums(on_cpu)}


def _on_cpu(leaf: Any) -> Any:
    return leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf


def _crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's elements, read in place (no copy, no NumPy)."""
    flat = tensor.contiguous()
    size = flat.numel() * flat.element_size()
    if size == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_ubyte * size).from_address(flat.data_ptr()))


def _tensor_name(path: tuple[Any, ...]) -> str:
    """``model.encoder.weight``, ``optimizer.state.0.exp_avg`` for a pytree key path."""
    return ".".join(
        str(entry.key) if isinstance(entry, pytree.MappingKey) else str(entry.idx) for entry in path
    )


def _checksums(leaves: list[tuple[Any, Any]]) -> dict[str, int]:
    """CRC-32 of each tensor among pytree ``leaves`` (key path, value), by its name."""
    return {
        _tensor_name(path): _crc32(leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)
    }


class BackgroundSaver:
    """Saves checkpoints so that ``path`` only ever holds a complete one; the wait for the
    disk (``fsync``, then the rename) runs in a thread.

    ``torch.save`` happens in the caller's thread, so the state is captured before
    training changes it; only the flush to disk, which takes milliseconds and holds
    no lock that training needs, overlaps the next steps. Until it is done the old
    ``latest.pt`` stays in place. The next `save` (and `wait`) waits for the previous
    one and raises its error, if any (a `_files.FileError` for a full disk).
    """

    def __init__(self) -> None:
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainingState, path: Path) -> None:
        self.wait()
        data = _to_dict(state)
        with AtomicFile(path, mode=MODE) as target:
            torch.save(data, target)
        self._pending = threading.Thread(
            target=self._commit, args=(target,), name="checkpoint-fsync"
        )
        self._pending.start()

    def _commit(self, target: AtomicFile) -> None:
        try:
            target.commit()
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


def _unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable checkpoint ({reason})")


def _read(path: Path) -> Any:
    """``torch.load`` of ``path`` to the CPU, once nothing in it can run code."""
    if not zipfile.is_zipfile(path):
        raise _unreadable(path, "not the zip archive torch.save writes: cut short, or another file")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as error:
        raise _unreadable(path, _first_line(error)) from error
    if unsafe:
        raise _unreadable(
            path,
            f"its pickle calls or creates Python objects, which a checkpoint never does: "
            f"{', '.join(sorted(unsafe))}; refused, nothing in it was run",
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message goes on to suggest weights_only=False: the one thing not to do.
        _, found, reason = str(error).partition("WeightsUnpickler error: ")
        detail = reason.split(". ")[0] if found else "its pickle is damaged"
        raise _unreadable(path, f"{detail}; refused, nothing in it was run") from None
    except Exception as error:
        raise _unreadable(path, _first_line(error)) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_layout(value: Any, layout: Any, where: str, path: Path) -> None:
    """`CheckpointError` naming the first entry of ``value`` that ``layout`` does not allow."""
    if isinstance(layout, dict):
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not a dict")
        for key, inner in layout.items():
            name = f"{where}.{key}" if where else key
            if key not in value:
                raise CheckpointError(f"{path} has no {name!r} entry: it is not complete")
            _check_layout(value[key], inner, name, path)
    elif isinstance(layout, list):
        if not isinstance(value, list):
            raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not a list")
        for index, item in enumerate(value):
            _check_layout(item, layout[0], f"{where}[{index}]", path)
    elif not isinstance(value, layout):
        kinds = layout if isinstance(layout, tuple) else (layout,)
        allowed = " or ".join("None" if kind is _NONE else kind.__name__ for kind in kinds)
        raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not {allowed}")


def _verify(data: dict[str, Any], path: Path) -> None:
    """`CheckpointError` for the first tensor whose bytes differ from its checksum."""
    recorded = data["checksums"]
    tensors = {key: value for key, value in data.items() if key not in ("format", "checksums")}
    computed = _checksums(pytree.tree_flatten_with_path(tensors)[0])
    names = recorded.keys() | computed.keys()
    damaged = [name for name in names if recorded.get(name) != computed.get(name)]
    if not damaged:
        return
    order = list(computed) + [name for name in recorded if name not in computed]
    first = min(damaged, key=order.index)
    if first not in computed:
        problem = f"tensor {first} is missing (its checksum is there)"
    elif first not in recorded:
        problem = f"tensor {first} has no checksum"
    else:
        problem = (
            f"tensor {first} does not match its checksum (CRC-32 {computed[first]:08x}, "
            f"written {recorded[first]:08x})"
        )
    others = f" (and {len(damaged) - 1} other tensor(s))" if len(damaged) > 1 else ""
    raise CheckpointError(
        f"{path} is damaged: {problem}{others}; resume from a copy of it, or start a new --run-dir"
    )


def _check_rng(processes: list[dict[str, Any]], path: Path) -> None:
    """`CheckpointError` for generator states that Python or torch would refuse."""
    for rank, process in enumerate(processes):
        where = f"{path}: processes[{rank}].rng"
        python = process["rng"]["python"]
        words = python["words"].tolist()
        # random.setstate truncates words beyond 32 bits and overflows on negative ones
        wrong = [(index, word) for index, word in enumerate(words[:-1]) if not 0 <= word < 2**32]
        if wrong:
            index, word = wrong[0]
            raise CheckpointError(
                f"{where}.python.words[{index}] is {word}, not a word of Python's random state "
                "(0 to 2**32-1)"
            )
        try:
            random.Random().setstate((python["version"], tuple(words), python["gauss"]))
        except (ValueError, OverflowError, TypeError) as error:
            raise CheckpointError(
                f"{where}.python is not a state of Python's random module ({error})"
            ) from None
        try:
            torch.Generator().set_state(process["rng"]["torch"])
        except (RuntimeError, TypeError) as error:
            raise CheckpointError(
                f"{where}.torch is not a torch generator state ({_first_line(error)})"
            ) from None


def load(path: Path) -> TrainingState:
    """Read and check the checkpoint ``path`` (see the module's docstring); its tensors
    are on the CPU. `CheckpointError` says what is wrong with it."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    data = _read(path)
    if not isinstance(data, dict) or not isinstance(data.get("format"), int):
        raise CheckpointError(f"{path} is not a checkpoint written by this training command")
    if data["format"] not in (UNVERIFIED_FORMAT, FORMAT):
        raise CheckpointError(
            f"{path} was written by another version of this training command (checkpoint "
            f"format {data['format']}; this one reads formats {UNVERIFIED_FORMAT} and "
            f"{FORMAT}): start a new --run-dir"
        )
    layout = _LAYOUT
    if data["format"] == FORMAT:
        layout = {**_LAYOUT, "checksums": dict}
    _check_layout(data, layout, "", path)
    if data["format"] == FORMAT:
        _verify(data, path)
    _check_rng(data["processes"], path)
    return TrainingState(
        position=Position(data["epoch"], data["step"], data["global_step"]),
        epoch_seconds=float(data["epoch_seconds"]),
        loss=data["loss"],
        run=RunSettings(**data["run"]),
        model=data["model"],
        optimizer=data["optimizer"],
        scaler=data["scaler"],
        processes=[ProcessState(p["rng"], p["loss"]) for p in data["processes"]],
        format=data["format"],
    )


def check_fits(state: TrainingState, model: torch.nn.Module, path: Path) -> None:
    """`CheckpointError` when ``state`` holds the weights (or optimizer state) of a model
    other than ``model`` (which may be on the meta device): the first name or shape
    that differs."""
    expected = model.state_dict()
    name = type(model).__name__
    missing = [key for key in expected if key not in state.model]
    unexpected = [key for key in state.model if key not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{path} holds the weights of another model than {name}: "
            + "; ".join(
                f"{label} {', '.join(keys)}"
                for label, keys in (("missing", missing), ("unexpected", unexpected))
                if keys
            )
        )
    for key, tensor in expected.items():
        if state.model[key].shape != tensor.shape:
            raise CheckpointError(
                f"{path} holds the weights of another model than {name}: {key} is "
                f"{list(state.model[key].shape)} there and {list(tensor.shape)} here"
            )
    parameters = [parameter.shape for parameter in model.parameters()]
    listed = [index for group in state.optimizer["param_groups"] for index in group["params"]]
    if sorted(listed) != list(range(len(parameters))):
        raise CheckpointError(
            f"{path}: optimizer.param_groups list {len(listed)} parameters, {name} has "
            f"{len(parameters)}"
        )
    for index, entries in state.optimizer["state"].items():
        for key, value in entries.items():
            shape = parameters[index] if index in range(len(parameters)) else None
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != shape:
                raise CheckpointError(
                    f"{path}: optimizer.state.{index}.{key} is {list(value.shape)}, and its "
                    f"parameter in {name} is {list(shape) if shape is not None else 'missing'}"
                )


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
