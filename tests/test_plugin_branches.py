"""``gradcheck(..., branches="all")``: gradients checked on both sides of each branch.

Each session runs in its own interpreter (``runpytest_subprocess``), as a user's does.
"""

from __future__ import annotations

import pytest
from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE

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


class ScaledSquare(torch.autograd.Function):
    # x**2 whose backward is 2% too large.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x * 1.02


class BuggyOnBothSides(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.mean() > 0:
            return ScaledSquare.apply(h)
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
from {package}.testing.branches import FORWARD_PASSES


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
    assert side.moved > 0
    assert side.forward_passes <= side.budget == FORWARD_PASSES
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
BOTH_GATE = LINES.index("        if h.mean() > 0:", BUGGY_GATE) + 1
GATED_GATE = LINES.index("        if h.mean() > 0:", BOTH_GATE) + 1


def test_a_bug_in_the_branch_not_taken_is_caught_only_with_branches_all(plugin_pytester):
    plugin_pytester.makepyfile(models=MODELS, test_branches=TESTS.format(package=DEFAULT_PACKAGE))
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
            "moved by * of their norm (* of 32 forward passes)*"
        ]
    )


BOTH_SIDES_TESTS = """
import pytest
import torch
from models import BuggyOnBothSides
from {package}.testing.gradcheck import WrongGradient


def positive_point():
    torch.manual_seed(0)
    model = BuggyOnBothSides()
    with torch.no_grad():
        model.linear.bias.fill_(0.5)
    torch.manual_seed(0)
    return model, torch.randn(2, 4, requires_grad=True)


def test_every_side_is_checked_and_reported(gradcheck):
    model, x = positive_point()
    with pytest.raises(WrongGradient) as raised:
        gradcheck(model, x, branches="all")
    point, also = str(raised.value).split("\\nalso:\\n")
    assert not point.startswith("on the other side"), point
    assert "ScaledSquare" in point, point  # the point's wrong gradient, narrowed down
    assert also.startswith(
        "  WrongGradient: on the other side of the branch at models.py:{gate} "
        "(if h.mean() > 0:): False there, True at the given point"
    ), also


def test_the_point_alone_reports_the_point_alone(gradcheck):
    model, x = positive_point()
    with pytest.raises(WrongGradient) as raised:
        gradcheck(model, x)
    assert "also:" not in str(raised.value)
    assert "ScaledSquare" in str(raised.value)
"""


def test_a_failure_at_the_point_and_one_on_the_other_side_are_both_reported(plugin_pytester):
    """The point's wrong gradient (2% in one custom Function) is the failure raised,
    narrowed down to that Function; the other side's (1.5x in another) follows it after
    ``also:``; with ``branches="point"`` only the point's is there."""
    plugin_pytester.makepyfile(
        models=MODELS,
        test_both=BOTH_SIDES_TESTS.format(package=DEFAULT_PACKAGE, gate=BOTH_GATE),
    )
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


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


LIBRARY_HABITS = """
import torch
from torch import nn

INF = torch.tensor(float("inf"), dtype=torch.float64)


def stepped(x, max_step=INF):
    \"\"\"A solver's guard against a step above max_step, which is inf unless set.\"\"\"
    dt = x.abs().mean()
    if dt > max_step:
        dt = max_step
    assert torch.isfinite(x).all(), "the state left the finite numbers"
    return x * dt


def far(x):
    if x.sum() < 1e7:  # a bound only inputs of size 1e7 reach
        return torch.sin(x)
    return torch.cos(x)


def guarded(x):
    assert x.max() < 0.35, "input out of range"  # a library's check of its input
    if x.sum() > 1.0:
        return x**2
    return torch.sin(x)


class Pondering(nn.Module):
    \"\"\"Adaptive computation time: steps until the halting probabilities add up to 1.\"\"\"

    def __init__(self, size=4, max_steps=6):
        super().__init__()
        self.cell = nn.GRUCell(size, size)
        self.halt = nn.Linear(size, 1)
        self.max_steps = max_steps

    def forward(self, x):
        h = torch.zeros_like(x)
        total = torch.zeros(x.shape[0], 1)
        out = torch.zeros_like(x)
        for _ in range(self.max_steps):
            h = self.cell(x, h)
            p = torch.sigmoid(self.halt(h))
            if (total + p).min() > 0.99:
                return out + (1 - total) * h
            out = out + p * h
            total = total + p
        return out


"""

