"""Training checkpoints: what one holds (`TrainingState`), written so that a kill at any
moment cannot corrupt it, and read back only once every byte and every value in it
has passed its check.

Writing (`BackgroundSaver`): ``torch.save`` into an `AtomicFile` beside ``latest.pt``
(a temporary file with a random name, created exclusively), then, in a thread while
training goes on, ``fsync``, ``previous.pt`` made a second name of the current
``latest.pt``, and the rename over ``latest.pt`` (see `AtomicFile.commit`): at every
instant ``latest.pt`` is a complete checkpoint, the last or the new one, and from the
second checkpoint on ``previous.pt`` is the one before, so a ``latest.pt`` damaged later
(a disk, a copy) leaves a generation to resume from. A kill during the write leaves at
most a stray temporary file, which the next start removes (`_files.remove_incomplete`);
a full disk leaves nothing.

Integrity (format 5): after ``torch.save`` comes a SHA-256 digest of every byte of the
file, in the zip archive's comment (`_digest`), and `load` checks it before anything
in the file is unpickled, so a change anywhere (the pickle of the positions, settings
and optimizer hyperparameters, a tensor, the zip's own headers, the digest) is
refused. Each tensor also carries a CRC-32 (the ``checksums`` entry), which names the
tensor when the damage is in one. The digest is for accidents, not attacks: whoever
can write the file can write a matching digest. Against attacks, checkpoints are read
as data: a pickle that names Python objects that loading would create or call is
refused (found by reading it without running it; ``torch.load(weights_only=True)``
never runs code either). Checkpoints of earlier versions still resume, with a warning
(`UNVERIFIED`): format 4 (no digest: its tensors are verified, not its other entries)
and format 3 (no checksums either).

Reading (`load`) refuses, with one line naming the file and the entry or the part
(`CheckpointError`): a file that is not the zip archive ``torch.save`` writes; bytes
that differ from the digest; a pickle that would run code; another format; an entry
missing, of the wrong type or out of range (`_LAYOUT`: positions are counts, Adam's
hyperparameters numbers in their ranges and flags booleans, the weights' names
strings); positions or process states that do not fit together; random number
generator states that cannot be set. `check_fits` then compares the weights' names,
shapes and types with the model.
"""

from __future__ import annotations

import ctypes
import math
import pickle
import random
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, get_type_hints

import torch
import torch.utils._pytree as pytree

from . import _digest
from ._command import CommandError, first_line
from ._digest import DigestCheck, DigestWriter
from ._files import AtomicFile

__all__ = [
    "FORMAT",
    "LATEST",
    "PREVIOUS",
    "UNVERIFIED",
    "BackgroundSaver",
    "CheckpointError",
    "Position",
    "ProcessState",
    "RunSettings",
    "TrainingState",
    "check_fits",
    "entries",
    "load",
    "rng_state",
    "set_rng_state",
    "write",
]

FORMAT = 5
TENSORS_VERIFIED_FORMAT = 4  # format 5 without the digest
UNVERIFIED_FORMAT = 3  # format 4 without the checksums
# What `load` could not verify in a checkpoint of an earlier format, by format.
UNVERIFIED = {
    TENSORS_VERIFIED_FORMAT: "it has no digest, so only its tensors are verified (by their "
    "CRC-32), not its positions, settings or optimizer hyperparameters",
    UNVERIFIED_FORMAT: "it has no checksums, so its tensors are not verified",
}
LATEST = "latest.pt"
PREVIOUS = "previous.pt"  # the checkpoint before latest.pt (see BackgroundSaver)
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
    # Micro-batches per optimizer step; missing from checkpoints written before
    # --accumulate existed, which all had 1 (the layout has it as optional: no new format).
    accumulate: int = 1


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
    format: int = FORMAT  # as read; see UNVERIFIED for the earlier ones


_NONE = type(None)
_NUMBER = (int, float)


@dataclass(frozen=True)
class _Value:
    """The values an entry may have: an instance of one of ``kinds`` that passes ``test``
    (a bool only where ``kinds`` lists bool: to Python, True is an int); ``allowed``
    says which, in a refusal."""

    kinds: tuple[type, ...]
    allowed: str
    test: Callable[[Any], bool] = lambda value: True

    def of_kind(self, value: Any) -> bool:
        if isinstance(value, bool) and bool not in self.kinds:
            return False
        return isinstance(value, self.kinds)

    def admits(self, value: Any) -> bool:
        return self.of_kind(value) and self.test(value)


