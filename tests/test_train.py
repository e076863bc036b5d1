"""The generated project's ``<package>-train``, run for real on the CPU.

Runs go through ``python -m dynamic_model.train`` (and ``torchrun``) in subprocesses
that are killed with SIGKILL where a crash is the point: mid-epoch, right after a
checkpoint (a ``sitecustomize`` module makes the process SIGKILL itself once the
Nth checkpoint is renamed into place), and halfway through writing a checkpoint
(``torch.save`` stalls there until the test kills it). Resumed runs must end with
weights, optimizer state and ``metrics.csv`` losses bitwise equal to an
uninterrupted run's, with DataLoader workers or without. Bad command lines are
checked in-process through ``main()``.
"""

from __future__ import annotations

import importlib
import io
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, module_environment
from training import (
    EPOCHS,
    SMALL,
    assert_bitwise_equal,
    checkpoint,
    metrics,
    plant,
    reproducible,
    torchrun,
    train,
    train_in_background,
    usage_error,
    wait_for_line,
)

# With --checkpoint-every 10 the 5th checkpoint is at step 8 of epoch 2 (steps 10, 20,
# 30, the end of epoch 1 at 32, then 40).
EVERY = ("--checkpoint-every", "10")
KILL_AT_CHECKPOINT = 5


# A checkpoint written by this template before checkpoints had checksums (format 3, commit
# d538a18): the run of `reference` (SMALL, 3 epochs) with --checkpoint-every 10, SIGKILLed
# after its 5th checkpoint: epoch 1 done, 8 steps into epoch 2, 40 steps in all.
FORMAT_3 = Path(__file__).parent / "data" / "format3-epoch1-step8.pt"


def test_one_epoch(default_project: Path, tmp_path: Path) -> None:
    result = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("trained 1 epochs on cpu: loss ")
    assert result.stdout.endswith(f", run {tmp_path}\n")
    (progress,) = result.stderr.splitlines()  # not a terminal: one line per epoch
    assert progress.startswith("epoch 1/1 [########################] 32/32 loss ")
    assert progress.split()[7] == "samples/s"
    saved = checkpoint(tmp_path)
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (1, 0, 32)
    assert saved["run"] == {
        "seed": 0,
        "samples": 1024,
        "batch_size": 32,
        "lr": 0.001,
        "noise": 0.05,
        "precision": "32",
        "world_size": 1,
        "accumulate": 1,
    }
    assert saved["scaler"] is None
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest.pt", "metrics.csv"]
    (row,) = metrics(tmp_path)
    assert list(row) == ["epoch", "step", "loss", "samples_per_s", "lr", "seconds"]
    assert (row["epoch"], row["step"], row["lr"]) == ("1", "32", "0.001")
    assert float(row["loss"]) == saved["loss"]  # written in full, not rounded
    assert f"loss {saved['loss']:.4f}" in progress
    assert float(row["samples_per_s"]) > 0
    assert float(row["seconds"]) > 0


