"""A real SLURM cluster on this machine: munged, slurmctld and two slurmd, for the tests.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` packages
(``.ci/apt-packages.txt``), run as root, each daemon in the foreground as a child of
the test process and stopped by its PID. Everything lives in one folder: the munge
key, socket and log, ``slurm.conf``, the controller's state, each node's spool, the
logs. The ports are chosen free; the client commands find the cluster through
``SLURM_CONF`` (`Cluster.env`).

Two nodes, ``n1`` and ``n2``, run on this machine (``slurmd -N NAME``, each on its own
port, with one CPU each), so a two-node job runs one ``srun`` task on each as on two
machines. A third node, ``r1`` in partition ``remote``, is configured on another host
and never started: it is what a cluster whose nodes are other machines looks like
to ``sinfo``.

Each of ``n1`` and ``n2`` has two GPUs of type ``tesla`` (``GRES``): ``gres.conf``
names two empty files as their devices, so sbatch takes and the scheduler allocates
typed GPU requests (``--gpus-per-node=tesla:2``, ``--gres=gpu:tesla:1``) and refuses
others (``v100``, three per node), while no GPU is there to run on.

Two settings differ from SLURM's defaults to keep the tests short:
``cred_expire=5`` (a requeued job waits ``cred_expire`` + 1 s before it may start
again, 121 s by default) and ``sched_interval=1`` (the scheduler looks at pending
jobs every second instead of every 60).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conftest import free_port

DAEMONS = {
    "munged": "munge",
    "mungekey": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
}
NODES = ("n1", "n2")
# Each node's GPUs as SLURM counts them: gres/gpu reports no GPU without device files,
# so gres.conf names empty files (a count alone left the nodes INVAL: 0 < 2).
GPU_TYPE, GPUS_PER_NODE = "tesla", 2
START_TIMEOUT_S = 60


def missing_requirement() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if not sys.platform.startswith("linux"):
        return "a SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "a SLURM cluster of its own needs root (slurmd starts jobs as their user)"
    for program, package in DAEMONS.items():
        if shutil.which(program) is None and not Path("/usr/sbin", program).exists():
            return f"needs {program} (Debian package {package}, in .ci/apt-packages.txt)"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def first_job_id(taken: dict[str, int]) -> int:
    """A first job id whose torchrun rendezvous port (launch's 20000 + id % 10000) is
    free, so that clusters running at the same time (pytest-xdist workers, CI jobs on
    one machine) give their jobs different ports. Drawn from the system's randomness:
    Python's ``random`` is seeded alike in every xdist worker, and two workers drawing
    the same first id gave their jobs the same port (a rendezvous store that one job's
    torchrun could not connect to)."""
    while True:
        job_id = random.SystemRandom().randrange(1, 9000)
        port = 20000 + job_id
        if port in taken.values():
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id


def slurm_conf(root: Path, ports: dict[str, int]) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} CPUs=1 "
        f"Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE}"
        for node in NODES
    )
    return f"""\
ClusterName=tests
FirstJobId={first_job_id(ports)}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports["slurmctld"]}
SlurmdPort={ports[NODES[0]]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/run/munge.socket,cred_expire=5
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
{nodes}
NodeName=r1 NodeHostname=elsewhere NodeAddr=127.0.0.1 Port={ports["r1"]} CPUs=1 State=DOWN
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
PartitionName=remote Nodes=r1 MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # this process's environment with SLURM_CONF
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(command), env=self.env, capture_output=True, text=True, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(command)} exited {result.returncode}: {result.stderr}\n{self.logs()}"
            )
        return result

    def job_state(self, job_id: int) -> str:
        """PENDING, RUNNING, COMPLETING, COMPLETED, FAILED... (finished jobs stay listed
        for MinJobAge, 300 s)."""
        answer = self.run("squeue", "--noheader", f"--jobs={job_id}", "--states=all", "--format=%T")
        return answer.stdout.strip()

    def restarts(self, job_id: int) -> int:
        shown = self.run("scontrol", "show", "job", str(job_id)).stdout
        match = re.search(r"\bRestarts=(\d+)", shown)
        assert match is not None, shown
        return int(match.group(1))

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float) -> float:
        """Seconds until ``condition()`` held; an `AssertionError` naming ``what`` and
        showing the daemons' logs after ``timeout``, or as soon as a daemon has exited."""
        start = time.monotonic()
        while not condition():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise AssertionError(
                        f"{what}: {name} exited ({process.returncode})\n{self.logs()}"
                    )
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{what}: not after {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)
        return time.monotonic() - start

    def logs(self) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name} (last lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    def nodes_idle(self) -> bool:
        answer = self.run(
            "sinfo", "--noheader", "--Node", "--partition=debug", "--format=%N %T", check=False
        )
        states = dict(line.split() for line in answer.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons (nodes, controller, munge)."""
        controller = self.processes.get("slurmctld")
        if controller is not None and controller.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run("scancel", "--full", "--user=root", check=False)
        for name, process in reversed(list(self.processes.items())):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            del self.processes[name]


def start(root: Path) -> Cluster:
    """Start munged, slurmctld and the nodes under ``root``; the cluster once both nodes
    are idle. On failure everything started is stopped and an `AssertionError` shows
    the logs."""
    for folder in ("state", "log", *(f"spool/{node}" for node in NODES)):
        (root / folder).mkdir(parents=True)
    # munged refuses a socket folder that others cannot enter, and a key others can read.
    (root / "run").mkdir(mode=0o755)
    (root / "munge").mkdir(mode=0o700)
    subprocess.run(
        [_program("mungekey"), "--create", f"--keyfile={root}/munge/munge.key"], check=True
    )
    ports = {name: free_port() for name in ("slurmctld", *NODES, "r1")}
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, ports))
    (root / "dev").mkdir()
    for index in range(GPUS_PER_NODE):
        (root / "dev" / f"gpu{index}").touch()
    (root / "gres.conf").write_text(
        f"Name=gpu Type={GPU_TYPE} File={root}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
    )
    cluster = Cluster(root, {**os.environ, "SLURM_CONF": str(conf)})
    daemons = {
        # --force: munged only warns that a folder above its socket (pytest's temporary
        # folder, mode 0700) keeps other users out; its clients here are all root.
        "munged": [
            _program("munged"), "--foreground", "--force",
            f"--key-file={root}/munge/munge.key", f"--socket={root}/run/munge.socket",
            f"--pid-file={root}/run/munged.pid", f"--seed-file={root}/munge/seed",
        ],
        "slurmctld": [_program("slurmctld"), "-D", "-f", str(conf)],
        **{node: [_program("slurmd"), "-D", "-N", node, "-f", str(conf)] for node in NODES},
    }  # fmt: skip
    try:
        for name, command in daemons.items():
            with (root / "log" / f"{name}.out").open("w") as output:
                cluster.processes[name] = subprocess.Popen(
                    command, env=cluster.env, stdout=output, stderr=subprocess.STDOUT
                )
            if name == "munged":
                cluster.wait_for(
                    "munged's socket", (root / "run/munge.socket").exists, START_TIMEOUT_S
                )
        cluster.wait_for("nodes n1 and n2 idle", cluster.nodes_idle, START_TIMEOUT_S)
    except BaseException:
        cluster.stop()
        raise
    return cluster
