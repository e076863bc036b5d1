#!/usr/bin/env bash
# GPU checks of the gradcheck fixture (issue 5), on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/gradcheck_gpu.sh [--dry-run]    # or through all.sh
#
# Needs a CUDA build of torch and pytest in $PYTHON (default: python3). No network:
# the project is baked as bake.sh says. Under a minute. Checks, all on the `gpu`
# device, where the fixture works in float64: the generated tests/test_gradients.py
# (example models, first and second order); dropout and BatchNorm; fast mode on a wide
# model; a planted wrong parameter gradient failing with the element named (slow and
# fast mode); a branch boundary reported as such; the user's model left on the GPU in
# float32.
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"
bake test_gradients.py

cat >"$project/tests/test_gradcheck_gpu.py" <<'EOF'
import pytest
import torch
from torch import nn

from dynamic_model import MeanGatedNet
from dynamic_model.testing.gradcheck import BranchBoundary, WrongGradient


def seeded(factory, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


class WrongWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        grad_w = g.t() @ x
        grad_w[1, 2] += 0.5
        return g @ w, grad_w


class Planted(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.inner = nn.Linear(size, size)
        self.weight = nn.Parameter(torch.randn(size, size))

    def forward(self, x):
        return WrongWeightGrad.apply(torch.tanh(self.inner(x)), self.weight)


@pytest.mark.parametrize("size, fast", [(4, False), (512, True)], ids=["slow", "fast"])
def test_planted_wrong_gradient_is_named(gpu, gradcheck, size, fast):
    model = seeded(lambda: Planted(size)).to(gpu)
    x = torch.randn(3, size, device=gpu, requires_grad=True)
    with pytest.raises(WrongGradient) as failure:
        gradcheck(model, x)
    print(failure.value)
    assert failure.value.tensor == "parameter weight" and failure.value.index == (1, 2)
    assert ("fast mode" in str(failure.value)) == fast
    assert all(p.device == gpu and p.dtype == torch.float32 for p in model.parameters())
    gradcheck(model, x, params=["inner.weight", "inner.bias"])  # the rest is right


def test_branch_boundary_reported_as_boundary(gpu, gradcheck):
    model = seeded(lambda: MeanGatedNet(4, 4)).to(gpu)
    x = torch.randn(3, 4, device=gpu)
    with torch.no_grad():
        model.linear.bias -= model.linear(x).mean()
    with pytest.raises(BranchBoundary) as failure:
        gradcheck(model, x.requires_grad_())
    print(failure.value)
    assert "models.py:" in str(failure.value)
    gradcheck(model, x, avoid_boundaries=True)


def test_checked_in_float64_on_the_gpu(gpu, gradcheck):
    seen = set()

    def forward(x, scale):
        seen.add((x.dtype, x.device.type))
        return torch.tanh(x) * scale

    x = torch.randn(6, device=gpu, requires_grad=True)
    gradcheck(forward, x, torch.tensor(2.0, device=gpu, requires_grad=True))
    print(sorted(map(str, seen)))
    assert (torch.float64, "cuda") in seen
    assert {device for _, device in seen} == {"cuda"}
    assert x.dtype == torch.float32


def test_dropout_batch_norm_and_fast_mode(gpu, gradcheck):
    model = seeded(lambda: nn.Sequential(
        nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Dropout(0.2), nn.Linear(256, 10)
    )).to(gpu)
    x = torch.randn(16, 64, device=gpu, requires_grad=True)
    running_mean = model[1].running_mean.clone()
    result = gradcheck(model, x, gradgrad=True)
    print(result)
    assert result.fast
    assert torch.equal(model[1].running_mean, running_mean)
EOF

cd "$project" || exit 1
collect_tests tests/test_gradients.py tests/test_gradcheck_gpu.py
check "gradcheck on CUDA in float64" --cuda --needs pytest --timeout 50 --expect " passed" -- \
    "${pytest_command[@]}" --gpu -v -rA tests/test_gradients.py tests/test_gradcheck_gpu.py
finish_checks
