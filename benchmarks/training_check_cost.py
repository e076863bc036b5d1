"""Cost of ``training_check`` against the bare training steps it runs.

The baseline is the loop a test would write by hand for the same question: ``steps``
times zero_grad, forward, loss, backward, optimizer step on one batch, with the same
Adam optimizer, then one more forward for the final loss. The check's side is
``training_check(model, (x, y), loss_fn, steps=steps)``: the RNG states reset before
each step, fresh copies of the inputs, the decision recorder, the finiteness checks,
the copies of the parameters and of the optimizer's state, and putting everything
back. Both sides run interleaved on the same model and batch (the check leaves the
model as it found it, so every round starts from the same weights), one torch thread;
the best of ``--repeats`` is compared by wall clock and by CPU time (the stable
figure on a shared machine). With ``--accumulation`` the check also runs its
micro-batch comparison, which the baseline does not.

    python benchmarks/training_check_cost.py [--repeats 15] [--steps 5] [--src SRC]

Bakes the default project to import the plugin's ``training_check`` unless ``--src``
points at an existing generated project's ``src`` folder.
"""

from __future__ import annotations

import argparse
import math
import time

from baking import use_generated_src


def mlp():
    """A static model of 790,531 parameters, beside the dynamic ones (also for ddp_check)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 3)
    )


def cases():
    """(name, model factory, batch) of each model compared."""
    import torch
    from dynamic_model import DynamicNet, PerSampleNet, RoutedRefineNet

    generator = torch.Generator().manual_seed(0)

    def batch(rows: int, features: int, scale: float = 1.0):
        x = torch.randn(rows, features, generator=generator) * scale
        return x, torch.randint(0, 3, (rows,), generator=generator)

    return [
        ("RoutedRefineNet (204 params)", RoutedRefineNet, batch(64, 8, 3.0)),
        ("PerSampleNet (72), 16 rows", lambda: PerSampleNet(8), batch(16, 8)),
        (
            "DynamicNet (1,700)",
            lambda: DynamicNet(in_features=16, out_features=3, tolerance=0.3),
            batch(64, 16, 4.0),
        ),
        ("MLP (790,531)", mlp, batch(64, 256)),
    ]


def bare_steps(model, batch, loss_fn, steps: int) -> float:
    import torch

    x, y = batch
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def timed(function) -> tuple[float, float]:
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall_start, time.process_time() - cpu_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=None)
    parser.add_argument("--src", default=None)
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch
    from dynamic_model.testing.training_check import training_check

    torch.set_num_threads(args.threads)
    loss_fn = torch.nn.CrossEntropyLoss()
    print(
        f"training_check vs {args.steps} bare Adam steps on one batch, best of {args.repeats}"
        f"{f', accumulation_steps={args.accumulation}' if args.accumulation else ''}"
    )
    print(f"{'model':<30}{'bare ms':>10}{'check ms':>10}{'wall x':>8}{'cpu x':>8}")
    for name, factory, batch in cases():
        torch.manual_seed(0)
        model = factory()
        pristine = {key: value.clone() for key, value in model.state_dict().items()}
        best = [[math.inf, math.inf], [math.inf, math.inf]]

        def bare(model=model, batch=batch, pristine=pristine) -> None:
            bare_steps(model, batch, loss_fn, args.steps)
            model.load_state_dict(pristine)  # the next round starts from the same weights

        def check(model=model, batch=batch) -> None:
            training_check(
                model, batch, loss_fn, steps=args.steps, accumulation_steps=args.accumulation
            )

        for _ in range(args.repeats):
            for slot, function in enumerate((bare, check)):
                wall, cpu = timed(function)
                best[slot] = [min(best[slot][0], wall), min(best[slot][1], cpu)]
        (bare_wall, bare_cpu), (check_wall, check_cpu) = best
        print(
            f"{name:<30}{bare_wall * 1e3:>10.2f}{check_wall * 1e3:>10.2f}"
            f"{check_wall / bare_wall:>8.2f}{check_cpu / bare_cpu:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
