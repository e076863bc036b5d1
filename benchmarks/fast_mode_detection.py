"""How often ``gradcheck``'s auto (fast) mode finds one planted wrong element in a large weight.

Target (issue 11): a single wrong element whose error is at least 1% of the largest
gradient element of its tensor is found in tensors of up to 1e6 elements. For each
size (64x64, 512x512, 1000x1000) and each of ``--seeds`` seeds, a model
``x -> tanh(Linear(x)) @ W.T`` gets a backward for ``W`` that adds ``--fraction``
times the largest element of the correct gradient to one random element; the check
runs in auto mode (``fast=None``, fast above 2,048 elements) and counts as a
detection only when it fails with ``WrongGradient`` naming that element. The same
seeds without the planted error count the false failures.

    python benchmarks/fast_mode_detection.py [--seeds 100] [--fraction 0.01] [--src SRC]

Bakes the default project to import the plugin's ``gradcheck`` module unless
``--src`` points at an existing generated project's ``src`` folder.
"""

from __future__ import annotations

import argparse
import sys
import time

from baking import use_generated_src

SIZES = (64, 512, 1000)


def planted_model(size: int, where: tuple[int, int] | None, fraction: float):
    import torch
    from torch import nn

    class PlantedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(x, weight)
            return x @ weight.t()

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            grad_weight = grad.t() @ x
            if where is not None:
                grad_weight[where] += fraction * grad_weight.abs().max()
            return grad @ weight, grad_weight

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, size)
            self.weight = nn.Parameter(torch.randn(size, size) / size**0.5)

        def forward(self, x):
            return PlantedLinear.apply(torch.tanh(self.inner(x)), self.weight)

    return Model()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    arguments = parser.parse_args()
    use_generated_src(arguments.src)
    import torch
    from dynamic_model.testing.gradcheck import WrongGradient, gradcheck

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; error planted: {arguments.fraction:g} x largest element")
    print(f"{'weight':>10}{'detected':>10}{'false failures':>16}{'s per check':>13}")
    for size in SIZES:
        detected = false_failures = 0
        started = time.perf_counter()
        for seed in range(arguments.seeds):
            generator = torch.Generator().manual_seed(seed)
            where = tuple(int(i) for i in torch.randint(0, size, (2,), generator=generator))
            for planted in (where, None):
                torch.manual_seed(seed)
                model = planted_model(size, planted, arguments.fraction)
                x = torch.randn(4, 16)
                try:
                    gradcheck(model, x)
                except WrongGradient as failure:
                    if planted is None:
                        false_failures += 1
                    elif failure.tensor == "parameter weight" and failure.index == where:
                        detected += 1
                except AssertionError:
                    false_failures += planted is None
        seconds = (time.perf_counter() - started) / (2 * arguments.seeds)
        print(
            f"{f'{size}x{size}':>10}{f'{detected}/{arguments.seeds}':>10}"
            f"{f'{false_failures}/{arguments.seeds}':>16}{seconds:>13.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
