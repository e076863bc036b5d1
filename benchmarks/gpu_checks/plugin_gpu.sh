#!/usr/bin/env bash
# GPU checks of the bundled pytest plugin (issue 3), on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/plugin_gpu.sh [--dry-run]    # or through all.sh
#
# Needs a CUDA build of torch and pytest in $PYTHON (default: python3); the -n 2
# check needs pytest-xdist and is skipped without it. No network: the baked project
# is used from its src folder (see lib.sh for how the plugin is loaded). About two
# minutes. Checks: what the allocator and the driver report for a tensor kept in a
# global and for cuBLAS workspaces (memory_facts.py); pytest --gpu; pytest --gpu -n 2
# with both workers on one GPU (and the controller never initializing CUDA); a
# planted CUDA memory leak caught while clean GPU tests pass, a reseeded CUDA RNG
# restored silently;
# no false leak report after a test's first cuBLAS, cuBLASLt, cuDNN, cuFFT or
# attention call, and a tensor kept in a global reported; a device-side assert failing
# the test that launched the kernel; the usage error when CUDA_VISIBLE_DEVICES hides
# every GPU.
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"
bake test_gpu.py test_models.py
cd "$project" || exit 1

cat >tests/conftest.py <<'EOF'
import sys


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        torch = sys.modules.get("torch")
        initialized = torch is not None and torch.cuda.is_initialized()
        print(f"\ncontroller initialized CUDA: {initialized}")
EOF

mkdir -p planted
cat >planted/test_after_test_checks.py <<'EOF'
import pytest
import torch

KEPT = []


def test_clean_matmul(gpu):
    a = torch.randn(512, 512, device=gpu)
    assert (a @ a).isfinite().all()


def test_planted_leak(gpu):
    KEPT.append(torch.ones(1 << 20, device=gpu))


@pytest.mark.keeps_cuda_memory
def test_kept_on_purpose(gpu):
    KEPT.append(torch.ones(1 << 20, device=gpu))


def test_reseeds_cuda_rng(gpu):
    torch.randn(3, device=gpu)
    torch.cuda.manual_seed(1)


def test_cuda_rng_restored_after_the_reseed(gpu):
    assert torch.cuda.initial_seed() != 1


@pytest.fixture
def model():
    return torch.nn.Linear(256, 256)


def test_moves_a_fixture_model_to_the_gpu(model, gpu):
    model.to(gpu)  # in place: the fixture holds GPU memory until teardown
    model(torch.randn(4, 256, device=gpu)).sum().backward()
EOF
cat >planted/test_workspaces.py <<'EOF'
"""First calls into CUDA libraries that keep workspaces or caches: no false leak report."""

import torch
import torch.nn.functional as F
from torch import nn

KEPT = None


def test_first_float32_matmul(gpu):
    torch.manual_seed(0)
    a = torch.randn(256, 256, device=gpu)
    assert (a @ a).isfinite().all()


def test_half_and_bfloat16_matmuls(gpu):
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.randn(256, 256, device=gpu, dtype=dtype)
        assert (a @ a.t()).isfinite().all()


def test_linear_with_bias_forward_and_backward(gpu):
    layer = nn.Linear(128, 64).to(gpu)  # addmm with a bias goes through cuBLASLt
    layer(torch.randn(32, 128, device=gpu)).sum().backward()
    assert layer.weight.grad is not None


def test_matmul_on_a_side_stream(gpu):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a = torch.randn(256, 256, device=gpu)
        product = a @ a
    stream.synchronize()
    assert product.isfinite().all()


def test_conv2d_with_cudnn(gpu):
    conv = nn.Conv2d(3, 16, 3).to(gpu)
    conv(torch.randn(8, 3, 32, 32, device=gpu)).sum().backward()


def test_fft(gpu):
    x = torch.randn(8, 4096, device=gpu)
    assert torch.fft.irfft(torch.fft.rfft(x), n=4096).sub(x).abs().max() < 1e-3


