"""The generated ``train`` never hangs and leaves no process behind: an error in training,
a killed DataLoader worker, a killed ``torchrun`` process or a killed ``torchrun`` end
the whole run within seconds, alone or under ``torchrun``, with workers 0 and 2, with
one line naming what failed.

Faults are real: a ``sitecustomize`` raises from an optimizer step post-hook at a step
drawn at random (printed in the test's id, so a failure can be rerun), or the test
sends SIGKILL to a worker, a training process or torchrun. A hang shows as the
subprocess's timeout. "No process left" is read from ``/proc``: every process of a
test, workers included (they are forks), carries the test's own ``--run-dir`` in its
command line.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import DEFAULT_PACKAGE, module_environment
from training import (
    AFTER_STEP,
    SMALL,
    TRAIN,
    assert_bitwise_equal,
    assert_nothing_left,
    checkpoint,
    plant,
    run_printed,
    torchrun,
    train,
    uninterrupted,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PREFIX = f"python -m {TRAIN}: error: "
STEPS = 32  # an epoch of SMALL
# Far longer than any of these runs takes to end (a few seconds), far shorter than a hang.
ENDS_WITHIN_S = 60

NAN_AT_STEP = """
    import os

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0


    def after_step(optimizer, args, kwargs):
        # A weight becomes NaN after step $NAN_STEP, as one diverging update makes it.
        global steps
        steps += 1
        if steps == int(os.environ["NAN_STEP"]):
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("nan"))


    register_optimizer_step_post_hook(after_step)
"""

SEED_OF_RANDOM = """
    import os
    import random

    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer, args, kwargs):
        with open(os.environ["RANDOM_OUT"], "a") as out:
            print(random.random(), file=out)


    register_optimizer_step_post_hook(after_step)
