#!/usr/bin/env bash
# GPU checks of the autograd_determinism fixture (issue 4), on a machine with an
# NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/determinism_gpu.sh [--dry-run]    # or through all.sh
#
# Needs a CUDA build of torch and pytest in $PYTHON (default: python3). No network:
# bakes the default project (bake.sh), writes GPU cases next to the generated
# tests/test_determinism.py and runs both with pytest --gpu -s. Under 2 minutes.
# Covered: the example models and a conv net pass on CUDA; index_add_/scatter_add_
# under deterministic mode; ops without a deterministic CUDA kernel (forward and
# backward) reported with where they ran; backward ops on CUDA's autograd thread;
# atomic adds found when deterministic mode is off. The "report" tests pass when the
# fixture raised the right error; its text is printed between ----- lines.
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"
bake test_determinism.py

cat >"$project/tests/test_determinism_gpu.py" <<'EOF'
"""GPU cases of autograd_determinism: pass on CUDA, index_add_/scatter_add_, clear reports."""

import pytest
import torch
from torch import nn

from dynamic_model import DynamicNet, RecursiveNet
from dynamic_model.testing.determinism import DeterminismFailure, NondeterministicOpError


def show(error):
    print(f"\n----- {type(error).__name__}\n{error}\n-----")


def test_cuda_models_pass(autograd_determinism, gpu):
    autograd_determinism(DynamicNet(tolerance=0.3).to(gpu), torch.randn(64, 16, device=gpu) * 4)
    autograd_determinism(RecursiveNet().to(gpu), torch.randn(16, 7, 8, device=gpu))
    conv = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(16, 8, 3), nn.Flatten(), nn.LazyLinear(10),
    ).to(gpu)
    conv(torch.randn(2, 3, 16, 16, device=gpu))  # materialize the lazy layer
    result = autograd_determinism(conv.train(), torch.randn(32, 3, 16, 16, device=gpu))
    assert result.outputs.device.type == "cuda"
    assert "1.running_mean" in result.buffers


def test_index_add_and_scatter_add_on_float_cuda_tensors(autograd_determinism, gpu):
    # Both use atomics unless deterministic mode picks their deterministic kernels.
    layer = nn.Linear(32, 32).to(gpu)
    index = torch.randint(0, 8, (4096,), device=gpu)  # many duplicates per target row

    def forward(x):
        h = layer(x)
        pooled = torch.zeros(8, 32, device=gpu).index_add_(0, index, h)
        scattered = torch.zeros(8, 32, device=gpu).scatter_add_(
            0, index[:, None].expand(-1, 32), h
        )
        return pooled, scattered

    autograd_determinism(forward, torch.randn(4096, 32, device=gpu), runs=5)


def test_op_without_deterministic_cuda_backward_is_reported(autograd_determinism, gpu):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(5)).to(gpu)
    with pytest.raises(NondeterministicOpError) as raised:
        autograd_determinism(model, torch.randn(4, 3, 32, 32, device=gpu))
    show(raised.value)
    message = str(raised.value)
    assert "adaptive_avg_pool2d_backward_cuda has no deterministic implementation" in message
    assert (
        "where: backward (AdaptiveAvgPool2DBackward0) of adaptive_avg_pool2d "
        "in 1 (AdaptiveAvgPool2d)" in message
    )


def test_op_without_deterministic_cuda_forward_is_reported(autograd_determinism, gpu):
    def forward(x):
        return torch.histc(x, bins=10) + x.sum()

    with pytest.raises(NondeterministicOpError) as raised:
        autograd_determinism(forward, torch.randn(1000, device=gpu))
    show(raised.value)
    assert "histc" in str(raised.value)
    assert "where: forward at " in str(raised.value)


class NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        generator = torch.Generator(device=grad.device)
        generator.seed()
        return grad * 2 + 1e-3 * torch.randn(grad.shape, generator=generator, device=grad.device)


def test_backward_ops_on_the_cuda_autograd_thread_are_localized(autograd_determinism, gpu):
    layer = nn.Linear(8, 8).to(gpu)
    with pytest.raises(DeterminismFailure) as raised:
        autograd_determinism(lambda x: NoisyBackward.apply(layer(x)), torch.randn(4, 8, device=gpu))
    show(raised.value)
    message = str(raised.value)
    assert "aten.randn.generator (backward (NoisyBackwardBackward) at " in message


def test_atomic_adds_in_backward_are_found_when_deterministic_mode_is_off(
    autograd_determinism, gpu
):
    # Indexing's backward is index_put_(accumulate=True), whose CUDA kernel adds with
    # float atomics unless deterministic mode (turned off here, for this test) is on.
    weight = nn.Parameter(torch.randn(16, 64, device=gpu))
    index = torch.randint(0, 16, (200_000,), device=gpu)

    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return self.weight[index] * x

    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(DeterminismFailure) as raised:
            autograd_determinism(Gather(), torch.randn(200_000, 64, device=gpu), runs=5)
    finally:
        torch.use_deterministic_algorithms(True)
    show(raised.value)
    message = str(raised.value)
    assert "grad of weight" in message
    assert "(backward (IndexBackward0) of __getitem__ in the model (Gather) at " in message
EOF

cd "$project" || exit 1
collect_tests tests/test_determinism_gpu.py tests/test_determinism.py
check "autograd_determinism on CUDA" --cuda --needs pytest --timeout 85 --expect " passed" -- \
    "${pytest_command[@]}" --gpu -s -rA tests/test_determinism_gpu.py tests/test_determinism.py
finish_checks