def test_seed_command_line_on_a_machine_without_gpu(default_project: Path) -> None:
    """``--device cuda --batch-size 64 --epochs 10``, as the seed documents run it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    result = train(default_project, "--device", "cuda", "--batch-size", "64", "--epochs", "10")
    assert result.returncode == 2
    message = result.stderr.splitlines()[-1]
    assert message.startswith(
        f"python -m {DEFAULT_PACKAGE}.train: error: argument --device: cuda asked for, but CUDA "
        f"is not usable: torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    )
    assert not (default_project / "runs").exists()  # nothing written for a bad command line


KILL_AFTER_CHECKPOINT = """
    import os
    import signal

    _replace = os.replace
    renamed = 0

    def replace(source, destination, *args, **kwargs):
        # SIGKILL this process as soon as the Nth checkpoint is in place.
        global renamed
        _replace(source, destination, *args, **kwargs)
        if os.path.basename(destination) == "latest.pt":
            renamed += 1
            if renamed == int(os.environ["KILL_AT_CHECKPOINT"]):
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
"""


@pytest.mark.parametrize(
    ("workers", "precision"), [("0", "32"), ("2", "32"), ("2", "bf16")], ids=str
)
def test_resume_after_sigkill_mid_epoch_is_bitwise_equal(
    default_project: Path,
    tmp_path: Path,
    reference: Path,
    tmp_path_factory: pytest.TempPathFactory,
    workers: str,
    precision: str,
) -> None:
    """Killed right after a checkpoint in the middle of epoch 2 and resumed: the same
    weights, optimizer state and metrics as the uninterrupted run, which had no workers."""
    if precision != "32":
        reference = tmp_path_factory.mktemp(f"reference-{precision}")
        whole = train(
            default_project, *SMALL, "--epochs", EPOCHS, "--precision", precision,
            "--run-dir", str(reference),
        )  # fmt: skip
        assert whole.returncode == 0, whole.stderr
    run = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--precision", precision, "--run-dir", str(run))
    killer = plant(tmp_path / "plant", KILL_AFTER_CHECKPOINT)
    environ = module_environment(
        default_project, path=(killer,), KILL_AT_CHECKPOINT=str(KILL_AT_CHECKPOINT)
    )
    killed = train(default_project, *args, *EVERY, "--workers", workers, env=environ)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = checkpoint(run)
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (1, 8, 40)
    assert len(metrics(run)) == 1

    resumed = train(default_project, *args, *EVERY, "--workers", workers, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    progress = resumed.stderr.splitlines()
    assert [line.split()[1] for line in progress] == ["2/3", "3/3"]
    assert " 32/32 " in progress[0]  # the epoch's steps in all, before and after the kill
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))
    assert (run / "metrics.csv").read_text().count("epoch,") == 1  # one header


def test_kill_at_an_epoch_end_and_resume_with_other_workers(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """--workers does not change the numbers: killed with 2 workers after epoch 1
    (``--checkpoint-dir``, the older name of ``--run-dir``), resumed with none."""
    run = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--checkpoint-dir", str(run))
    killer = plant(tmp_path / "plant", KILL_AFTER_CHECKPOINT)
    environ = module_environment(default_project, path=(killer,), KILL_AT_CHECKPOINT="1")
    killed = train(default_project, *args, "--workers", "2", env=environ)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (checkpoint(run)["epoch"], checkpoint(run)["step"]) == (1, 0)
    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))


STALLING_SAVE = """
    import io
    import os
    import sys
    import time

    import torch

    _save = torch.save
    saves = 0

    def save(obj, f, *args, **kwargs):
        # The second checkpoint gets half its bytes on disk, then the process hangs
        # there until the test kills it.
        global saves
        saves += 1
        if saves == 2:
            buffer = io.BytesIO()
            _save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            print("STALLED IN SAVE", file=sys.stderr, flush=True)
            time.sleep(600)
        return _save(obj, f, *args, **kwargs)

    torch.save = save
"""


def test_kill_during_checkpoint_write_leaves_latest_intact(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """Killed while writing the checkpoint of epoch 2, after its metrics row: the resumed
    run starts from epoch 1's checkpoint and writes epoch 2's row again, once."""
    stall = plant(tmp_path / "plant", STALLING_SAVE)
    runs = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(runs))
    process = train_in_background(default_project, *args, path=(stall,))
    try:
        wait_for_line(process, "STALLED IN SAVE")
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()

    (partial,) = (path for path in runs.iterdir() if path.suffix == ".tmp")
    assert partial.name.startswith(".latest.pt.")
    with pytest.raises((RuntimeError, OSError)):  # torn: no zip directory at its end
        torch.load(partial, weights_only=True)
    assert checkpoint(runs)["epoch"] == 1  # the complete one from before the kill
    assert [row["epoch"] for row in metrics(runs)] == ["1", "2"]

    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"removed {partial}, an incomplete checkpoint of a killed run"
    )
    assert sorted(path.name for path in runs.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",
    ]
    assert_bitwise_equal(checkpoint(runs), checkpoint(reference))
    assert reproducible(metrics(runs)) == reproducible(metrics(reference))


def test_a_format_3_checkpoint_still_resumes(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """Without checksums to verify, with a warning saying so, and bit for bit."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(FORMAT_3, run / "latest.pt")
    resumed = train(default_project, *SMALL, "--epochs", EPOCHS, "--resume", "--run-dir", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"warning: {run / 'latest.pt'} is a checkpoint of format 3, written by an earlier "
        "version of this command: it has no checksums, so its tensors are not verified"
    )
    assert resumed.stdout.splitlines()[0] == (
        f"resumed {run} at epoch 2, step 8/32 (step 40 of the run)"
    )
    assert checkpoint(run)["format"] == 5
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))