"""


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [
        int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()
    ]


def wait_for_children(pid: int, count: int) -> list[int]:
    """The first ``count`` child processes of ``pid``, once it has started them."""
    deadline = time.monotonic() + ENDS_WITHIN_S
    while len(found := children(pid)) < count:
        assert time.monotonic() < deadline, f"{pid} started {found}, not {count} processes"
        time.sleep(0.05)
    return found


def ended(process: subprocess.Popen) -> tuple[int, str]:
    """``process``'s exit status and stderr; a process still running after
    `ENDS_WITHIN_S` is a hang, killed and reported."""
    try:
        _, stderr = process.communicate(timeout=ENDS_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"still running {ENDS_WITHIN_S} s after the fault (a hang):\n{stderr}")
    return process.returncode, stderr


def started(command: list[str], environ: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


# Steps drawn once per session: anywhere in a 3-epoch run after its first checkpoint
# (--checkpoint-every 8), epoch ends included.
STEP_DRAWS = random.Random(os.environ.get("PYTEST_XDIST_TESTRUNUID", "")).sample(
    range(9, 3 * STEPS), 2
)


@pytest.mark.parametrize(("workers", "step"), [("0", STEP_DRAWS[0]), ("2", STEP_DRAWS[1])])
def test_an_error_in_training_ends_the_run_and_its_workers(
    default_project: Path, tmp_path: Path, workers: str, step: int
) -> None:
    """A forward/backward/step that raises ends the run (exit 1): its traceback, then one
    line naming the step and the error and the command that resumes from the last
    checkpoint; that command finishes the run bit for bit."""
    faulty = plant(tmp_path / "faulty", AFTER_STEP)
    run = tmp_path / "run"
    environ = module_environment(
        default_project, path=(faulty,), AFTER_STEP=str(step), AFTER_STEP_DO="raise"
    )
    result = subprocess.run(
        [sys.executable, "-m", TRAIN, *SMALL, "--epochs", "3", "--workers", workers,
         "--checkpoint-every", "8", "--run-dir", str(run)],
        env=environ, capture_output=True, text=True, timeout=ENDS_WITHIN_S,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert "RuntimeError: planted fault in the optimizer step" in lines[-2]
    epoch, done = divmod(step - 1, STEPS)
    saved = (step - 1) // 8 * 8
    assert lines[-1].startswith(
        f"{PREFIX}training failed in epoch {epoch + 1}, step {done + 1}/{STEPS} (step {step} of "
        f"the run): RuntimeError: planted fault in the optimizer step; the last checkpoint, "
        f"{run / 'latest.pt'}, holds step {saved} of the run: resume with python -m {TRAIN} "
    ), result.stderr
    assert_nothing_left(str(run))

    command = lines[-1].partition("resume with ")[2]
    resumed = run_printed(default_project, command)
    assert resumed.returncode == 0, resumed.stderr
    whole = uninterrupted(default_project, tmp_path / "whole")
    assert_bitwise_equal(checkpoint(run), checkpoint(whole))


def test_a_killed_worker_ends_the_run_in_one_line(default_project: Path, tmp_path: Path) -> None:
    """SIGKILL to a DataLoader worker (the OOM killer's signal): the run ends (exit 1) with
    one line naming the worker and the signal, no traceback, and its other worker ends.

    The kill comes once training is under way (its first checkpoint written): in the
    first batch's fetch torch imports a module under an ``except Exception`` that logs
    what it caught, with a traceback. Training may meet the death as DataLoader's error
    or as a connection closed under it (the two tests below make each certain)."""
    run = tmp_path / "run"
    process = started(
        [sys.executable, "-m", TRAIN, *SMALL, "--epochs", "1000", "--workers", "2",
         "--checkpoint-every", "1", "--run-dir", str(run)],
        module_environment(default_project),
    )  # fmt: skip
    worker = wait_for_children(process.pid, 2)[0]
    deadline = time.monotonic() + ENDS_WITHIN_S
    while not (run / "latest.pt").exists():
        assert process.poll() is None, ended(process)[1]
        assert time.monotonic() < deadline, "no step was trained"
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    status, stderr = ended(process)
    assert status == 1, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1].startswith(f"{PREFIX}training failed in epoch "), stderr
    assert sigkilled(0, worker) in stderr
    assert_nothing_left(str(run))


def started_loader(train_module: ModuleType, data: ModuleType) -> tuple[Any, Iterator[Any]]:
    """A loader of the default project with 2 workers and its iterator, one batch in."""
    inputs, labels = train_module.synthetic_data(256, seed=0)
    dataset = data.SyntheticBatches(inputs, labels, noise=0.1, seed=0)
    batches = data.loader(
        dataset, data.EpochBatches(256, 8, seed=0), workers=2, seed=0, pin_memory=False
    )
    iterator = iter(batches)
    next(iterator)
    return batches, iterator


def sigkilled(index: int, pid: int) -> str:
    """How the report names DataLoader worker ``index`` killed by SIGKILL."""
    return (
        f"DataLoader worker {index} (pid {pid}) was killed by SIGKILL (the OOM killer's "
        "signal: dmesg says if it was memory)"
    )


def no_waiting(*args: object) -> None:
    raise AssertionError("waited for workers after an error that is not a closed connection")


def test_a_dead_worker_is_raised_where_a_batch_is_fetched_not_elsewhere(train_module) -> None:
    """DataLoader's SIGCHLD handler raises wherever the training process is (in
    ``Thread.start``, a checkpoint write, the report of another error): in training it
    raises in the next fetch of a batch alone, and the report then names the worker
    without waiting."""
    data = importlib.import_module(f"{DEFAULT_PACKAGE}._data")
    batches, iterator = started_loader(train_module, data)
    try:
        worker = batches._iterator._workers[1]
        os.kill(worker.pid, signal.SIGKILL)
        multiprocessing.connection.wait([worker.sentinel])
        time.sleep(0.2)  # SIGCHLD comes, and its handler runs, while this code runs
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed") as error:
            next(iterator)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(multiprocessing.connection, "wait", no_waiting)
            dead = data.dead_workers(batches, error.value)
    finally:
        data.close(batches)
    assert [str(worker) for worker in dead] == [sigkilled(1, worker.pid)]


def test_a_worker_killed_under_a_closed_connection_is_waited_for(train_module) -> None:
    """The race of the killed-worker test, made certain: a worker is SIGKILLed and its
    status read at once. After a closed connection (the error training meets first) the
    ending worker is waited for and named; after any other error, with every worker
    alive, nothing waits."""
    data = importlib.import_module(f"{DEFAULT_PACKAGE}._data")
    alive, _ = started_loader(train_module, data)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(multiprocessing.connection, "wait", no_waiting)
            assert data.dead_workers(alive, RuntimeError("a bug in training")) == []
    finally:
        data.close(alive)

    killed, _ = started_loader(train_module, data)
    try:
        worker = killed._iterator._workers[1]
        os.kill(worker.pid, signal.SIGKILL)
        dead = data.dead_workers(killed, ConnectionResetError(104, "Connection reset by peer"))
    finally:
        data.close(killed)
    assert [str(worker) for worker in dead] == [sigkilled(1, worker.pid)]


def test_stop_signals_to_the_whole_process_group_stop_the_run_cleanly(
    default_project: Path, tmp_path: Path
) -> None:
    """SIGTERM from outside to the workers alone changes nothing (the training process
    decides when to stop); SIGINT to the whole process group (Ctrl-C in a terminal)
    stops the run with its checkpoint (exit 130), and ends the workers."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", TRAIN, *SMALL, "--epochs", "1000", "--workers", "2",
         "--run-dir", str(run)],
        env=module_environment(default_project), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    workers = wait_for_children(process.pid, 2)
    for worker in workers:
        os.kill(worker, signal.SIGTERM)
    time.sleep(1)  # ample for a worker to die of it and the run to fail
    assert process.poll() is None, process.communicate()[1]
    assert sorted(children(process.pid)) == sorted(workers), process.communicate(timeout=5)
    os.killpg(process.pid, signal.SIGINT)
    status, stderr = ended(process)
    assert status == 128 + signal.SIGINT, stderr
    assert stderr.splitlines()[-2].startswith("stopped by SIGINT at epoch "), stderr
    assert_nothing_left(str(run))


