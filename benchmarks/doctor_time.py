"""How long ``<package>-doctor`` takes on the CPU. Target: under 5 s.

Each side is a fresh process, as a user runs it: ``python -m dynamic_model.doctor``
in a generated project, against ``python -c "import torch"`` as the baseline (the
part no check can avoid). The two alternate; the median of ``--repeats`` runs of
each is reported by wall clock and by CPU time (user + system of the child, the
stable figure on a shared machine), with the doctor's own cost (the difference)
and the ratio.

    python benchmarks/doctor_time.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from baking import bake_default

TARGET_S = 5.0


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one run of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        project = bake_default(work)
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        for name in ("PROJECT_SSH_PORT", "PROJECT_JUPYTER_PORT"):
            env.pop(name, None)
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            "doctor": [sys.executable, "-m", "dynamic_model.doctor"],
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                samples[name].append(timed(command, env))
    medians = {
        name: tuple(statistics.median(run[i] for run in runs) for i in (0, 1))
        for name, runs in samples.items()
    }
    print(f"median of {args.repeats} fresh processes each, {os.cpu_count()} CPUs")
    print(f"{'':14} {'wall s':>8} {'cpu s':>8}")
    for name, (wall, cpu) in medians.items():
        print(f"{name:14} {wall:8.2f} {cpu:8.2f}")
    (base_wall, base_cpu), (wall, cpu) = medians["import torch"], medians["doctor"]
    print(f"{'doctor - base':14} {wall - base_wall:8.2f} {cpu - base_cpu:8.2f}")
    print(f"{'doctor / base':14} {wall / base_wall:8.2f} {cpu / base_cpu:8.2f}")
    verdict = "met" if wall < TARGET_S else "MISSED"
    print(f"target: doctor under {TARGET_S:.0f} s wall: {verdict} ({wall:.2f} s)")
    return 0 if wall < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