LIBRARY_HABITS_TESTS = """
import torch


def at_the_if(result):
    (side,) = [side for side in result.branches if side.source.startswith("if ")]
    return side

def test_an_infinite_margin_is_not_searched(gradcheck):
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    side = at_the_if(gradcheck(stepped, x, branches="all"))
    assert not side.found and side.forward_passes == 0
    assert side.reason.startswith("the compared value is -inf at the point")


def test_a_side_too_large_for_finite_differences_is_not_checked(gradcheck):
    (side,) = gradcheck(far, torch.randn(3, requires_grad=True), branches="all").branches
    assert not side.found and side.moved > 1e6
    assert "a finite-difference step of eps=1e-06 is rounded by " in side.reason


def test_the_model_refuses_the_other_side(gradcheck):
    x = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
    side = at_the_if(gradcheck(guarded, x, branches="all"))
    assert not side.found
    assert side.reason.startswith("the model refused the inputs moved toward its other side by ")
    assert "AssertionError: input out of range (raised at models.py:" in side.reason


def test_a_halting_probability_that_saturates(gradcheck):
    # The GRU's state saturates: the first steps' halting probabilities cannot reach 0.99.
    torch.manual_seed(0)
    result = gradcheck(Pondering(), torch.randn(3, 4, requires_grad=True), branches="all")
    *saturated, last = result.branches
    assert last.found and saturated
    for side in saturated:
        assert "the compared value comes no nearer its boundary than " in side.reason
        assert str(side).endswith(f"({side.forward_passes} of 32 forward passes)")
"""


def test_branches_of_library_code_are_searched_only_where_it_makes_sense(plugin_pytester):
    plugin_pytester.makepyfile(
        models=LIBRARY_HABITS, test_habits="from models import *\n" + LIBRARY_HABITS_TESTS
    )
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


FAR_MODELS = """
import torch
from torch import nn


class TenPercentSwish(torch.autograd.Function):
    # x * sigmoid(x), whose backward is 10% too large.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s)) * 1.1


class Swish(nn.Module):
    def forward(self, x):
        return TenPercentSwish.apply(x)


class AdaptiveComputation(nn.Module):
    \"\"\"Adaptive computation time: residual steps, each with its own layer, until the
    halting probabilities add up to 0.99; each step's state counts by its probability.\"\"\"

    def __init__(self, size=4, max_steps=6, threshold=0.99):
        super().__init__()
        self.steps = nn.ModuleList(
            nn.Sequential(nn.Linear(size, size), nn.Tanh()) for _ in range(max_steps)
        )
        self.halting = nn.Linear(size, 1)
        nn.init.constant_(self.halting.bias, 2.0)  # few steps to begin with
        self.threshold = threshold

    def forward(self, x):
        state = x
        total = x.new_zeros(())
        output = torch.zeros_like(x)
        for step in self.steps:
            state = state + step(state)
            p = torch.sigmoid(self.halting(state)).mean()
            if total + p > self.threshold:
                return output + (1 - total) * state
            total = total + p
            output = output + p * state
        return output


class Outliers(nn.Module):
    \"\"\"Inputs of norm above ``limit`` are outliers: scaled back to it first.\"\"\"

    def __init__(self, limit, activation=None):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.limit = limit
        self.activation = activation or nn.Tanh()

    def forward(self, x):
        if x.norm() > self.limit:
            return self.activation(self.linear(x * self.limit / x.norm()))
        return torch.tanh(self.linear(x))


def far_off(x):
    if x.norm().log() < 60:  # only inputs of norm above e**60 (about 1e26)
        return torch.sin(x)
    return torch.cos(x)


def rectified_gate(x):
    if torch.relu(x).sum() > 1.0:  # relu passes no gradient back where x < 0
        return x**2
    return torch.sin(x)
"""

