"""How long a generated project's first ``pytest`` takes on the CPU. Target: under 30 s.

A default project is baked into a temporary folder and its tests are run as a user runs
them, from the project's folder with its ``pyproject.toml`` (the plugin, ``-m "not
slow" -n auto --dist worksteal``), with the project's ``src`` on ``PYTHONPATH`` and torch
already installed:

- ``pytest``: the default set as configured, one xdist worker per core (the target);
- ``pytest -n0``: the default set in one process, what ``-n auto`` saves;
- ``pytest -m slow``: the end-to-end runs the default set leaves out, alone;
- ``import torch`` in a fresh process: the start-up no run avoids, the baseline.

The commands alternate; the median of ``--repeats`` runs of each is reported by wall
clock and by CPU time (user + system of the children, the stable figure on a shared
machine), with the tests each ran (from pytest's last line) and the ratio to the
baseline. The target is the default set's wall time as configured.

    python benchmarks/first_pytest.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from baking import bake_default

TARGET_S = 30.0
# pytest's last line: "85 passed, 27 skipped in 21.30s"; xdist leaves out "deselected".
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b")


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    outcomes: str


def timed(command: list[str], project: Path, env: dict[str, str]) -> Run:
    """One run of ``command`` in ``project``: wall and CPU seconds, pytest's outcomes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}{result.stderr}")
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    outcomes = ", ".join(f"{n} {what}" for n, what in OUTCOME.findall(last))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, outcomes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pytest = [sys.executable, "-m", "pytest"]
    commands = {
        "import torch": [sys.executable, "-c", "import torch"],
        "pytest": pytest,
        "pytest -n0": [*pytest, "-n0"],
        "pytest -m slow": [*pytest, "-m", "slow"],
    }
    with tempfile.TemporaryDirectory() as work:
        project = bake_default(work)
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        for name in ("PROJECT_SSH_PORT", "PROJECT_JUPYTER_PORT"):
            env.pop(name, None)
        runs: dict[str, list[Run]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                runs[name].append(timed(command, project, env))
    print(f"median of {args.repeats} runs each, {os.cpu_count()} CPUs")
    print(f"{'':22} {'wall s':>8} {'cpu s':>8} {'/ base':>7}  tests")
    base = statistics.median(run.wall_s for run in runs["import torch"])
    medians = {}
    for name, samples in runs.items():
        wall = statistics.median(run.wall_s for run in samples)
        cpu = statistics.median(run.cpu_s for run in samples)
        medians[name] = wall
        print(f"{name:22} {wall:8.2f} {cpu:8.2f} {wall / base:7.1f}  {samples[-1].outcomes}")
    wall = medians["pytest"]
    verdict = "met" if wall < TARGET_S else "MISSED"
    print(f"target: the default set (pytest) under {TARGET_S:.0f} s wall: {verdict} ({wall:.2f} s)")
    return 0 if wall < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
