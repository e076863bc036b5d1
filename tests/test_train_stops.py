"""The generated ``train`` stopped by real signals and resumed, and one writer per run folder.

The contract launch scripts rely on (``<project>-launch slurm`` among them): SIGINT,
SIGTERM or SIGUSR1 stop training after the step under way, ``latest.pt`` then holds
that exact position, the last two lines of stderr say where it stopped and the command
that resumes, and the exit status is 128 + the signal's number; that command (the same
``--run-dir`` and ``--resume``) continues bit for bit.

The signals are real ones, delivered by the kernel: a ``sitecustomize`` module
registers a global optimizer step hook (``register_optimizer_step_post_hook``) that
sends the process a signal with ``os.kill`` right after its Nth step, or the test
sends SIGTERM to ``torchrun`` itself from outside, as ``docker stop`` or SLURM would.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import module_environment, run_module
from training import (
    AFTER_STEP,
    EPOCHS,
    SMALL,
    TRAIN,
    assert_bitwise_equal,
    checkpoint,
    metrics,
    plant,
    reproducible,
    run_printed,
    torchrun,
    train,
    train_in_background,
    wait_for_line,
)

STEPS = 32  # an epoch of SMALL

# Then, while torch.save writes the checkpoint of the stop, a SIGTERM and a SIGINT after
# every chunk it writes.
SIGNALS_DURING_THE_WRITE = """
    import torch

    _save = torch.save


    def save(obj, file, *args, **kwargs):
        if steps >= int(os.environ["AFTER_STEP"]):
            write = file.write

            def write_and_signal(data):
                written = write(data)
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
                return written

            file.write = write_and_signal
        return _save(obj, file, *args, **kwargs)


    torch.save = save
"""


@pytest.mark.parametrize(
    ("name", "after", "workers"),
    [
        ("SIGTERM", 1, "0"),  # the first step
        ("SIGTERM", 32, "2"),  # the last step of epoch 1: stops once the epoch is done
        ("SIGTERM", 40, "0"),  # inside epoch 2, past an epoch's end
        ("SIGTERM", 95, "2"),  # the last step but one of the run
        ("SIGINT", 17, "2"),  # Ctrl-C (DataLoader workers ignore it; the main process stops)
        ("SIGUSR1", 70, "0"),  # SLURM's --signal=USR1@SECONDS
    ],
    ids=str,
)
def test_stopped_by_a_signal_then_resumed_is_bitwise_equal(
    default_project: Path,
    tmp_path: Path,
    reference: Path,
    name: str,
    after: int,
    workers: str,
) -> None:
    run = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--workers", workers, "--run-dir", str(run))
    stopper = plant(tmp_path / "plant", AFTER_STEP)
    environ = module_environment(
        default_project, path=(stopper,), AFTER_STEP_DO=name, AFTER_STEP=str(after)
    )
    stopped = train(default_project, *args, env=environ)
    assert stopped.returncode == 128 + getattr(signal, name), stopped.stderr
    epoch, step = divmod(after, STEPS)
    saved = checkpoint(run)
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (epoch, step, after)
    where = f"epoch {epoch + 1}, step {step}/{STEPS} (step {after} of the run)"
    *progress, message, command = stopped.stderr.splitlines()
    assert all(line.startswith("epoch ") for line in progress), stopped.stderr
    assert message == f"stopped by {name} at {where}; checkpoint {run / 'latest.pt'}"
    workers_flag = " --workers 2" if workers == "2" else ""
    assert command == (
        f"resume with: python -m {TRAIN} --device cpu --batch-size 32 --epochs {EPOCHS} "
        f"--samples 1024{workers_flag} --run-dir {run} --resume"
    )
    kept = ["previous.pt"] if after > STEPS else []  # the checkpoint of an earlier step
    assert sorted(path.name for path in run.iterdir()) == ["latest.pt", "metrics.csv", *kept]

    resumed = run_printed(default_project, command.removeprefix("resume with: "))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == f"resumed {run} at {where}"
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))


def test_signals_during_the_checkpoint_write_change_nothing(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """SIGTERM after step 40, then a SIGTERM and a SIGINT after every chunk torch.save
    writes of that step's checkpoint: the first signal stands, the checkpoint is whole."""
    run = tmp_path / "run"
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(run))
    stopper = plant(tmp_path / "plant", AFTER_STEP + SIGNALS_DURING_THE_WRITE)
    environ = module_environment(
        default_project, path=(stopper,), AFTER_STEP_DO="SIGTERM", AFTER_STEP="40"
    )
    stopped = train(default_project, *args, env=environ)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.splitlines()[-2].startswith("stopped by SIGTERM at epoch 2, step 8/32")
    assert (checkpoint(run)["epoch"], checkpoint(run)["step"]) == (1, 8)
    resumed = train(default_project, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))


SLOW_STEPS = """
    import os
    import sys
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0


    def after_step(optimizer, args, kwargs):
        # From step $SLOW_FROM on, say so (once) and take 0.2 s a step: time for the test
        # to send its signal while training goes on.
        global steps
        steps += 1
        if steps == int(os.environ["SLOW_FROM"]):
            print("SLOW FROM NOW ON", file=sys.stderr, flush=True)
        if steps >= int(os.environ["SLOW_FROM"]):
            time.sleep(0.2)


    register_optimizer_step_post_hook(after_step)
"""