def test_resume_when_already_done(default_project: Path, tmp_path: Path) -> None:
    args = (*SMALL, "--epochs", "1", "--run-dir", str(tmp_path))
    assert train(default_project, *args).returncode == 0
    again = train(default_project, *args, "--resume")
    assert again.returncode == 0
    assert again.stdout == f"{tmp_path / 'latest.pt'} has already trained 1 epochs; nothing to do\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "-1"], "argument --batch-size: must be a positive integer, got '-1'"),
        (["--batch-size", "8.5"], "argument --batch-size: must be a positive integer, got '8.5'"),
        (["--epochs", "0"], "argument --epochs: must be a positive integer, got '0'"),
        (["--lr", "0"], "argument --lr: must be a positive number, got '0'"),
        (["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'"),
        (["--seed", "-3"], "argument --seed: must be an integer from 0 to 2**63-1, got '-3'"),
        (["--samples", "many"], "argument --samples: must be a positive integer, got 'many'"),
        (["--device", "gpu"], "argument --device: must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (
            ["--run-dir", ""],
            "argument --run-dir/--checkpoint-dir: must be a directory path, got an empty string",
        ),
        (["--resume"], "argument --resume: needs --run-dir DIR, the folder of the run"),
        (["--noise", "-1"], "argument --noise: must be a number >= 0, got '-1'"),
        (["--noise", "inf"], "argument --noise: must be a number >= 0, got 'inf'"),
        (
            ["--checkpoint-every", "0"],
            "argument --checkpoint-every: must be a positive integer, got '0'",
        ),
        (["--workers", "-1"], "argument --workers: must be an integer >= 0, got '-1'"),
        (["--workers", "two"], "argument --workers: must be an integer >= 0, got 'two'"),
        (
            ["--precision", "fp8"],
            "argument --precision: must be 32, bf16 or fp16, got 'fp8'",
        ),
        (
            ["--device", "cpu", "--precision", "fp16"],
            "argument --precision: fp16 needs a CUDA device (its gradients are scaled by "
            "torch.amp.GradScaler), and this run uses cpu; on the CPU use bf16",
        ),
    ],
)
def test_bad_flags(
    train_module, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv, message
) -> None:
    monkeypatch.chdir(tmp_path)
    assert usage_error(train_module, capsys, *argv) == message
    assert list(tmp_path.iterdir()) == []  # no run folder for a bad command line


