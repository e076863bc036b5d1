"""Cost of ``train --detect-nonfinite`` on finite steps, against a bare training step and
against ``torch.autograd.detect_anomaly(check_nan=True)`` on the same steps.

Target: at most 1.05x a bare training step. A step is what the command does: the
forward and loss, ``zero_grad``, backward, Adam's step. The detecting side adds what
`Trainer.step` adds with ``--detect-nonfinite``: the generators' states taken
(`GeneratorsAtStep.take`) and `FiniteSteps.finite` (one fused pass over the loss, the
weights and the gradients into one flag, and one read of it), from the generated
package itself. The anomaly side runs the bare step under anomaly mode.
Each side trains its own copy of the same model on the same batches; the sides run
interleaved, ``--steps`` steps a round, and the verdict is the median over
``--repeats`` rounds of each side's CPU time over the bare side's in that round (one
torch thread: on a shared machine CPU time is the stable figure).
Models: the example `DynamicNet` (batch 64 of the synthetic data, the
loop and the skipped block decided by the data) and a transformers Llama decoder
layer (a transformers-sized block: hidden 256, 4 heads, 2 x 64 tokens).

    python benchmarks/train_nonfinite_cost.py [--repeats 15] [--steps 40] [--src SRC]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

from baking import use_generated_src
from finite_check_overhead import models as finite_check_models

TARGET_RATIO = 1.05


def models():
    """(name, model, batches, loss of (model, batch)) for each model measured."""
    import torch
    import torch.nn.functional as F
    from dynamic_model import train

    torch.manual_seed(0)
    inputs, labels = train.synthetic_data(64 * 40, seed=0)
    batches = list(zip(inputs.split(64), labels.split(64), strict=True))
    yield (
        "DynamicNet (batch 64, 16 features)",
        train.build_model(),
        batches,
        lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
    )
    for name, model, x in finite_check_models():
        if name.startswith("Llama"):  # the same transformers-sized block, trained here
            batches = [(x + 0.1 * torch.randn_like(x),) for _ in range(4)]
            yield name, model, batches, lambda model, batch: model(batch[0]).pow(2).mean()


def sides(model, loss_of) -> dict:
    """The steps compared, each on its own copy of ``model`` and its own Adam."""
    import torch
    from dynamic_model._finite_steps import FiniteSteps, GeneratorsAtStep

    device = torch.device("cpu")

    def step_of(watch: bool, anomaly: bool):
        own = copy.deepcopy(model)
        optimizer = torch.optim.Adam(own.parameters(), lr=1e-4)
        finite = FiniteSteps(list(own.parameters()), device, world_size=1)

        def step(batch) -> None:
            if watch:
                GeneratorsAtStep.take(device)
            loss = loss_of(own, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if watch:
                assert finite.finite(loss, gradients=True)
            optimizer.step()

        if not anomaly:
            return step

        def under_anomaly(batch) -> None:
            with torch.autograd.detect_anomaly(check_nan=True):
                step(batch)

        return under_anomaly

    return {
        "bare step": step_of(watch=False, anomaly=False),
        "--detect-nonfinite": step_of(watch=True, anomaly=False),
        "detect_anomaly": step_of(watch=False, anomaly=True),
    }


def measure(name: str, model, batches, loss_of, repeats: int, steps: int) -> float:
    import warnings

    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    works = sides(model, loss_of)
    for work in works.values():  # warm every path once
        work(batches[0])
    cpu: dict[str, list[float]] = {label: [] for label in works}
    wall: dict[str, list[float]] = {label: [] for label in works}
    for _ in range(repeats):
        for label, work in works.items():
            started_wall, started_cpu = time.perf_counter(), time.process_time()
            for number in range(steps):
                work(batches[number % len(batches)])
            cpu[label].append(time.process_time() - started_cpu)
            wall[label].append(time.perf_counter() - started_wall)
    print(f"\n{name}")
    bare = cpu["bare step"]
    print(f"  bare step            {statistics.median(bare) / steps * 1e3:.3f} ms CPU")
    ratios = {}
    for label in ("--detect-nonfinite", "detect_anomaly"):
        ratios[label] = statistics.median(c / b for c, b in zip(cpu[label], bare, strict=True))
        best = min(wall[label]) / min(wall["bare step"])
        print(
            f"  {label:<20} {statistics.median(cpu[label]) / steps * 1e3:.3f} ms CPU  "
            f"{ratios[label]:.3f}x CPU (median of {repeats} rounds), {best:.3f}x wall (best)"
        )
    return ratios["--detect-nonfinite"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--src", default=None)
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch

    torch.set_num_threads(args.threads)
    worst = max(
        measure(name, model, batches, loss_of, args.repeats, args.steps)
        for name, model, batches, loss_of in models()
    )
    verdict = "within" if worst <= TARGET_RATIO else "ABOVE"
    print(f"\n--detect-nonfinite: at most {worst:.3f}x a bare step, {verdict} {TARGET_RATIO}x")
    return 0 if worst <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
