"""The generated project's ``<package>-train``, run for real on the CPU.

Runs go through ``python -m dynamic_model.train`` (and ``torchrun``) in subprocesses
that are killed with SIGKILL where a crash is the point: mid-training, and halfway
through writing a checkpoint (a ``sitecustomize`` module makes ``torch.save`` stall
there). Resumed runs must end with weights and optimizer state bitwise equal to an
uninterrupted run's. Bad command lines are checked in-process through ``main()``.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, module_environment, run_module

TRAIN = f"{DEFAULT_PACKAGE}.train"
# Small enough for seconds per run, large enough for several steps per epoch.
SMALL = ("--device", "cpu", "--samples", "1024", "--batch-size", "32")
# Killed after epoch 2, a run still has 8 epochs to go: time enough to kill it mid-training
# even when the test process gets the CPU late.
EPOCHS = "10"


def train(project: Path, *args: str, env: dict[str, str] | None = None):
    return run_module(project, TRAIN, *args, env=env)


def checkpoint(directory: Path) -> dict:
    return torch.load(directory / "latest.pt", weights_only=True)


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    """Same epoch, loss, weights and optimizer state, bit for bit."""
    assert (actual["epoch"], actual["loss"]) == (expected["epoch"], expected["loss"])
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), f"weight {name} differs"
    for index, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"]["state"][index][key], tensor), (index, key)


def wait_for_line(process: subprocess.Popen, text: str) -> list[str]:
    """Read the process's stderr up to the line containing ``text``; the lines read."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(
        f"the run ended (exit {process.wait()}) before printing {text!r}:\n{''.join(lines)}"
    )


