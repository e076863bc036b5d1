"""Run ``train`` on a SLURM cluster: one ``torchrun`` per node, requeued when preempted.

    <project>-launch slurm --nodes 2 --gpus-per-node 4 --time 24:00:00 -- --epochs 100
    <project>-launch slurm --nodes 2 --gpus-per-node 4 --dry-run -- --epochs 100
    <project>-launch slurm --run-dir runs/slurm-hpc-1234 --time 24:00:00   # a new job for that run
    <project>-launch slurm --gpus-per-node a100:4 --setup 'module load cuda/12.4' -- --epochs 9

``slurm`` writes a batch script and submits it with ``sbatch``; ``--dry-run`` prints
the script and writes and submits nothing. Everything after ``--`` goes to ``train``
(checked by train's own parser first). The job's run folder is
``runs/slurm-<cluster>-<job id>`` (or ``--run-dir``): the script, ``slurm-<job id>.out``
(the log of every attempt of the job, appended), ``metrics.csv``, ``latest.pt`` and
`OWNER`, whose token names the submission that owns the folder. Job ids repeat (a
reset of SLURM's state, ``MaxJobId``), so a new job never takes over a folder: one
whose folder exists is cancelled at submission, and an attempt that does not find its
token in the folder (a newer job took it over with ``--run-dir``) cancels itself.

In the job, ``srun`` starts one ``torchrun`` per node; the ``torchrun`` agents meet
(c10d rendezvous) on the first node of ``scontrol show hostnames``, each starts one
training process per GPU, and rank 0 of the whole job writes the run folder, which
must be on a filesystem every node reaches. An attempt resumes with ``--resume``
whenever the run folder holds a checkpoint.

Sites' lines (``--setup``, ``--setup-file``: ``module load``, ``source
.venv/bin/activate``...) run verbatim in bash on each node inside the job step,
before ``torchrun`` (``bash -c STEP setup torchrun ...``), under ``set -e``: what
they set is what ``torchrun`` and train see on every node, node-local work (a copy to
local scratch) happens on every node, and a failing line ends the step before
training. They are not run in the batch shell as well: it only runs SLURM's own
commands (``scontrol``, ``sinfo``, ``scancel``), and running them there would do
each line twice on the first node. The interpreter stays the one launch runs in
(``sys.executable``): a line that activates an environment sets its variables, not
the Python that runs. With ``--container-image`` the step, so the lines, runs inside
the container; with ``--apptainer`` on the node, before ``apptainer exec``.

GPUs are asked for per node (``--gpus-per-node [TYPE:]N``, ``--gres gpu:[TYPE:]N``,
or ``--gpus [TYPE:]N`` for the whole job, which must divide evenly among the nodes
and is written as per node: ``torchrun`` starts the same number of processes, one
per GPU, on every node). ``OMP_NUM_THREADS`` is the task's CPUs shared by those
processes.

How a job stops and comes back (checked on SLURM 22.05 and torch's ``torchrun``):

- Preemption, ``scontrol requeue``, ``scancel``, the time limit: slurmd sends SIGCONT
  and SIGTERM to every process of the job (the batch shell, ``srun``, each
  ``torchrun`` and each training process, so a training process may see SIGTERM
  more than once within milliseconds), then SIGKILL ``KillWait`` seconds later
  (``scontrol show config``; 30 s by default). ``torchrun`` forwards SIGTERM, SIGINT,
  SIGHUP and SIGQUIT to its processes and kills them 30 s later.
- ``--requeue``: a preempted job (``PreemptMode=REQUEUE``) or one on a failed node
  goes back to the queue under the same job id, so it finds the same run folder.
  SLURM holds a requeued job back for ``cred_expire`` + 1 seconds (121 s by default).
- ``--signal=B:USR1@SECONDS``: that long before the time limit (up to 60 s more)
  SLURM sends SIGUSR1 to the batch shell alone. Its trap sends SIGCONT and SIGTERM to
  the job's steps (``scancel --signal``, which spares the batch shell), waits for
  ``srun`` to end, at most SECONDS - `REQUEUE_MARGIN_S`, and only then runs ``scontrol
  requeue``, so the checkpoint is not cut off by the requeue's SIGKILL (train's
  processes all wait for rank 0's checkpoint before exiting, so no node's ``torchrun``
  ends first and ``srun --kill-on-bad-exit`` does not cut it short; torchrun's own
  wait is raised to match). SIGUSR1
  is not sent to the job's processes (no ``B:``) because ``torchrun`` does not
  forward it by default: it dies of it, and ``srun`` then kills its training
  processes at once.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from . import _checkpoint
from ._command import command_name
from ._files import filesystem_type
from .train import UsageError, positive_int
from .train import build_parser as build_train_parser

__all__ = [
    "Container",
    "Gpus",
    "Runtime",
    "SlurmJob",
    "Submitted",
    "main",
    "render_script",
    "submit",
]

PACKAGE = __package__
# The folder holding this package (a project's src): containers get it on PYTHONPATH.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
SCRIPT_SUFFIX = ".sbatch"
# The rendezvous port is derived from the job id, so that jobs sharing a first node
# use different ports; 20000-29999 stays below Linux's ephemeral ports (32768 and up).
RDZV_PORT_BASE, RDZV_PORT_SPAN = 20000, 10000
# sbatch's --signal takes 0 to 65535 seconds, and SLURM may signal up to 60 s early.
MAX_SIGNAL_SECONDS = 65535
# Near the time limit the batch shell waits for train's checkpoint at most --requeue-before
# less this, then requeues: `scontrol requeue` must reach the controller before the limit
# (a job past it ends TIMEOUT, which --requeue does not bring back); 10 s covers a busy
# controller's answer.
REQUEUE_MARGIN_S = 10
# torchrun kills its processes this long after passing SIGTERM on to them (its default,
# which TORCH_ELASTIC_SHUTDOWN_TIMEOUT changes); the script never sets it lower.
TORCHRUN_SHUTDOWN_S = 30
# The file in a run folder that names the submission owning it (launch's token for it).
OWNER = "launch-job.txt"
# In --dry-run without a reachable cluster: the cluster's name in the run folder's.
UNKNOWN_CLUSTER = "<cluster>"
# What an #SBATCH line cannot hold: a newline ends it, other control characters are not
# text, and sbatch leaves %j unreplaced in a path with a backslash.
NOT_SBATCH_TEXT = re.compile(r"[\x00-\x1f\x7f\\]")
# sbatch's answer: "ID" or "ID;CLUSTER" (--parsable), "Submitted batch job ID[ on cluster
# NAME]" (without it); a site's wrapper may add lines of its own.
JOB_ID_LINE = re.compile(r"(?:Submitted batch job )?(\d+)(?:;\S+| on cluster \S+)?")
# Filesystems that only the machine mounting them sees. Types not listed (nfs, lustre,
# gpfs, beegfs, ceph, cifs, ...) are taken to be shared.
LOCAL_FILESYSTEMS = frozenset(
    {"btrfs", "exfat", "ext2", "ext3", "ext4", "f2fs", "overlay", "ramfs", "tmpfs", "vfat", "xfs",
     "zfs"}
)  # fmt: skip
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
# A GRES type: a SLURM name, not all digits (``gpu:4:2`` would not say which is the
# count); MIG types start with one (1g.10gb).
GPU_TYPE = r"(?![0-9]+:)[A-Za-z0-9][A-Za-z0-9_.+-]*"
GPU_COUNT = re.compile(rf"(?:({GPU_TYPE}):)?([0-9]+)")
# sbatch options that ask for GPUs: the script's own (from --gpus-per-node, --gpus or
# --gres), which torchrun's processes per node follow; another would change them.
GPU_SBATCH_OPTIONS = ("--gpus", "--gpus-per-node", "--gpus-per-task", "--gpus-per-socket")
# The heredoc that holds the setup lines in the script ends at this line (made longer
# while a setup line is exactly it).
SETUP_END = "END_OF_SETUP"
# SLURM's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds.
TIME = re.compile(r"(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)")
# train's settings that the job script makes (train's option, why); the other train
# arguments after -- go to train unchanged.
SCRIPT_SETS = {
    "run_dir": ("--run-dir", "the run folder is launch slurm's --run-dir (give it before --)"),
    "resume": ("--resume", "the job script adds it when the run folder holds a checkpoint"),
    "device": ("--device", "the job script sets it: cuda with --gpus-per-node, cpu with 0"),
}


@dataclass(frozen=True)
class Gpus:
    """The GPUs of each node: one training process each."""

    per_node: int  # at least 1
    type: str | None = None  # a GRES type, as the cluster's gres.conf names it
    gres: bool = False  # asked for as --gres=gpu:... (sites without select/cons_tres)
    # launch's option that asked for them, and its value as given, for messages
    asked_with: str = "--gpus-per-node"
    asked: str = "1 (the default)"

    @property
    def option(self) -> str:
        """The sbatch and srun option that asks for them."""
        count = str(self.per_node) if self.type is None else f"{self.type}:{self.per_node}"
        return f"--gres=gpu:{count}" if self.gres else f"--gpus-per-node={count}"


class Runtime(enum.Enum):
    """How the nodes run the dev container's image; the value is launch's option."""

    APPTAINER = "--apptainer"  # apptainer (or singularity) exec --nv IMAGE ...
    PYXIS = "--container-image"  # srun --container-image=IMAGE ... (pyxis and enroot)


@dataclass(frozen=True)
class Container:
    runtime: Runtime
    image: str


@dataclass(frozen=True)
class SlurmJob:
    """Everything the batch script says; paths are absolute."""

    nodes: int
    gpus: Gpus | None  # None: a CPU job
    nproc_per_node: int
    workdir: Path
    python: str  # the interpreter on the nodes (without a container)
    cluster: str  # ClusterName, part of the default run folder's name
    requeue_before: int = 120
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = PACKAGE
    run_dir: Path | None = None  # None: workdir/runs/slurm-<cluster>-<job id>
    container: Container | None = None
    sbatch_options: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()  # shell lines run on each node before torchrun
    train_args: tuple[str, ...] = ()
    # Names this submission in its run folder (`OWNER`): a requeued attempt of it finds
    # its own token there, a job that only shares its id (or a --run-dir) does not.
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def runs(self) -> Path:
        """The folder that holds the run folder."""
        return self.workdir / "runs" if self.run_dir is None else self.run_dir.parent

    def run_dir_of(self, job_id: int) -> Path:
        return (
            self.runs / f"slurm-{self.cluster}-{job_id}" if self.run_dir is None else self.run_dir
        )

    @property
    def requeue_grace(self) -> int:
        """Seconds the batch shell waits for train to stop near the time limit."""
        return max(0, self.requeue_before - REQUEUE_MARGIN_S)


@dataclass(frozen=True)
class Submitted:
    job_id: int
    run_dir: Path
    script: Path

    @property
    def log(self) -> Path:
        return self.run_dir / f"slurm-{self.job_id}.out"

    def __str__(self) -> str:
        return (
            f"submitted job {self.job_id}; run folder {self.run_dir}\n"
            f"  script {self.script}\n"
            f"  log    {self.log}\n"
            f"follow it with: tail -f {shlex.quote(str(self.log))}   (squeue -j {self.job_id}; "
            f"scancel {self.job_id} stops it)"
        )


class SubmitError(Exception):
    """The cluster refused or could not take the job; nothing is left queued."""


def sbatch_line(option: str) -> str:
    """``--name=value`` as an ``#SBATCH`` line. sbatch splits those lines at whitespace
    outside quotes, takes a backslash as escaping the next character and an unquoted
    ``#`` as starting a comment: a value with anything but plain characters is quoted."""
    name, equals, value = option.partition("=")
    if equals and not re.fullmatch(r"[\w./%:,@+=-]*", value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"#SBATCH {name}{equals}{value}"


def literal_path(path: Path) -> str:
    """``path`` for sbatch's --output, in which ``%`` starts a pattern such as ``%j``."""
    return str(path).replace("%", "%%")


# The parts of the batch script that do not depend on the job.
OWNED = f"""
# The run folder is this submission's only when it holds the token launch wrote there:
# not a folder of an earlier job with the same id, nor one a newer job (--run-dir) took.
owner=$(head -n 1 -- "$run_dir"/{OWNER} 2>/dev/null) || owner=
if [ "$owner" != "token=$token" ]; then
    echo "launch: $run_dir/{OWNER} does not hold this submission's token: the folder is" \\
        "another job's; job $SLURM_JOB_ID cancelled, the folder left as it is" >&2
    scancel "$SLURM_JOB_ID"
    exit 1
fi
"""
STOPPING = """
# Near the time limit (SIGUSR1): train first, then the requeue. The job's steps get
# SIGCONT and SIGTERM as slurmd sends them (this shell does not), train writes the
# checkpoint of the step under way and exits, and this shell waits for that, at most
# $grace s, before it requeues the job.
training=
near_time_limit() {
    echo "launch: time limit near: train checkpoints, then job $SLURM_JOB_ID is requeued"
    scancel --signal=CONT "$SLURM_JOB_ID" || true
    scancel --signal=TERM "$SLURM_JOB_ID" || true
    deadline=$((SECONDS + grace))
    while kill -0 "$training" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 1
    done
    echo "launch: requeueing job $SLURM_JOB_ID"
    trap '' TERM  # the requeue's SIGTERM to this shell, which is done
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap near_time_limit USR1
trap 'echo "launch: SIGTERM (preempted, requeued or cancelled): train checkpoints"' TERM
"""
RENDEZVOUS = f"""
# The torchrun agents meet on the first node, at the address SLURM reaches it by, on a
# port derived from the job id.
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${{nodes%%$'\\n'*}}
addresses=$(sinfo --noheader --Node --nodes="$head_node" --format=%o)
head_address=${{addresses%%$'\\n'*}}
port=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))

if [ -e "$run_dir"/{_checkpoint.LATEST} ]; then resume=--resume; else resume=; fi
export PYTHONUNBUFFERED=1
"""
WAITING = """training=$!
status=0
wait "$training" || status=$?
while kill -0 "$training" 2>/dev/null; do  # a trap interrupted the wait
    status=0
    wait "$training" || status=$?
done
exit "$status"
"""


def omp_threads_lines(job: SlurmJob) -> list[str]:
    """``OMP_NUM_THREADS`` for the processes on each node: the task's CPUs (one task per
    node runs torchrun) shared by its processes, at least 1; torch would otherwise start
    a thread per core of the machine on CPUs it was not given, and torchrun's own
    default of 1 holds only for several processes."""
    processes = job.nproc_per_node
    if job.cpus_per_task:
        threads = max(1, job.cpus_per_task // processes)
        return [
            f"export OMP_NUM_THREADS={threads}  # --cpus-per-task {job.cpus_per_task} shared by "
            f"{processes} process(es)"
        ]
    return [
        f"# OMP_NUM_THREADS: the CPUs of a node's task shared by its {processes} process(es), at",
        "# least 1: SLURM_CPUS_PER_TASK when the job asked for CPUs per task, else the CPUs",
        "# it has on this node (srun's step, without --exact, gets them all), else 1.",
        f"threads=$((${{SLURM_CPUS_PER_TASK:-${{SLURM_CPUS_ON_NODE:-1}}}} / {processes}))",
        "export OMP_NUM_THREADS=$((threads > 1 ? threads : 1))",
    ]


def setup_lines(job: SlurmJob) -> list[str]:
    """The step each node runs before torchrun: the setup lines as given (a quoted
    heredoc: nothing in them is expanded here), under ``set -e``, then ``exec`` of
    torchrun's command line (srun's arguments after ``bash -c "$step" setup``)."""
    end = SETUP_END
    while end in job.setup:
        end += "_"
    return [
        "",
        "# --setup: run on each node, in the job step, before torchrun (a failing line",
        "# ends the step); as given, in bash.",
        f"IFS= read -r -d '' step <<'{end}' || true",
        "set -e",
        *job.setup,
        'exec "$@"',
        end,
    ]


def render_script(job: SlurmJob, *, written: datetime | None = None) -> str:
    """The batch script for ``job``: readable, and every value in it quoted."""
    gpus = job.gpus
    if job.run_dir is None:
        run_dir = shlex.quote(f"{job.runs}/slurm-{job.cluster}-") + '"$SLURM_JOB_ID"'
        output = f"{literal_path(job.runs)}/slurm-{literal_path(Path(job.cluster))}-%j/slurm-%j.out"
    else:
        run_dir = shlex.quote(str(job.run_dir))
        output = f"{literal_path(job.run_dir)}/slurm-%j.out"
    sbatch = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([gpus.option] if gpus else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--time={job.time}"] if job.time else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        *job.sbatch_options,
        "--requeue",
        f"--signal=B:USR1@{job.requeue_before}",
        f"--output={output}",
        "--open-mode=append",
    ]
    stamp = (written or datetime.now()).strftime("%Y-%m-%d %H:%M")
    script = [
        "#!/bin/bash",
        f"# Written by {command_name(f'{PACKAGE}.launch')} slurm on {stamp}.",
        "# One torchrun per node (srun), c10d rendezvous on the first node.",
        *(
            [
                f"# --gpus {gpus.asked} on {job.nodes} node(s): {gpus.option}, as torchrun "
                "starts as many processes on each."
            ]
            if gpus and gpus.asked_with == "--gpus"
            else []
        ),
        "# --requeue: back to the queue after preemption or a node failure, under the same",
        "#   job id, so to the same run folder.",
        f"# --signal: SIGUSR1 to this shell {job.requeue_before} s before the time limit:"
        " train checkpoints, then",
        "#   the job is requeued.",
        "# Every attempt resumes from the run folder's checkpoint.",
        *(sbatch_line(option) for option in sbatch),
        "set -eu",
        "",
        "# Where launch ran: relative paths in train's arguments start here.",
        f"cd {shlex.quote(str(job.workdir))}",
        f"run_dir={run_dir}",
        f"token={job.token}",
        f"grace={job.requeue_grace}  # --requeue-before {job.requeue_before} less"
        f" {REQUEUE_MARGIN_S} s for the requeue",
        'echo "launch: job $SLURM_JOB_ID, attempt $((${SLURM_RESTART_COUNT:-0} + 1)), on'
        ' $SLURM_JOB_NODELIST at $(date -Is); run folder $run_dir"',
        OWNED + STOPPING + RENDEZVOUS.rstrip("\n"),
        "# How long torchrun lets its processes checkpoint after passing SIGTERM on.",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={max(job.requeue_grace, TORCHRUN_SHUTDOWN_S)}",
        *omp_threads_lines(job),
    ]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if gpus:
        srun.append(gpus.option)
    if job.cpus_per_task:  # since SLURM 22.05 srun no longer takes it from sbatch
        srun.append(f"--cpus-per-task={job.cpus_per_task}")
    python = [shlex.quote(job.python)]
    if job.container is not None:
        script += container_lines(job)
        if job.container.runtime is Runtime.PYXIS:
            srun += pyxis_options(job)
            python = ["python3"]
        else:
            python = ['"$runtime" exec', *(["--nv"] if gpus else []), '--bind "$binds"']
            python += [shlex.quote(job.container.image), "python3"]
    if job.setup:
        script += setup_lines(job)
    train_args = " ".join(shlex.quote(argument) for argument in job.train_args)
    script += [
        "",
        " ".join(srun) + (' \\\n    bash -c "$step" setup' if job.setup else "") + " \\",
        f"    {' '.join(python)} -m torch.distributed.run \\",
        f'        --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={job.nproc_per_node} \\',
        '        --rdzv-backend=c10d --rdzv-endpoint="$head_address:$port"'
        ' --rdzv-id="$SLURM_JOB_ID" \\',
        f"    -m {PACKAGE}.train --device {'cuda' if gpus else 'cpu'}"
        ' --run-dir "$run_dir" ${resume:+"$resume"}'
        + (f" \\\n        {train_args}" if train_args else "")
        + " &",
        WAITING,
    ]
    return "\n".join(script)


def _mounted(job: SlurmJob) -> list[str]:
    """The folders a container must see at the same paths: the package's, the work folder
    and the run folder's parent (each only once, and none inside another)."""
    folders = [PACKAGE_ROOT, job.workdir, job.runs]
    return [
        str(folder)
        for index, folder in enumerate(folders)
        if folder not in folders[:index]
        and not any(other != folder and folder.is_relative_to(other) for other in folders)
    ]


def container_lines(job: SlurmJob) -> list[str]:
    assert job.container is not None
    lines = [
        "",
        "# The dev container's image: this package from the shared folder, on PYTHONPATH.",
        f'export PYTHONPATH={shlex.quote(str(PACKAGE_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
    ]
    if job.container.runtime is Runtime.APPTAINER:
        lines += [
            "runtime=$(command -v apptainer || command -v singularity) || {",
            '    echo "launch: neither apptainer nor singularity on $(hostname)" >&2',
            "    exit 1",
            "}",
            f"binds={shlex.quote(','.join(_mounted(job)))}",
        ]
    return lines


def pyxis_options(job: SlurmJob) -> list[str]:
    assert job.container is not None
    mounts = ",".join(f"{folder}:{folder}" for folder in _mounted(job))
    return [
        f"--container-image={shlex.quote(job.container.image)}",
        f"--container-mounts={shlex.quote(mounts)}",
        f"--container-workdir={shlex.quote(str(job.workdir))}",
        "--no-container-entrypoint",  # the image's entrypoint starts sshd and Jupyter
    ]


def _run(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, check=False)


def job_id_of(answer: str) -> int | None:
    """The job id in sbatch's answer (`JOB_ID_LINE`), or None when no line is one."""
    for line in reversed(answer.splitlines()):
        match = JOB_ID_LINE.fullmatch(line.strip())
        if match is not None:
            return int(match[1])
    return None


def held_job_of(script: str) -> int | None:
    """This user's pending job whose batch script is ``script`` (squeue's command, ``%o``:
    the path sbatch was given, which `submit` made unique), or None."""
    answer = _run(["squeue", "--me", "--noheader", "--states=PENDING", "--format=%i %o"])
    for line in answer.stdout.splitlines():
        job_id, _, command = line.lstrip().partition(" ")
        if command == script and job_id.isdigit():
            return int(job_id)
    return None


def owner_text(job: SlurmJob, job_id: int) -> str:
    """`OWNER`'s text: the token the script checks on its first line, then for people."""
    return (
        f"token={job.token}\njob={job_id}\ncluster={job.cluster}\n"
        f"submitted={datetime.now().isoformat(timespec='seconds')}\n"
    )


def submit(job: SlurmJob, script: str) -> Submitted:
    """Write ``script`` into the run folder and submit it; `SubmitError` when SLURM refuses.

    ``sbatch --test-only`` first takes the script or refuses it with sbatch's reason
    (a held job is accepted even when no node can run it). The job is then submitted
    held: its run folder (named after the job id, unless
    ``--run-dir``) is only known once sbatch answers, and the job's log goes into it.
    The folder is then made, never taken over (job ids repeat: a new job that finds a
    folder of its id is cancelled), the script moved in, `OWNER` written (the token the
    job checks at each start), and the job released. When a step fails, the job is
    cancelled (found by its script in squeue when sbatch's answer names no id) and
    what was made for it removed.
    """
    staging = job.runs if job.run_dir is None else job.run_dir
    made = [folder for folder in (staging, *staging.parents) if not folder.exists()][::-1]
    # A --run-dir's owner before this job, put back if this job does not take the folder.
    earlier = job.run_dir / OWNER if job.run_dir is not None else None
    earlier_owner = None
    job_id = None
    try:
        if earlier is not None and earlier.exists():
            earlier_owner = earlier.read_bytes()
        staging.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".launch-", suffix=SCRIPT_SUFFIX, dir=staging)
        made.append(Path(temporary))
        with os.fdopen(fd, "w") as file:
            file.write(script)
        # A held job is accepted even when no node can ever run it (GPUs of a type the
        # cluster lacks): released, it would wait forever (BadConstraints). --test-only
        # refuses it, and submits nothing.
        answer = _run(["sbatch", "--test-only", temporary])
        if answer.returncode == 0:
            answer = _run(["sbatch", "--parsable", "--hold", temporary])
        if answer.returncode != 0:
            reason = "; ".join((answer.stderr or answer.stdout).strip().splitlines())
            raise SubmitError(f"sbatch refused the job: {reason}")
        job_id = job_id_of(answer.stdout)
        if job_id is None:
            job_id = held_job_of(temporary)
            found = "" if job_id is None else f"; squeue shows job {job_id} held with this script"
            raise SubmitError(
                f"sbatch's answer names no job id: {answer.stdout!r} (expected ID, ID;CLUSTER "
                f"or 'Submitted batch job ID'){found or '; squeue shows no job of this script'}"
            )
        run_dir = job.run_dir_of(job_id)
        if job.run_dir is None:
            try:
                run_dir.mkdir()
            except FileExistsError:
                raise SubmitError(
                    f"run folder {run_dir} already exists, from an earlier job {job_id} (SLURM "
                    "numbers jobs anew after its state is reset, and at MaxJobId); it is left "
                    "as it is"
                ) from None
            made.append(run_dir)
        script_path = run_dir / f"slurm-{job_id}{SCRIPT_SUFFIX}"
        os.replace(temporary, script_path)
        made.remove(Path(temporary))
        made.append(script_path)
        if earlier_owner is None:
            made.append(run_dir / OWNER)
        (run_dir / OWNER).write_text(owner_text(job, job_id))
        released = _run(["scontrol", "release", str(job_id)])
        if released.returncode != 0:
            raise SubmitError(f"scontrol release {job_id} failed: {released.stderr.strip()}")
    except BaseException as error:  # Ctrl-C included: a held job would wait forever
        if job_id is not None:
            _run(["scancel", str(job_id)])
        if earlier is not None and earlier_owner is not None:
            earlier.write_bytes(earlier_owner)
        undo(made)
        if isinstance(error, (OSError, SubmitError)):
            cancelled = "" if job_id is None else f"; job {job_id} cancelled"
            raise SubmitError(f"{error}{cancelled}") from None
        raise
    return Submitted(job_id, run_dir, script_path)


def undo(made: list[Path]) -> None:
    """Remove what `submit` made, newest first; folders only when empty."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()


def cluster_name() -> str | None:
    """The cluster's ``ClusterName`` (``scontrol show config``), or None when scontrol
    cannot tell (no SLURM here, the controller unreachable) or it is not a `NAME`."""
    if shutil.which("scontrol") is None:
        return None
    answer = _run(["scontrol", "show", "config"])
    match = re.search(r"^ClusterName\s*=\s*(\S+)\s*$", answer.stdout, re.MULTILINE)
    if answer.returncode != 0 or match is None or not NAME.fullmatch(match[1]):
        return None
    return match[1]


def cluster_hosts(partition: str | None) -> set[str] | None:
    """The host names of the nodes of ``partition`` (a comma-separated list; None: the
    cluster's default partition), or None when sinfo cannot tell."""
    if shutil.which("sinfo") is None:
        return None
    answer = _run(["sinfo", "--noheader", "--Node", "--format=%P %n"])
    if answer.returncode != 0:
        return None
    wanted = set(partition.split(",")) if partition else None
    hosts = set()
    for line in answer.stdout.splitlines():
        name, _, host = line.strip().partition(" ")
        default = name.endswith("*")  # sinfo marks the default partition so
        if (default if wanted is None else name.rstrip("*") in wanted) and host:
            hosts.add(host)
    return hosts


def unshared_run_folder(path: Path, kind: str | None, hosts: set[str] | None) -> str | None:
    """Why ``path`` cannot be the run folder of a job on ``hosts``, or None when it can
    (or when that cannot be told)."""
    if kind not in LOCAL_FILESYSTEMS:
        return None
    here = socket.gethostname()
    if hosts is not None and hosts <= {here, here.split(".")[0]}:
        return None  # every node of this cluster runs on this machine
    nodes = "the nodes" if hosts is None else "nodes on " + ", ".join(sorted(hosts - {here}))
    return (
        f"{path} is on a filesystem local to this machine ({kind} on {here}), which {nodes} "
        "cannot reach; choose a folder on a shared filesystem (home, project or scratch "
        "space: NFS, Lustre, GPFS, BeeGFS...)"
    )


# Command-line types: each returns the value or raises argparse.ArgumentTypeError.


def slurm_name(text: str) -> str:
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be a SLURM name (letters, digits, and _ . + - after the first), got {text!r}"
        )
    return text


def partition_names(text: str) -> str:
    if not all(NAME.fullmatch(name) for name in text.split(",")):
        raise argparse.ArgumentTypeError(
            f"must be a partition name or a comma-separated list of them, got {text!r}"
        )
    return text


def time_seconds(text: str) -> int:
    """Seconds in a SLURM time limit (`TIME`); ValueError when it is not one."""
    match = TIME.fullmatch(text)
    if match is None:
        raise ValueError(text)
    days, day_hours, day_minutes, day_seconds, first, second, third = (
        int(group) if group is not None else None for group in match.groups()
    )
    if days is not None:
        return ((days * 24 + day_hours) * 60 + (day_minutes or 0)) * 60 + (day_seconds or 0)
    if third is not None:  # hours:minutes:seconds
        return (first * 60 + second) * 60 + third
    return first * 60 + (second or 0)  # minutes[:seconds]


def time_limit(text: str) -> str:
    try:
        seconds = time_seconds(text)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            "must be a time limit as SLURM writes it (MINUTES, HOURS:MINUTES:SECONDS, "
            f"DAYS-HOURS[:MINUTES[:SECONDS]]...) above 0, got {text!r}"
        )
    return text


