"""``gradcheck(..., branches="all")``: gradients checked on both sides of each branch.

Each session runs in its own interpreter (``runpytest_subprocess``), as a user's does.
"""

from __future__ import annotations

import pytest
from conftest import PLUGIN_MODULE

MODELS = """
import torch
from torch import nn


class ScaledTanh(torch.autograd.Function):
    # tanh whose backward is wrong by a factor of 1.5: a bug in one branch only.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2) * 1.5


class BuggyOnTheNegativeSide(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.mean() > 0:
            return h**2
        return ScaledTanh.apply(h)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.mean() > 0:
            return h**2
        return torch.tanh(h)


def masked(x):
    if (x > 100).any():  # a branch on no single comparison: no margin to move along
        return x * 0
    return x**3
"""

TESTS = """
import pytest
import torch
from models import BuggyOnTheNegativeSide, Gated, masked


def positive_point(model):
    torch.manual_seed(0)
    with torch.no_grad():
        model.linear.bias.fill_(0.5)
    return model, torch.randn(2, 4, requires_grad=True)


def test_the_point_alone_passes(gradcheck):
    torch.manual_seed(0)
    model, x = positive_point(BuggyOnTheNegativeSide())
    gradcheck(model, x)


def test_both_sides_catch_the_bug(gradcheck):
    torch.manual_seed(0)
    model, x = positive_point(BuggyOnTheNegativeSide())
    gradcheck(model, x, branches="all")


def test_both_sides_of_a_correct_model(gradcheck):
    torch.manual_seed(0)
    model, x = positive_point(Gated())
    result = gradcheck(model, x, branches="all")
    (side,) = result.branches
    assert side.found and side.at_point is True
    assert 0 < side.moved <= 1  # MAX_DISTANCE
    assert side.forward_passes <= 16
    assert torch.equal(x, x.detach().clone())  # the inputs are left as they were


def test_no_margin_is_reported_not_failed(gradcheck):
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    result = gradcheck(masked, x, branches="all")
    (side,) = result.branches
    assert not side.found
    assert "no comparison" in side.reason


def test_bad_branches_value(gradcheck):
    with pytest.raises(ValueError, match="branches='both'"):
        gradcheck(torch.sin, torch.randn(2, requires_grad=True), branches="both")
"""


LINES = MODELS.strip("\n").splitlines()
BUGGY_GATE = LINES.index("        if h.mean() > 0:") + 1
GATED_GATE = LINES.index("        if h.mean() > 0:", BUGGY_GATE) + 1


def test_a_bug_in_the_branch_not_taken_is_caught_only_with_branches_all(plugin_pytester):
    plugin_pytester.makepyfile(models=MODELS, test_branches=TESTS)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "-v", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_both_sides_catch_the_bug FAILED*",
            f"*on the other side of the branch at models.py:{BUGGY_GATE} (if h.mean() > 0:): "
            "False there, True at the given point; the inputs moved by * of their norm*",
            "*WrongGradient*",
        ]
    )
    # -v: the check line names both sides.
    result.stdout.fnmatch_lines(
        [
            f"*branches: models.py:{GATED_GATE}: True at the point, False with the inputs "
            "moved by * of their norm (* forward passes)"
        ]
    )


@pytest.mark.parametrize("value", ["point", "all"])
def test_the_result_says_which_branches_were_checked(plugin_pytester, value):
    plugin_pytester.makepyfile(
        models=MODELS,
        test_one=(
            "import torch\nfrom models import Gated\n\n"
            "def test_gated(gradcheck):\n"
            "    torch.manual_seed(0)\n"
            f"    result = gradcheck(Gated(), torch.randn(2, 4, requires_grad=True), "
            f"branches={value!r})\n"
            f"    assert len(result.branches) == {int(value == 'all')}\n"
        ),
    )
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
