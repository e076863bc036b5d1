"""``<project>-launch slurm`` on a real SLURM cluster (`slurm_cluster`): two nodes, requeued.

The job: 2 nodes, one ``torchrun`` each with one gloo process on the CPU (a 2-task
job), 3 epochs of 16 steps with ``--checkpoint-every 5``, submitted from a project
whose folder name holds shell and sbatch syntax (``$(...)``, backquotes, quotes,
``#``, ``%j``). Rank 0 of the first attempt stops itself with SIGSTOP after step 23
(`at_step`); the test then runs ``scontrol requeue``, which sends every process of
the job SIGCONT and SIGTERM and puts it back in the queue under the same id. The
second attempt must find the same run folder, resume from its checkpoint, and end
bitwise equal to an uninterrupted 2-process run; near the time limit (SIGUSR1 to the
batch shell, from scancel or from SLURM at a real 3-minute limit) train must have
stopped before the job is requeued. Another job of the same kind is ended by
``scancel --signal=TERM`` and must keep the checkpoint of the step it stopped at.
A short two-node job with ``--setup`` lines, which must run on each node before
torchrun. Without training: typed GPU requests in sbatch's ``--test-only`` (the
cluster has two ``tesla`` GPUs per node), a job id whose run folder exists, a
--run-dir taken over by a newer job, ``sbatch`` wrappers that add a line or print no
id, a refused ``scontrol release``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import slurm_cluster
from at_step import plant
from conftest import DEFAULT_PACKAGE, bake_project, module_environment, run_module
from training import assert_bitwise_equal, checkpoint, gloo_environment, metrics, reproducible

MISSING = slurm_cluster.missing_requirement()
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=str(MISSING)),
    pytest.mark.xdist_group("slurm"),  # one cluster, one job per scenario (tests/run)
]

LAUNCH = f"{DEFAULT_PACKAGE}.launch"
# 2 processes share 1024 samples in batches of 32: 16 steps an epoch, 48 in all.
ARGS = ("--samples", "1024", "--batch-size", "32", "--epochs", "3")  # --device: launch's
EVERY = ("--checkpoint-every", "5")
AT_STEP = 23  # in epoch 2
LAST_CHECKPOINT = 20  # the last one before step 23
HOSTILE = "proj $(touch PWNED) `touch PWNED` 'q' \"d\" #c %j 100% ;x"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.Cluster]:
    running = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield running
    finally:
        running.stop()


# How the job is sent back to the queue: as a preemption or an administrator does it,
# or by the job itself near its time limit: its batch shell gets SIGUSR1 from
# --signal=B:USR1@SECONDS (as `scancel --batch --signal=USR1` sends it, or SLURM at the
# real time limit: no command), stops train and then runs `scontrol requeue`.
REQUEUES = {
    "scontrol-requeue": ("scontrol", "requeue"),
    "near-time-limit": ("scancel", "--batch", "--signal=USR1"),
    "time-limit": None,
}
# A short time limit whose signal comes after rank 0 stopped at step 23 (14 to 21 s after
# launch here, more on a loaded machine): SLURM signals --requeue-before (60 s) to 120 s
# before the limit (its timer has a resolution of up to 60 s), so 60 to 120 s into the
# attempt. The 50 s left for the checkpoint (less the 10 s the script keeps for the
# requeue) cover rank 0's slow fsyncs (13 s measured); the second attempt trains its 25
# steps long before its own signal.
TIME_LIMIT = ("--time", "3", "--requeue-before", "60")


@dataclass(frozen=True)
class Requeued:
    """A job that was requeued mid-run, after it finished."""

    how: str  # a key of REQUEUES
    run_dir: Path
    job_id: int
    log: str
    between: dict  # latest.pt while the job waited in the queue between its attempts
    seconds: dict[str, float]  # from the requeue command to each state of the job


@pytest.fixture(scope="module")
def hostile_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default project, in a folder named `HOSTILE`."""
    return bake_project(tmp_path_factory.mktemp("outside") / HOSTILE)


