"""``gradcheck`` on every kind of op torch has, against ``torch.autograd.gradcheck``.

A sample of torch's operator database (``op_db_sweep``: the ops torch's own gradient
tests run on the CPU, each called through its ``gradcheck_wrapper`` where it has one)
is checked by both, in the default mode and in fast mode, and the verdicts must agree;
conjugate and complex outputs, empty tensors in every input position and mode, and
outputs that do not require grad are checked on their own; planted bugs must fail both
and be named by the fixture, down to the Function, the input and the element. The whole
sweep is ``benchmarks/gradcheck_op_db.py --agreement`` (counts in the README).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import op_db_sweep as sweep
import pytest
import torch
from conftest import DEFAULT_PACKAGE
from gradcheck_sessions import check_session

# Every 10th op of torch's list (a spread over its families), and the ops each of
# which stands for a kind of op the fixture once got wrong or that is checked through
# a gradcheck_wrapper: conjugate-view outputs, complex outputs, hermitian, triangular and
# masked inputs, CTC loss, random ops that reseed.
SAMPLE_EVERY = 10
NAMED = {
    "fft.ifft",
    "fft.ihfft",
    "linalg.eigh",
    "linalg.cholesky",
    "masked.sum",
    "masked.normalize",
    "nn.functional.ctc_loss",
    "nn.functional.dropout",
    "native_layer_norm",
}
COMPLEX_NAMED = {"conj", "H", "linalg.lu_solve", "fft.ifft"}


@pytest.fixture(scope="module")
def gradcheck(default_project: Path):
    import sys

    sys.path.insert(0, str(default_project / "src"))
    try:
        yield importlib.import_module(f"{DEFAULT_PACKAGE}.testing.gradcheck").gradcheck
    finally:
        sys.path.remove(str(default_project / "src"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sampled_names() -> set[str]:
    names = [sweep.op_name(op) for op in sweep.ops(torch.float64)]
    return set(names[::SAMPLE_EVERY]) | NAMED


@pytest.mark.parametrize("fast", [None, True], ids=["default mode", "fast mode"])
def test_a_sample_of_torchs_ops_agrees_with_torch(gradcheck, fast):
    cases = [
        *sweep.cases(torch.float64, samples_per_op=1, names=sampled_names()),
        *sweep.cases(torch.complex128, samples_per_op=2, names=COMPLEX_NAMED),
    ]
    assert len(cases) >= 35
    differ = []
    for case in cases:
        ours, theirs = sweep.ours(gradcheck, case, fast), sweep.theirs(case, fast)
        if ours.verdict is not theirs.verdict:
            differ.append(f"{case.name}: torch {theirs}; fixture {ours}")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("fast", [None, True], ids=["default mode", "fast mode"])
def test_elementwise_ops_on_empty_tensors_in_every_position(gradcheck, fast):
    cases = [c for c in sweep.empty_cases() if c.op.name in {"sin", "exp", "add", "mul", "atan2"}]
    assert {c.name for c in cases} >= {"sin (empty input)", "add (empty input 1)"}
    for case in cases:
        ours, theirs = sweep.ours(gradcheck, case, fast), sweep.theirs(case, fast)
        assert ours.verdict is theirs.verdict is sweep.Verdict.PASS, (case.name, str(ours))


@pytest.mark.parametrize("plant", list(sweep.Plant), ids=lambda plant: plant.name.lower())
def test_planted_bugs_fail_both_and_are_named(gradcheck, plant):
    names = {"addmm", "matmul", "softmax", "cumsum", "nn.functional.conv1d", "exp"}
    cases = [c for c in sweep.cases(torch.float64, samples_per_op=1, names=names)]
    cases = [c for c in cases if sweep.plantable(c)]
    assert len(cases) == len(names)
    for case in cases:
        correct = sweep.ours(gradcheck, case)
        assert correct.verdict is sweep.Verdict.PASS, (case.name, str(correct))
        bug = sweep.planted_case(case, plant)
        ours, theirs = sweep.ours(gradcheck, bug), sweep.theirs(bug)
        assert theirs.verdict is ours.verdict is sweep.Verdict.FAIL, (bug.name, str(ours))
        assert sweep.names_the_plant(bug, plant, ours), (bug.name, str(ours))
        assert "op_db_sweep.py" in str(ours.error).splitlines()[0]  # the backward's file


USER_CASES = """
import collections
import dataclasses

import pytest
import torch
from torch import nn
from helpers import *


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    label: str = "out"


Pair = collections.namedtuple("Pair", ["mean", "scale"])


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 4)

    def forward(self, x):
        h = torch.tanh(self.layer(x))
        return Out(logits=h.sum(-1), hidden=h)


class WithStatistic(nn.Module):
    \"\"\"A layer that also returns a detached statistic of its activations.\"\"\"

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(64, 64)

    def forward(self, x):
        h = self.layer(x)
        return h, h.mean().detach()


def test_an_empty_batch_in_fast_mode(gradcheck):
    torch.manual_seed(0)
    result = gradcheck(nn.Linear(64, 64), torch.randn(0, 64, requires_grad=True))
    assert result.fast


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("gradgrad", [False, True])
def test_an_empty_input_in_every_position_and_mode(gradcheck, position, fast, gradgrad):
    torch.manual_seed(0)
    inputs = [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)]
    inputs[position] = torch.randn(0, requires_grad=True)
    gradcheck(lambda x, y: (x.sum() * 2 + y.sum(), y * 3), *inputs, fast=fast, gradgrad=gradgrad)


def test_an_empty_parameter(gradcheck):
    torch.manual_seed(0)
    gradcheck(nn.Linear(0, 3), torch.randn(2, 0, requires_grad=True), fast=True, gradgrad=True)


def test_conjugate_view_outputs(gradcheck):
    torch.manual_seed(0)
    z = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    gradcheck(lambda z: z.conj(), z)
    gradcheck(lambda z: torch.fft.ifft(z), z, fast=True)
    gradcheck(lambda x: torch.fft.ihfft(x), torch.randn(6, requires_grad=True))


def test_outputs_that_do_not_require_grad_are_left_out(gradcheck):
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    gradcheck(lambda x: torch.native_layer_norm(x, (3,), None, None, 1e-5), x, fast=True)
    model = WithStatistic()
    result = gradcheck(model, torch.randn(40, 64, requires_grad=True))
    assert result.fast  # 6,720 elements


def test_a_wrong_gradient_next_to_an_output_that_does_not_require_grad(gradcheck):
    torch.manual_seed(0)
    layer = Linear(ScaledInputGrad, 64)
    x = torch.randn(40, 64, requires_grad=True)
    gradcheck(lambda x: (layer(x), layer(x).mean().detach()), x)


def test_dataclass_and_named_tuple_outputs(gradcheck):
    torch.manual_seed(0)
    model = Structured()
    result = gradcheck(model, torch.randn(2, 3, requires_grad=True))
    assert [name for name, _ in result.tensors][0] == "input x"
    gradcheck(lambda x: Pair(x.mean(), x.std()), torch.randn(5, requires_grad=True))
"""

EXPECTED_USER_FAILURES = {
    "test_a_wrong_gradient_next_to_an_output_that_does_not_require_grad": [
        "E*WrongGradient: wrong first-order gradient of *<lambda>: the error enters in the custom"
        " autograd Function ScaledInputGrad *",
        "E*it reaches input x[*",
    ],
}


def test_user_style_edge_cases_in_a_pytest_session(plugin_pytester):
    check_session(plugin_pytester, USER_CASES, passed=13, expected=EXPECTED_USER_FAILURES)