def test_tensorboard_without_the_package(
    train_module, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an uninstalled one raises
    assert usage_error(train_module, capsys, "--device", "cpu", "--tensorboard") == (
        "argument --tensorboard: the tensorboard package is not installed (pip install tensorboard)"
    )
    assert list(tmp_path.iterdir()) == []


def test_default_run_folder_is_new_for_each_run(train_module, monkeypatch, tmp_path) -> None:
    """Created exclusively: a folder of that name made by anyone, a moment before, is
    never shared; -2, -3... follow."""
    monkeypatch.chdir(tmp_path)
    now = train_module.datetime(2026, 12, 1, 9, 30, 5)
    assert train_module.default_run_dir(now, create=False) == Path("runs/2026-12-01_09-30-05")
    assert train_module.default_run_dir(now, create=True) == Path("runs/2026-12-01_09-30-05")
    assert Path("runs/2026-12-01_09-30-05").is_dir()
    assert train_module.default_run_dir(now, create=True) == Path("runs/2026-12-01_09-30-05-2")
    Path("runs/2026-12-01_09-30-05-3").symlink_to(tmp_path)  # planted: not a folder to use
    assert train_module.default_run_dir(now, create=True) == Path("runs/2026-12-01_09-30-05-4")
    assert sorted(path.name for path in Path("runs").iterdir()) == [
        "2026-12-01_09-30-05", "2026-12-01_09-30-05-2", "2026-12-01_09-30-05-3",
        "2026-12-01_09-30-05-4",
    ]  # fmt: skip


def test_cuda_device_without_gpu(train_module, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    for device in ("cuda", "cuda:1"):
        message = usage_error(train_module, capsys, "--device", device)
        assert message.startswith(
            f"argument --device: {device} asked for, but CUDA is not usable: "
        )
        assert "CPU-only build" in message


def test_bad_checkpoint_directories(
    train_module, capsys, tmp_path: Path, finished_run: Path
) -> None:
    missing = tmp_path / "missing"
    assert usage_error(train_module, capsys, "--resume", "--run-dir", str(missing)) == (
        f"argument --run-dir: {missing} does not exist (nothing to resume)"
    )
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert usage_error(train_module, capsys, "--resume", "--checkpoint-dir", str(empty)) == (
        f"argument --resume: no checkpoint in {empty} (latest.pt is missing)"
    )
    before = (finished_run / "latest.pt").read_bytes()
    assert usage_error(train_module, capsys, "--run-dir", str(finished_run)) == (
        f"argument --run-dir: {finished_run} already holds a run (latest.pt): pass "
        "--resume to continue it, or choose another folder"
    )
    assert (finished_run / "latest.pt").read_bytes() == before
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    message = usage_error(train_module, capsys, "--run-dir", str(a_file / "sub"))
    assert message.startswith(f"argument --run-dir: cannot create {a_file / 'sub'}: ")


def resume(directory: Path) -> tuple[str, ...]:
    return (*SMALL, "--resume", "--run-dir", str(directory))


def test_corrupt_checkpoint(train_module, capsys, finished_run: Path) -> None:
    latest = finished_run / "latest.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message.startswith(f"argument --resume: {latest} is not a readable checkpoint (")
    latest.write_bytes(b"not a checkpoint at all")
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert message.startswith(f"argument --resume: {latest} is not a readable checkpoint (")
    torch.save({"weights": torch.ones(2)}, latest)
    assert usage_error(train_module, capsys, *resume(finished_run)) == (
        f"argument --resume: {latest} is not a checkpoint written by this training command"
    )


def test_checkpoint_of_another_format_is_refused(train_module, capsys, finished_run: Path) -> None:
    latest = finished_run / "latest.pt"
    state = torch.load(latest, weights_only=True)
    assert state["format"] == 5  # resumes are tested with this one (and formats 3, 4)
    torch.save({**state, "format": 2}, latest)
    assert usage_error(train_module, capsys, *resume(finished_run)) == (
        f"argument --resume: {latest} was written by another version of this training "
        "command (checkpoint format 2; this one reads formats 3, 4 and 5): start a new --run-dir"
    )


def test_checkpoint_is_loaded_as_data(
    train_module, capsys, finished_run: Path, tmp_path: Path
) -> None:
    """A checkpoint that would run code when unpickled is refused, and the code never runs."""
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"format": 2, "payload": Payload()}, finished_run / "latest.pt")
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert "is not a readable checkpoint" in message
    assert not marker.exists()
    # What is in it, and never torch's hint that weights_only=False "will likely succeed".
    assert "pathlib.Path" in message
    assert "weights_only" not in message
    assert "succeed" not in message


def test_resume_with_other_data_is_refused(train_module, capsys, finished_run: Path) -> None:
    argv = (*resume(finished_run), "--samples", "2048")
    assert usage_error(train_module, capsys, *argv) == (
        f"argument --samples: {finished_run / 'latest.pt'} was trained with --samples 1024, "
        "this run has 2048, which makes another data set; use the same value, or a new "
        "--run-dir"
    )


def test_resume_with_another_schedule_warns(default_project: Path, finished_run: Path) -> None:
    """Another batch size or learning rate is allowed, with a warning, and takes effect."""
    args = ("--device", "cpu", "--samples", "1024", "--batch-size", "64", "--lr", "0.01")
    result = train(
        default_project, *args, "--epochs", "2", "--checkpoint-dir", str(finished_run), "--resume"
    )
    assert result.returncode == 0, result.stderr
    latest = finished_run / "latest.pt"
    assert result.stderr.splitlines()[:2] == [
        f"warning: {latest} was trained with batch size 32 and this run uses 64: training "
        "continues, but not bit for bit as an uninterrupted run would",
        f"warning: {latest} was trained with lr 0.001 and this run uses 0.01: training "
        "continues, but not bit for bit as an uninterrupted run would",
    ]
    assert " 16/16 " in result.stderr.splitlines()[2]  # 1024 samples, 64 a step
    saved = checkpoint(finished_run)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.01
    assert saved["run"]["batch_size"] == 64


def test_running_mean_resumed_from_its_state_ends_with_the_same_bits(train_module) -> None:
    """Across a fold of the partial sums (every 1,024 steps) and an interruption between."""
    torch.manual_seed(0)
    losses = torch.rand(2500) * 3
    sizes = [64] * 2499 + [17]
    device = torch.device("cpu")
    whole = train_module.RunningMean(device)
    for loss, size in zip(losses, sizes, strict=True):
        whole.add(loss, size)
    first = train_module.RunningMean(device)
    for loss, size in zip(losses[:1500], sizes[:1500], strict=True):
        first.add(loss, size)
    state = first.state()
    assert state["partials"].shape == (1,)
    assert state["losses"].shape == (1500 - 1024,)
    state = torch.load(io.BytesIO(save_bytes(state)), weights_only=True)  # as in a checkpoint
    second = train_module.RunningMean(device, state)
    for loss, size in zip(losses[1500:], sizes[1500:], strict=True):
        second.add(loss, size)
    assert second.count == whole.count == 64 * 2499 + 17
    assert torch.equal(second.total(), whole.total())
    expected = (losses.double() * torch.tensor(sizes, dtype=torch.float64)).sum() / whole.count
    assert whole.value() == pytest.approx(expected.item(), rel=1e-12)


def save_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_synthetic_data_makes_dynamic_net_skip_its_block_for_some_batches(train_module) -> None:
    """Why DDP needs ``find_unused_parameters=True`` for this model and data."""
    inputs, _ = train_module.synthetic_data(8192, seed=0)
    torch.manual_seed(0)
    model = train_module.DynamicNet(in_features=16, out_features=4)
    skipped = used = 0
    for batch in inputs[torch.randperm(8192, generator=torch.Generator().manual_seed(0))].split(64):
        first = torch.tanh(model.encoder(batch))
        if first.abs().mean() < model.tolerance:
            skipped += 1
        else:
            used += 1
    assert skipped > 0
    assert used > 0


def test_batches_without_workers_are_the_dataloaders(train_module) -> None:
    """--workers 0 skips the DataLoader; the batches, and their order from a mid-epoch
    position, are bit for bit those a DataLoader with no workers yields."""
    data = importlib.import_module(f"{DEFAULT_PACKAGE}._data")
    inputs, labels = train_module.synthetic_data(1000, seed=3)
    dataset = data.SyntheticBatches(inputs, labels, noise=0.1, seed=3)
    batches = data.EpochBatches(1000, 64, seed=3)
    in_process = data.loader(dataset, batches, workers=0, seed=3, pin_memory=False)
    reference = torch.utils.data.DataLoader(dataset, sampler=batches, batch_size=None)
    assert isinstance(in_process, data.InProcessBatches)
    assert len(in_process) == len(reference) == 16
    for epoch, start in ((0, 0), (1, 5)):
        batches.set_position(epoch, start)
        ours = list(in_process)
        batches.set_position(epoch, start)
        theirs = list(reference)
        assert len(ours) == len(theirs) == 16 - start
        for (x, y), (x_ref, y_ref) in zip(ours, theirs, strict=True):
            assert torch.equal(x.view(torch.int32), x_ref.view(torch.int32))
            assert torch.equal(y, y_ref)
    batches.set_position(0)
    assert not torch.equal(next(iter(in_process))[0], ours[0][0])  # another epoch, other data


def test_progress_bar(default_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the line is redrawn in place; elsewhere only finished epochs are
    written, and the loss (a GPU synchronization) is read only for a line drawn."""
    monkeypatch.syspath_prepend(str(default_project / "src"))
    progress_module = importlib.import_module(f"{DEFAULT_PACKAGE}._progress")
    reads = []

    def loss() -> float:
        reads.append(1)
        return 0.5

    log = io.StringIO()
    quiet = progress_module.Progress(2, 4, stream=log, interactive=False)
    quiet.start_epoch(1)
    for step in range(1, 5):
        quiet.update(step, step * 8, loss)
    quiet.end_epoch(32, 0.25)
    assert reads == []
    (line,) = log.getvalue().splitlines()
    assert line.startswith("epoch 1/2 [########################] 4/4 loss 0.2500 ")

    terminal = io.StringIO()
    live = progress_module.Progress(2, 4, stream=terminal, interactive=True, min_interval=0)
    live.start_epoch(2)
    live.update(2, 16, loss)
    live.end_epoch(32, 0.25)
    assert reads == [1]
    drawn, finished = terminal.getvalue().split("\x1b[K", 1)
    assert drawn.startswith("\repoch 2/2 [############------------] 2/4 loss 0.5000 ")
    assert finished.startswith("\repoch 2/2 [########################] 4/4 loss 0.2500 ")
    assert finished.endswith("\x1b[K\n")


def test_torchrun_two_processes_on_cpu(default_project: Path, tmp_path: Path) -> None:
    """Two processes, and the same run with rank 0 killed mid-epoch 2 and resumed."""
    args = ("--device", "cpu", "--samples", "512", "--batch-size", "32", "--epochs", "2")
    whole, split = tmp_path / "whole", tmp_path / "split"
    result = torchrun(default_project, *args, "--run-dir", str(whole))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("trained 2 epochs on 2 processes on cpu (gloo): loss ")
    # DynamicNet's block is used only when its loop goes on: DDP must search for unused ones.
    assert (
        "DistributedDataParallel: find_unused_parameters=True needed: block.0.weight, "
        "block.0.bias reached only when `if h.abs().mean() < self.tolerance:` at "
    ) in result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"]  # rank 0 only
    assert "8/8" in progress[0]  # 512 samples in 2 shares of 256: 8 steps of 32
    saved = checkpoint(whole)
    assert saved["run"]["world_size"] == 2
    assert len(saved["processes"]) == 2
    assert [row["epoch"] for row in metrics(whole)] == ["1", "2"]

    # Checkpoints at steps 3, 6, 8 (epoch 1's end), 9: killed at step 1 of epoch 2.
    killer = plant(tmp_path / "plant", KILL_AFTER_CHECKPOINT)
    every = ("--checkpoint-every", "3", "--run-dir", str(split))
    killed = torchrun(default_project, *args, *every, path=(killer,), KILL_AT_CHECKPOINT="4")
    assert killed.returncode != 0
    assert (checkpoint(split)["epoch"], checkpoint(split)["step"]) == (1, 1)
    resumed = torchrun(default_project, *args, *every, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(split), saved)
    assert reproducible(metrics(split)) == reproducible(metrics(whole))


def test_tensorboard_events_hold_the_metrics(default_project: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(
        default_project, *SMALL, "--epochs", "2", "--tensorboard", "--run-dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/seconds", "train/epoch"} <= set(
        events.Tags()["scalars"]
    )
    losses = [(event.step, event.value) for event in events.Scalars("train/loss")]
    rows = metrics(tmp_path)
    assert losses == [(int(row["step"]), pytest.approx(float(row["loss"]))) for row in rows]


def test_fp16_gradient_scaler_state_is_checkpointed_and_resumed(
    train_module, tmp_path: Path
) -> None:
    """fp16 with torch.amp.GradScaler, in-process on the CPU: the command allows fp16 on
    CUDA only, but GradScaler("cpu") has the same state (scale, growth tracker) and the
    same step logic, and that state is what a checkpoint must carry across a resume."""
    device = torch.device("cpu")
    settings = dict(device="cpu", samples=512, batch_size=32, precision="fp16")
    whole, split = tmp_path / "whole", tmp_path / "split"
    for folder in (whole, split):
        folder.mkdir()
    launch = train_module.Launch()
    config = train_module.Config(**settings, epochs=2, run_dir=whole)
    train_module.train(config, launch, device, log=io.StringIO())
    first = train_module.Config(**settings, epochs=1, run_dir=split, checkpoint_every=5)
    train_module.train(first, launch, device, log=io.StringIO())
    saved = checkpoint(split)
    assert saved["scaler"]["scale"] == 65536.0  # no overflow here: the initial scale
    assert saved["scaler"]["_growth_tracker"] == 16  # the steps since the last change
    resume = train_module.Config(**settings, epochs=2, run_dir=split, resume=True)
    resumed = train_module.load_resumable(resume, launch, device, io.StringIO())
    train_module.train(resume, launch, device, resumed, log=io.StringIO())
    assert checkpoint(split)["scaler"] == checkpoint(whole)["scaler"]
    assert checkpoint(whole)["scaler"]["_growth_tracker"] == 32
    assert_bitwise_equal(checkpoint(split), checkpoint(whole))


@pytest.mark.slow
def test_installed_commands(default_project: Path, project_env, tmp_path: Path) -> None:
    """``pip install`` puts both commands on PATH ([project.scripts])."""
    project_env.install(default_project)
    environ = project_env.env()
    bin_dir = project_env.root / "bin"
    work = tmp_path / "work"
    work.mkdir()
    doctor = subprocess.run(
        [bin_dir / "dynamic-model-doctor"], env=environ, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.startswith("check")
    trained = subprocess.run(
        [bin_dir / "dynamic-model-train", *SMALL, "--epochs", "1"],
        env=environ,
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.startswith("trained 1 epochs on cpu")
    (run,) = (work / "runs").iterdir()  # runs/<date-time> by default
    assert trained.stdout.endswith(f", run {run.relative_to(work)}\n")
    assert sorted(path.name for path in run.iterdir()) == ["latest.pt", "metrics.csv"]
    wrong = subprocess.run(
        [bin_dir / "dynamic-model-train", "--epochs", "0"],
        env=environ,
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines()[-1].startswith("dynamic-model-train: error: argument --epochs")
