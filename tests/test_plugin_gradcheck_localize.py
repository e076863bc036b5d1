"""Where a wrong gradient enters: the Function, submodule or hook, named by its own place.

When the whole model's gradient is wrong, ``gradcheck`` narrows it down before it
reports: a gradient hook of the wrong parameter, then each custom autograd Function the
forward applied, checked on its own at the inputs it got, then the submodules from the
outside in, to the smallest one wrong on its own. Planted bugs in a Function nested two
modules deep, in one expert of a mixture and in a parameter hook are each named by their
own place, the same models without the bug pass, and the report says what the narrowing
cost next to what the check itself cost. Decisions that changed under a finite
difference are told apart: an ``if`` that went the other way, a loop that ran more times.
"""

from __future__ import annotations

import re

import pytest
from gradcheck_sessions import check_session, run_session
from sessions import assert_failures, failure_reports

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PLANTED = """
import pytest
import torch
from torch import nn
from helpers import *


class TanhLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x @ w.t())
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, y = ctx.saved_tensors
        grad = grad * (1 - y * y)
        return grad @ w, grad.t() @ x


class SloppyTanhLinear(TanhLinear):
    @staticmethod
    def backward(ctx, grad):  # LINE-SLOPPY-BACKWARD
        x, w, y = ctx.saved_tensors
        grad = grad * (1 - y * y)
        return 1.1 * (grad @ w), grad.t() @ x  # the input's gradient 10% too large


class Projection(nn.Module):
    def __init__(self, size, function):
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(torch.randn(size, size) / size**0.5)

    def forward(self, x):
        return self.function.apply(x, self.weight)  # LINE-APPLY


class Block(nn.Module):
    def __init__(self, size, function):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.projection = Projection(size, function)

    def forward(self, x):
        return x + self.projection(self.norm(x))


class Encoder(nn.Module):
    def __init__(self, size=6, function=TanhLinear):
        super().__init__()
        self.embed = nn.Linear(size, size)
        self.blocks = nn.ModuleList([Block(size, TanhLinear), Block(size, function)])
        self.head = nn.Linear(size, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Expert(nn.Module):
    def __init__(self, size=4):
        super().__init__()
        self.inner = nn.Linear(size, size)

    def forward(self, x):
        return self.inner(x) + 0.5 * x**2


class LeakyExpert(Expert):
    def forward(self, x):
        return self.inner(x) + 0.5 * x.detach() ** 2  # a term the backward does not see



def hooked():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Linear(8, 2))


def halved(grad):  # LINE-HOOK
    return grad * 0.5


def test_encoder_passes(gradcheck):
    torch.manual_seed(0)
    gradcheck(Encoder(), torch.randn(3, 6, requires_grad=True))


def test_function_two_modules_deep(gradcheck):
    torch.manual_seed(0)
    gradcheck(Encoder(function=SloppyTanhLinear), torch.randn(3, 6, requires_grad=True))


def test_function_two_modules_deep_in_fast_mode(gradcheck):
    torch.manual_seed(0)
    model = Encoder(size=64, function=SloppyTanhLinear)
    gradcheck(model, torch.randn(16, 64, requires_grad=True))


def test_mixture_passes(gradcheck):
    torch.manual_seed(0)
    gradcheck(TopOneMixture(expert=Expert), torch.randn(8, 4, requires_grad=True))


def test_one_expert_of_a_mixture(gradcheck):
    torch.manual_seed(0)
    model = TopOneMixture(expert=Expert)
    model.experts[2] = LeakyExpert()
    gradcheck(model, torch.randn(8, 4, requires_grad=True))


def test_hooked_model_passes(gradcheck):
    model = hooked()
    model[2][0].weight.register_hook(lambda grad: grad.clone())
    gradcheck(model, torch.randn(3, 4, requires_grad=True))


def test_parameter_hook(gradcheck):
    model = hooked()
    model[2][0].weight.register_hook(halved)
    gradcheck(model, torch.randn(3, 4, requires_grad=True))


def test_the_failure_carries_where_it_enters(gradcheck):
    torch.manual_seed(0)
    with pytest.raises(WrongGradient) as caught:
        gradcheck(Encoder(function=SloppyTanhLinear), torch.randn(3, 6, requires_grad=True))
    source = caught.value.source
    assert (source.kind.name, source.name, source.module) == (
        "FUNCTION", "SloppyTanhLinear", "blocks.1.projection (Projection)"
    )
    assert source.location.line == LINE_SLOPPY_BACKWARD
    assert source.applied_at.line == LINE_APPLY
    assert source.tensor == "input x" and caught.value.tensor.startswith("input x")
"""


def lines_of(source: str) -> dict[str, int]:
    """The line number of each ``# LINE-...`` marker in ``source``."""
    found = {}
    for number, line in enumerate(source.strip("\n").splitlines(), start=1):
        marker = re.search(r"# (LINE-[A-Z-]+)", line)
        if marker:
            found[marker.group(1)] = number
    return found