def signal_seconds(text: str) -> int:
    value = int(text) if re.fullmatch(r"\d+", text) else 0
    if not 0 < value <= MAX_SIGNAL_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 1 to {MAX_SIGNAL_SECONDS}, got {text!r}"
        )
    return value


def sbatch_option(text: str) -> str:
    if not re.fullmatch(r"--[a-z][a-z0-9-]*(=[^\x00-\x1f\x7f]*)?", text):
        raise argparse.ArgumentTypeError(
            f"must be one long sbatch option, as --name or --name=value on one line, got {text!r}"
        )
    return text


@dataclass(frozen=True)
class GpuCount:
    """A number of GPUs as an option gives it: ``N`` or ``TYPE:N``."""

    count: int
    type: str | None
    text: str


def gpu_count(text: str) -> GpuCount:
    match = GPU_COUNT.fullmatch(text)
    if match is None or (match[1] is not None and int(match[2]) == 0):
        raise argparse.ArgumentTypeError(
            "must be a number of GPUs, N or TYPE:N as the cluster names its GPUs (4, a100:4; "
            f"0 for none), got {text!r}"
        )
    return GpuCount(int(match[2]), match[1], text)


def gres_gpus(text: str) -> GpuCount:
    match = re.fullmatch(rf"gpu:{GPU_COUNT.pattern}", text)
    if match is None or int(match[2]) == 0:
        raise argparse.ArgumentTypeError(
            f"must be gpu:N or gpu:TYPE:N with N >= 1 (gpu:4, gpu:a100:4), got {text!r}"
        )
    return GpuCount(int(match[2]), match[1], text)