@dataclass(frozen=True)
class _Each:
    """A dict whose keys are not fixed: each key is a ``key``, each value fits ``value``."""

    key: _Value
    value: Any


@dataclass(frozen=True)
class _Optional:
    """A dict entry that may be missing (its default is used: torch's for optimizer
    flags torch added, RunSettings' for a setting added), or fits ``layout``."""

    layout: Any


@dataclass(frozen=True)
class _NoneOr:
    """None, or a value that fits ``layout``."""

    layout: Any


def _finite(test: Callable[[float], bool]) -> Callable[[Any], bool]:
    return lambda value: math.isfinite(value) and test(value)


_COUNT = _Value((int,), "a whole number from 0", lambda value: value >= 0)
_POSITIVE_COUNT = _Value((int,), "a whole number from 1", lambda value: value >= 1)
_POSITIVE = _Value(_NUMBER, "a finite number above 0", _finite(lambda value: value > 0))
_NON_NEGATIVE = _Value(_NUMBER, "a finite number from 0", _finite(lambda value: value >= 0))
_FLAG = _Value((bool,), "True or False")
_FLAG_OR_NONE = _Value((bool, _NONE), "True, False or None")
_NAME = _Value((str,), "a name (a string)")
_TENSOR = _Value((torch.Tensor,), "a tensor")
_BETAS = _Value(
    (tuple, list),
    "two numbers from 0 up to (not including) 1",
    lambda pair: (
        len(pair) == 2
        and all(_Value(_NUMBER, "", _finite(lambda beta: 0 <= beta < 1)).admits(b) for b in pair)
    ),
)
# RunSettings as train's command line allows them (precision: a short name to print).
_RUN = {
    "seed": _Value((int,), "a whole number from 0 to 2**63-1", lambda value: 0 <= value < 2**63),
    "samples": _POSITIVE_COUNT,
    "batch_size": _POSITIVE_COUNT,
    "lr": _POSITIVE,
    "noise": _NON_NEGATIVE,
    "precision": _Value(
        (str,),
        "a precision's name (such as 32 or bf16)",
        lambda name: name.isalnum() and len(name) <= 8,
    ),
    "world_size": _POSITIVE_COUNT,
    "accumulate": _Optional(_POSITIVE_COUNT),
}
assert _RUN.keys() == get_type_hints(RunSettings).keys()
# A param group of torch.optim.Adam, the optimizer train builds. The flags torch added
# over the versions may be missing (Adam's __setstate__ sets their defaults).
_ADAM_GROUP = {
    "params": [_COUNT],
    "lr": _POSITIVE,
    "betas": _BETAS,
    "eps": _POSITIVE,
    "weight_decay": _NON_NEGATIVE,
    "amsgrad": _FLAG,
    "maximize": _FLAG,
    "foreach": _Optional(_FLAG_OR_NONE),
    "capturable": _Optional(_FLAG),
    "differentiable": _Optional(_FLAG),
    "fused": _Optional(_FLAG_OR_NONE),
    "decoupled_weight_decay": _Optional(_FLAG),
}
# torch.amp.GradScaler.state_dict, with the ranges its constructor requires.
_SCALER = {
    "scale": _POSITIVE,
    "growth_factor": _Value(_NUMBER, "a finite number above 1", _finite(lambda value: value > 1)),
    "backoff_factor": _Value(
        _NUMBER, "a number between 0 and 1", _finite(lambda value: 0 < value < 1)
    ),
    "growth_interval": _POSITIVE_COUNT,
    "_growth_tracker": _COUNT,
}
# The entries of a checkpoint and their values, checked before anything is used.
_LAYOUT: dict[str, Any] = {
    "epoch": _COUNT,
    "step": _COUNT,
    "global_step": _COUNT,
    "epoch_seconds": _NON_NEGATIVE,
    "loss": _Value(
        (*_NUMBER, _NONE),
        "None or a finite number",
        lambda value: value is None or math.isfinite(value),
    ),
    "run": _RUN,
    "model": _Each(_NAME, _TENSOR),
    "optimizer": {
        "state": _Each(
            _COUNT, _Each(_NAME, _Value((torch.Tensor, *_NUMBER), "a tensor or a number"))
        ),
        "param_groups": [_ADAM_GROUP],
    },
    "scaler": _NoneOr(_SCALER),
    "processes": [
        {
            "rng": {
                "python": {
                    "version": int,
                    "words": torch.Tensor,
                    "gauss": (float, _NONE),
                },
                "torch": torch.Tensor,
                "cuda": (torch.Tensor, _NONE),
            },
            "loss": {
                "partials": torch.Tensor,
                "losses": torch.Tensor,
                "sizes": torch.Tensor,
                "samples": _COUNT,
            },
        }
    ],
}
_CHECKSUMS = _Each(_NAME, _Value((int,), "a CRC-32"))
_LAYOUTS = {
    FORMAT: {**_LAYOUT, "checksums": _CHECKSUMS},
    TENSORS_VERIFIED_FORMAT: {**_LAYOUT, "checksums": _CHECKSUMS},
    UNVERIFIED_FORMAT: _LAYOUT,
}