LINES = lines_of(PLANTED)
EXPECTED_PLANTED = {
    "test_function_two_modules_deep": [
        "E*WrongGradient: wrong first-order gradient of Encoder: the error enters in the custom "
        "autograd Function SloppyTanhLinear (its backward at test_session.py:"
        f"{LINES['LINE-SLOPPY-BACKWARD']}), applied at test_session.py:{LINES['LINE-APPLY']} in "
        "blocks.1.projection (Projection)",
        "E*on its own, at the inputs it got there: d output[*] / d input x[*]: numerical *, "
        "analytical *",
        "E*it reaches input x[*",
        "E*narrowed down in * s by checking parts on their own (2 autograd Function calls); the "
        "diagnosis made * evaluations, *x the * of the check",
    ],
    "test_function_two_modules_deep_in_fast_mode": [
        "E*WrongGradient: wrong first-order gradient of Encoder: the error enters in the custom "
        "autograd Function SloppyTanhLinear (*), applied at * in blocks.1.projection (Projection)",
        "E*it reaches *",
        "E*checked Encoder (float64, *), fast mode *",
    ],
    "test_one_expert_of_a_mixture": [
        "E*WrongGradient: wrong first-order gradient of TopOneMixture: the error enters in the "
        "submodule"
        " experts.2 (LeakyExpert): wrong on its own (none of its submodules experts.2.inner is, "
        "nor any autograd Function)",
        "E*on its own, at the inputs it got there: d output[*] / d input x[*]: numerical *",
        "E*it reaches input x[*",
        "E*narrowed down in * s by checking parts on their own (* module calls)*",
    ],
    "test_parameter_hook": [
        "E*WrongGradient: wrong first-order gradient of Sequential: the error enters in the "
        f"gradient hook halved (test_session.py:{LINES['LINE-HOOK']}) of parameter 2.0.weight",
        "E*it reaches parameter 2.0.weight[*",
        "E*in all of them the analytical gradient is 0.5 times the numerical one",
        "E*narrowed down in * s by checking parts on their own (the model without its gradient "
        "hooks)*",
    ],
}


def test_planted_bugs_are_named_by_their_own_place(plugin_pytester):
    source = PLANTED + "".join(
        f"\n{marker.replace('-', '_')} = {line}" for marker, line in LINES.items()
    )
    result = check_session(plugin_pytester, source, passed=4, expected=EXPECTED_PLANTED)
    # The narrowing is bounded: at most DIAGNOSIS_MULTIPLE (20) times the check's own cost.
    for report in failure_reports(result).values():
        multiple = re.search(r"the diagnosis made [\d,]+ evaluations, ([\d.]+)x", "\n".join(report))
        assert multiple, report
        assert float(multiple.group(1)) <= 21, report


DECISIONS = """
import torch
from torch import nn


class Halting(nn.Module):
    \"\"\"Refines until the update is small: the data decides how many steps run.\"\"\"

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(3, 3)

    def forward(self, x):
        h = x
        steps = 0
        while steps < 10:
            update = torch.tanh(self.cell(h))
            h = h + 0.5 * update
            steps += 1
            if update.abs().mean() < self.tolerance:  # LINE-LOOP
                break
        return h


def gated(x, threshold):
    if x.sum() > threshold:  # LINE-IF
        return x**2
    return torch.sin(x)


def test_a_flipped_if(gradcheck):
    x = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64, requires_grad=True)
    gradcheck(gated, x, 3.0)


def test_a_loop_that_runs_once_more(gradcheck):
    torch.manual_seed(0)
    model = Halting()
    x = torch.randn(2, 3)
    with torch.no_grad():  # the loop stops exactly at the second step's test
        h = x + 0.5 * torch.tanh(model.cell(x))
        model.tolerance = float(torch.tanh(model.cell(h)).abs().mean())
    gradcheck(model, x, params=["cell.bias"])
"""


def test_a_flipped_if_is_told_from_a_changed_loop_trip_count(plugin_pytester):
    lines = lines_of(DECISIONS)
    result = run_session(plugin_pytester, DECISIONS)
    result.assert_outcomes(failed=2)
    assert_failures(
        result,
        {
            "test_a_flipped_if": [
                "E*BranchBoundary: cannot check the gradient of gated here: the point is within "
                f"eps of a branch boundary at decision #1 (test_session.py:{lines['LINE-IF']}): "
                "moving input x[*] by *eps sends that decision the other way (an if, a comparison)",
                "E*the same decision, with another outcome: False at the point, True with input "
                "x[*] + eps",
            ],
            "test_a_loop_that_runs_once_more": [
                "E*BranchBoundary: cannot check the gradient of Halting here: the point is within "
                f"eps of a branch boundary at decision #* (test_session.py:{lines['LINE-LOOP']}):"
                " moving parameter cell.bias[*] by *eps changes how many times a loop runs",
                f"E*the decision at test_session.py:{lines['LINE-LOOP']} was made * time(s) at "
                "the point and * time(s) with parameter cell.bias[*",
            ],
        },
    )
