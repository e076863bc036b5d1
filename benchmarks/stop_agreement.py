"""What agreeing on the stop step costs a ``torchrun`` training step, on the CPU.

Under ``torchrun`` every process of ``train`` asks the others after each optimizer
step whether a stop signal came (an all-reduce of one integer over a gloo group;
see ``_preemption.py``), so that all stop after the same step. This runs ``train()``
in 2 processes (gloo, 1 torch thread each), interleaving epochs with the agreement
as shipped and with it switched off (``StopAgreement.signal`` returning None at
once, in every process alike), and prints the difference per step: wall clock and
the CPU time of process 0 (gloo's threads included), medians over ``--repeats``
pairs. Without ``torchrun`` the agreement is not made at all (nothing to measure).

    python benchmarks/stop_agreement.py [--repeats 7] [--epochs 2] [--samples 8192]

Bakes the default project unless ``--src`` points at a generated project's ``src``;
it then runs itself under ``python -m torch.distributed.run --standalone``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from baking import use_generated_src
from determinism_overhead import timed

PROCESSES = 2


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    return parser.parse_args()


def launch(options: argparse.Namespace) -> int:
    """Run this script again, under torchrun, on a generated project's src."""
    src = use_generated_src(options.src)
    environ = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(PROCESSES), __file__, *sys.argv[1:]]
    if options.src is None:
        command += ["--src", str(src)]
    return subprocess.run(command, env=environ, check=False).returncode


def measure(options: argparse.Namespace) -> None:
    use_generated_src(options.src)
    import torch
    import torch.distributed as dist
    from dynamic_model import _preemption, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    launched = train.Launch.from_environment()
    agreed = _preemption.StopAgreement.signal
    variants = {"agreement": agreed, "none": lambda self: None}
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(options.repeats + 1):  # the first pair warms up
            for name, signal in variants.items():
                folder = Path(scratch, f"{name}{repeat}")
                folder.mkdir()
                config = train.Config(
                    device="cpu",
                    epochs=options.epochs,
                    samples=options.samples,
                    batch_size=options.batch_size,
                    run_dir=folder,
                )
                _preemption.StopAgreement.signal = signal
                run = functools.partial(
                    train.train,
                    config,
                    launched,
                    torch.device("cpu"),
                    log=io.StringIO(),
                    stop=_preemption.StopSignal(),
                )
                dist.barrier()
                if repeat:
                    seconds[name].append(timed(run))
                else:
                    run()
    steps = options.epochs * len(train.epoch_batches(config, launched))
    if launched.rank == 0:
        print(
            f"torch {torch.__version__}, {PROCESSES} processes (gloo, CPU, 1 thread each), "
            f"{options.samples} samples, batch {options.batch_size} a process, {steps} steps a run"
        )
        per_step = {
            name: [(wall / steps * 1e6, cpu / steps * 1e6) for wall, cpu in runs]
            for name, runs in seconds.items()
        }
        for name, runs in per_step.items():
            wall = statistics.median(run[0] for run in runs)
            cpu = statistics.median(run[1] for run in runs)
            print(f"{name}: {wall:.0f} us a step (CPU {cpu:.0f} us), median of {len(runs)}")
        differences = [
            (with_[0] - without[0], with_[1] - without[1])
            for with_, without in zip(per_step["agreement"], per_step["none"], strict=True)
        ]
        ratios = [
            with_[0] / without[0]
            for with_, without in zip(per_step["agreement"], per_step["none"], strict=True)
        ]
        print(
            f"the agreement costs {statistics.median(d[0] for d in differences):.0f} us a step "
            f"wall clock (CPU {statistics.median(d[1] for d in differences):.0f} us), paired "
            f"medians; ratio {statistics.median(ratios):.3f} "
            f"(pairs {min(ratios):.3f} to {max(ratios):.3f})"
        )
    # DDP's reducer sits in reference cycles: collect it while the process group and the
    # interpreter are alive, or gloo's threads die at interpreter exit (as in train.py).
    gc.collect()
    dist.destroy_process_group()


def main() -> int:
    options = arguments()
    if "RANK" not in os.environ:
        return launch(options)
    measure(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
