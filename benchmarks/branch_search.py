"""What ``gradcheck(..., branches="all")`` spends to find the other side of each branch.

For the template's models with data-dependent branches, at a seeded point: each
branch decision the point reaches, whether an input on its other side was found,
how far the inputs moved (relative to their norm) and the forward passes the
search took (the bound is 16 per decision; one more pass per check records the
decisions), then the time of the whole check
against ``branches="point"`` in the same process.

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
        x = torch.randn(shape, requires_grad=True)
        timings = {}
        for branches in ("point", "all"):
            start = time.process_time()
            result = gradcheck(model, x, branches=branches)
            timings[branches] = time.process_time() - start
        for side in result.branches:
            where = side.location.rsplit("/", 1)[-1] + (
                f" (#{side.occurrence})" if side.occurrence > 1 else ""
            )
            moved = f"{side.moved:.3g}" if side.found else "-"
            print(f"{name:<24} {where:<36} {side.found!s:>6} {moved:>8} {side.forward_passes:>7}")
        passes = [side.forward_passes for side in result.branches]
        print(
            f"{name:<24} {len(passes)} decision(s), {sum(passes) / max(len(passes), 1):.1f} "
            f"forward passes each; check {timings['all']:.2f} s CPU with branches='all', "
            f"{timings['point']:.2f} s with 'point'"
        )


if __name__ == "__main__":
    main()
