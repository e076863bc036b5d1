"""Cost of the ``gradcheck`` fixture against ``torch.autograd.gradcheck`` on the same function.

Targets: at most 1.10x a direct ``torch.autograd.gradcheck`` in slow and in fast mode,
on an MLP and on models of many small ops with data-dependent routing (the
template's top-2 mixture of experts ``TopKMixture``, multi-head attention with a
padding mask), and fast-mode time
that grows like a few forward/backward passes, not with the parameter count.

The direct call is what a test would write by hand, as PyTorch's own module tests
do: a float64 copy of the model, its parameters passed next to the input, and
``torch.func.functional_call`` as the function. The fixture's side is the same check
through ``gradcheck(model, x)`` on the float32 model: copying, seeding each
evaluation, collecting outputs and restoring the global state included. Both sides
run interleaved; the best of ``--repeats`` is compared, by wall clock and by CPU time
(on a shared machine the CPU-time ratio is the stable one; one torch thread by
default for the same reason).

    python benchmarks/gradcheck_overhead.py [--repeats 7] [--threads 1] [--src SRC]

Bakes the default project to import the plugin's ``gradcheck`` module unless
``--src`` points at an existing generated project's ``src`` folder.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

from baking import use_generated_src

TARGET_RATIO = 1.10
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def mlp(parameters: int, inputs: int = 16):
    """Three tanh layers with about ``parameters`` parameters."""
    from torch import nn

    # h^2 + (inputs + 12) h + 10 = parameters
    b = inputs + 12
    hidden = max(2, round((-b + math.sqrt(b * b + 4 * (parameters - 10))) / 2))
    return nn.Sequential(
        nn.Linear(inputs, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 10),
    )


def masked_attention(features: int, heads: int = 2):
    """Self-attention over padded sequences: the padding mask hides each sequence's tail."""
    from torch import nn

    class MaskedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(features, heads, batch_first=True)
            self.head = nn.Linear(features, 4)

        def forward(self, x, padding):
            h, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
            return self.head(h)

    return MaskedAttention()


def cases(mode: str):
    """(name, model, inputs) of each model compared, sized for slow or fast mode."""
    import torch
    from dynamic_model.models import TopKMixture

    slow = mode == "slow"
    features = 4 if slow else 32
    lengths = torch.tensor([5, 3, 4])
    padding = torch.arange(5)[None, :] >= lengths[:, None]  # True: padded position
    return [
        ("MLP", mlp(500 if slow else 50_000), (torch.randn(4 if slow else 16, 16),)),
        ("top-2 MoE", TopKMixture(features, k=2), (torch.randn(6 if slow else 32, features),)),
        ("masked MHA", masked_attention(features), (torch.randn(3, 5, features), padding)),
    ]


def direct_check(model, inputs, fast: bool) -> bool:
    """``torch.autograd.gradcheck`` over the first input and every parameter, by hand."""
    import torch

    double = copy.deepcopy(model).double()
    names = [name for name, _ in double.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in double.parameters()]
    x, *rest = inputs
    checked = (x.detach().double().requires_grad_(), *params)

    def function(x, *params):
        parameters = dict(zip(names, params, strict=True))
        return torch.func.functional_call(double, parameters, (x, *rest))

    return torch.autograd.gradcheck(function, checked, fast_mode=fast)


def best(function, repeats: int) -> tuple[float, float]:
    """Best wall-clock and CPU seconds of ``repeats`` calls."""
    wall, cpu = math.inf, math.inf
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        function()
        wall = min(wall, time.perf_counter() - wall_start)
        cpu = min(cpu, time.process_time() - cpu_start)
    return wall, cpu


def interleaved(first, second, repeats: int):
    """Best times of two functions measured in alternation, so load hits both alike."""
    times = [[math.inf, math.inf], [math.inf, math.inf]]
    for _ in range(repeats):
        for slot, function in enumerate((first, second)):
            wall, cpu = best(function, 1)
            times[slot] = [min(times[slot][0], wall), min(times[slot][1], cpu)]
    return times


def compare_with_direct(gradcheck, repeats: int) -> bool:

    print(f"fixture vs direct torch.autograd.gradcheck (target <= {TARGET_RATIO:.2f}x)")
    print(
        f"{'mode':<6}{'model':<12}{'elements':>10}{'direct s':>11}{'fixture s':>11}"
        f"{'wall x':>8}{'cpu x':>8}"
    )
    ok = True
    for mode in ("slow", "fast"):
        fast = mode == "fast"
        for name, model, (x, *rest) in cases(mode):
            x.requires_grad_()
            elements = x.numel() + sum(p.numel() for p in model.parameters())
            direct, fixture = interleaved(
                lambda: direct_check(model, (x, *rest), fast),  # noqa: B023
                lambda: gradcheck(model, x, *rest, fast=fast),  # noqa: B023
                repeats,
            )
            wall, cpu = fixture[0] / direct[0], fixture[1] / direct[1]
            ok = ok and cpu <= TARGET_RATIO
            print(
                f"{mode:<6}{name:<12}{elements:>10,}{direct[0]:>11.4f}{fixture[0]:>11.4f}"
                f"{wall:>8.3f}{cpu:>8.3f}"
            )
    return ok


def fast_mode_growth(gradcheck, repeats: int) -> None:
    import torch

    print("\nfast mode by model size, CPU seconds (one float64 forward+backward = 'pass')")
    print(f"{'parameters':>12}{'pass s':>10}{'direct s':>10}{'fixture s':>11}{'passes':>8}")
    for parameters in SIZES:
        model = mlp(parameters)
        x = torch.randn(16, 16, requires_grad=True)
        double = copy.deepcopy(model).double()
        x64 = x.detach().double().requires_grad_()
        _, one_pass = best(lambda: double(x64).sum().backward(), repeats)  # noqa: B023
        _, direct = best(lambda: direct_check(model, (x,), fast=True), repeats)  # noqa: B023
        _, check = best(lambda: gradcheck(model, x, fast=True), repeats)  # noqa: B023
        count = sum(p.numel() for p in model.parameters())
        print(f"{count:>12,}{one_pass:>10.4f}{direct:>10.4f}{check:>11.4f}{check / one_pass:>8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch
    from dynamic_model.testing.gradcheck import gradcheck

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gradcheck(mlp(100), torch.randn(2, 16, requires_grad=True))  # warm up
    ok = compare_with_direct(gradcheck, args.repeats)
    fast_mode_growth(gradcheck, args.repeats)
    print(f"\n{'within' if ok else 'OVER'} target (CPU-time ratio <= {TARGET_RATIO:.2f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