def printable(line: str) -> bool:
    """One line of text: no newline, NUL or other control character (tabs allowed), and
    nothing that does not print (Unicode's invisible formatting characters)."""
    return line.replace("\t", " ").isprintable()


def setup_line(text: str) -> str:
    if not text.strip() or not printable(text):
        raise argparse.ArgumentTypeError(
            "must be one non-empty shell line of printable text (no newline or other control "
            f"character but tabs), got {text!r}"
        )
    return text


def setup_file(text: str) -> list[str]:
    """The lines of the file ``text`` names, each checked as `setup_line` checks one."""
    try:
        content = Path(text).read_bytes().decode("utf-8")  # newlines as they are: \r shown
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text} is not UTF-8 text ({error.reason})") from None
    lines = content.removesuffix("\n").split("\n") if content else []
    for number, line in enumerate(lines, 1):
        if not printable(line):
            crlf = " (Windows line ends: convert with dos2unix)" if line.endswith("\r") else ""
            raise argparse.ArgumentTypeError(
                f"{text}, line {number}: {line!r} holds a control character{crlf}; each line "
                "must be printable text (tabs allowed)"
            )
    return lines


def one_line(text: str) -> str:
    """Text that goes into the script: anything but control characters (a newline would
    end an #SBATCH line) and backslashes (sbatch turns off its %j patterns for them)."""
    if not text or NOT_SBATCH_TEXT.search(text):
        raise argparse.ArgumentTypeError(
            f"must be a non-empty path without control characters or backslashes, got {text!r}"
        )
    return text


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and that of its ``slurm`` command."""
    parser = argparse.ArgumentParser(
        prog=command_name(f"{PACKAGE}.launch"),
        description="Run train on a cluster.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{slurm}")
    slurm = commands.add_parser(
        "slurm",
        help="submit train as a SLURM batch job: one torchrun per node, requeued when preempted",
        description="Write a batch script into the run folder and submit it with sbatch. "
        "Arguments after -- go to train.",
        usage="%(prog)s [options] [-- TRAIN ARGUMENTS]",
    )
    add = slurm.add_argument
    add("--nodes", metavar="N", type=positive_int, default=1, help="nodes (default: 1)")
    gpus = slurm.add_mutually_exclusive_group()
    gpus.add_argument(
        "--gpus-per-node",
        metavar="[TYPE:]G",
        type=gpu_count,
        help="GPUs per node, one training process each, e.g. 4 or a100:4; 0 for a CPU job "
        "(default: 1)",
    )
    gpus.add_argument(
        "--gpus",
        metavar="[TYPE:]G",
        type=gpu_count,
        help="GPUs of the whole job, divided evenly among the nodes",
    )
    gpus.add_argument(
        "--gres",
        metavar="gpu:[TYPE:]G",
        type=gres_gpus,
        help="GPUs per node as a generic resource, e.g. gpu:a100:4 (sites without --gpus-per-node)",
    )
    add(
        "--nproc-per-node",
        metavar="P",
        type=positive_int,
        help="training processes per node of a CPU job (--gpus-per-node 0; default: 1)",
    )
    add(
        "--cpus-per-task",
        metavar="C",
        type=positive_int,
        help="CPUs per node for its training processes (default: the partition's)",
    )
    add("--time", type=time_limit, help="time limit, e.g. 24:00:00 or 2-00:00:00")
    add("--partition", type=partition_names, help="partition(s) to run in")
    add("--account", type=slurm_name, help="account to charge")
    add("--job-name", type=slurm_name, default=PACKAGE, help=f"(default: {PACKAGE})")
    add(
        "--requeue-before",
        metavar="SECONDS",
        type=signal_seconds,
        default=120,
        help="requeue the job this long before its time limit, which makes train write a "
        "checkpoint (default: 120)",
    )
    add(
        "--run-dir",
        metavar="DIR",
        type=one_line,
        help="the run folder, on a filesystem every node sees; an existing run there is "
        "resumed (default: runs/slurm-<job id>)",
    )
    container = slurm.add_mutually_exclusive_group()
    container.add_argument(
        "--apptainer",
        metavar="IMAGE",
        type=one_line,
        help="run in this Apptainer/Singularity image (.sif, or docker://...) with --nv",
    )
    container.add_argument(
        "--container-image",
        metavar="IMAGE",
        type=one_line,
        help="run in this image through pyxis/enroot (srun --container-image)",
    )
    add(
        "--sbatch",
        metavar="--OPTION[=VALUE]",
        type=sbatch_option,
        action="append",
        default=[],
        help="another sbatch option for the script, e.g. --sbatch=--qos=high (repeatable)",
    )
    add(
        "--setup",
        metavar="LINE",
        type=setup_line,
        action="append",
        dest="setup",
        default=[],
        help="a shell line each node runs before torchrun, e.g. 'module load cuda/12.4' "
        "(repeatable, in order with --setup-file)",
    )
    add(
        "--setup-file",
        metavar="PATH",
        type=setup_file,
        action="extend",
        dest="setup",
        help="a file of such lines, read now and written into the script",
    )
    add(
        "--force",
        action="store_true",
        help="submit a GPU job although the torch it would run is a CPU build",
    )
    add("--dry-run", action="store_true", help="print the script; write and submit nothing")
    return parser, slurm


def check_train_args(args: Sequence[str]) -> None:
    """`UsageError` unless train's parser takes ``args`` and they leave what the job
    script sets (`SCRIPT_SETS`) alone; parsed, so abbreviations (``--res``) count too."""
    parser = build_train_parser()
    parser.set_defaults(device=None)  # to tell --device auto from no --device

    def refuse(message: str) -> None:
        raise UsageError(f"train arguments (after --): {message}")

    parser.error = refuse  # type: ignore[method-assign]
    parsed = parser.parse_args(list(args))
    for name, (flag, why) in SCRIPT_SETS.items():
        if getattr(parsed, name) not in (None, False):
            raise UsageError(f"train arguments (after --): {flag}: {why}")


def gpus_of(options: argparse.Namespace) -> Gpus | None:
    """The GPUs of each node from whichever of --gpus-per-node, --gpus and --gres was
    given (argparse lets only one through); None for a CPU job."""
    if options.gres is not None:
        count, gres, asked_with = options.gres, True, "--gres"
    elif options.gpus is not None:
        count, gres, asked_with = options.gpus, False, "--gpus"
        if count.count % options.nodes:
            raise UsageError(
                f"argument --gpus: {count.text} does not divide evenly among --nodes "
                f"{options.nodes}: torchrun starts as many processes, one per GPU, on each "
                "node; give --gpus-per-node"
            )
        count = GpuCount(count.count // options.nodes, count.type, count.text)
    elif options.gpus_per_node is not None:
        count, gres, asked_with = options.gpus_per_node, False, "--gpus-per-node"
    else:
        return Gpus(1)
    if count.count == 0:
        return None
    return Gpus(count.count, count.type, gres, asked_with, count.text)


def check_sbatch_options(sbatch_options: Sequence[str], *, gres: bool) -> None:
    """`UsageError` for an --sbatch option that asks for what launch's own options give,
    and the script's processes and threads follow: GPUs, CPUs per task."""
    for option in sbatch_options:
        name, _, value = option.partition("=")
        if name in GPU_SBATCH_OPTIONS or (
            name == "--gres" and (gres or re.search(r"(?:^|,)gpu\b", value))
        ):
            raise UsageError(
                f"argument --sbatch: {option} asks for GPUs: give them with --gpus-per-node, "
                "--gpus or --gres, from which the number of training processes per node follows"
            )
        if name == "--cpus-per-task":
            raise UsageError(
                f"argument --sbatch: {option}: give it as --cpus-per-task, from which srun's "
                "CPUs and OMP_NUM_THREADS follow"
            )


