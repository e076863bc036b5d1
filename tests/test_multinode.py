"""``train`` on several nodes: two ``torchrun`` agents on 127.0.0.1 stand for two machines.

Each agent ("node") starts 2 gloo processes on the CPU; the agents meet through c10d
rendezvous on a TCP port as they would across machines (``--nnodes 2 --rdzv-backend
c10d --rdzv-endpoint HOST:PORT``), and the 4 processes train one model. What differs
from two machines is only that the run folder is shared because it is the same disk.

The run is stopped the way an orchestrator (Kubernetes, ``docker stop``) stops it:
SIGTERM to both agents, which forward it to their processes; rank 0 sends it after
optimizer step 13 (`at_step`), 3 steps after the last ``--checkpoint-every 5``
checkpoint. Resumed on two nodes, it must end bitwise equal to an uninterrupted run of
4 processes on one node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from at_step import plant
from conftest import DEFAULT_PACKAGE, free_port, run_module
from training import assert_bitwise_equal, checkpoint, gloo_environment, metrics, reproducible

TRAIN = f"{DEFAULT_PACKAGE}.train"
# 4 processes share 1024 samples in batches of 32: 8 steps an epoch, 32 in all.
ARGS = ("--device", "cpu", "--samples", "1024", "--batch-size", "32", "--epochs", "4")
EVERY = ("--checkpoint-every", "5")
AT_STEP = 13  # in epoch 2
LAST_CHECKPOINT = 10  # the last one before step 13
pytestmark = pytest.mark.xdist_group("multinode")  # the runs are set up once (tests/run)


@dataclass(frozen=True)
class Nodes:
    """What the two agents of a run left: exit statuses and output (stdout and stderr)."""

    returncodes: tuple[int, ...]
    outputs: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(
            f"--- node {index}: exit {code}\n{output}"
            for index, (code, output) in enumerate(zip(self.returncodes, self.outputs, strict=True))
        )


def two_nodes(run_dir: Path, *args: str, env: dict[str, str], logs: Path) -> Nodes:
    """``train ARGS`` under two ``torchrun`` agents that meet on 127.0.0.1; their PIDs
    are written to ``logs/pids`` once both are started."""
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test",
        "-m", TRAIN, *ARGS, *args, "--run-dir", str(run_dir),
    ]  # fmt: skip
    logs.mkdir()
    files = [(logs / f"node{index}.log").open("w+") for index in range(2)]
    agents = [
        subprocess.Popen(command, env=env, stdout=file, stderr=subprocess.STDOUT, text=True)
        for file in files
    ]
    try:
        (logs / "pids.tmp").write_text(" ".join(str(agent.pid) for agent in agents))
        os.replace(logs / "pids.tmp", logs / "pids")
        codes = tuple(agent.wait(timeout=600) for agent in agents)
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    outputs = []
    for file in files:
        file.seek(0)
        outputs.append(file.read())
        file.close()
    return Nodes(codes, tuple(outputs))


@pytest.fixture(scope="module")
def reference(default_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 processes on one node, uninterrupted."""
    directory = tmp_path_factory.mktemp("one-node")
    command = ("torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", TRAIN)
    result = run_module(
        default_project,
        *command, *ARGS, "--run-dir", str(directory),
        env=gloo_environment(default_project),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture(scope="module")
def stopped(default_project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Nodes]:
    """The run folder of two nodes sent SIGTERM after step 13, and what the agents left."""
    folder = tmp_path_factory.mktemp("two-nodes")
    logs = folder / "logs"
    environ = gloo_environment(
        default_project,
        path=(plant(folder / "hook"),),
        AT_STEP=str(AT_STEP),
        AT_STEP_ACTION="terminate",
        AT_STEP_PIDS=str(logs / "pids"),
    )
    run_dir = folder / "run"
    nodes = two_nodes(run_dir, *EVERY, env=environ, logs=logs)
    return run_dir, nodes


def test_two_nodes_resume_after_sigterm_bitwise_equal(
    default_project: Path, tmp_path: Path, stopped: tuple[Path, Nodes], reference: Path
) -> None:
    stopped_dir, nodes = stopped
    # torchrun re-raises the signal as an error after its processes have stopped.
    assert all(code != 0 for code in nodes.returncodes), nodes
    saved = checkpoint(stopped_dir)
    assert saved["run"]["world_size"] == 4
    assert len(saved["processes"]) == 4  # every rank's generators, gathered by rank 0
    assert LAST_CHECKPOINT <= saved["global_step"] < 32, nodes  # stopped at the signal
    assert sorted(path.name for path in stopped_dir.iterdir()) == [
        "latest.pt",
        "metrics.csv",
        "previous.pt",  # the checkpoint of step 10
    ]

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_dir, run_dir)
    resumed = two_nodes(
        run_dir, *EVERY, "--resume", env=gloo_environment(default_project), logs=tmp_path / "logs"
    )
    assert resumed.returncodes == (0, 0), resumed
    # Rank 0 of the whole job, on whichever node the rendezvous put it, reports once.
    output = "".join(resumed.outputs)
    assert output.count("trained 4 epochs on 4 processes on cpu (gloo): loss ") == 1, resumed
    epochs = [line.split()[1] for line in output.splitlines() if line.startswith("epoch ")]
    assert epochs == [f"{epoch}/4" for epoch in range(saved["epoch"] + 1, 5)], resumed
    assert_bitwise_equal(checkpoint(run_dir), checkpoint(reference))
    assert reproducible(metrics(run_dir)) == reproducible(metrics(reference))


def test_sigterm_writes_a_checkpoint_of_the_step_reached(stopped: tuple[Path, Nodes]) -> None:
    """Stopped after step 13, the run keeps step 13 or later, not the checkpoint of step
    10, and rank 0 prints how to resume."""
    stopped_dir, nodes = stopped
    saved = checkpoint(stopped_dir)
    assert saved["global_step"] >= AT_STEP, nodes
    assert any("--resume" in output and str(stopped_dir) in output for output in nodes.outputs)