@pytest.fixture(scope="module")
def reference(default_project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run the interrupted ones are compared with."""
    directory = tmp_path_factory.mktemp("reference")
    result = train(default_project, *SMALL, "--epochs", EPOCHS, "--checkpoint-dir", str(directory))
    assert result.returncode == 0, result.stderr
    return checkpoint(directory)


def test_one_epoch(default_project: Path, tmp_path: Path) -> None:
    result = train(default_project, *SMALL, "--epochs", "1", "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("trained 1 epochs on cpu: loss ")
    (progress,) = result.stderr.splitlines()  # not a terminal: one line per epoch
    assert progress.startswith("epoch 1/1 [########################] 32/32 loss ")
    assert progress.split()[7] == "samples/s"
    saved = checkpoint(tmp_path)
    assert saved["epoch"] == 1
    assert saved["run"] == {
        "seed": 0,
        "samples": 1024,
        "batch_size": 32,
        "lr": 0.001,
        "world_size": 1,
    }
    assert [path.name for path in tmp_path.iterdir()] == ["latest.pt"]


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


def test_resume_after_sigkill_mid_training_is_bitwise_equal(
    default_project: Path, tmp_path: Path, reference: dict
) -> None:
    args = (*SMALL, "--epochs", EPOCHS, "--checkpoint-dir", str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", TRAIN, *args],
        env=module_environment(default_project),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_line(process, f"epoch  2/{EPOCHS}")
        assert process.poll() is None, "the run finished before it could be killed"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL
    killed_at = checkpoint(tmp_path)["epoch"]
    assert 2 <= killed_at < int(EPOCHS)

    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert [line.split()[1] for line in resumed.stderr.splitlines()] == [
        f"{epoch}/{EPOCHS}" for epoch in range(killed_at + 1, int(EPOCHS) + 1)
    ]
    assert_bitwise_equal(checkpoint(tmp_path), reference)


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
    default_project: Path, tmp_path: Path, reference: dict
) -> None:
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(textwrap.dedent(STALLING_SAVE))
    runs = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--checkpoint-dir", str(runs))
    process = subprocess.Popen(
        [sys.executable, "-m", TRAIN, *args],
        env=module_environment(default_project, path=(plant,)),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_line(process, "STALLED IN SAVE")
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()

    (partial,) = (path for path in runs.iterdir() if path.name != "latest.pt")
    assert partial.name.startswith(".latest.pt.")
    assert partial.suffix == ".tmp"
    with pytest.raises((RuntimeError, OSError)):  # torn: no zip directory at its end
        torch.load(partial, weights_only=True)
    assert checkpoint(runs)["epoch"] == 1  # the complete one from before the kill

    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"removed {partial}, an incomplete checkpoint of a killed run"
    )
    assert [path.name for path in runs.iterdir()] == ["latest.pt"]
    assert_bitwise_equal(checkpoint(runs), reference)


def test_resume_when_already_done(default_project: Path, tmp_path: Path) -> None:
    args = (*SMALL, "--epochs", "1", "--checkpoint-dir", str(tmp_path))
    assert train(default_project, *args).returncode == 0
    again = train(default_project, *args, "--resume")
    assert again.returncode == 0
    assert again.stdout == f"{tmp_path / 'latest.pt'} has already trained 1 epochs; nothing to do\n"


@pytest.fixture
def train_module(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return importlib.import_module(TRAIN)


@pytest.fixture
def finished_run(tmp_path: Path, default_project: Path) -> Path:
    """A checkpoint directory of a finished 1-epoch run with ``SMALL``."""
    directory = tmp_path / "finished"
    result = train(default_project, *SMALL, "--epochs", "1", "--checkpoint-dir", str(directory))
    assert result.returncode == 0, result.stderr
    return directory


def usage_error(train_module, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(list(argv))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"usage: python -m {DEFAULT_PACKAGE}.train ")
    assert "Traceback" not in "\n".join(lines)
    prefix = f"python -m {DEFAULT_PACKAGE}.train: error: "
    assert lines[-1].startswith(prefix)
    return lines[-1].removeprefix(prefix)


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
            ["--checkpoint-dir", ""],
            "argument --checkpoint-dir: must be a directory path, got an empty string",
        ),
        (["--resume"], "argument --resume: needs --checkpoint-dir DIR, the directory of the run"),
    ],
)
def test_bad_flags(train_module, capsys, argv: list[str], message: str) -> None:
    assert usage_error(train_module, capsys, *argv) == message


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
    assert usage_error(train_module, capsys, "--resume", "--checkpoint-dir", str(missing)) == (
        f"argument --checkpoint-dir: {missing} does not exist (nothing to resume)"
    )
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert usage_error(train_module, capsys, "--resume", "--checkpoint-dir", str(empty)) == (
        f"argument --resume: no checkpoint in {empty} (latest.pt is missing)"
    )
    before = (finished_run / "latest.pt").read_bytes()
    assert usage_error(train_module, capsys, "--checkpoint-dir", str(finished_run)) == (
        f"argument --checkpoint-dir: {finished_run} already holds a run (latest.pt): pass "
        "--resume to continue it, or choose another directory"
    )
    assert (finished_run / "latest.pt").read_bytes() == before
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    message = usage_error(train_module, capsys, "--checkpoint-dir", str(a_file / "sub"))
    assert message.startswith(f"argument --checkpoint-dir: cannot create {a_file / 'sub'}: ")


def resume(directory: Path) -> tuple[str, ...]:
    return (*SMALL, "--resume", "--checkpoint-dir", str(directory))


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


def test_checkpoint_is_loaded_as_data(
    train_module, capsys, finished_run: Path, tmp_path: Path
) -> None:
    """A checkpoint that would run code when unpickled is refused, and the code never runs."""
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"format": 1, "payload": Payload()}, finished_run / "latest.pt")
    message = usage_error(train_module, capsys, *resume(finished_run))
    assert "is not a readable checkpoint" in message
    assert not marker.exists()


def test_resume_with_other_data_is_refused(train_module, capsys, finished_run: Path) -> None:
    argv = (*resume(finished_run), "--samples", "2048")
    assert usage_error(train_module, capsys, *argv) == (
        f"argument --samples: {finished_run / 'latest.pt'} was trained with --samples 1024, "
        "this run has 2048, which makes another data set; use the same value, or a new "
        "--checkpoint-dir"
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


def torchrun(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone`` with 2 CPU processes talking gloo over the loopback device."""
    environ = module_environment(project, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = ("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", TRAIN)
    return run_module(project, *command, *args, env=environ)


def test_torchrun_two_processes_on_cpu(default_project: Path, tmp_path: Path) -> None:
    args = ("--device", "cpu", "--samples", "512", "--batch-size", "32")
    whole, split = tmp_path / "whole", tmp_path / "split"
    result = torchrun(default_project, *args, "--epochs", "2", "--checkpoint-dir", str(whole))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("trained 2 epochs on 2 processes on cpu (gloo): loss ")
    progress = [line for line in result.stderr.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"]  # rank 0 only
    assert "8/8" in progress[0]  # 512 samples in 2 shares of 256: 8 steps of 32
    saved = checkpoint(whole)
    assert saved["run"]["world_size"] == 2
    assert len(saved["rng"]) == 2

    first = torchrun(default_project, *args, "--epochs", "1", "--checkpoint-dir", str(split))
    assert first.returncode == 0, first.stderr
    second = torchrun(
        default_project, *args, "--epochs", "2", "--checkpoint-dir", str(split), "--resume"
    )
    assert second.returncode == 0, second.stderr
    assert_bitwise_equal(checkpoint(split), saved)


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
    assert os.listdir(work) == []  # no checkpoint unless asked for
    wrong = subprocess.run(
        [bin_dir / "dynamic-model-train", "--epochs", "0"],
        env=environ,
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines()[-1].startswith("dynamic-model-train: error: argument --epochs")