def test_torchrun_processes_stop_at_the_same_step(default_project: Path, tmp_path: Path) -> None:
    """Under torchrun with 2 gloo processes: a signal to one process only, and SIGTERM to
    torchrun (which forwards it to each process in turn). Both processes stop after the
    same step, one after the step at which the signal was seen (the processes' exchange
    of it overlaps that step), and the printed command resumes bit for bit."""
    args = ("--device", "cpu", "--samples", "512", "--batch-size", "32", "--epochs", "2")
    whole, alone, forwarded = tmp_path / "whole", tmp_path / "alone", tmp_path / "forwarded"
    result = torchrun(default_project, *args, "--run-dir", str(whole))
    assert result.returncode == 0, result.stderr

    # SIGUSR1 to rank 1 alone, after its step 5: both stop after step 6 of 8.
    stopper = plant(tmp_path / "stopper", AFTER_STEP)
    stopped = torchrun(
        default_project, *args, "--run-dir", str(alone), path=(stopper,),
        AFTER_STEP_DO="SIGUSR1", AFTER_STEP="5", AFTER_STEP_RANK="1",
    )  # fmt: skip
    assert stopped.returncode != 0  # torchrun reports its processes' 138 as a failure
    assert f"stopped by SIGUSR1 at epoch 1, step 6/8 (step 6 of the run); checkpoint {alone}" in (
        stopped.stderr
    )
    assert (checkpoint(alone)["epoch"], checkpoint(alone)["step"]) == (0, 6)
    (command,) = [line for line in stopped.stderr.splitlines() if line.startswith("resume with")]
    assert command == (
        f"resume with: torchrun --standalone --nproc_per_node 2 -m {TRAIN} --device cpu "
        f"--batch-size 32 --epochs 2 --samples 512 --run-dir {alone} --resume"
    )
    resumed = run_printed(
        default_project, command.removeprefix("resume with: "),
        GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {alone} at epoch 1, step 6/8 (step 6 of the run)" in resumed.stdout
    assert_bitwise_equal(checkpoint(alone), checkpoint(whole))
    assert reproducible(metrics(alone)) == reproducible(metrics(whole))

    # SIGTERM to torchrun itself, while the processes take 0.2 s a step from step 3 on.
    slow = plant(tmp_path / "slow", SLOW_STEPS)
    environ = module_environment(
        default_project, path=(slow,), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        SLOW_FROM="3",
    )  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    process = subprocess.Popen(
        [*launcher, "--nproc_per_node", "2", "-m", TRAIN, *args, "--run-dir", str(forwarded)],
        env=environ,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_line(process, "SLOW FROM NOW ON")
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
    finally:
        process.kill()
        process.wait()
    assert "stopped by SIGTERM at epoch " in rest, rest
    saved = checkpoint(forwarded)
    assert 3 <= saved["global_step"] < 16, rest  # stopped, not finished
    resumed = torchrun(default_project, *args, "--run-dir", str(forwarded), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(forwarded), checkpoint(whole))
    assert reproducible(metrics(forwarded)) == reproducible(metrics(whole))


STALL_IN_FIRST_SAVE = """
    import sys
    import time

    import torch

    _save = torch.save


    def save(obj, f, *args, **kwargs):
        # The run's first checkpoint: half written, then the process waits to be killed.
        _save(obj, f, *args, **kwargs)
        print("STALLED IN SAVE", file=sys.stderr, flush=True)
        time.sleep(600)


    torch.save = save
"""


def test_one_train_per_run_folder(default_project: Path, tmp_path: Path, reference: Path) -> None:
    """Two ``train --resume`` on one folder: the second is refused with one line naming the
    folder and the first one's PID, and touches nothing; once the first is SIGKILLed, the
    kernel has dropped its lock and the folder resumes (bit for bit)."""
    run = tmp_path / "run"
    first = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(run), "--resume")
    stall = plant(tmp_path / "plant", STALL_IN_FIRST_SAVE)
    holder = train_in_background(default_project, *args, path=(stall,))
    try:
        wait_for_line(holder, "STALLED IN SAVE")
        before = {path.name: path.read_bytes() for path in run.iterdir()}
        second = run_module(default_project, TRAIN, *args)
        assert second.returncode == 1
        assert re.fullmatch(
            re.escape(
                f"python -m {TRAIN}: error: {run} is being written by another process (PID "
                f"{holder.pid} on {socket.gethostname()}, which has held {run / '.lock'} for "
            )
            + r"0 min \d+ s"
            + re.escape("): wait for it to end, or use another folder\n"),
            second.stderr,
        ), second.stderr
        assert {path.name: path.read_bytes() for path in run.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == -signal.SIGKILL

    resumed = train(default_project, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.startswith("removed ")  # the killed run's temporary checkpoint
    assert sorted(path.name for path in run.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",
    ]
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
