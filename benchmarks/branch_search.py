"""What ``gradcheck(..., branches="all")`` spends to find the other side of each branch.

For the template's models with data-dependent branches, and an adaptive-computation
loop whose halting decisions flip two to three input norms away, at a seeded point: each
branch decision the point reaches, whether an input on its other side was found,
how far the inputs moved (relative to their norm, as information: there is no bound
on it) and the forward passes the search took (within the budget of
``FORWARD_PASSES`` per decision; one more pass per check records the decisions),
then the time of the whole check against ``branches="point"`` in the same process.

    python benchmarks/branch_search.py [--src PATH]   # PATH: a generated project's src
"""

from __future__ import annotations

import argparse
import time

from baking import use_generated_src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)

    import torch
    from dynamic_model import DynamicNet, MeanGatedNet, PerSampleNet, forward_with_condition
    from dynamic_model.testing.branches import FORWARD_PASSES
    from dynamic_model.testing.gradcheck import gradcheck

    gradcheck(torch.sin, torch.randn(3, requires_grad=True), branches="all")  # warm-up
    torch.manual_seed(0)
    cases = {
        "forward_with_condition": (lambda x: forward_with_condition(x, 0.5), (4,)),
        "MeanGatedNet": (MeanGatedNet(8, 8), (4, 8)),
        "PerSampleNet": (PerSampleNet(8), (4, 8)),
        "DynamicNet": (DynamicNet(in_features=8, hidden=16, out_features=4), (4, 8)),
    }
    print(f"{'model':<24} {'decision':<36} {'found':>6} {'moved':>8} {'passes':>7}")
    for name, (model, shape) in cases.items():
        report(gradcheck, FORWARD_PASSES, name, model, torch.randn(shape, requires_grad=True))
    torch.manual_seed(0)  # the point of the tests' adaptive-computation model
    model = adaptive_computation(torch)
    x = torch.randn(3, 4, requires_grad=True)
    report(gradcheck, FORWARD_PASSES, "AdaptiveComputation", model, x)


def report(gradcheck, budget, name, model, x) -> None:
    """One row per decision of ``model`` at ``x``, then the passes and times in all."""
    timings = {}
    for branches in ("point", "all"):
        start = time.process_time()
        result = gradcheck(model, x, branches=branches)
        timings[branches] = time.process_time() - start
    for side in result.branches:
        where = side.where.rsplit("/", 1)[-1]
        moved = f"{side.moved:.3g}" if side.found else "-"
        print(f"{name:<24} {where:<36} {side.found!s:>6} {moved:>8} {side.forward_passes:>7}")
    passes = [side.forward_passes for side in result.branches]
    print(
        f"{name:<24} {len(passes)} decision(s), {sum(passes) / max(len(passes), 1):.1f} "
        f"of {budget} forward passes each; check {timings['all']:.2f} s CPU with "
        f"branches='all', {timings['point']:.2f} s with 'point'"
    )


def adaptive_computation(torch):
    """Residual steps, each with its own layer, until the halting probabilities add up to
    0.99 (as in tests/test_plugin_branches.py): seeded, it halts after two steps."""
    from torch import nn

    class AdaptiveComputation(nn.Module):
        def __init__(self, size=4, max_steps=6):
            super().__init__()
            self.steps = nn.ModuleList(
                nn.Sequential(nn.Linear(size, size), nn.Tanh()) for _ in range(max_steps)
            )
            self.halting = nn.Linear(size, 1)
            nn.init.constant_(self.halting.bias, 2.0)

        def forward(self, x):
            state, total, output = x, x.new_zeros(()), torch.zeros_like(x)
            for step in self.steps:
                state = state + step(state)
                p = torch.sigmoid(self.halting(state)).mean()
                if total + p > 0.99:
                    return output + (1 - total) * state
                total, output = total + p, output + p * state
            return output

    return AdaptiveComputation()


if __name__ == "__main__":
    main()
