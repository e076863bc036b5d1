"""What a failing ``gradcheck`` costs next to a passing one: the diagnosis and the narrowing.

For each model, the same check with and without a planted bug: the passing check's
CPU time and evaluations, and the failing check's (the element search, the other
tensors, the parts checked on their own). Bound: the diagnosis makes at most
``DIAGNOSIS_MULTIPLE`` (20) times the evaluations of the check itself plus
``DIAGNOSIS_FLOOR`` (64); the table shows evaluations and time.

    python benchmarks/gradcheck_diagnosis.py [--repeats 3] [--src SRC]

Bakes the default project unless ``--src`` points at a generated project's ``src``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time

from baking import use_generated_src


def models():
    """(name, build(planted: bool) -> (model, x)) of each model compared."""
    import torch
    from torch import nn

    class TanhLinear(torch.autograd.Function):
        scale = 1.0

        @staticmethod
        def forward(ctx, x, w):
            y = torch.tanh(x @ w.t())
            ctx.save_for_backward(x, w, y)
            return y

        @classmethod
        def backward(cls, ctx, grad):
            x, w, y = ctx.saved_tensors
            grad = grad * (1 - y * y)
            return cls.scale * (grad @ w), grad.t() @ x

    class Sloppy(TanhLinear):
        scale = 1.1

    class Projection(nn.Module):
        def __init__(self, size, function):
            super().__init__()
            self.function = function
            self.weight = nn.Parameter(torch.randn(size, size) / size**0.5)

        def forward(self, x):
            return self.function.apply(x, self.weight)

    class Encoder(nn.Module):
        def __init__(self, size, function):
            super().__init__()
            self.embed = nn.Linear(size, size)
            self.blocks = nn.ModuleList([Projection(size, TanhLinear), Projection(size, function)])
            self.head = nn.Linear(size, 4)

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    class Expert(nn.Module):
        def __init__(self, size=4, detached=False):
            super().__init__()
            self.inner = nn.Linear(size, size)
            self.detached = detached

        def forward(self, x):
            return self.inner(x) + 0.5 * (x.detach() if self.detached else x) ** 2

    class Mixture(nn.Module):
        def __init__(self, planted, experts=3, size=4):
            super().__init__()
            self.gate = nn.Linear(size, experts)
            self.experts = nn.ModuleList(
                Expert(size, detached=planted and e == 2) for e in range(experts)
            )

        def forward(self, x):
            weight, index = self.gate(x).softmax(-1).max(-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                rows = (index == e).nonzero().squeeze(1)
                if rows.numel():
                    out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
            return out

    def encoder(size, batch):
        def build(planted):
            torch.manual_seed(0)
            model = Encoder(size, Sloppy if planted else TanhLinear)
            return model, torch.randn(batch, size, requires_grad=True)

        return build

    def mixture(planted):
        torch.manual_seed(0)
        return Mixture(planted), torch.randn(8, 4, requires_grad=True)

    def hooked(planted):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )
        model[2].weight.register_hook((lambda g: g * 0.5) if planted else (lambda g: g))
        return model, torch.randn(3, 4, requires_grad=True)

    return [
        ("Function bug, 170 elements, slow mode", encoder(6, 3)),
        ("Function bug, 19,324 elements, fast mode", encoder(96, 8)),
        ("detached term in one expert, slow mode", mixture),
        ("parameter hook, slow mode", hooked),
    ]


def best_cpu(function, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.process_time()
        function()
        best = min(best, time.process_time() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch
    from dynamic_model.testing import gradcheck as module

    torch.set_num_threads(1)
    print(
        f"{'case':<44}{'pass s':>9}{'fail s':>9}{'x time':>8}{'check evals':>13}{'diagnosis':>11}"
    )
    within = True
    for name, build in models():
        model, x = build(False)
        passing = best_cpu(lambda: module.gradcheck(model, x), args.repeats)  # noqa: B023
        model, x = build(True)
        message = ""

        def failing():
            nonlocal message
            try:
                module.gradcheck(model, x)  # noqa: B023
            except module.WrongGradient as failure:
                message = str(failure)

        failed = best_cpu(failing, args.repeats)
        found = re.search(
            r"the diagnosis made ([\d,]+) evaluations, ([\d.]+)x the ([\d,]+)", message
        )
        diagnosis, _, check = (found.group(i).replace(",", "") for i in (1, 2, 3))
        bound = module.DIAGNOSIS_MULTIPLE * int(check) + module.DIAGNOSIS_FLOOR
        within = within and int(diagnosis) <= bound
        print(
            f"{name:<44}{passing:>9.3f}{failed:>9.3f}{failed / passing:>8.1f}{check:>13}"
            f"{diagnosis:>11}"
        )
    print(
        f"\ndiagnosis {'within' if within else 'OVER'} DIAGNOSIS_MULTIPLE x check + DIAGNOSIS_FLOOR"
    )
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
