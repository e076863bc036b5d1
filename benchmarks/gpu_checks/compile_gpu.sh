#!/usr/bin/env bash
# GPU checks of the compile_check and export_check fixtures (issue 14), on a machine
# with an NVIDIA GPU: torch.compile's inductor backend generating Triton kernels.
#
#   bash benchmarks/gpu_checks/compile_gpu.sh [--dry-run]
#
# Not a step of all.sh (its time limits are spent): run it on its own, with OUT= as
# all.sh's steps are not needed. Needs a CUDA build of torch (with Triton) and pytest
# in $PYTHON (default: python3). No network: the project is baked as bake.sh says.
# About a minute, most of it Triton compiling. Checks, all on the `gpu` device: the
# generated tests/test_compile.py (inductor variants); inductor against eager on the
# example models, forward and backward, with their graph breaks; a perturbed backend
# failing with the output named; CondGatedNet exported and run on CUDA against eager
# on both sides of its branch.
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"
bake test_compile.py

cat >"$project/tests/test_compile_gpu.py" <<'PY'
import pytest
import torch

from dynamic_model import CondGatedNet, DynamicNet, MeanGatedNet, PerSampleNet, RecursiveNet
from dynamic_model.testing.compile_check import CompileMismatch


@pytest.mark.parametrize("factory, shape, breaks", [
    (MeanGatedNet, (64, 8), 1),
    (PerSampleNet, (8, 8), 1),
    (lambda: DynamicNet(in_features=8), (64, 8), 1),
    (lambda: RecursiveNet(8), (4, 6, 8), 0),
    (CondGatedNet, (64, 8), 0),
], ids=["branch", "per-sample", "loop", "recursion", "cond"])
def test_inductor_on_cuda_matches_eager(gpu, compile_check, factory, shape, breaks):
    torch.manual_seed(0)
    model = factory().to(gpu)
    result = compile_check(model, torch.randn(shape, device=gpu, requires_grad=True),
                           backend="inductor")
    print(result)
    assert len(result.graph_breaks) == breaks


def test_dropout_under_inductor_from_the_same_rng(gpu, compile_check):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.3)).to(gpu)
    compile_check(model, torch.randn(16, 32, device=gpu), backend="inductor")


def test_perturbed_backend_is_named(gpu, compile_check):
    def perturbing(gm, example_inputs):
        def run(*args):
            return [o * 1.001 if isinstance(o, torch.Tensor) else o for o in gm(*args)]
        return run

    with pytest.raises(CompileMismatch) as failure:
        compile_check(MeanGatedNet().to(gpu), torch.randn(4, 8, device=gpu), backend=perturbing)
    print(failure.value)
    assert failure.value.name == "output"


def test_cond_version_exports_on_cuda(gpu, export_check):
    torch.manual_seed(0)
    gated = MeanGatedNet().to(gpu)
    rewritten = CondGatedNet().to(gpu)
    rewritten.load_state_dict(gated.state_dict())
    direction = gated.linear.weight.sum(dim=0).sign().expand(4, -1)
    sides = [(10.0 * direction,), (-10.0 * direction,)]
    program = export_check(rewritten, inputs_list=sides)
    for (x,) in sides:
        torch.testing.assert_close(program.module()(x), gated(x))
PY

cd "$project" || exit 1
collect_tests tests/test_compile.py tests/test_compile_gpu.py
check "compile_check and export_check, inductor on CUDA" --cuda --needs pytest --timeout 60 \
    --expect " passed" -- \
    "${pytest_command[@]}" --gpu -v -rA tests/test_compile.py tests/test_compile_gpu.py
finish_checks
