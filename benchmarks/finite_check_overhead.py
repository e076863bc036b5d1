"""Cost of ``finite_check`` on a finite run, against a bare forward and backward and against
``torch.autograd.detect_anomaly(check_nan=True)`` on the same work.

Target: at most 1.10x the bare forward and backward. The bare side is what a test
would write by hand: the model on the input, then ``torch.autograd.grad`` of the
outputs with a fixed cotangent into every parameter. The fixture's side is
``finite_check(model, x)``: its subject set up and put back, the same forward and
backward (the other checks' cotangents), and the one reduction per output and
gradient, read once. The anomaly side is the bare work under anomaly mode, which
checks every backward node's outputs and keeps a stack trace per forward op.
The sides run interleaved; the best of ``--repeats`` is compared, by wall clock and by
CPU time (one torch thread by default: on a shared machine CPU time is the stable
figure). Models: the template's top-2 mixture of experts, an MLP, and a transformers
Llama decoder layer (a transformers-sized block: hidden 256, 4 heads, sequence 64).

    python benchmarks/finite_check_overhead.py [--repeats 15] [--threads 1] [--src SRC]
"""

from __future__ import annotations

import argparse
import sys
import time

from baking import use_generated_src

TARGET_RATIO = 1.10


def models():
    import torch
    from dynamic_model.models import TopKMixture
    from torch import nn

    yield "TopKMixture (8 features, 4 experts, 64 rows)", TopKMixture(8), torch.randn(64, 8)
    mlp = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                        nn.Linear(512, 10))  # fmt: skip
    yield "MLP (64-512-512-10, batch 128)", mlp, torch.randn(128, 64)
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    except ImportError:
        return
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=4, attn_implementation="eager")  # fmt: skip
    layer, rotary = LlamaDecoderLayer(config, layer_idx=0), LlamaRotaryEmbedding(config)
    x = torch.randn(2, 64, 256)
    positions = rotary(x, torch.arange(64)[None])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, hidden):
            out = self.layer(hidden, position_embeddings=positions)
            return out[0] if isinstance(out, tuple) else out

    yield "Llama decoder layer (hidden 256, 4 heads, 2 x 64 tokens)", Block(), x


def timed(work, repeats: int) -> tuple[float, float]:
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def sides(model, x) -> dict:
    """The works compared: bare, the check's own set-up run, the fixture, anomaly mode."""
    import torch
    from dynamic_model.testing.finite_check import FiniteCheckFailure, finite_check
    from dynamic_model.testing.runs import Cotangents, run_once
    from dynamic_model.testing.subject import Subject

    parameters = [p for p in model.parameters() if p.requires_grad]

    def bare():
        out = model(x)
        torch.autograd.grad(out, parameters, torch.ones_like(out))

    def anomaly():
        with torch.autograd.detect_anomaly(check_nan=True):
            bare()

    def fixture():
        finite_check(model, x)

    def setup_and_run():
        subject = Subject(model, (x,), {}, failure=FiniteCheckFailure)
        try:
            run_once(subject, Cotangents(0))
        finally:
            subject.reset()

    return {
        "bare": bare,
        "check's own run": setup_and_run,
        "finite_check": fixture,
        "anomaly": anomaly,
    }


def measure(name: str, model, x, repeats: int) -> None:
    works = sides(model, x)
    for work in works.values():  # warm every path once
        work()
    results = {label: (float("inf"), float("inf")) for label in works}
    for _ in range(repeats):  # interleaved, the best of each kept
        for label, work in works.items():
            wall, cpu = timed(work, 1)
            results[label] = (min(results[label][0], wall), min(results[label][1], cpu))
    bare_wall, bare_cpu = results["bare"]
    run_wall, run_cpu = results["check's own run"]
    print(f"\n{name}")
    print(f"  bare forward+backward  {bare_wall:.4f} ({bare_cpu:.4f})")
    for label in ("finite_check", "anomaly"):
        wall, cpu = results[label]
        print(
            f"  {label:<22} {wall:.4f} ({cpu:.4f})  {wall / bare_wall:.2f}x wall, "
            f"{cpu / bare_cpu:.2f}x CPU"
        )
    wall, cpu = results["finite_check"]
    print(
        f"  detection pass: finite_check over its own set-up run (subject copied and put "
        f"back, forward, backward): {wall / run_wall:.2f}x wall, {cpu / run_cpu:.2f}x CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--src", default=None)
    args = parser.parse_args()
    use_generated_src(args.src)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"best of {args.repeats}, {args.threads} torch thread(s); wall (CPU) seconds")
    for name, model, x in models():
        measure(name, model, x, args.repeats)
    print(
        f"\ntarget: finite_check <= {TARGET_RATIO}x the bare forward+backward (its detection "
        "pass, the reductions read once, on top of the run it checks)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
