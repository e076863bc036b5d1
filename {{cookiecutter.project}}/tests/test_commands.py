"""The project's commands, run as a user runs them: ``python -m {{ cookiecutter.package }}.doctor``,
``python -m {{ cookiecutter.package }}.train`` and ``python -m {{ cookiecutter.package }}.launch`` in a fresh process.

The GPU tests run with ``pytest --gpu``; each subprocess inherits this test process's
``CUDA_VISIBLE_DEVICES``, so under ``-n auto`` it uses this worker's GPU.
"""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from {{ cookiecutter.package }} import train

SMALL = ("--samples", "512", "--batch-size", "32")
# The dev container's services are not what these tests are about.
SERVICES = ("PROJECT_SSH_PORT", "PROJECT_JUPYTER_PORT")


def run(command: str, *args: str) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name not in SERVICES}
    return subprocess.run(
        [sys.executable, "-m", f"{{ cookiecutter.package }}.{command}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def failures(doctor: subprocess.CompletedProcess) -> list[dict]:
    return [check for check in json.loads(doctor.stdout)["checks"] if check["status"] == "FAIL"]


def assert_resume_is_bitwise_equal(device: str, tmp_path) -> None:
    """Two epochs in one run, and one epoch then ``--resume`` to two: the same weights."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    for args in (
        ("--epochs", "2", "--checkpoint-dir", str(whole)),
        ("--epochs", "1", "--checkpoint-dir", str(split)),
        ("--epochs", "2", "--checkpoint-dir", str(split), "--resume"),
    ):
        result = run("train", "--device", device, *SMALL, *args)
        assert result.returncode == 0, result.stderr
    expected, actual = (
        torch.load(directory / "latest.pt", weights_only=True)["model"]
        for directory in (whole, split)
    )
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} differs after --resume on {device}"


def test_doctor_finds_nothing_wrong():
    doctor = run("doctor", "--json")
    assert doctor.returncode == 0, failures(doctor)


@pytest.mark.slow
def test_train_resumes_bit_for_bit_on_the_cpu(tmp_path):
    assert_resume_is_bitwise_equal("cpu", tmp_path)


@pytest.mark.slow
def test_train_stops_on_sigterm_and_resumes_bit_for_bit(tmp_path):
    """What a preempted job sees (``docker stop``, SLURM): SIGTERM after step 20 of 32,
    a checkpoint of step 20, exit status 143 (128 + 15); ``--resume`` then ends with the
    weights of an uninterrupted run. In this process, so the signal lands at that step."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ["--device", "cpu", *SMALL, "--epochs", "2"]
    assert train.main([*args, "--run-dir", str(whole)]) == 0
    steps = []

    def sigterm_after_step_20(optimizer, args, kwargs):
        steps.append(optimizer)
        if len(steps) == 20:
            os.kill(os.getpid(), signal.SIGTERM)

    hook = register_optimizer_step_post_hook(sigterm_after_step_20)
    try:
        assert train.main([*args, "--run-dir", str(split)]) == 128 + signal.SIGTERM
    finally:
        hook.remove()
    assert torch.load(split / "latest.pt", weights_only=True)["global_step"] == 20
    assert train.main([*args, "--run-dir", str(split), "--resume"]) == 0
    expected, actual = (
        torch.load(directory / "latest.pt", weights_only=True)["model"]
        for directory in (whole, split)
    )
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} differs after the stop and --resume"


# The quick mode of the preemption fuzz: each stop signal once, at a seeded random
# moment of a run (start-up, training, a checkpoint's write, after the last step, the
# exit), each run then resumed as it says until it finishes. The moments count from
# the end of the imports (a signal during torch's import, before train's main runs,
# is the one moment not covered: its default action stands). benchmarks/preemption_fuzz.py
# in the template runs the long fuzz.
FUZZ_SEED = 0
FUZZ_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGKILL)
# A SMALL run of 2 epochs takes about a second after its imports: the moments go past
# its end, into the exit.
FUZZ_LATEST_S = 1.5
# Loaded first by the fuzzed runs: the imports done, it says so on stderr.
IMPORTED = "imported"
SITECUSTOMIZE = (
    f"import sys\nimport {train.__name__}\nprint({IMPORTED!r}, file=sys.stderr, flush=True)\n"
)


@pytest.mark.slow
def test_train_survives_stop_signals_at_random_moments(tmp_path):
    whole = tmp_path / "whole"
    args = ["--device", "cpu", *SMALL, "--epochs", "2"]
    assert train.main([*args, "--run-dir", str(whole)]) == 0
    expected = torch.load(whole / "latest.pt", weights_only=True)["model"]
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {name: value for name, value in os.environ.items() if name not in SERVICES}
    planted = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    draw = random.Random(FUZZ_SEED)
    for trial, kind in enumerate(draw.sample(FUZZ_SIGNALS, k=len(FUZZ_SIGNALS))):  # each once
        folder = tmp_path / f"trial-{trial}"
        delay = draw.uniform(0.0, FUZZ_LATEST_S)
        command = [sys.executable, "-m", train.__name__, *args, "--run-dir", str(folder)]
        process = subprocess.Popen(command, env=planted, stderr=subprocess.PIPE, text=True)
        assert process.stderr is not None
        first = process.stderr.readline()
        assert first.strip() == IMPORTED, first
        time.sleep(delay)
        process.send_signal(kind)
        _, stderr = process.communicate(timeout=600)
        status = process.returncode
        what = f"trial {trial}: {kind.name} {delay:.2f} s after the imports, exit {status}"
        assert status in (0, 128 + kind, -signal.SIGKILL), f"{what}:\n{stderr}"
        if status == 128 + kind:
            printed = [
                line
                for line in stderr.splitlines()
                if line.startswith(("resume with: ", "start again with: "))
            ]
            assert printed, f"{what}: no command to go on with:\n{stderr}"
            command = [sys.executable, *shlex.split(printed[-1].partition(": ")[2])[1:]]
        elif status != 0:  # SIGKILL: what the README says to run after a kill
            resume = ["--resume"] if (folder / "latest.pt").exists() else []
            command = [*command, *resume]
        if status != 0:
            rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            assert rerun.returncode == 0, f"{what}, then {shlex.join(command)}:\n{rerun.stderr}"
        actual = torch.load(folder / "latest.pt", weights_only=True)["model"]
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), f"{what}: {name} differs once resumed"


def test_train_rejects_a_bad_flag():
    result = run("train", "--epochs", "0")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].endswith(
        "error: argument --epochs: must be a positive integer, got '0'"
    )


def test_launch_writes_a_slurm_batch_script(tmp_path):
    """``launch slurm --dry-run`` prints the job script (a cluster is not needed for it)."""
    result = run("launch", "slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "0",
                 "--", "--epochs", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --requeue" in result.stdout
    script = tmp_path / "job.sbatch"
    script.write_text(result.stdout)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    wrong = run("launch", "slurm", "--dry-run", "--", "--epochs", "0")
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines()[-1].endswith(
        "error: train arguments (after --): argument --epochs: must be a positive integer, got '0'"
    )


def test_doctor_with_require_gpu(gpu):
    doctor = run("doctor", "--json", "--require-gpu")
    assert doctor.returncode == 0, failures(doctor)
    names = [check["check"] for check in json.loads(doctor.stdout)["checks"]]
    assert "autograd cuda:0" in names


@pytest.mark.slow
def test_train_resumes_bit_for_bit_on_the_gpu(gpu, tmp_path):
    assert_resume_is_bitwise_equal("cuda", tmp_path)