def test_scaled_dot_product_attention(gpu):
    q = torch.randn(2, 4, 128, 64, device=gpu, dtype=torch.float16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def test_tensor_kept_in_a_global(gpu):
    global KEPT
    KEPT = torch.empty(2 << 20, dtype=torch.uint8, device=gpu)
EOF
cat >planted/test_async_error.py <<'EOF'
import torch


def test_before(gpu):
    assert torch.ones(3, device=gpu).sum().item() == 3


def test_out_of_bounds_index(gpu):
    x = torch.zeros(3, device=gpu)
    x[torch.tensor([5], device=gpu)]  # a device-side assert, reported asynchronously
EOF

collect_tests tests planted

check "memory_facts.py compiles" -- "$python" -c \
    'import sys; compile(open(sys.argv[1]).read(), sys.argv[1], "exec")' "$gpu_checks_dir/memory_facts.py"
check "memory facts: allocator and driver" --cuda --timeout 60 --expect "^memory facts hold" -- \
    "$python" "$gpu_checks_dir/memory_facts.py"

check "pytest --gpu" --cuda --needs pytest \
    --expect "GPU tests: on; torch .*CUDA runtime [0-9.]+, NVIDIA driver [0-9.]+, cuDNN [0-9]+" \
    --expect "GPU 0: .*GiB, compute capability" --expect " passed" \
    --expect "controller initialized CUDA: True" -- \
    "${pytest_command[@]}" --gpu -rs tests/test_gpu.py tests/test_models.py

check "pytest --gpu -n 2, both workers on GPU 0" --cuda --needs pytest --needs xdist \
    --expect "xdist workers \(CUDA_VISIBLE_DEVICES\): gw0 -> 0, gw1 -> 0" \
    --expect "needs 2 GPUs, 1 visible to this test process" \
    --expect "controller initialized CUDA: False" -- \
    env CUDA_VISIBLE_DEVICES=0 "${pytest_command[@]}" --gpu -n 2 -rs tests/test_gpu.py tests/test_models.py

check "planted leak caught, clean GPU tests and a CUDA reseed pass" --cuda --needs pytest \
    --status 1 \
    --expect "6 passed, 1 error" \
    --expect "ERROR planted/test_after_test_checks.py::test_planted_leak - AfterTestCheckFailed" \
    --expect "cuda:0: the test left 4194304 bytes" -- \
    "${pytest_command[@]}" --gpu -rfE planted/test_after_test_checks.py

# In a process of its own, so each library's first call happens in these tests.
check "no false leak report from CUDA library workspaces; a global tensor reported" \
    --cuda --needs pytest --status 1 \
    --expect "8 passed, 1 error" \
    --expect "ERROR planted/test_workspaces.py::test_tensor_kept_in_a_global - AfterTestCheckFailed" \
    --expect "cuda:0: the test left 2097152 bytes" -- \
    "${pytest_command[@]}" --gpu -rfE planted/test_workspaces.py

check "device-side assert fails the test that caused it" --cuda --needs pytest --status 1 \
    --expect "1 failed, 1 passed" \
    --expect "FAILED planted/test_async_error.py::test_out_of_bounds_index - AfterTestCheckFailed" \
    --expect "device-side assert" -- \
    "${pytest_command[@]}" --gpu -rfE planted/test_async_error.py

check "--gpu with CUDA_VISIBLE_DEVICES='' is a usage error" --cuda --needs pytest --status 4 \
    --expect "CUDA_VISIBLE_DEVICES='' hides every GPU" -- \
    env CUDA_VISIBLE_DEVICES= "${pytest_command[@]}" --gpu tests/test_gpu.py

check "--gpu -n 2 with CUDA_VISIBLE_DEVICES='' is a usage error" --cuda --needs pytest --needs xdist \
    --status 4 --expect "CUDA_VISIBLE_DEVICES='' hides every GPU" -- \
    env CUDA_VISIBLE_DEVICES= "${pytest_command[@]}" --gpu -n 2 tests/test_gpu.py

finish_checks
