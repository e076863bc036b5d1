"""What ``pytest --decisions`` costs: the generated project's own suite with and without it.

Target: at most 1.5x the wall time. Each side is a fresh ``pytest`` process on the
default project's ``tests/`` (one process, no xdist, so the ratio is that of the
recording and not of the scheduling); the sides alternate and the medians of
``--repeats`` runs are compared, by wall clock and by CPU time (user + system).

    python benchmarks/decisions_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from baking import bake_default
from plugin_overhead import PLUGIN, make_env, run_pytest

TARGET = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="decisions-overhead-"))
    try:
        project = bake_default(work / "baked")
        # src itself on PYTHONPATH: the suite's own subprocesses (the commands) import it too.
        env = make_env(project / "src")
        sides = {"without": (), "with --decisions": ("--decisions",)}
        runs: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        run_pytest(project, env, *PLUGIN, "-p", "no:randomly")  # warm the caches
        for _ in range(args.repeats):
            for side, extra in sides.items():
                runs[side].append(run_pytest(project, env, *PLUGIN, "-p", "no:randomly", *extra))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    medians = {
        side: (
            statistics.median(wall for wall, _ in samples),
            statistics.median(cpu for _, cpu in samples),
        )
        for side, samples in runs.items()
    }
    (wall_without, cpu_without), (wall_with, cpu_with) = medians.values()
    print(f"\nthe default project's tests, one process; medians of {args.repeats} runs each")
    print(f"without --decisions: {wall_without:7.2f} s wall, {cpu_without:7.2f} s CPU")
    print(f"with --decisions:    {wall_with:7.2f} s wall, {cpu_with:7.2f} s CPU")
    print(
        f"ratio: {wall_with / wall_without:.2f}x wall, {cpu_with / cpu_without:.2f}x CPU "
        f"(target <= {TARGET}x wall)"
    )


if __name__ == "__main__":
    main()
