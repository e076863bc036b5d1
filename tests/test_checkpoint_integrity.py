"""Every byte and every value of a ``train`` checkpoint checked before a resume uses it.

Format 5 ends with a SHA-256 digest of the whole file (in the zip archive's comment),
checked before anything is unpickled: a single-bit flip anywhere is refused in one
line, the file named. Checkpoints crafted with valid digests (as a user editing one
with the module's own writer makes them) are refused by the value checks, in one line
naming the entry. ``previous.pt``, the checkpoint before ``latest.pt``, is offered when
``latest.pt`` is refused, with a command that the test runs. The resumes are real
``train`` processes; the flip sweep calls ``load_resumable`` in this process (what
``main`` does before training), thousands of times.
"""

from __future__ import annotations

import io
import os
import re
import signal
import struct
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from training import (
    EPOCHS,
    SMALL,
    assert_bitwise_equal,
    checkpoint,
    plant,
    resume,
    train,
    train_in_background,
    wait_for_line,
)

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length


def tensor_records(path: Path) -> list[range]:
    """Where the bytes of each tensor lie in the zip archive ``path``."""
    data = path.read_bytes()
    records = []
    with zipfile.ZipFile(path) as archive:
        for entry in archive.infolist():
            if "/data/" not in entry.filename or not entry.file_size:
                continue
            _, name, extra = _LOCAL_HEADER.unpack_from(data, entry.header_offset)
            start = entry.header_offset + _LOCAL_HEADER.size + name + extra
            records.append(range(start, start + entry.file_size))
    return records


