"""The generated ``train`` against faults and hostile files: each ends in one line naming
the file, the entry or the value, with nothing followed, nothing lost and nothing left
half written.

The faults are real ones: a full disk is a full tmpfs and a read-only run folder a
read-only bind mount (each in a private mount namespace, see `filesystems`); links are
planted where someone sharing the folder could plant them; damaged checkpoints are
real checkpoints with bytes overwritten, an entry removed, generator state spoiled, or
written for a wider model. Failures found before training starts are usage errors
(``argument --resume: ...``, exit status 2); the others are ``error: ...`` lines with
exit status 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import module_environment
from filesystems import FILL, READ_ONLY, SMALL_DISK, in_private_mounts
from training import SMALL, TRAIN, checkpoint, plant, resume, train, usage_error

PREFIX = f"python -m {TRAIN}: error: "


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def one_error_line(result) -> str:
    """The message of a command that failed with exit status 1 and printed only that line."""
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(PREFIX), result.stderr
    return result.stderr.removeprefix(PREFIX).rstrip("\n")


def test_links_planted_at_the_metrics_names_are_not_followed(
    default_project: Path, tmp_path: Path, finished_run: Path
) -> None:
    """``.metrics.csv.tmp`` (the temporary name the file was rewritten through) and
    ``metrics.csv`` itself, each a link to a file of someone else's: the first is left
    alone, the second refused, and neither target is written."""
    victim = tmp_path / "victim.csv"
    victim.write_text((finished_run / "metrics.csv").read_text())  # a CSV the run could use
    original = victim.read_bytes()

    run = tmp_path / "run"
    run.mkdir()
    (run / ".metrics.csv.tmp").symlink_to(victim)
    result = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(run))
    assert result.returncode == 0, result.stderr
    assert victim.read_bytes() == original
    assert (run / ".metrics.csv.tmp").readlink() == victim
    assert not (run / "metrics.csv").is_symlink()
    assert (run / "metrics.csv").read_text().count("\n") == 2  # the header and epoch 1

    (finished_run / "metrics.csv").unlink()
    (finished_run / "metrics.csv").symlink_to(victim)
    before = (finished_run / "latest.pt").read_bytes()
    refused = train(default_project, *resume(finished_run))
    assert one_error_line(refused) == (
        f"cannot read {finished_run / 'metrics.csv'}: it is a symbolic link, which is not followed"
    )
    assert victim.read_bytes() == original
    assert (finished_run / "latest.pt").read_bytes() == before
    assert not (finished_run / ".lock").exists()


def test_a_malformed_metrics_csv(default_project: Path, finished_run: Path) -> None:
    metrics = finished_run / "metrics.csv"
    header, row = metrics.read_text().splitlines()
    metrics.write_text(f"{header}\nxx{row[1:]}\n")
    before = contents(finished_run)
    refused = train(default_project, *resume(finished_run))
    assert one_error_line(refused) == (
        f"{metrics} line 2: epoch 'xx' is not a whole number; this command did not write it "
        "so: repair the line, or move the file away to start a new one"
    )
    assert contents(finished_run) == before

    metrics.write_text(f"{header}\n{row}\n")  # repaired: it resumes
    assert train(default_project, *resume(finished_run)).returncode == 0


def test_a_full_disk_leaves_the_last_checkpoint_and_no_temporary_file(
    default_project: Path, tmp_path: Path
) -> None:
    """Resumed on a full file system, the end-of-epoch checkpoint cannot be written: one
    line, the previous ``latest.pt`` as it was, its temporary file removed."""
    disk, saved = tmp_path / "disk", tmp_path / "saved"
    disk.mkdir()
    saved.mkdir()
    run = disk / "run"
    first = f'"$PYTHON" -m {TRAIN} {" ".join(SMALL)} --epochs 1 --run-dir "$FOLDER/run"'
    script = " && ".join(
        [
            SMALL_DISK,
            f"{first} 2>/dev/null >/dev/null",
            'cp "$FOLDER/run/latest.pt" "$SAVED/before.pt"',
            FILL,
        ]
    ) + (
        f'; "$PYTHON" -m {TRAIN} {" ".join(resume(run))} 2>"$SAVED/stderr" >/dev/null; '
        'echo $? >"$SAVED/status"; ls -A "$FOLDER/run" >"$SAVED/listing"; '
        'cp "$FOLDER/run/latest.pt" "$SAVED/after.pt"'
    )
    environ = module_environment(
        default_project, FOLDER=str(disk), SAVED=str(saved), SIZE="1m", PYTHON=sys.executable
    )
    done = in_private_mounts(script, environ)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (saved / "status").read_text() == "1\n", (saved / "stderr").read_text()
    assert (saved / "stderr").read_text() == (
        f"{PREFIX}cannot write {run / 'latest.pt'}: No space left on device (the previous "
        "latest.pt is intact)\n"
    )
    assert (saved / "listing").read_text().split() == ["latest.pt", "metrics.csv"]
    assert (saved / "after.pt").read_bytes() == (saved / "before.pt").read_bytes()


def test_a_read_only_run_folder(default_project: Path, finished_run: Path) -> None:
    before = contents(finished_run)
    environ = module_environment(default_project, FOLDER=str(finished_run), PYTHON=sys.executable)
    done = in_private_mounts(
        f'{READ_ONLY} && exec "$PYTHON" -m {TRAIN} {" ".join(resume(finished_run))}', environ
    )
    assert one_error_line(done) == (f"cannot lock {finished_run / '.lock'}: Read-only file system")
    assert contents(finished_run) == before


def test_a_damaged_tensor_is_named(
    default_project: Path, train_module, capsys, finished_run: Path
) -> None:
    """20 bytes of 0xFF in the middle of a weight: refused, naming the tensor; the same
    file undamaged resumes."""
    latest = finished_run / "latest.pt"
    data = latest.read_bytes()
    weight = checkpoint(finished_run)["model"]["encoder.weight"]
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    damaged = data[: at + 100] + b"\xff" * 20 + data[at + 120 :]
    latest.write_bytes(damaged)
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message.startswith(
        f"argument --resume: {latest} is damaged: tensor model.encoder.weight does not "
        "match its checksum (CRC-32 "
    )
    assert message.endswith("); resume from a copy of it, or start a new --run-dir")
    assert latest.read_bytes() == damaged

    latest.write_bytes(data)
    assert train(default_project, *resume(finished_run)).returncode == 0


WIDER_MODEL = """
    from dynamic_model import models

    # DynamicNet(in_features, hidden, out_features, max_steps, tolerance), hidden 48 not 32
    models.DynamicNet.__init__.__defaults__ = (16, 48, 4, 4, 0.5)