def check_setup(lines: Sequence[str]) -> None:
    """`UsageError` when the setup lines are not complete bash (``bash -n``: an ``if``
    without its ``fi``), which would fail on every node after the wait in the queue."""
    if not lines or shutil.which("bash") is None:
        return
    checked = _run(["bash", "-n", "-c", "\n".join(lines)])
    if checked.returncode != 0:
        reason = "; ".join(checked.stderr.strip().splitlines())
        raise UsageError(f"argument --setup: the setup lines are not complete bash: {reason}")


def cpu_torch(job: SlurmJob) -> str | None:
    """Why the job's GPUs would go unused: it asks for them, and the torch its Python
    imports (this one: the job runs ``sys.executable``) is built without CUDA or ROCm.
    None otherwise, and for a container, whose torch is the image's."""
    gpus = job.gpus
    if gpus is None or job.container is not None or torch.version.cuda or torch.version.hip:
        return None
    return (
        f"argument {gpus.asked_with}: {gpus.asked} asks for GPUs, but the torch the job runs, "
        f"{torch.__version__} in {job.python}, is a CPU build (torch.version.cuda is None): "
        "train's --device cuda fails on every node; install a CUDA build of torch there, give "
        "--gpus-per-node 0 for a CPU job, or add --force to submit anyway"
    )


