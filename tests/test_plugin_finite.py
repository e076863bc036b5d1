"""The finite_check fixture in a real pytest session: where the first NaN or inf came from.

Each case users hit, with its good case passing: ``log``, ``sqrt`` and ``pow`` of a
negative number, ``0/0``, a softmax over a fully masked row (a mask of ``-inf`` made by
the code, and one given as an input to transformers' BERT attention, whose
``finfo.min`` mask, the fix printed, passes), a float16 overflow under autocast, an
exponential too large for bfloat16, a NaN
on one side of a data-dependent branch, a NaN born in the backward only (``sqrt`` at
0), a NaN already in an input or a parameter, and a model under ``torch.compile``.
Each failure's origin is asserted: the op, forward or backward, the user's line, the
values and the cause.
"""

from __future__ import annotations

import pytest
from sessions import assert_failures, run_session

pytest.importorskip("transformers", reason="transformers is in requirements-libraries.txt")

HELPERS = """
import torch
from torch import nn


class Logged(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        return torch.log(h.abs() if self.safe else h).sum()

    safe = False


class Rooted(nn.Module):
    def forward(self, x):
        return torch.sqrt(x).sum() + (x ** 0.5).sum()


class Ratio(nn.Module):
    def forward(self, x, y):
        return (x / y).sum()


class MaskedAttention(nn.Module):
    def __init__(self, masked_row):
        super().__init__()
        self.masked_row = masked_row

    def forward(self, q):
        scores = q @ q.T
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[self.masked_row, : (None if self.masked_row == 2 else 1)] = True
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1).sum()


class HalfPrecision(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = self.linear(x * self.scale)
            return (h @ h.T).float().sum()


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.mean() > 0:
            return torch.log(h).sum()
        return torch.tanh(h).sum()


def scores_in_bfloat16(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.exp(x.bfloat16() * 100).float().sum()


def hand_norm(x):
    return (x * x).sum(-1).sqrt().sum()


def bert_attention():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16,
                        attn_implementation="eager")
    return BertSelfAttention(config)
"""

TESTS = """
import pytest
import torch
from {package}.testing.finite_check import NonFiniteInput, NonFiniteRun
from helpers import *


def failed(finite_check, *args, **kwargs):
    with pytest.raises(NonFiniteRun) as caught:
        finite_check(*args, **kwargs)
    return caught.value


def test_log_of_a_negative_number(finite_check):
    torch.manual_seed(0)
    model, x = Logged(), torch.randn(3, 4)
    error = failed(finite_check, model, x)
    assert error.origin.op == "log" and not error.origin.backward
    assert error.origin.cause == "the logarithm of a negative number"
    assert error.origin.inputs[0] < 0
    assert error.location.source == "return torch.log(h.abs() if self.safe else h).sum()"
    model.safe = True
    finite_check(model, x)


def test_sqrt_and_pow_of_a_negative_number(finite_check):
    torch.manual_seed(0)
    error = failed(finite_check, Rooted(), torch.tensor([4.0, -0.25, 9.0]))
    assert (error.origin.op, error.origin.element) == ("sqrt", (1,))
    assert error.origin.inputs == (-0.25,)
    assert error.origin.cause == "the square root of a negative number"
    finite_check(Rooted(), torch.tensor([4.0, 0.25, 9.0]))


def test_zero_over_zero(finite_check):
    torch.manual_seed(0)
    error = failed(finite_check, Ratio(), torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]))
    assert (error.origin.op, error.origin.cause, error.origin.inputs) == ("div", "0/0", (0.0, 0.0))
    finite_check(Ratio(), torch.tensor([1.0, 0.0]), torch.tensor([2.0, 1.0]))


def test_a_fully_masked_row(finite_check):
    torch.manual_seed(0)
    error = failed(finite_check, MaskedAttention(masked_row=2), torch.randn(4, 4))
    assert error.origin.op == "_softmax" and error.origin.element[0] == 2
    assert "a fully masked row" in error.origin.cause
    assert error.origins.mask.op == "masked_fill"
    finite_check(MaskedAttention(masked_row=1), torch.randn(4, 4))  # one position masked


def test_a_float16_overflow_under_autocast(finite_check):
    torch.manual_seed(0)
    error = failed(finite_check, HalfPrecision(scale=300.0), torch.randn(4, 8))
    assert (error.origin.op, error.origin.kind, error.origin.dtype) == ("mm", "inf", torch.float16)
    assert "an overflow" in error.origin.cause and "65504" in error.origin.cause
    finite_check(HalfPrecision(scale=1.0), torch.randn(4, 8))


def test_an_exponential_too_large_for_bfloat16(finite_check):
    torch.manual_seed(0)
    error = failed(finite_check, scores_in_bfloat16, torch.tensor([0.5, 1.0]))
    origin = error.origin
    assert (origin.op, origin.kind, origin.dtype) == ("exp", "inf", torch.bfloat16)
    assert error.origin.cause == "an exponential too large for the dtype"
    finite_check(scores_in_bfloat16, torch.tensor([0.05, 0.1]))


def test_a_nan_on_one_side_of_a_branch(finite_check):
    torch.manual_seed(0)
    model = Gate()
    with torch.no_grad():
        model.linear.weight.copy_(torch.eye(4))
        model.linear.bias.zero_()
    finite_check(model, torch.randn(3, 4) - 2)  # mean below 0: tanh
    error = failed(finite_check, model, torch.randn(3, 4) + 0.5)  # above 0: log of h
    assert error.origin.op == "log"
    (decision,) = error.origin.decisions
    assert decision.value is True and decision.location.source == "if h.mean() > 0:"


def test_a_nan_born_in_the_backward_only(finite_check):
    torch.manual_seed(0)
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]], requires_grad=True)
    error = failed(finite_check, hand_norm, x)
    assert error.seen == ("grad of input x",)
    assert error.origin.backward and error.origin.site.what == "backward (SqrtBackward0)"
    assert error.origin.cause == "a division by 0"
    assert error.origins.nan.op == "mul" and error.origins.nan.cause == "0 * inf"
    assert error.location.source == "return (x * x).sum(-1).sqrt().sum()"
    finite_check(torch.linalg.vector_norm, torch.tensor([0.0, 0.0], requires_grad=True))


def test_a_nan_already_in_an_input_or_a_parameter(finite_check):
    torch.manual_seed(0)
    model = Logged()
    model.safe = True
    with pytest.raises(NonFiniteInput, match=r"input x already holds 3 NaN of 12 elements"):
        finite_check(model, torch.tensor([[1.0, float("nan"), 0, 0]] * 3))
    with torch.no_grad():
        model.linear.weight[1, 2] = float("inf")
    with pytest.raises(NonFiniteInput, match=r"parameter linear.weight already holds 1 inf"):
        finite_check(model, torch.randn(3, 4))


def test_a_bert_attention_mask_of_minus_inf(finite_check):
    torch.manual_seed(0)
    attention, x = bert_attention(), torch.randn(1, 4, 8)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 2, :] = float("-inf")
    error = failed(finite_check, attention, x, forward_kwargs={{"attention_mask": mask}})
    assert error.origin.op == "_softmax"
    assert "input attention_mask holds inf" in str(error)
    mask[..., 2, :] = torch.finfo(torch.float32).min  # the fix the message prints
    finite_check(attention, x, forward_kwargs={{"attention_mask": mask}})


def test_under_torch_compile_the_origin_is_found_eagerly(finite_check):
    torch.manual_seed(0)
    compiled = torch.compile(Rooted(), backend="aot_eager")
    error = failed(finite_check, compiled, torch.tensor([4.0, -0.25, 9.0]))
    assert error.origin.op == "sqrt"
    assert "replaying the original module eagerly" in str(error)
    finite_check(compiled, torch.tensor([4.0, 0.25, 9.0]))


def test_report(finite_check):
    torch.manual_seed(0)
    finite_check(hand_norm, torch.tensor([[0.0, 0.0], [3.0, 4.0]], requires_grad=True))
"""


