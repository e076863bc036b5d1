"""What the bundled pytest plugin costs: start-up, and per test.

Targets: pytest start-up with the plugin at most 1.05x without it, on a project whose
tests do not use torch; under 1 ms per test for the global-state check.

- start-up: ``pytest`` on 20 trivial torch-free tests, with the plugin loaded the way
  the generated project's configuration loads it (``-p <package>.testing.plugin``)
  and without it.
- per test: 1,000 trivial tests in a module that imports torch (so every test takes
  the full snapshot of torch's state), with and without the plugin, once without
  fixtures and once with a function-scoped fixture; and the cost of one
  ``snapshot()`` + ``differences()`` measured in this process.

Every pytest session is a fresh process; the two sides alternate and the median of
``--repeats`` runs is compared, by wall clock and by CPU time (user + system of the
child: the stable figure on a shared machine).

    python benchmarks/plugin_overhead.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

from baking import bake_default

PACKAGE = "dynamic_model"
PLUGIN = ("-p", f"{PACKAGE}.testing.plugin")
START_UP_TARGET = 1.05
PER_TEST_TARGET_MS = 1.0
TRIVIAL_TESTS = 1000

TORCH_FREE_TESTS = """
import pytest

@pytest.mark.parametrize("n", range(20))
def test_trivial(n):
    assert n + 1 > n
"""

TORCH_TESTS = f"""
import pytest
import torch

@pytest.mark.parametrize("n", range({TRIVIAL_TESTS}))
def test_trivial(n):
    assert n + 1 > n
"""

# The same with a function-scoped fixture: the state before it is snapshotted too.
TORCH_FIXTURE_TESTS = f"""
import pytest
import torch

@pytest.fixture
def one():
    return 1

@pytest.mark.parametrize("n", range({TRIVIAL_TESTS}))
def test_trivial(n, one):
    assert n + one > n
"""


def make_importable(site: Path, src: Path) -> None:
    """Make ``src`` importable, as ``pip install -e`` does (a ``.pth`` file)."""
    site.mkdir(parents=True)
    (site / f"{PACKAGE}.pth").write_text(f"{src}\n")


def make_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
    # .pth files are read only from site directories: add it as one.
    env["PYTHONPATH"] = str(site)
    return env


def run_pytest(tests: Path, env: dict[str, str], *extra: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``pytest`` session in a fresh process."""
    command = [sys.executable, "-c", SITE_BOOTSTRAP, "-q", "-p", "no:cacheprovider", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"pytest failed in {tests}:\n{result.stdout}\n{result.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


# PYTHONPATH entries are not site directories, so their .pth files would be ignored.
SITE_BOOTSTRAP = (
    "import os, site, sys; site.addsitedir(os.environ['PYTHONPATH']); "
    "import pytest; sys.exit(pytest.main(sys.argv[1:]))"
)


def compare(tests: Path, env: dict[str, str], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, cpu) with the plugin and without it, runs alternating."""
    runs: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    run_pytest(tests, env)  # warm the file system cache and the bytecode
    for _ in range(repeats):
        runs["with"].append(run_pytest(tests, env, *PLUGIN))
        runs["without"].append(run_pytest(tests, env))
    return {
        side: (
            statistics.median(wall for wall, _ in samples),
            statistics.median(cpu for _, cpu in samples),
        )
        for side, samples in runs.items()
    }


def check_plugin_loaded(tests: Path, env: dict[str, str]) -> None:
    command = [sys.executable, "-c", SITE_BOOTSTRAP, *PLUGIN, "--help"]
    output = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True).stdout
    if "--gpu" not in output:
        raise SystemExit(f"the plugin did not load with {' '.join(PLUGIN)}")


def snapshot_cost_ms(src: Path) -> float:
    sys.path.insert(0, str(src))
    import torch  # noqa: F401  (the snapshot covers torch only once it is imported)
    from dynamic_model.testing import global_state

    before = global_state.snapshot()

    def check() -> None:
        global_state.differences(before, global_state.snapshot())

    number = 2000
    best = min(timeit.repeat(check, number=number, repeat=5))
    return best / number * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="plugin-overhead-"))
    try:
        project = bake_default(work / "baked")
        site = work / "site"
        make_importable(site, project / "src")
        env = make_env(site)
        tests = work / "torch-free"
        tests.mkdir()
        (tests / "test_trivial.py").write_text(TORCH_FREE_TESTS)
        check_plugin_loaded(tests, env)
        rows = [("start-up, 20 torch-free tests", compare(tests, env, args.repeats))]

        per_test = {}
        for label, source in (("", TORCH_TESTS), (", with a fixture", TORCH_FIXTURE_TESTS)):
            tests = work / f"torch-tests{len(per_test)}"
            tests.mkdir()
            (tests / "test_trivial.py").write_text(source)
            per_test[label] = compare(tests, env, args.repeats)
        snapshot_ms = snapshot_cost_ms(project / "src")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmedians of {args.repeats} runs each, alternating; CPU = user + system time\n")
    header = (
        f"{'measurement':<48} {'without':>15} {'with':>15} {'ratio (CPU)':>12} {'ratio (wall)':>13}"
    )
    print(header)
    print("-" * len(header))
    for label, medians in rows:
        (wall_with, cpu_with), (wall_without, cpu_without) = medians["with"], medians["without"]
        print(
            f"{label:<48} {cpu_without:6.3f} / {wall_without:6.3f} "
            f"{cpu_with:6.3f} / {wall_with:6.3f} "
            f"{cpu_with / cpu_without:11.2f}x {wall_with / wall_without:12.2f}x"
        )
    costs = []
    for label, medians in per_test.items():
        (wall_with, cpu_with), (wall_without, cpu_without) = medians["with"], medians["without"]
        print(
            f"{f'{TRIVIAL_TESTS} trivial tests in a torch module{label}':<48} "
            f"{cpu_without:6.3f} / {wall_without:6.3f} {cpu_with:6.3f} / {wall_with:6.3f}"
        )
        per_test_cpu = (cpu_with - cpu_without) / TRIVIAL_TESTS * 1000
        per_test_wall = (wall_with - wall_without) / TRIVIAL_TESTS * 1000
        costs.append(
            f"plugin cost per test{label + ':':<18} {per_test_cpu:.3f} ms CPU, "
            f"{per_test_wall:.3f} ms wall"
        )
    print("(seconds: CPU / wall)\n")
    print("\n".join(costs))
    print(f"snapshot() + differences():   {snapshot_ms:.3f} ms (best of 5 x 2000, in process)")
    print(f"targets: start-up <= {START_UP_TARGET}x, per test < {PER_TEST_TARGET_MS} ms")


if __name__ == "__main__":
    main()