def job_from_arguments(
    options: argparse.Namespace, train_args: Sequence[str], cluster: str
) -> SlurmJob:
    """The job the command line describes on ``cluster``; `UsageError` for what the types
    cannot see."""
    gpus = gpus_of(options)
    if gpus and options.nproc_per_node not in (None, gpus.per_node):
        raise UsageError(
            f"argument --nproc-per-node: with {gpus.asked_with} {gpus.asked} each node runs one "
            f"process per GPU ({gpus.per_node}); --nproc-per-node is for CPU jobs "
            "(--gpus-per-node 0)"
        )
    check_sbatch_options(options.sbatch, gres=options.gres is not None)
    check_setup(options.setup)
    if options.time is not None and options.requeue_before >= time_seconds(options.time):
        raise UsageError(
            f"argument --requeue-before: {options.requeue_before} s is not less than --time "
            f"{options.time} ({time_seconds(options.time)} s)"
        )
    check_train_args(train_args)
    workdir = Path.cwd()
    container = None
    if options.apptainer is not None:
        image = options.apptainer
        if "://" not in image:  # else a URI apptainer pulls, docker://... or oras://...
            image = os.path.abspath(image)
            if not os.path.isfile(image):
                raise UsageError(f"argument --apptainer: {image} does not exist")
        container = Container(Runtime.APPTAINER, image)
    elif options.container_image is not None:
        image = options.container_image
        if os.path.isfile(image):  # a squashfs file; pyxis would take dev.sqsh for an image name
            image = os.path.abspath(image)
        container = Container(Runtime.PYXIS, image)
    job = SlurmJob(
        nodes=options.nodes,
        gpus=gpus,
        nproc_per_node=gpus.per_node if gpus else options.nproc_per_node or 1,
        workdir=workdir,
        python=sys.executable,
        cluster=cluster,
        requeue_before=options.requeue_before,
        cpus_per_task=options.cpus_per_task,
        time=options.time,
        partition=options.partition,
        account=options.account,
        job_name=options.job_name,
        run_dir=None if options.run_dir is None else Path(os.path.abspath(options.run_dir)),
        container=container,
        sbatch_options=tuple(options.sbatch),
        setup=tuple(options.setup),
        train_args=tuple(train_args),
    )
    log_folder = job.runs if job.run_dir is None else job.run_dir
    if (character := NOT_SBATCH_TEXT.search(str(log_folder))) is not None:
        source = "the working directory" if job.run_dir is None else "argument --run-dir"
        raise UsageError(
            f"{source}: {str(log_folder)!r} holds {character[0]!r} and goes into the script's "
            "#SBATCH --output line, which ends at a newline and loses its %j after a "
            "backslash; allowed: any character but backslashes and control characters"
        )
    if container is not None:
        for folder in _mounted(job):
            if re.search("[,:]", folder):
                raise UsageError(
                    f"argument {container.runtime.value}: {folder} must be mounted into the "
                    "container, and a path with ',' or ':' cannot be (they separate mounts)"
                )
    return job


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser, slurm = build_parsers()
    options, unknown = parser.parse_known_args(argv[:split])
    train_args = argv[split + 1 :]
    if unknown:
        slurm.error(
            f"unrecognized arguments: {' '.join(unknown)} (train's arguments go after --: "
            f"{slurm.prog} --nodes 2 -- --epochs 10)"
        )
    cluster = cluster_name()
    try:
        job = job_from_arguments(options, train_args, cluster or UNKNOWN_CLUSTER)
    except UsageError as error:
        slurm.error(str(error))
    script = render_script(job)
    unused_gpus = cpu_torch(job)
    if options.dry_run:
        if unused_gpus is not None:  # a submission without --force would be refused
            print(f"{slurm.prog}: warning: {unused_gpus}", file=sys.stderr)
        sys.stdout.write(script)
        return 0
    if unused_gpus is not None and not options.force:
        slurm.error(unused_gpus)
    if shutil.which("sbatch") is None:
        print(
            f"{slurm.prog}: error: sbatch is not on PATH: submit from a machine with the SLURM "
            "client (a login node), or add --dry-run to print the script",
            file=sys.stderr,
        )
        return 1
    if cluster is None:
        print(
            f"{slurm.prog}: error: scontrol show config names no cluster (ClusterName): the "
            "run folder's name holds it; is the SLURM controller reachable?",
            file=sys.stderr,
        )
        return 1
    folder = job.run_dir or job.runs / f"slurm-{cluster}-<job id>"
    problem = unshared_run_folder(folder, filesystem_type(folder), cluster_hosts(job.partition))
    if problem is not None:
        slurm.error(f"argument --run-dir: {problem}")
    try:
        submitted = submit(job, script)
    except (SubmitError, OSError) as error:
        print(f"{slurm.prog}: error: {error}", file=sys.stderr)
        return 1
    print(submitted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