"""


def test_a_checkpoint_of_another_model(
    default_project: Path, train_module, capsys, tmp_path: Path
) -> None:
    """Trained with a wider `DynamicNet` (as after an edit of the model), resumed with this one."""
    run = tmp_path / "run"
    wider = plant(tmp_path / "plant", WIDER_MODEL)
    environ = module_environment(default_project, path=(wider,))
    first = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(run), env=environ)
    assert first.returncode == 0, first.stderr
    assert usage_error(train_module, capsys, *resume(run)) == (
        f"argument --resume: {run / 'latest.pt'} holds the weights of another model than "
        "DynamicNet: encoder.weight is [48, 16] there and [32, 16] here"
    )


def test_a_checkpoint_without_its_run_entry(train_module, capsys, finished_run: Path) -> None:
    latest = finished_run / "latest.pt"
    state = torch.load(latest, weights_only=True)
    del state["run"]  # no tensor in it: the checksums still hold
    with latest.open("wb") as file:
        train_module._checkpoint.write(state, file)  # with its digest, as train writes it
    assert usage_error(train_module, capsys, *resume(finished_run)) == (
        f"argument --resume: {latest} has no 'run' entry: it is not complete"
    )


def test_spoiled_random_generator_state(train_module, capsys, finished_run: Path) -> None:
    """A word of Python's Mersenne Twister state out of range (``random.setstate`` raised
    OverflowError): in a checkpoint with checksums (format 4), the checksum names it; in
    one without (format 3), the state check does."""
    latest = finished_run / "latest.pt"
    state = torch.load(latest, weights_only=True)
    state["processes"][0]["rng"]["python"]["words"][5] = -1
    torch.save({**state, "format": 4}, latest)  # checksums, no digest
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message.startswith(
        f"argument --resume: {latest} is damaged: tensor processes.0.rng.python.words does "
        "not match its checksum"
    )
    del state["checksums"]
    torch.save({**state, "format": 3}, latest)
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message == (
        f"argument --resume: {latest}: processes[0].rng.python.words[5] is -1, not a word "
        "of Python's random state (0 to 2**32-1)"
    )


@pytest.mark.parametrize(
    "content",
    [b"hello", b"PK\x05\x06" + bytes(18)],
    ids=["text", "an empty zip archive"],
)
def test_a_file_that_is_no_checkpoint(
    train_module, capsys, finished_run: Path, content: bytes
) -> None:
    latest = finished_run / "latest.pt"
    latest.write_bytes(content)
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message.startswith(f"argument --resume: {latest} is not a readable checkpoint (")
    assert message.endswith(")")
    assert "weights_only" not in message
    if content == b"hello":  # torch.load said "101" here
        assert message.endswith(
            "(not the zip archive torch.save writes: cut short, or another file)"
        )


def test_the_lock_file_is_never_followed(default_project: Path, tmp_path: Path) -> None:
    """A link planted at ``.lock`` (to a file of someone else's): refused, target untouched."""
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    result = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(run))
    assert one_error_line(result) == (
        f"cannot lock {run / '.lock'}: it is a symbolic link, which is not followed"
    )
    assert victim.read_text() == "keep\n"
    assert sorted(path.name for path in run.iterdir()) == [".lock"]
    assert os.path.islink(run / ".lock")
