"""Where the time of ``ddp_check`` goes: starting the processes against the steps.

For each model, ``ddp_check(model, batch_0, batch_1)`` runs ``--repeats`` times with
DDP's defaults and as many with ``find_unused_parameters=True``, 2 gloo ranks on the
CPU (each rank one torch thread, as torchrun sets it), the two alternating. With
``find_unused_parameters=True`` the check also times bare DDP steps of the model (no
recorder, no spy, nothing sent), 30 of each configuration: they are the baseline,
what the same steps cost in a training job, and they are most of that run's time.
Its result reports the start-up (processes started and joined in their process
groups, the model copied) and the checked steps (forward with the decision recorder
and the collective spy, the pause for every rank's report, backward, the gradients
sent to the test's process, the optimizer step). The table gives the medians; a
model that fails with the defaults (``RoutedRefineNet``: a parameter only one rank
uses) shows the cost of the failure, which launches the ranks twice. ``--spawn`` adds
one run with spawned ranks, which import torch themselves. ``DynamicNet`` is the
model of the ``train`` command, at its default batch size per process, on batches
whose every step runs the residual block: its "bare step" with
``find_unused_parameters=True`` against the same without it is what the search costs
``train`` per step.

    python benchmarks/ddp_check_cost.py [--repeats 3] [--spawn] [--rounds N] [--only NAME]
        [--src SRC]

Bakes the default project to import the plugin's ``ddp_check`` unless ``--src``
points at an existing generated project's ``src`` folder.
"""

from __future__ import annotations

import argparse
import statistics
import time

from baking import use_generated_src
from training_check_cost import mlp


def cases():
    """(name, model factory, the two ranks' batches) of each model measured."""
    import torch
    from dynamic_model import DynamicNet, PerSampleNet, RoutedRefineNet

    generator = torch.Generator().manual_seed(0)

    def batch(rows: int, features: int, scale: float = 1.0):
        return torch.randn(rows, features, generator=generator) * scale

    return [
        ("PerSampleNet (72 params), 8 rows", PerSampleNet, (batch(8, 8), batch(8, 8))),
        ("RoutedRefineNet (204), 32 rows", RoutedRefineNet, (batch(32, 8, 3.0), batch(32, 8, 0.1))),
        ("MLP (790,531), 64 rows", mlp, (batch(64, 256), batch(64, 256))),
        (
            "DynamicNet of train (1,700), 64 rows",
            lambda: DynamicNet(in_features=16, out_features=4),
            (batch(64, 16, 4.0), batch(64, 16, 4.0)),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternating blocks of timed steps per configuration (the check's own: 3); "
        "more give a steadier per-step figure on a busy machine",
    )
    parser.add_argument("--only", default=None, help="only the models whose name holds this")
    parser.add_argument("--src", default=None)
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch
    import torch._dynamo  # imported by the first check anyway: not timed
    from dynamic_model.testing import ddp_check as module
    from dynamic_model.testing.ddp_check import DEFAULT_STEPS, DdpCheckFailure, ddp_check

    if args.rounds is not None:
        module.TIMING_ROUNDS = args.rounds

    print(
        f"ddp_check, 2 gloo ranks, {DEFAULT_STEPS} checked steps, medians of {args.repeats} "
        "(ms; a bare step is DDP's own, without the check, with find_unused_parameters=True; "
        "'no search' the same without it, with the rewrite that touches every parameter "
        "where one would be unused; 'cpu' and 'cpu no': the same in CPU time)"
    )
    print(
        f"{'model':<38}{'defaults':>9}{'timed':>7}{'start-up':>9}{'per step':>9}"
        f"{'bare step':>10}{'step x':>7}{'no search':>10}{'cpu':>7}{'cpu no':>7}"
    )
    for name, factory, batches in cases():
        if args.only and args.only not in name:
            continue
        plain, timed = [], []
        for _ in range(args.repeats):
            for options, runs in (({}, plain), ({"find_unused_parameters": True}, timed)):
                torch.manual_seed(0)
                model = factory()
                started = time.perf_counter()
                try:
                    result = ddp_check(model, *batches, **options)
                except DdpCheckFailure:  # RoutedRefineNet needs find_unused_parameters
                    result = None
                runs.append((time.perf_counter() - started, result))
        startup = statistics.median(r.startup_seconds for _, r in timed)
        step = statistics.median(r.step_seconds for _, r in timed)
        bare = statistics.median(r.cost.with_search for _, r in timed)
        without = statistics.median(r.cost.without_search for _, r in timed)
        cpu = statistics.median(r.cost.cpu_with_search for _, r in timed)
        cpu_without = statistics.median(r.cost.cpu_without_search for _, r in timed)
        failed = " (fails)" if plain[0][1] is None else ""
        print(
            f"{name:<38}{statistics.median(w for w, _ in plain) * 1e3:>9.0f}"
            f"{statistics.median(w for w, _ in timed) * 1e3:>7.0f}{startup * 1e3:>9.0f}"
            f"{step * 1e3:>9.1f}{bare * 1e3:>10.2f}{step / bare:>7.0f}{without * 1e3:>10.2f}"
            f"{cpu * 1e3:>7.2f}{cpu_without * 1e3:>7.2f}{failed}"
        )
        if args.spawn:
            torch.manual_seed(0)
            started = time.perf_counter()
            result = ddp_check(
                factory(), *batches, find_unused_parameters=True, start_method="spawn"
            )
            print(
                f"{'  spawned ranks':<38}{'':>9}{(time.perf_counter() - started) * 1e3:>7.0f}"
                f"{result.startup_seconds * 1e3:>9.0f}{result.step_seconds * 1e3:>9.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