def test_finite_check_names_the_origin_of_each_nan_and_passes_finite_runs(plugin_pytester):
    result = run_session(plugin_pytester, TESTS, "-v", helpers=HELPERS)
    assert_failures(
        result,
        {
            "test_report": [
                "E*NonFiniteRun: finite_check hand_norm: the forward and backward of input "
                "set 0 made non-finite values: grad of input x has 2 NaN of 4 elements (first "
                "at [0, 0]: nan).",
                "E*Origin, in the backward: inf made by div of *, 0 at element [0] "
                "(torch.float32): a division by 0, backward (SqrtBackward0) of sqrt at "
                "helpers.py:*",
                "E*: return (x * x).sum(-1).sqrt().sum()",
                "E*Then, in the backward: NaN made by mul of inf, 0 at element [0, 0] "
                "(torch.float32): 0 * inf, backward (MulBackward0) of mul at helpers.py:*",
            ]
        },
    )
    result.assert_outcomes(passed=11, failed=1)
    result.stdout.fnmatch_lines(
        [
            "finite_check Logged: forward and backward finite on 1 input set(s), 3 values "
            "looked at (outputs, gradients, changed buffers); * s. Not seen: *"
        ]
    )


DECISION_TESTS = """
import torch
from helpers import Gate


def test_gate(finite_check):
    torch.manual_seed(0)
    model = Gate()
    with torch.no_grad():
        model.linear.weight.copy_(torch.eye(4))
        model.linear.bias.zero_()
    finite_check(model, torch.randn(3, 4) - 2)
    try:
        finite_check(model, torch.randn(3, 4) + 0.5)
    except AssertionError:
        pass
"""


def test_the_checks_run_counts_for_decisions_and_its_replay_does_not(plugin_pytester):
    """Two checks, one replayed to find its origin: the gate decided twice, not three times."""
    plugin_pytester.makepyfile(helpers=HELPERS)
    result = run_session(plugin_pytester, DECISION_TESTS, "--decisions-source=.")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["helpers.py:*: if h.mean() > 0:", "    branch: True x1, False x1"])