TORCHRUN_STEPS = [("0", STEP_DRAWS[1] // 2), ("2", STEP_DRAWS[0] // 2)]  # 16 steps an epoch


@pytest.mark.parametrize(("workers", "step"), TORCHRUN_STEPS)
def test_an_error_in_one_torchrun_process_ends_every_process(
    default_project: Path, tmp_path: Path, workers: str, step: int
) -> None:
    """Rank 1 raises at a random step while rank 0 waits for it in the gradient
    all-reduce: both end (torchrun exits 1), rank 1 with its traceback and line, rank 0
    with one line saying that another process ended first."""
    faulty = plant(tmp_path / "faulty", AFTER_STEP)
    run = tmp_path / "run"
    result = torchrun(
        default_project, *SMALL, "--epochs", "3", "--workers", workers, "--run-dir", str(run),
        path=(faulty,), AFTER_STEP=str(step), AFTER_STEP_DO="raise", AFTER_STEP_RANK="1",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    steps = STEPS // 2  # each of the 2 processes has half of every epoch
    epoch, done = divmod(step - 1, steps)
    failed = f"training failed in epoch {epoch + 1}, step {done + 1}/{steps} (step {step} of"
    failed += " the run)"
    assert f"{PREFIX}rank 1: {failed}: RuntimeError: planted fault" in "\n".join(errors)
    # Rank 1 raises after its optimizer step, so rank 0 has finished that step too and
    # waits at the next collective: the next step's all-reduce, or the epoch's end.
    rank_0 = (f"epoch {epoch + 1}, step ", f"the end of epoch {epoch + 1} ")
    assert any(
        line.startswith(tuple(f"{PREFIX}rank 0: training failed in {at}" for at in rank_0))
        and "another process of this job ended first" in line
        for line in errors
    ), result.stderr
    assert_nothing_left(str(run))


@pytest.mark.parametrize("killed", ["torchrun", "a training process"])
def test_a_killed_torchrun_or_process_ends_the_whole_job(
    default_project: Path, tmp_path: Path, killed: str
) -> None:
    """SIGKILL to torchrun (nothing of it can clean up) or to one of its 2 training
    processes: every process of the job, with its 2 DataLoader workers, ends."""
    run = tmp_path / "run"
    environ = module_environment(default_project, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    agent = started(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", TRAIN, *SMALL, "--epochs", "1000", "--workers", "2", "--run-dir", str(run)],
        environ,
    )  # fmt: skip
    ranks = wait_for_children(agent.pid, 2)
    for rank in ranks:
        wait_for_children(rank, 2)
    os.kill(agent.pid if killed == "torchrun" else ranks[1], signal.SIGKILL)
    status, stderr = ended(agent)
    assert status == (-signal.SIGKILL if killed == "torchrun" else 1), stderr
    assert_nothing_left(str(run))


def test_a_run_whose_loss_becomes_nan_stops_with_an_error(
    default_project: Path, tmp_path: Path
) -> None:
    """A weight that turns NaN in epoch 2: the run stops at that epoch's end (exit 1) with
    one line naming the epoch and its loss, without checkpointing it; latest.pt keeps
    epoch 1."""
    diverging = plant(tmp_path / "diverging", NAN_AT_STEP)
    run = tmp_path / "run"
    result = train(
        default_project, *SMALL, "--epochs", "3", "--run-dir", str(run),
        env=module_environment(default_project, path=(diverging,), NAN_STEP=str(STEPS + 5)),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"{PREFIX}the loss of epoch 2 is nan (its mean over every step): training diverged, "
        f"so this epoch was not checkpointed and {run / 'latest.pt'} holds step {STEPS} of the "
        "run; a lower --lr, --precision 32 or gradient clipping are the usual remedies"
    )
    assert (checkpoint(run)["epoch"], checkpoint(run)["step"]) == (1, 0)
    good = train(default_project, *SMALL, "--epochs", "3", "--run-dir", str(tmp_path / "good"))
    assert good.returncode == 0, good.stderr


def test_pythons_random_is_seeded_from_seed(default_project: Path, tmp_path: Path) -> None:
    """User code drawing from Python's ``random`` during training draws the same numbers
    for the same --seed, other numbers for another."""
    drawing = plant(tmp_path / "drawing", SEED_OF_RANDOM)

    def draws(seed: str, name: str) -> list[str]:
        out = tmp_path / f"{name}.txt"
        result = train(
            default_project, *SMALL, "--epochs", "1", "--seed", seed,
            "--run-dir", str(tmp_path / name),
            env=module_environment(default_project, path=(drawing,), RANDOM_OUT=str(out)),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return out.read_text().splitlines()

    first = draws("3", "first")
    assert draws("3", "again") == first
    assert draws("4", "other") != first