@pytest.fixture(scope="module")
def reference(hostile_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training by 2 processes on one machine, uninterrupted."""
    folder = tmp_path_factory.mktemp("reference")
    whole = run_module(
        hostile_project,
        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
        f"{DEFAULT_PACKAGE}.train", "--device", "cpu", *ARGS, "--run-dir", str(folder),
        env=gloo_environment(hostile_project),
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    return folder


def job_at_step(
    cluster: slurm_cluster.Cluster,
    project: Path,
    folder: Path,
    *options: str,
    own_run_dir: bool = False,
) -> tuple[int, Path, Path]:
    """Submit ``launch slurm OPTIONS -- ARGS EVERY`` with rank 0 set to stop itself after
    step `AT_STEP` (`at_step`), and wait until it has: the job id, its run folder (in
    ``folder`` with ``own_run_dir``) and the file holding rank 0's PID.

    A first job that torch's c10d rendezvous fails before training starts is submitted
    once more: both "nodes" share this machine, and under a loaded CI machine the
    rendezvous store's connection has been seen to drop (``RendezvousConnectionError``),
    which is torch's start-up, not what these tests are about. Any other end fails."""
    hook = plant(folder / "hook")
    attempt = 1
    while True:
        marker = folder / f"stopped-{attempt}"
        environ = gloo_environment(
            project,
            path=(hook,),
            AT_STEP=str(AT_STEP),
            AT_STEP_ACTION="stop",
            AT_STEP_MARKER=str(marker),
            SLURM_CONF=cluster.env["SLURM_CONF"],
        )
        run_dir = folder / f"run-{attempt}" if own_run_dir else None
        chosen = ("--run-dir", str(run_dir)) if run_dir else ()
        launch = ("slurm", *options, *chosen, "--", *ARGS, *EVERY)
        submitted = run_module(project, LAUNCH, *launch, env=environ)
        assert submitted.returncode == 0, submitted.stderr
        job_id, run_dir = submitted_job(submitted.stdout)

        def at_step_or_ended(job_id: int = job_id, marker: Path = marker) -> bool:
            return marker.exists() or cluster.job_state(job_id) not in ("PENDING", "RUNNING")

        cluster.wait_for(f"job {job_id}: rank 0 stopped after step 23", at_step_or_ended, 180)
        if marker.exists():
            return job_id, run_dir, marker
        text = log(run_dir, job_id)
        if attempt == 2 or "RendezvousConnectionError" not in text:
            raise AssertionError(f"job {job_id} {cluster.job_state(job_id)}:\n{text}")
        print(f"job {job_id}: torch's rendezvous failed before training started; submitted again")
        attempt += 1


def submitted_job(stdout: str) -> tuple[int, Path]:
    """The job id and run folder that launch's ``submitted job ...`` line names."""
    match = re.match(r"submitted job (\d+); run folder (.*)\n", stdout)
    assert match is not None, stdout
    return int(match[1]), Path(match[2])


@pytest.fixture(scope="module", params=list(REQUEUES))
def requeued(
    request, cluster, hostile_project: Path, tmp_path_factory: pytest.TempPathFactory
) -> Requeued:
    limit = TIME_LIMIT if request.param == "time-limit" else ("--time", "10")
    options = ("--nodes", "2", "--gpus-per-node", "0", *limit)
    folder = tmp_path_factory.mktemp("requeue")
    launched = time.monotonic()
    job_id, run_dir, _ = job_at_step(
        cluster, hostile_project, folder, *options, f"--sbatch=--comment={HOSTILE}"
    )
    requeue = time.monotonic()
    print(
        f"job {job_id}: rank 0 stopped after step {AT_STEP} {requeue - launched:.1f} s after launch"
    )
    command = REQUEUES[request.param]
    if command is not None:
        cluster.run(*command, str(job_id))
    seconds = {}
    for state in ("PENDING", "RUNNING", "COMPLETED"):
        cluster.wait_for(
            f"job {job_id} {state}", lambda state=state: cluster.job_state(job_id) == state, 180
        )
        seconds[state] = round(time.monotonic() - requeue, 1)
        if state == "PENDING":  # the first attempt is over, the second not started
            between = checkpoint(run_dir)
    # The requeue's time line, for the README: `pytest -s` shows it.
    print(f"job {job_id} ({request.param}): seconds to each state: {seconds}")
    return Requeued(request.param, run_dir, job_id, log(run_dir, job_id), between, seconds)


def log(run_dir: Path, job_id: int) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else f"(no {path})"


def test_requeued_job_resumes_and_ends_bitwise_equal(
    cluster, requeued: Requeued, reference: Path, hostile_project: Path
) -> None:
    job_id, run_dir = requeued.job_id, requeued.run_dir
    assert cluster.restarts(job_id) == 1
    shown = cluster.run("scontrol", "show", "job", str(job_id)).stdout
    # An #SBATCH line that sbatch read as written (scontrol ends the line with a space).
    assert re.search(r"^ +Comment=(.*) $", shown, re.MULTILINE).group(1) == HOSTILE
    assert run_dir == hostile_project / "runs" / f"slurm-tests-{job_id}"
    assert sorted(path.name for path in run_dir.iterdir()) == [
        "latest.pt",
        "launch-job.txt",
        "metrics.csv",
        "previous.pt",
        f"slurm-{job_id}.out",
        f"slurm-{job_id}.sbatch",
    ]
    first, second = requeued.log.split(f"launch: job {job_id}, attempt 2, on n[1-2] at ")
    assert first.startswith(f"launch: job {job_id}, attempt 1, on n[1-2] at "), requeued.log
    if requeued.how == "scontrol-requeue":
        assert f"STEP {job_id}.0 ON n1 CANCELLED AT" in first
        assert "DUE TO JOB REQUEUE" in first
        assert "launch: SIGTERM (preempted, requeued or cancelled): train checkpoints" in first
    else:  # train was stopped, and had stopped, before the job was requeued
        signalled = first.index(
            f"launch: time limit near: train checkpoints, then job {job_id} is requeued\n"
        )
        stopped = first.index("\nstopped by SIGTERM at epoch 2, step ")
        requeueing = first.index(f"launch: requeueing job {job_id}\n")
        assert signalled < stopped < requeueing, requeued.log
        # The step ended by itself: the requeue cancelled nothing that still ran.
        assert "DUE TO JOB REQUEUE" not in first[:requeueing], requeued.log
    assert "trained 3 epochs" not in first
    assert second.count("trained 3 epochs on 2 processes on cpu (gloo): loss ") == 1, second
    # The second attempt resumed (with --resume: without it train refuses the folder).
    position = requeued.between
    assert LAST_CHECKPOINT <= position["global_step"] < 48, position
    epochs = [line.split()[1] for line in second.splitlines() if line.startswith("epoch ")]
    assert epochs == [f"{epoch}/3" for epoch in range(position["epoch"] + 1, 4)], second
    assert_bitwise_equal(checkpoint(run_dir), checkpoint(reference))
    assert reproducible(metrics(run_dir)) == reproducible(metrics(reference))
    # Every value in the script was data: nothing ran the folder name's commands.
    assert not list(hostile_project.parent.parent.rglob("PWNED")), "the folder name ran as code"


def test_requeue_checkpoints_the_step_reached(requeued: Requeued) -> None:
    """Stopped after step 23, the job keeps step 23 or later across the requeue, not the
    checkpoint of step 20, and rank 0's message says how to resume."""
    assert requeued.between["global_step"] >= AT_STEP, requeued.between
    first = requeued.log.split("attempt 2, on n[1-2]")[0]
    # The checkpoint the requeue kept is the one rank 0 wrote when it stopped.
    at_stop = re.search(r"^stopped by SIGTERM at .* \(step (\d+) of the run\)", first, re.M)
    assert at_stop is not None, requeued.log
    assert int(at_stop[1]) == requeued.between["global_step"], requeued.log
    hints = [line for line in first.splitlines() if line.startswith("resume with: ")]
    assert len(hints) == 1, requeued.log
    (hint,) = hints
    run_dir = shlex.quote(str(requeued.run_dir))
    assert f"slurm <this job's options> --run-dir {run_dir} -- " in hint
    assert hint.endswith("(a requeued job resumes by itself)")


def test_step_signalled_by_scancel_ends_with_a_checkpoint(
    cluster, hostile_project: Path, tmp_path: Path
) -> None:
    """``scancel --signal=TERM`` signals the processes of the job's steps and neither
    cancels nor requeues the job. Rank 1 stops after its step and waits for rank 0's
    checkpoint; rank 0, continued with every ``fsync`` 2 s slower (`at_step`), writes the
    checkpoint of the step it stops at and says how to resume. Both torchruns then exit
    1, in either order, and ``srun --kill-on-bad-exit`` ends the step on the first (with
    SIGTERM and, only KillWait (30 s) later, SIGKILL); the job ends FAILED, not
    requeued."""
    options = ("--nodes", "2", "--gpus-per-node", "0")
    job_id, run_dir, stopped = job_at_step(
        cluster, hostile_project, tmp_path, *options, own_run_dir=True
    )
    cluster.run("scancel", "--signal=TERM", str(job_id))
    os.kill(int(stopped.read_text()), signal.SIGCONT)
    cluster.wait_for(f"job {job_id} ended", lambda: cluster.job_state(job_id) == "FAILED", 120)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert re.search(r"^srun: error: n[12]: task [01]: Exited with exit code 1$", log, re.M), log
    assert checkpoint(run_dir)["global_step"] >= AT_STEP, log
    assert re.search(
        r"^stopped by SIGTERM at epoch 2, step \d+/16 \(step \d+ of the run\)", log, re.M
    )
    hint = re.search(r"^resume with: (.*)$", log, re.MULTILINE)
    assert hint is not None, log
    assert f"slurm <this job's options> --run-dir {shlex.quote(str(run_dir))} -- " in hint[1]


def test_run_folder_on_a_local_disk_is_refused_for_other_machines(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """Partition ``remote`` has a node on another host: a run folder in /dev/shm (tmpfs,
    this machine's memory) is refused before anything is written or submitted.
    Partition ``debug``, whose nodes run on this machine, takes folders on the local
    disk, as the requeue test shows."""
    run_dir = Path("/dev/shm") / f"launch-test-{os.getpid()}" / "run"
    environ = {**module_environment(default_project), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    args = ("slurm", "--gpus-per-node", "0", "--partition", "remote", "--run-dir", str(run_dir))
    refused = run_module(default_project, LAUNCH, *args, env=environ, cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"python -m {LAUNCH} slurm: error: argument --run-dir: {run_dir} is on a filesystem "
        f"local to this machine (tmpfs on {socket.gethostname()}), which nodes on elsewhere "
        "cannot reach; choose a folder on a shared filesystem (home, project or scratch space: "
        "NFS, Lustre, GPFS, BeeGFS...)"
    )
    assert not run_dir.parent.exists()
    queued = cluster.run("squeue", "--noheader", "--states=all", "--partition=remote")
    assert queued.stdout.strip() == ""


def test_a_job_sbatch_refuses_leaves_nothing_behind(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """GPUs of a type the cluster does not have (--force: the test environment's torch
    is a CPU build), which a held job would wait for forever (BadConstraints): refused
    by ``sbatch --test-only``, in sbatch's own words, one line, exit 1; nothing queued,
    and neither the run folder nor the ``runs`` folder made for it is left."""
    environ = {**module_environment(default_project), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    refused = run_module(
        default_project, LAUNCH, "slurm", "--gpus-per-node", "v100:1", "--force",
        env=environ, cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"python -m {LAUNCH} slurm: error: sbatch refused the job: allocation failure: "
        "Requested node configuration is not available\n"
    )
    assert list(tmp_path.iterdir()) == []
    queued = cluster.run("squeue", "--noheader", "--states=all", f"--name={DEFAULT_PACKAGE}")
    assert "BadConstraints" not in queued.stdout, queued.stdout


def test_typed_gpus_as_sbatch_takes_them(cluster, default_project: Path, tmp_path: Path) -> None:
    """The scripts launch writes for each form of a GPU request, given to ``sbatch
    --test-only`` (which schedules and submits nothing): the forms the cluster's GPUs
    (`slurm_cluster.GPU_TYPE`, 2 per node) can meet are taken, a type it lacks or more
    per node than it has are refused."""
    gpus = f"{slurm_cluster.GPU_TYPE}:{slurm_cluster.GPUS_PER_NODE}"
    forms = {
        ("--gpus-per-node", gpus): "n1",
        ("--gpus-per-node", "2"): "n1",
        ("--nodes", "2", "--gpus", f"{slurm_cluster.GPU_TYPE}:4"): "n[1-2]",
        ("--nodes", "2", "--gres", f"gpu:{slurm_cluster.GPU_TYPE}:1"): "n[1-2]",
        ("--gpus-per-node", "v100:1"): None,
        ("--gres", f"gpu:{slurm_cluster.GPU_TYPE}:3"): None,
    }
    environ = launch_env(cluster, default_project)
    for form, nodes in forms.items():
        written = run_module(
            default_project, LAUNCH, "slurm", "--dry-run", *form, env=environ, cwd=tmp_path
        )
        assert written.returncode == 0, written.stderr
        script = tmp_path / "job.sbatch"
        script.write_text(written.stdout)
        tested = cluster.run("sbatch", "--test-only", str(script), check=False)
        if nodes is None:
            assert tested.returncode == 1, (form, tested.stderr)
            assert tested.stderr.strip().endswith(
                "Requested node configuration is not available"
            ), (form, tested.stderr)
        else:
            assert tested.returncode == 0, (form, tested.stderr)
            assert f" on nodes {nodes} in partition debug" in tested.stderr, (form, tested.stderr)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["job.sbatch"]


def test_setup_lines_run_on_each_node_before_torchrun(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """A two-node job with a --setup line and a --setup-file: each node's step runs them
    (a file per node, named after it, written by them) with the job's OMP_NUM_THREADS
    (1: each node has 1 CPU) and a variable an earlier line exported, then torchrun,
    whose two processes train."""
    (tmp_path / "site.sh").write_text(
        "export SITE=ready\n"
        'echo "$SITE on $SLURMD_NODENAME OMP_NUM_THREADS=$OMP_NUM_THREADS" '
        '> "setup-$SLURMD_NODENAME.txt"\n'
    )
    options = ("--nodes", "2", "--gpus-per-node", "0", "--run-dir", "run", "--time", "5")
    submitted = run_module(
        default_project, LAUNCH, "slurm", *options,
        "--setup", "echo \"$(date -Is) $SLURMD_NODENAME\" >> setup-order.txt",
        "--setup-file", "site.sh",
        "--", "--samples", "64", "--batch-size", "32", "--epochs", "1",
        env=launch_env(cluster, default_project), cwd=tmp_path,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id, run_dir = submitted_job(submitted.stdout)
    cluster.wait_for(
        f"job {job_id} ended",
        lambda: cluster.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED"),
        180,
    )
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert cluster.job_state(job_id) == "COMPLETED", log
    assert "trained 1 epochs on 2 processes on cpu (gloo)" in log, log
    for node in slurm_cluster.NODES:
        marker = (tmp_path / f"setup-{node}.txt").read_text()
        assert marker == f"ready on {node} OMP_NUM_THREADS=1\n", log
    order = (tmp_path / "setup-order.txt").read_text().split()
    assert sorted(order[1::2]) == list(slurm_cluster.NODES), order  # once on each node


def launch_env(cluster: slurm_cluster.Cluster, project: Path, *path: Path) -> dict[str, str]:
    """The environment to run launch in, with ``path`` ahead of PATH."""
    environ = {**module_environment(project), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    environ["PATH"] = os.pathsep.join([*map(str, path), environ["PATH"]])
    return environ


def next_job_id(cluster: slurm_cluster.Cluster) -> int:
    """The id SLURM gives the next job launch submits: two more than that of a job
    submitted (held) and cancelled here, as launch's ``sbatch --test-only`` takes one."""
    probe = int(cluster.run("sbatch", "--parsable", "--hold", "--wrap=true").stdout.strip())
    cluster.run("scancel", str(probe))
    return probe + 2


def test_a_job_id_seen_before_leaves_that_run_alone(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """Job ids repeat (a reset of SLURM's state, ids wrapping at MaxJobId): a new job that
    finds a run folder of its id is cancelled, with one line saying why, and the earlier
    run's folder stays as it was, its log not appended to."""
    job_id = next_job_id(cluster)
    earlier = tmp_path / "runs" / f"slurm-tests-{job_id}"
    earlier.mkdir(parents=True)
    (earlier / f"slurm-{job_id}.out").write_text("trained 3 epochs on cpu: loss 0.5003\n")
    before = {path.name: path.read_bytes() for path in earlier.iterdir()}
    refused = run_module(
        default_project, LAUNCH, "slurm", "--gpus-per-node", "0",
        env=launch_env(cluster, default_project), cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"python -m {LAUNCH} slurm: error: run folder {earlier} already exists, from an earlier "
        f"job {job_id} (SLURM numbers jobs anew after its state is reset, and at MaxJobId); it is "
        f"left as it is; job {job_id} cancelled\n"
    )
    assert cluster.job_state(job_id) == "CANCELLED"
    assert {path.name: path.read_bytes() for path in earlier.iterdir()} == before
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == [earlier.name]


def test_a_run_folder_taken_over_by_a_newer_job_is_not_continued(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """Two jobs for one --run-dir: the newer one owns it (its token in launch-job.txt), so
    the older one, started (as a requeued job would be) after the newer was submitted,
    cancels itself before training, one line in its log saying why."""
    run_dir = tmp_path / "run"
    environ = launch_env(cluster, default_project)
    later = ("--gpus-per-node", "0", "--run-dir", str(run_dir), "--sbatch=--begin=now+600")
    jobs = []
    for _ in range(2):
        submitted = run_module(
            default_project, LAUNCH, "slurm", *later, "--", *ARGS, env=environ, cwd=tmp_path
        )
        assert submitted.returncode == 0, submitted.stderr
        jobs.append(submitted_job(submitted.stdout)[0])
    older, newer = jobs
    owner = (run_dir / "launch-job.txt").read_text()
    assert f"\njob={newer}\ncluster=tests\n" in owner, owner
    cluster.run("scontrol", "update", f"JobId={older}", "StartTime=now")
    cluster.wait_for(f"job {older} ended", lambda: cluster.job_state(older) == "CANCELLED", 60)
    log = (run_dir / f"slurm-{older}.out").read_text()
    assert (
        f"launch: {run_dir}/launch-job.txt does not hold this submission's token: the folder "
        f"is another job's; job {older} cancelled, the folder left as it is\n"
    ) in log, log
    assert not (run_dir / "latest.pt").exists(), log
    assert (run_dir / "launch-job.txt").read_text() == owner
    assert cluster.job_state(newer) == "PENDING"
    cluster.run("scancel", str(newer))


def wrapper(folder: Path, body: str) -> Path:
    """``folder`` (made) holding an ``sbatch`` that runs the real one as ``body`` says."""
    folder.mkdir()
    real = shutil.which("sbatch")
    assert real is not None
    script = folder / "sbatch"
    script.write_text(f"#!/bin/sh\n{body.format(sbatch=shlex.quote(real))}\n")
    script.chmod(0o755)
    return folder


def test_sbatch_answers_with_more_than_the_job_id(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """A site's sbatch wrapper that prints a line of its own before sbatch's answer, and
    drops --parsable (sbatch then says ``Submitted batch job ID``): the job id is found,
    the job released, nothing left held. One that prints no job id at all: one line with
    what it printed, the job it queued (held) found in squeue by its script and
    cancelled, the script and folders made for the job removed."""
    chatty = wrapper(
        tmp_path / "chatty",
        'echo "sbatch: partition debug is billed per CPU hour"\n'
        '[ "$1" = --parsable ] && shift\nexec {sbatch} "$@"',
    )
    work = tmp_path / "work"
    work.mkdir()
    args = ("slurm", "--gpus-per-node", "0", "--sbatch=--begin=now+600")
    submitted = run_module(
        default_project, LAUNCH, *args, env=launch_env(cluster, default_project, chatty), cwd=work
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id, run_dir = submitted_job(submitted.stdout)
    shown = cluster.run("scontrol", "show", "job", str(job_id)).stdout
    # Released, not held: a held job has Priority=0 and Reason=JobHeldUser. Until the
    # scheduler's next pass a released job's Reason is None, after it BeginTime.
    assert re.search(r"\bJobState=PENDING Reason=(BeginTime|None)\b", shown), shown
    assert not re.search(r"\bPriority=0\b", shown), shown
    assert sorted(path.name for path in run_dir.iterdir()) == [
        "launch-job.txt",
        f"slurm-{job_id}.sbatch",
    ]
    cluster.run("scancel", str(job_id))

    quiet = wrapper(tmp_path / "quiet", '{sbatch} "$@" >/dev/null && echo "sbatch: accepted"')
    work = tmp_path / "quiet-work"
    work.mkdir()
    refused = run_module(
        default_project, LAUNCH, *args, env=launch_env(cluster, default_project, quiet), cwd=work
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    match = re.fullmatch(
        rf"python -m {LAUNCH} slurm: error: sbatch's answer names no job id: 'sbatch: "
        r"accepted\\n' \(expected ID, ID;CLUSTER or 'Submitted batch job ID'\); squeue shows "
        r"job (\d+) held with this script; job (\d+) cancelled\n",
        refused.stderr,
    )
    assert match is not None, refused.stderr
    assert match[1] == match[2], refused.stderr
    assert cluster.job_state(int(match[1])) == "CANCELLED"
    assert list(work.iterdir()) == []
    held = cluster.run(
        "squeue", "--noheader", "--states=PENDING", "--format=%i %r", f"--name={DEFAULT_PACKAGE}"
    ).stdout.split()
    assert held == [], held


def test_a_job_that_cannot_be_released_is_cancelled_and_its_folder_removed(
    cluster, default_project: Path, tmp_path: Path
) -> None:
    """``scontrol release`` refused after the run folder was made and the script moved
    in: the held job is cancelled, and the run folder and ``runs`` made for it removed."""
    folder = tmp_path / "refusing"
    folder.mkdir()
    real = shutil.which("scontrol")
    assert real is not None
    scontrol = folder / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\nif [ "$1" = release ]; then\n'
        '    echo "Access/permission denied for job $2" >&2\n    exit 1\nfi\n'
        f'exec {shlex.quote(real)} "$@"\n'
    )
    scontrol.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    refused = run_module(
        default_project, LAUNCH, "slurm", "--gpus-per-node", "0",
        env=launch_env(cluster, default_project, folder), cwd=work,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr
    match = re.fullmatch(
        rf"python -m {LAUNCH} slurm: error: scontrol release (\d+) failed: Access/permission "
        r"denied for job (\d+); job (\d+) cancelled\n",
        refused.stderr,
    )
    assert match is not None, refused.stderr
    assert len(set(match.groups())) == 1, refused.stderr
    assert cluster.job_state(int(match[1])) == "CANCELLED"
    assert list(work.iterdir()) == []