FAR_TESTS = """
import pytest
import torch
from models import AdaptiveComputation, Outliers, Swish, far_off, rectified_gate
from {package}.testing.branches import FORWARD_PASSES
from {package}.testing.gradcheck import WrongGradient


def pondering():
    torch.manual_seed(0)
    model = AdaptiveComputation()
    return model, torch.randn(3, 4, requires_grad=True)


def test_both_sides_of_each_halting_decision(gradcheck):
    model, x = pondering()
    result = gradcheck(model, x, branches="all")
    assert [side.at_point for side in result.branches] == [False, True]  # halts at step 2
    assert all(side.found and side.moved > 2 for side in result.branches), result.branches


def test_a_bug_in_a_step_only_longer_ponders_reach(gradcheck):
    model, x = pondering()
    model.steps[2][1] = Swish()  # the third step: the point halts after two
    gradcheck(model, x)
    with pytest.raises(WrongGradient) as raised:
        gradcheck(model, x, branches="all")
    message = str(raised.value)
    assert message.startswith(
        "on the other side of decision #2 of the branch at models.py:{act_gate} "
        "(if total + p > self.threshold:): False there, True at the given point; the inputs "
        "moved by 2."
    ), message
    assert "TenPercentSwish" in message.splitlines()[1]
    assert "also:" not in message  # halting after one step reaches no third step


def outliers(activation=None):
    torch.manual_seed(0)
    x = torch.randn(2, 4, requires_grad=True)
    return Outliers(limit=6 * x.norm().item(), activation=activation), x


def test_an_outlier_five_norms_away(gradcheck):
    model, x = outliers()
    (side,) = gradcheck(model, x, branches="all").branches
    assert side.found and side.moved == pytest.approx(5, rel=1e-3)


def test_a_bug_in_the_outliers_branch(gradcheck):
    model, x = outliers(activation=Swish())
    gradcheck(model, x, branches="all")


def test_a_boundary_the_budget_cannot_reach(gradcheck):
    (side,) = gradcheck(far_off, torch.randn(3, requires_grad=True), branches="all").branches
    assert not side.found and side.forward_passes == side.budget == FORWARD_PASSES
    assert side.reason.startswith(
        f"not found within the budget of {{FORWARD_PASSES}} forward passes: the compared value "
        "is still "
    ), side.reason


def test_a_compared_value_without_gradient(gradcheck):
    x = -torch.rand(3, requires_grad=True)
    (side,) = gradcheck(rectified_gate, x, branches="all").branches
    assert not side.found and side.forward_passes == 0
    assert side.reason == "the gradient of the compared value is zero here"
"""

FAR_LINES = FAR_MODELS.strip("\n").splitlines()
ACT_GATE = FAR_LINES.index("            if total + p > self.threshold:") + 1
OUTLIERS_GATE = FAR_LINES.index("        if x.norm() > self.limit:") + 1


def test_other_sides_however_far_within_the_budget(plugin_pytester):
    """An adaptive-computation loop whose halting decisions flip two to three input norms
    away, and an outlier test five norms away: both sides checked, and a 10% wrong
    backward reached only there caught, naming the side; a boundary beyond the budget's
    reach, or a compared value without gradient, is said so and is no failure."""
    plugin_pytester.makepyfile(
        models=FAR_MODELS,
        test_far=FAR_TESTS.format(package=DEFAULT_PACKAGE, act_gate=ACT_GATE),
    )
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "-v", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_a_bug_in_the_outliers_branch FAILED*",
            f"*on the other side of the branch at models.py:{OUTLIERS_GATE} "
            "(if x.norm() > self.limit:): True there, False at the given point; the inputs "
            "moved by 5 of their norm:",
            "*the error enters in the custom autograd Function TenPercentSwish*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            f"*branches: models.py:{OUTLIERS_GATE}: False at the point, True with the inputs "
            "moved by 5 of their norm (* of 32 forward passes)*"
        ]
    )