def flipped_offsets(path: Path) -> list[int]:
    """Every byte of the file except inside tensors (the pickle, the zip's headers and
    directory, its small entries, the digest), and the first, middle and last byte of
    each tensor: all of the file's parts, and every byte of those that are not numbers
    (inside a tensor every byte is checked in the same way)."""
    inside = {offset for record in tensor_records(path) for offset in record}
    offsets = [offset for offset in range(path.stat().st_size) if offset not in inside]
    for record in tensor_records(path):
        offsets += [record[0], record[len(record) // 2], record[-1]]
    return sorted(offsets)


def resumable(train_module, directory: Path):
    """``load_resumable`` as ``main`` calls it for ``--resume`` of ``directory``."""
    config = train_module.Config(**vars(train_module.build_parser().parse_args(resume(directory))))
    launch = train_module.Launch.from_environment()
    return lambda: train_module.load_resumable(
        config, launch, torch.device("cpu"), log=io.StringIO()
    )


def refusal(train_module, load) -> str:
    """The one line ``load`` was refused with (no warning shown, no other exception)."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(train_module.UsageError) as refused:
            load()
    assert not shown, [str(warning.message) for warning in shown]
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_every_single_bit_flip_is_refused_in_one_line(train_module, finished_run: Path) -> None:
    latest = finished_run / "latest.pt"
    load = resumable(train_module, finished_run)
    assert load().position.epoch == 1  # the good file resumes

    offsets = flipped_offsets(latest)
    assert len(offsets) > 6000
    descriptor = os.open(latest, os.O_RDWR)
    refusals: dict[str, int] = {}
    try:
        for offset in offsets:
            (original,) = os.pread(descriptor, 1, offset)
            os.pwrite(descriptor, bytes([original ^ 1 << offset % 8]), offset)
            message = refusal(train_module, load)
            os.pwrite(descriptor, bytes([original]), offset)
            kind = re.sub(r"\(CRC-32 \w+, written \w+\)", "(CRC-32 ...)", message)
            refusals[kind] = refusals.get(kind, 0) + 1
    finally:
        os.close(descriptor)
    prefix = f"argument --resume: {latest} "
    assert all(kind.startswith(prefix) for kind in refusals), refusals
    damaged = f"{prefix}is damaged: its bytes differ from the SHA-256 digest written with them"
    pickle = f"{damaged} (in its pickle, archive/data.pkl)"
    assert refusals[f"{pickle}; resume from a copy of it, or start a new --run-dir"] > 3000
    assert any(
        "tensor model.encoder.weight does not match its checksum" in kind for kind in refusals
    )
    assert load().position.epoch == 1  # every byte put back: it resumes again


def adam_maximize_flipped(path: Path) -> None:
    """The one bit that turns Adam's ``maximize`` from False to True (pickle opcode
    NEWFALSE, 0x89, into NEWTRUE, 0x88): the loss then climbs."""
    data = bytearray(path.read_bytes())
    key = data.index(b"maximize")
    at = key + len(b"maximize") + (data[key + len(b"maximize")] == ord("q")) * 2
    assert data[at] == 0x89, data[key : key + 16]
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_the_maximize_bit_resumes_silently_in_format_4_and_is_refused_in_format_5(
    train_module, finished_run: Path
) -> None:
    latest = finished_run / "latest.pt"
    load = resumable(train_module, finished_run)
    good = latest.read_bytes()
    adam_maximize_flipped(latest)
    assert refusal(train_module, load).endswith(
        "its bytes differ from the SHA-256 digest written with them (in its pickle, "
        "archive/data.pkl); resume from a copy of it, or start a new --run-dir"
    )
    latest.write_bytes(good)
    torch.save({**torch.load(latest, weights_only=True), "format": 4}, latest)
    assert load().optimizer["param_groups"][0]["maximize"] is False
    adam_maximize_flipped(latest)
    assert load().optimizer["param_groups"][0]["maximize"] is True  # what format 5 prevents


def edit(state: dict, entry: str, value) -> None:
    """Set ``entry`` (``optimizer.param_groups.0.betas``) of ``state`` to ``value``."""
    *path, last = entry.split(".")
    for key in path:
        state = state[int(key)] if isinstance(state, list) else state[key]
    state[int(last) if isinstance(state, list) else last] = value


CRAFTED = {
    "integer model keys": (
        lambda state: state.update(model=dict(enumerate(state["model"].values()))),
        "model has the key 0, not a name (a string)",
    ),
    "a string for betas": (
        lambda state: edit(state, "optimizer.param_groups.0.betas", "0.9, 0.999"),
        "optimizer.param_groups[0].betas is a str, not two numbers from 0 up to (not including) 1",
    ),
    "a beta of 1": (
        lambda state: edit(state, "optimizer.param_groups.0.betas", (0.9, 1.0)),
        "optimizer.param_groups[0].betas is (0.9, 1.0), not two numbers from 0 up to (not "
        "including) 1",
    ),
    "eps 0": (
        lambda state: edit(state, "optimizer.param_groups.0.eps", 0.0),
        "optimizer.param_groups[0].eps is 0.0, not a finite number above 0",
    ),
    "maximize 1": (
        lambda state: edit(state, "optimizer.param_groups.0.maximize", 1),
        "optimizer.param_groups[0].maximize is a int, not True or False",
    ),
    "empty processes": (
        lambda state: state.update(processes=[]),
        "processes holds the states of 0 processes, and run.world_size is 1 (each "
        "process's random generators are needed)",
    ),
    "no python generator state": (
        lambda state: state["processes"][0]["rng"].pop("python"),
        "has no 'processes[0].rng.python' entry: it is not complete",
    ),
    "a negative step": (
        lambda state: state.update(step=-3),
        "step is -3, not a whole number from 0",
    ),
    "global_step below step": (
        lambda state: state.update(step=20, global_step=10),
        "global_step is 10, less than step 20 (the steps done in the epoch under way, "
        "which global_step counts too)",
    ),
    "an epoch of True": (
        lambda state: state.update(epoch=True),
        "epoch is a bool, not a whole number from 0",
    ),
    "a string seed": (
        lambda state: edit(state, "run.seed", "0"),
        "run.seed is a str, not a whole number from 0 to 2**63-1",
    ),
    "a NaN loss": (
        lambda state: state.update(loss=float("nan")),
        "loss is nan, not None or a finite number",
    ),
    "weights of float64": (
        lambda state: state["model"].update(
            {"encoder.weight": state["model"]["encoder.weight"].double()}
        ),
        "model.encoder.weight is of torch.float64, and DynamicNet's is of torch.float32",
    ),
}


@pytest.mark.parametrize("case", CRAFTED, ids=list(CRAFTED))
def test_a_crafted_checkpoint_with_a_valid_digest_is_refused(
    train_module, finished_run: Path, case: str
) -> None:
    latest = finished_run / "latest.pt"
    load = resumable(train_module, finished_run)
    state = torch.load(latest, weights_only=True)
    with latest.open("wb") as file:  # unchanged, written again with its digest
        train_module._checkpoint.write(state, file)
    assert load().position.epoch == 1

    change, expected = CRAFTED[case]
    change(state)
    with latest.open("wb") as file:
        train_module._checkpoint.write(state, file)
    message = refusal(train_module, load)
    assert message in (
        f"argument --resume: {latest}: {expected}",
        f"argument --resume: {latest} {expected}",
    )


def test_previous_checkpoint_resumes_when_latest_is_damaged(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """Two epochs leave latest.pt (epoch 2) and previous.pt (epoch 1); latest.pt damaged,
    the refusal names previous.pt and the command to resume from it, which the test
    runs: the resumed run ends bitwise equal to an uninterrupted one, with the Python
    random state of the checkpoint it resumed from restored."""
    run = tmp_path / "run"
    first = train(default_project, *SMALL, "--epochs", "2", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    assert sorted(path.name for path in run.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",
    ]
    latest, previous = run / "latest.pt", run / "previous.pt"
    assert (checkpoint(run)["epoch"], torch.load(previous, weights_only=True)["epoch"]) == (2, 1)
    kept = torch.load(previous, weights_only=True)["processes"][0]["rng"]["python"]["words"]
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0x10  # in a tensor
    latest.write_bytes(bytes(data))

    args = (*SMALL, "--epochs", EPOCHS, "--resume", "--run-dir", str(run))
    refused = train(default_project, *args)
    assert refused.returncode == 2
    *usage, line = refused.stderr.splitlines()
    assert usage[0].startswith("usage: ")
    assert "Traceback" not in refused.stderr
    move = f"mv {previous} {latest}"
    assert line.endswith(
        f"; resume from a copy of it, or start a new --run-dir; {previous} is intact, at "
        f"epoch 2, step 0/32 (step 32 of the run): to resume from it, run {move}, then this "
        "command again"
    ), line
    assert f"error: argument --resume: {latest} is damaged: tensor " in line

    subprocess.run(move, shell=True, check=True)
    resumed = train(default_project, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith(f"resumed {run} at epoch 2, step 0/32 (step 32 of the run)")
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert torch.equal(checkpoint(run)["processes"][0]["rng"]["python"]["words"], kept)


def test_no_previous_offered_when_it_is_damaged_too(
    train_module, tmp_path: Path, one_epoch
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = (one_epoch / "latest.pt").read_bytes()
    damaged = good[:100] + bytes([good[100] ^ 1]) + good[101:]
    (run / "latest.pt").write_bytes(damaged)
    load = resumable(train_module, run)
    (run / "previous.pt").write_bytes(good)
    assert f"; {run / 'previous.pt'} is intact, at epoch 2, step 0/32" in refusal(
        train_module, load
    )
    (run / "previous.pt").write_bytes(damaged)
    assert refusal(train_module, load).endswith(
        "; resume from a copy of it, or start a new --run-dir"
    )


# The second checkpoint's commit is killed between its two names: previous.pt made a
# second name of latest.pt, the new file not yet renamed over latest.pt.
KILLED_BETWEEN_NAMES = """
    import os
    import signal
    import sys

    _link = os.link
    links = 0

    def link(*args, **kwargs):
        global links
        _link(*args, **kwargs)
        links += 1
        if links == 1:
            print("KILLED AFTER LINK", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    os.link = link
"""


def test_a_kill_while_committing_leaves_a_resumable_checkpoint(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    runs = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(runs))
    killer = plant(tmp_path / "plant", KILLED_BETWEEN_NAMES)
    process = train_in_background(default_project, *args, path=(killer,))
    try:
        wait_for_line(process, "KILLED AFTER LINK")
        assert process.wait() == -signal.SIGKILL
    finally:
        process.kill()
        process.wait()
    latest, previous = runs / "latest.pt", runs / "previous.pt"
    assert os.path.samefile(latest, previous)  # epoch 1's checkpoint under both names
    (partial,) = (path for path in runs.iterdir() if path.suffix == ".tmp")
    assert checkpoint(runs)["epoch"] == 1

    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"removed {partial}, an incomplete checkpoint of a killed run" in resumed.stderr
    assert sorted(path.name for path in runs.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",
    ]
    assert_bitwise_equal(checkpoint(runs), checkpoint(reference))
    assert torch.load(previous, weights_only=True)["epoch"] == 2


def test_removing_incomplete_checkpoints_keeps_previous(train_module, finished_run: Path) -> None:
    latest = finished_run / "latest.pt"
    (finished_run / "previous.pt").write_bytes(latest.read_bytes())
    (finished_run / ".latest.pt.0123456789ab.tmp").write_bytes(b"partial")
    assert train_module.remove_incomplete(latest) == [finished_run / ".latest.pt.0123456789ab.tmp"]
    assert sorted(path.name for path in finished_run.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",
    ]


def test_a_format_4_checkpoint_resumes_with_a_warning(
    default_project: Path, finished_run: Path
) -> None:
    latest = finished_run / "latest.pt"
    torch.save({**torch.load(latest, weights_only=True), "format": 4}, latest)
    resumed = train(default_project, *resume(finished_run))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"warning: {latest} is a checkpoint of format 4, written by an earlier version of "
        "this command: it has no digest, so only its tensors are verified (by their CRC-32), "
        "not its positions, settings or optimizer hyperparameters"
    )
    assert checkpoint(finished_run)["format"] == 5