def entries(state: TrainingState) -> dict[str, Any]:
    """The checkpoint's entries as saved: plain values, every tensor on the CPU."""
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
    return pytree.tree_map(_on_cpu, entries)


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


def write(entries: dict[str, Any], file: BinaryIO | AtomicFile) -> None:
    """A checkpoint of ``entries`` (tensors on the CPU) into ``file``: ``torch.save`` of
    them with this format and the checksums of their tensors (``format`` and
    ``checksums`` among ``entries`` are replaced), then the digest (`_digest`). How
    every checkpoint is written, one edited by hand included."""
    content = {key: value for key, value in entries.items() if key not in ("format", "checksums")}
    checksums = _checksums(pytree.tree_flatten_with_path(content)[0])
    writer = DigestWriter(file)
    torch.save({"format": FORMAT, **content, "checksums": checksums}, writer)
    writer.finish()


class BackgroundSaver:
    """Saves checkpoints so that ``path`` only ever holds a complete one, and ``PREVIOUS``
    beside it the one before; the wait for the disk (``fsync``, then the renames) runs
    in a thread.

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
        data = entries(state)
        with AtomicFile(path, mode=MODE) as target:
            write(data, target)
        self._pending = threading.Thread(
            target=self._commit, args=(target, path.with_name(PREVIOUS)), name="checkpoint-fsync"
        )
        self._pending.start()

    def _commit(self, target: AtomicFile, previous: Path) -> None:
        try:
            target.commit(keep_previous=previous)
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


def _damaged(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is damaged: {problem}; resume from a copy of it, or start a new --run-dir"
    )


def _read(path: Path) -> Any:
    """``torch.load`` of ``path`` to the CPU, once nothing in it can run code; torch's
    warnings about what it reads are not shown (a refusal says what is wrong)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as error:
            raise _unreadable(path, first_line(error)) from error
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
            raise _unreadable(path, first_line(error)) from error


def _refuse_digest_mismatch(path: Path) -> NoReturn:
    """`CheckpointError` for a file whose bytes differ from its digest, naming what changed
    as far as the zip archive's own CRC-32 of each entry tells: the tensor (by its
    checksum, read once the pickle is known intact), the entry, or the archive's headers
    or digest. The file is only unpickled when its pickle's CRC-32 matches."""
    entry = _first_damaged_entry(path)
    if entry is not None and entry.rpartition("/")[0].endswith("/data"):  # a tensor's bytes
        data = _read(path)
        if isinstance(data, dict) and isinstance(data.get("checksums"), dict):
            _verify(data, path)
    where = (
        "in the zip archive's headers or in the digest"
        if entry is None
        else f"in its pickle, {entry}"
        if entry.endswith(".pkl")
        else f"in its entry {entry}"
    )
    raise _damaged(path, f"its bytes differ from the SHA-256 digest written with them ({where})")


def _is_zip(path: Path) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except zipfile.BadZipFile:  # is_zipfile raises it for some damaged ends of an archive
        return False


def _first_damaged_entry(path: Path) -> str | None:
    """The first entry of the zip archive ``path`` that cannot be read or differs from the
    CRC-32 the archive holds for it; None when every one reads intact (or the archive's
    directory cannot be read)."""
    try:
        archive = zipfile.ZipFile(path)
    except Exception:  # damaged headers: zipfile raises more kinds than BadZipFile
        return None
    with archive:
        for entry in archive.infolist():
            try:
                archive.read(entry)
            except Exception:
                return entry.filename
    return None


