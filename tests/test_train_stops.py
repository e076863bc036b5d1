"""The generated ``train`` stopped by real signals and resumed, and one writer per run folder.

The contract launch scripts rely on (``<project>-launch slurm`` among them): SIGINT,
SIGTERM or SIGUSR1 stop training after the step under way, ``latest.pt`` then holds
that exact position, the last two lines of stderr say where it stopped and the command
that resumes, and the exit status is 128 + the signal's number; that command (the same
``--run-dir`` and ``--resume``) continues bit for bit.

A signal at any other moment is safe too: during start-up training stops before its
first step, and once the run is complete the signal stops nothing (exit status 0).

The signals are real ones, delivered by the kernel: a ``sitecustomize`` module
registers a global optimizer step hook (``register_optimizer_step_post_hook``) that
sends the process a signal with ``os.kill`` right after its Nth step, or at another
moment (`preemption.Moment`), or the test sends SIGTERM to ``torchrun`` itself from
outside, as ``docker stop`` or SLURM would.
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
from preemption import MAIN_STARTED, Moment, plant_moments
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
    assert command == (  # the settings the checkpoint keeps are left out
        f"resume with: python -m {TRAIN} --device cpu --epochs {EPOCHS}{workers_flag} "
        f"--run-dir {run} --resume"
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
        f"--epochs 2 --run-dir {alone} --resume"
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


def at_moment(project: Path, plants: Path, moment: Moment, name: str, *args: str, step: int = 0):
    """``train`` with ``name`` sent to it at ``moment`` (`preemption`), which came."""
    result = run_module(
        project, TRAIN, *args, env=moment_environment(project, plants, moment, name, step)
    )
    assert (plants / "sent.log").read_text() == f"{moment.value} {name}\n", result.stderr
    return result


def moment_environment(project: Path, plants: Path, moment: Moment, name: str, step: int = 0):
    (plants / "sent.log").write_text("")
    return module_environment(
        project, path=(plants,), STOP_AT=moment.value, STOP_SIGNAL=name, STOP_STEP=str(step),
        STOP_LOG=str(plants / "sent.log"),
    )  # fmt: skip


def test_a_signal_during_start_up_stops_before_the_first_step(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """From main's first line on: a new run stops with nothing written to resume and says
    how to start it again; a resumed one stops where its checkpoint stands."""
    run, plants = tmp_path / "run", plant_moments(tmp_path / "plant")
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(run))
    stopped = at_moment(default_project, plants, Moment.START, "SIGTERM", *args)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert stopped.stderr.splitlines() == [
        MAIN_STARTED,
        "stopped by SIGTERM before training began: no checkpoint was written, so there is "
        "nothing to resume",
        f"start again with: python -m {TRAIN} --device cpu --batch-size 32 --epochs {EPOCHS} "
        f"--samples 1024 --run-dir {run}",
    ]
    assert not (run / "latest.pt").exists()
    one = at_moment(
        default_project, plants, Moment.STEP, "SIGINT", *args, step=STEPS + 8
    )  # the first run of the printed command, stopped in epoch 2
    assert one.returncode == 128 + signal.SIGINT, one.stderr

    resuming = at_moment(default_project, plants, Moment.LOAD, "SIGUSR1", *args, "--resume")
    assert resuming.returncode == 128 + signal.SIGUSR1, resuming.stderr
    where = f"epoch 2, step 8/{STEPS} (step {STEPS + 8} of the run)"
    assert resuming.stderr.splitlines()[-2:] == [
        f"stopped by SIGUSR1 at {where}, before training resumed; checkpoint {run / 'latest.pt'}",
        f"resume with: python -m {TRAIN} --device cpu --epochs {EPOCHS} --run-dir {run} --resume",
    ]
    resumed = run_printed(default_project, resuming.stderr.splitlines()[-1][len("resume with: ") :])
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))


@pytest.mark.parametrize(
    ("moment", "name", "said"),
    [
        (Moment.LAST_STEP, "SIGTERM", "SIGTERM during the run's last step: nothing to stop"),
        (Moment.FINISHED, "SIGUSR1", "SIGUSR1 after the run had finished: nothing to stop"),
        (Moment.EXIT, "SIGUSR1", None),  # after main returned: ignored
    ],
    ids=str,
)
def test_a_signal_once_the_run_is_complete_stops_nothing(
    default_project: Path,
    tmp_path: Path,
    reference: Path,
    moment: Moment,
    name: str,
    said: str | None,
) -> None:
    """After the last step, during the last line and during the interpreter's exit (where
    a program that does not see to it is killed: the reverse case)."""
    run, plants = tmp_path / "run", plant_moments(tmp_path / "plant")
    args = (*SMALL, "--epochs", EPOCHS, "--run-dir", str(run))
    result = at_moment(default_project, plants, moment, name, *args, step=3 * STEPS)
    assert result.returncode == 0, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last == said if said is not None else last.startswith(f"epoch {EPOCHS}/"), last
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))

    if moment is Moment.EXIT:  # the same signal kills a program that does not see to it
        environ = moment_environment(default_project, plants, moment, name)
        unaware = subprocess.run([sys.executable, "-c", "pass"], env=environ)
        assert unaware.returncode == -getattr(signal, name)


def test_a_signal_while_resuming_a_finished_run_stops_nothing(
    default_project: Path, tmp_path: Path, finished_run: Path
) -> None:
    plants = plant_moments(tmp_path / "plant")
    args = (*SMALL, "--epochs", "1", "--run-dir", str(finished_run), "--resume")
    result = at_moment(default_project, plants, Moment.START, "SIGINT", *args)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == "SIGINT after the run had finished: nothing to stop"
    assert "nothing to do" in result.stdout


def test_resumed_from_the_run_folder_alone(default_project: Path, tmp_path: Path) -> None:
    """A run with its own --seed, --samples and --batch-size, stopped: the printed command
    is --run-dir and --resume alone, and continues bit for bit with the checkpoint's
    settings; the same with another --seed is refused in one line, touching nothing."""
    args = ("--seed", "5", "--samples", "256", "--batch-size", "16", "--epochs", "10")
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert train(default_project, *args, "--run-dir", str(whole)).returncode == 0
    stopper = plant(tmp_path / "plant", AFTER_STEP)
    environ = module_environment(
        default_project, path=(stopper,), AFTER_STEP_DO="SIGTERM", AFTER_STEP="50"
    )
    stopped = train(default_project, *args, "--run-dir", str(run), env=environ)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    command = stopped.stderr.splitlines()[-1]
    assert command == f"resume with: python -m {TRAIN} --run-dir {run} --resume"

    before = {path.name: path.read_bytes() for path in run.iterdir()}
    other = train(default_project, "--run-dir", str(run), "--resume", "--seed", "6")
    assert other.returncode == 2
    assert other.stderr.splitlines()[-1] == (
        f"python -m {TRAIN}: error: argument --seed: {run / 'latest.pt'} was trained with "
        "--seed 5, this run has 6, which makes another data set; use the same value, or a "
        "new --run-dir"
    )
    assert {path.name: path.read_bytes() for path in run.iterdir()} == before

    resumed = run_printed(default_project, command.removeprefix("resume with: "))
    assert resumed.returncode == 0, resumed.stderr
    assert "warning" not in resumed.stderr
    assert_bitwise_equal(checkpoint(run), checkpoint(whole))
    assert reproducible(metrics(run)) == reproducible(metrics(whole))


def test_torchrun_processes_stop_before_training_when_one_is_signalled_starting(
    default_project: Path, tmp_path: Path
) -> None:
    """SIGTERM to rank 1 alone while it starts: the processes agree before the first step,
    and both stop there; rank 0 says that nothing was written and how to start again."""
    run, plants = tmp_path / "run", plant_moments(tmp_path / "plant")
    args = ("--device", "cpu", "--samples", "512", "--batch-size", "32", "--epochs", "2")
    stopped = torchrun(
        default_project, *args, "--run-dir", str(run), path=(plants,), STOP_TORCHRUN="1",
        STOP_RANK="1", STOP_AT=Moment.START.value, STOP_SIGNAL="SIGTERM",
        STOP_LOG=str(plants / "sent.log"),
    )  # fmt: skip
    assert (plants / "sent.log").read_text() == "start SIGTERM\n", stopped.stderr
    assert stopped.returncode != 0  # torchrun reports its processes' 143 as a failure
    lines = stopped.stderr.splitlines()
    assert (
        lines.count(
            "stopped by SIGTERM before training began: no checkpoint was written, so there is "
            "nothing to resume"
        )
        == 1
    ), stopped.stderr
    (again,) = [line for line in lines if line.startswith("start again with: ")]
    assert again == (
        f"start again with: torchrun --standalone --nproc_per_node 2 -m {TRAIN} --device cpu "
        f"--batch-size 32 --epochs 2 --samples 512 --run-dir {run}"
    )
    assert "latest.pt" not in [path.name for path in run.iterdir()]
    started = run_printed(
        default_project, again.removeprefix("start again with: "),
        GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert checkpoint(run)["global_step"] == 16
