#!/usr/bin/env bash
# GPU checks of the bundled pytest plugin (issue 3), on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/plugin_gpu.sh      # from the template repository root
#
# Needs a CUDA build of torch, pytest and pytest-xdist in $PYTHON
# (default: python). No network: the baked project is used from its src folder with
# `-p dynamic_model.testing.plugin` instead of being installed. About a minute.
# Checks: pytest --gpu; pytest --gpu -n 2 with both workers on one GPU (and the
# controller never initializing CUDA); a planted CUDA memory leak and a reseeded CUDA
# RNG caught while clean GPU tests pass; an asynchronous CUDA error failing the test
# that launched the kernel; the usage error when CUDA_VISIBLE_DEVICES hides every GPU.
set -uo pipefail

python=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=benchmarks/gpu_checks/bake.sh
source "$(dirname "$0")/bake.sh"
project=$(bake_project "$work" test_gpu.py test_models.py) || exit 1
export PYTHONPATH="$project/src${PYTHONPATH:+:$PYTHONPATH}"
failed=0

# expect NAME RC PATTERN... -- COMMAND...: run COMMAND in the project, show its output,
# and check its exit status and that each PATTERN (grep -E) occurs in the output.
expect() {
    local name=$1 rc=$2 patterns=() output status
    shift 2
    while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
    shift
    echo "=== $name: $*"
    output=$(cd "$project" && "$@" 2>&1)
    status=$?
    echo "$output" | tail -n 40
    local ok=1
    [ "$status" -eq "$rc" ] || { echo "--- expected exit status $rc, got $status"; ok=0; }
    for pattern in "${patterns[@]}"; do
        grep -qE -- "$pattern" <<<"$output" || { echo "--- missing: $pattern"; ok=0; }
    done
    if [ $ok -eq 1 ]; then echo "=== PASS $name"; else echo "=== FAIL $name"; failed=1; fi
    echo
}

run_pytest=("$python" -m pytest -p dynamic_model.testing.plugin -p no:cacheprovider -p no:randomly)

cat >"$project/tests/conftest.py" <<'EOF'
import sys


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        torch = sys.modules.get("torch")
        initialized = torch is not None and torch.cuda.is_initialized()
        print(f"\ncontroller initialized CUDA: {initialized}")
EOF

mkdir -p "$project/planted"
cat >"$project/planted/test_after_test_checks.py" <<'EOF'
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


@pytest.fixture
def model():
    return torch.nn.Linear(256, 256)


def test_moves_a_fixture_model_to_the_gpu(model, gpu):
    model.to(gpu)  # in place: the fixture holds GPU memory until teardown
    model(torch.randn(4, 256, device=gpu)).sum().backward()
EOF
cat >"$project/planted/test_async_error.py" <<'EOF'
import torch


def test_before(gpu):
    assert torch.ones(3, device=gpu).sum().item() == 3


def test_out_of_bounds_index(gpu):
    x = torch.zeros(3, device=gpu)
    x[torch.tensor([5], device=gpu)]  # a device-side assert, reported asynchronously
EOF

expect "pytest --gpu" 0 \
    "GPU tests: on; torch .*CUDA runtime [0-9.]+, NVIDIA driver [0-9.]+, cuDNN [0-9]+" \
    "GPU 0: .*GiB, compute capability" "passed" "controller initialized CUDA: True" \
    -- "${run_pytest[@]}" --gpu -rs tests/test_gpu.py tests/test_models.py

expect "pytest --gpu -n 2, both workers on GPU 0" 0 \
    "xdist workers \(CUDA_VISIBLE_DEVICES\): gw0 -> 0, gw1 -> 0" \
    "needs 2 GPUs, 1 visible to this test process" "controller initialized CUDA: False" \
    -- env CUDA_VISIBLE_DEVICES=0 "${run_pytest[@]}" --gpu -n 2 -rs tests/test_gpu.py tests/test_models.py

expect "planted leak and reseed caught, clean GPU tests pass" 1 \
    "1 failed, 4 passed, 1 error" \
    "ERROR planted/test_after_test_checks.py::test_planted_leak - AfterTestCheckFailed" \
    "cuda:0: the test left 4194304 bytes" \
    "torch cuda:0 RNG: reseeded, initial seed [0-9]+ -> 1" \
    -- "${run_pytest[@]}" --gpu -rfE planted/test_after_test_checks.py

expect "asynchronous CUDA error fails the test that caused it" 1 \
    "1 failed, 1 passed" \
    "FAILED planted/test_async_error.py::test_out_of_bounds_index - AfterTestCheckFailed" \
    -- "${run_pytest[@]}" --gpu -rfE planted/test_async_error.py

expect "--gpu with CUDA_VISIBLE_DEVICES='' is a usage error" 4 \
    "CUDA_VISIBLE_DEVICES='' hides every GPU" \
    -- env CUDA_VISIBLE_DEVICES= "${run_pytest[@]}" --gpu tests/test_gpu.py

expect "--gpu -n 2 with CUDA_VISIBLE_DEVICES='' is a usage error" 4 \
    "CUDA_VISIBLE_DEVICES='' hides every GPU" \
    -- env CUDA_VISIBLE_DEVICES= "${run_pytest[@]}" --gpu -n 2 tests/test_gpu.py

if [ $failed -eq 0 ]; then echo "ALL PLUGIN GPU CHECKS PASSED"; else echo "SOME PLUGIN GPU CHECKS FAILED"; fi
exit $failed