def _shown(value: Any) -> str:
    """``value`` as a refusal shows it: its repr, on one line, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _check_layout(value: Any, layout: Any, where: str, path: Path) -> None:
    """`CheckpointError` naming the first entry of ``value`` that ``layout`` does not allow."""
    if isinstance(layout, _NoneOr):
        if value is not None:
            _check_layout(value, layout.layout, where, path)
    elif isinstance(layout, dict):
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not a dict")
        for key, inner in layout.items():
            name = f"{where}.{key}" if where else key
            if isinstance(inner, _Optional):
                if key not in value:
                    continue
                inner = inner.layout
            if key not in value:
                raise CheckpointError(f"{path} has no {name!r} entry: it is not complete")
            _check_layout(value[key], inner, name, path)
    elif isinstance(layout, _Each):
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not a dict")
        for key, item in value.items():
            if not layout.key.admits(key):
                raise CheckpointError(
                    f"{path}: {where} has the key {_shown(key)}, not {layout.key.allowed}"
                )
            _check_layout(item, layout.value, f"{where}.{key}", path)
    elif isinstance(layout, list):
        if not isinstance(value, list):
            raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not a list")
        for index, item in enumerate(value):
            _check_layout(item, layout[0], f"{where}[{index}]", path)
    elif isinstance(layout, _Value):
        if not layout.admits(value):
            shown = _shown(value) if layout.of_kind(value) else f"a {type(value).__name__}"
            raise CheckpointError(f"{path}: {where} is {shown}, not {layout.allowed}")
    elif not isinstance(value, layout):
        kinds = layout if isinstance(layout, tuple) else (layout,)
        allowed = " or ".join("None" if kind is _NONE else kind.__name__ for kind in kinds)
        raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, not {allowed}")


def _check_consistency(data: dict[str, Any], path: Path) -> None:
    """`CheckpointError` for entries that are each allowed but do not fit together."""
    if data["global_step"] < data["step"]:
        raise CheckpointError(
            f"{path}: global_step is {data['global_step']}, less than step {data['step']} "
            "(the steps done in the epoch under way, which global_step counts too)"
        )
    processes, world_size = data["processes"], data["run"]["world_size"]
    if len(processes) != world_size:
        raise CheckpointError(
            f"{path}: processes holds the states of {len(processes)} processes, and "
            f"run.world_size is {world_size} (each process's random generators are needed)"
        )
    for rank, process in enumerate(processes):
        loss = process["loss"]
        if loss["sizes"].shape != loss["losses"].shape or loss["losses"].dim() != 1:
            raise CheckpointError(
                f"{path}: processes[{rank}].loss.sizes is {list(loss['sizes'].shape)} and "
                f"losses {list(loss['losses'].shape)}: one size per loss was written"
            )


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
    raise _damaged(path, f"{problem}{others}")


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
                f"{where}.torch is not a torch generator state ({first_line(error)})"
            ) from None


def load(path: Path) -> TrainingState:
    """Read and check the checkpoint ``path`` (see the module's docstring); its tensors
    are on the CPU. `CheckpointError` says what is wrong with it."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if not _is_zip(path):
        raise _unreadable(path, "not the zip archive torch.save writes: cut short, or another file")
    try:
        digest = _digest.check(path)
    except OSError as error:
        raise _unreadable(path, error.strerror or str(error)) from None
    if digest is DigestCheck.DIFFERS:
        _refuse_digest_mismatch(path)
    data = _read(path)
    if not isinstance(data, dict) or not _Value((int,), "").admits(data.get("format")):
        raise CheckpointError(f"{path} is not a checkpoint written by this training command")
    if data["format"] not in _LAYOUTS:
        raise CheckpointError(
            f"{path} was written by another version of this training command (checkpoint "
            f"format {data['format']}; this one reads formats {UNVERIFIED_FORMAT}, "
            f"{TENSORS_VERIFIED_FORMAT} and {FORMAT}): start a new --run-dir"
        )
    if data["format"] == FORMAT and digest is not DigestCheck.MATCHES:
        raise _damaged(
            path,
            "it has no SHA-256 digest, which every checkpoint of its format ends with (it "
            "was written again by another program, which left it out)",
        )
    _check_layout(data, _LAYOUTS[data["format"]], "", path)
    if data["format"] != UNVERIFIED_FORMAT:
        _verify(data, path)
    _check_consistency(data, path)
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
    other than ``model`` (which may be on the meta device): the first name, shape or
    type that differs."""
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
        if state.model[key].dtype != tensor.dtype:
            raise CheckpointError(
                f"{path}: model.{key} is of {state.model[key].dtype}, and {name}'s is of "
                f"{tensor.dtype}"
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
