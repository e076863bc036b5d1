"""Cost of the ``compile_check`` fixture against compiling by hand, per backend and model.

Target: ``compile_check`` costs at most the compilation plus one eager and one compiled
forward+backward. The baseline is what a test would write by hand: ``torch.compile``
the model, run it forward and backward once (which compiles it), and run the eager
model forward and backward once to compare with. Each side runs in a fresh process
with a fresh inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``) and in-process
compilation (``TORCHINDUCTOR_COMPILE_THREADS=1``), so neither side reuses the other's
compiled kernels, and CPU time counts the C++ compiler's processes too. Before either side, each
process compiles a one-line function with the backend and resets dynamo, so importing
dynamo and the backend's start-up are not counted; the best of ``--repeats``
is compared, by wall clock and by CPU time (the stable figure on a shared machine).
The baseline's time is the compile time per backend that the README gives.

    python benchmarks/compile_check_cost.py [--backends eager,aot_eager,inductor]
        [--models MeanGatedNet,...] [--repeats 1] [--src SRC]

Bakes the default project to import the plugin's ``compile_check`` module unless
``--src`` points at an existing generated project's ``src`` folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from baking import use_generated_src

TARGET_RATIO = 1.10
# The template's models with their default sizes, by class name: input shape.
MODELS = {
    "MeanGatedNet": (64, 8),
    "PerSampleNet": (16, 8),
    "DynamicNet": (64, 16),
    "RecursiveNet": (16, 5, 8),
    "CondGatedNet": (64, 8),
}


def measured(side: str, backend: str, model_name: str) -> dict[str, float]:
    """In this (fresh) process: seconds of wall and CPU time of one side."""
    import torch
    from dynamic_model import models
    from dynamic_model.testing.compile_check import compile_check

    torch.set_num_threads(1)
    # Importing dynamo and the backend's first use (for inductor: the C++ toolchain) are
    # paid once per process, before either side; what is timed is the model's compile.
    warm_up = torch.compile(lambda t: torch.tanh(t) * 2, backend=backend)
    warm_up(torch.ones(3, requires_grad=True)).sum().backward()
    torch.compiler.reset()
    torch.manual_seed(0)
    model = getattr(models, model_name)()
    shape = MODELS[model_name]
    x = torch.randn(shape, requires_grad=True)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    if side == "by hand":
        compiled = torch.compile(model, backend=backend)
        for forward in (compiled, model):
            output = forward(x)
            wrt = [x, *model.parameters()]
            torch.autograd.grad(output, wrt, torch.ones_like(output), allow_unused=True)
    else:
        compile_check(model, x, backend=backend)
    return {"wall": time.perf_counter() - wall, "cpu": _cpu_seconds() - cpu}


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (inductor's C++ compiler)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run_side(side: str, backend: str, model_name: str, src: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        environ = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            TORCHINDUCTOR_COMPILE_THREADS="1",
            PYTHONPATH=src,
        )
        child = subprocess.run(
            [sys.executable, __file__, "--child", side, backend, model_name, "--src", src],
            env=environ,
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="eager,aot_eager,inductor")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--src", help="a generated project's src folder (baked if not given)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, args.src)
        print(json.dumps(measured(*args.child)))
        return 0
    src = str(use_generated_src(args.src))
    print(
        "| backend | model | by hand: compile + 1 compiled + 1 eager fwd+bwd | compile_check | "
        "ratio (CPU) |"
    )
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for backend in args.backends.split(","):
        for model_name in args.models.split(","):
            sides = {}
            for side in ("by hand", "compile_check"):
                runs = [run_side(side, backend, model_name, src) for _ in range(args.repeats)]
                sides[side] = min(runs, key=lambda run: run["cpu"])
            hand, check = sides["by hand"], sides["compile_check"]
            ratio = check["cpu"] / hand["cpu"]
            worst = max(worst, ratio)
            print(
                f"| {backend} | {model_name} | {hand['wall']:.2f} s ({hand['cpu']:.2f} s CPU) | "
                f"{check['wall']:.2f} s ({check['cpu']:.2f} s CPU) | {ratio:.2f}x |",
                flush=True,
            )
    print(f"worst CPU-time ratio {worst:.2f}x (target: <= {TARGET_RATIO:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
