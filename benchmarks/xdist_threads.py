"""``pytest -n N`` with the plugin's thread share per worker against torch's default threads.

Runs one session of gradient checks (the kind a project's test suite has: small
float64 models, many evaluations; some wide enough for torch to split an op over
threads) with ``-n N`` twice: with each worker's torch given ``cores // N`` threads
(``torch_worker_threads = auto``, the default) and with torch's own default
(``torch_worker_threads = off``: each worker starts a thread per core).
Wall time of each, best of ``--repeats``.

    python benchmarks/xdist_threads.py [--workers 2] [--tests 16] [--repeats 3] [--src SRC]

Bakes the default project unless ``--src`` points at a generated project's ``src``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baking import use_generated_src

TESTS = """
import pytest
import torch
from torch import nn


@pytest.mark.parametrize("seed", range({tests}))
def test_small_model(gradcheck, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    gradcheck(model, torch.randn(4, 8, requires_grad=True))


@pytest.mark.parametrize("seed", range({tests}))
def test_wider_model(gradcheck, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    gradcheck(model, torch.randn(64, 256, requires_grad=True))
"""


def session(folder: Path, src: Path, workers: int, setting: str) -> float:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    environ["PYTHONPATH"] = str(src)
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "dynamic_model.testing.plugin",
        "-p", "no:cacheprovider", "-n", str(workers), "-o", f"torch_worker_threads={setting}",
    ]  # fmt: skip
    started = time.perf_counter()
    run = subprocess.run(command, cwd=folder, env=environ, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"the session failed:\n{run.stdout}\n{run.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    src = use_generated_src(args.src)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "test_checks.py").write_text(TESTS.format(tests=args.tests))
        best = {"auto": math.inf, "off": math.inf}
        for _ in range(args.repeats):
            for setting in best:
                best[setting] = min(
                    best[setting], session(Path(folder), src, args.workers, setting)
                )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    checks = 2 * args.tests
    print(f"pytest -n {args.workers} on {cores} cores, {checks} gradient checks, wall s")
    print(
        f"  torch_worker_threads = auto ({max(1, cores // args.workers)} each): {best['auto']:.1f}"
    )
    print(f"  torch_worker_threads = off (torch's default): {best['off']:.1f}")
    print(f"  ratio off / auto: {best['off'] / best['auto']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
