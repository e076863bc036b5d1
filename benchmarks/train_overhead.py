"""Time per epoch of the generated ``train`` against a bare training loop, on the CPU.

Target: at most 1.05x. Both train `DynamicNet` with Adam on the same synthetic data,
batches and per-batch noise (the train module's own `synthetic_data`, `EpochBatches`
and `SyntheticBatches`), in this process, one torch thread. The bare loop is what a
script without the command's machinery does: take each batch, forward, backward,
step. ``train()`` (``--workers 0``: batches from the same sampler, made in the
process) adds the running loss, the progress line, ``metrics.csv`` and an atomic,
fsynced checkpoint at every epoch's end; the run's setup is timed too, reading the
checkpoint back for the weights comparison is not. The two are interleaved; the
verdict is the median, over ``--repeats`` pairs, of the CPU-time ratio of a train
run to the bare run right after it (on a shared machine that is the figure load
changes disturb least); the ratios of the best runs of each, by wall clock and CPU
time, are printed too.

    python benchmarks/train_overhead.py [--repeats 7] [--epochs 3] [--samples 8192]

Bakes the default project unless ``--src`` points at a generated project's ``src``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
from pathlib import Path

from baking import use_generated_src
from determinism_overhead import timed

TARGET_RATIO = 1.05


def bare_loop(train_module, data_module, config) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(config.seed)
    model = train_module.DynamicNet(train_module.IN_FEATURES, out_features=train_module.CLASSES)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    inputs, labels = train_module.synthetic_data(config.samples, config.seed)
    dataset = data_module.SyntheticBatches(inputs, labels, noise=config.noise, seed=config.seed)
    batches = data_module.EpochBatches(config.samples, config.batch_size, seed=config.seed)
    for epoch in range(config.epochs):
        batches.set_position(epoch)
        for key in batches:
            batch_inputs, batch_labels = dataset[key]
            loss = F.cross_entropy(model(batch_inputs), batch_labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.state_dict()


def command(train_module, config, folder: Path) -> Path:
    """``train()`` as the command calls it; the checkpoint it wrote."""
    import torch

    run = train_module.Config(**{**vars(config), "run_dir": folder})
    folder.mkdir()
    train_module.train(run, train_module.Launch(), torch.device("cpu"), log=io.StringIO())
    return folder / "latest.pt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    arguments = parser.parse_args()
    use_generated_src(arguments.src)
    import torch
    from dynamic_model import _data, train

    torch.set_num_threads(1)
    config = train.Config(
        device="cpu",
        epochs=arguments.epochs,
        samples=arguments.samples,
        batch_size=arguments.batch_size,
    )
    with tempfile.TemporaryDirectory() as scratch:
        folders = (Path(scratch, f"run{index}") for index in range(10**6))
        runs = {
            "train": lambda: command(train, config, next(folders)),
            "bare": lambda: bare_loop(train, _data, config),
        }
        warm_up = {name: run() for name, run in runs.items()}
        weights = {
            "train": torch.load(warm_up["train"], weights_only=True)["model"],
            "bare": warm_up["bare"],
        }
        best = {name: [float("inf")] * 2 for name in runs}
        paired = []  # CPU-time ratio of each train run to the bare run right after it
        for _ in range(arguments.repeats):  # interleaved, so load changes hit both
            times = {name: timed(run) for name, run in runs.items()}
            for name, (wall, cpu) in times.items():
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
            paired.append(times["train"][1] / times["bare"][1])
    steps = -(-arguments.samples // arguments.batch_size)
    print(
        f"torch {torch.__version__}, 1 thread, CPU; {arguments.samples} samples, batch "
        f"{arguments.batch_size} ({steps} steps an epoch), {arguments.epochs} epochs a run"
    )
    same = all(
        torch.equal(weights["train"][name], weights["bare"][name]) for name in weights["bare"]
    )
    print(f"final weights of both bitwise equal (the same computation): {same}")
    for name, (wall, cpu) in best.items():
        print(
            f"{name}: {wall / arguments.epochs * 1e3:.1f} ms an epoch "
            f"(CPU {cpu / arguments.epochs * 1e3:.1f} ms)"
        )
    wall_ratio = best["train"][0] / best["bare"][0]
    cpu_ratio = best["train"][1] / best["bare"][1]
    median = statistics.median(paired)
    verdict = "meets" if median <= TARGET_RATIO else "misses"
    print(
        f"ratio of the best runs {wall_ratio:.3f} wall clock, {cpu_ratio:.3f} CPU time; "
        f"median of the paired CPU-time ratios {median:.3f}: {verdict} the target of "
        f"{TARGET_RATIO}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
