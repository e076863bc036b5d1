"""The training_check fixture in real pytest sessions: models that learn, and each planted bug.

Every bug has its fixed twin in the passing session: a branch no batch takes against a
batch that takes it, a ``.detach()`` against none, an optimizer built before a layer
was added against one built after, ``sqrt`` of a ReLU against ``sqrt`` of a ReLU plus
an epsilon, a backward with the wrong sign against the right one. A tiny random GPT-2
and BERT from transformers are code nobody here wrote. Each session runs in a fresh
interpreter (``runpytest_subprocess``), as a user's does.
"""

from __future__ import annotations

from functools import partial

import sessions
from conftest import DEFAULT_PACKAGE
from sessions import SEEDED, assert_failures

HELPERS = f'''
import torch
from torch import nn
from {DEFAULT_PACKAGE}.models import MeanGatedNet, PerSampleNet, RoutedRefineNet

cross_entropy = nn.CrossEntropyLoss()


def batch(scale=1.0, rows=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=generator) * scale
    return x, torch.randint(0, 3, (rows,), generator=generator)


{SEEDED}


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


class DetachedEncoder(Encoder):
    def forward(self, x):
        h = torch.tanh(self.encoder(x)).detach()
        return self.head(h)


class SqrtWherePositive(Encoder):
    """torch.where picks sqrt(h) where h > 0, but sqrt's backward sees every h."""

    def forward(self, x):
        h = self.encoder(x)
        return self.head(torch.where(h > 0, torch.sqrt(h), 0.0))


class SqrtOfPositivesOnly(Encoder):
    def forward(self, x):
        h = self.encoder(x)
        return self.head(torch.where(h > 0, torch.sqrt(torch.where(h > 0, h, 1.0)), 0.0))


class LogOfLinear(Encoder):
    def forward(self, x):
        return torch.log(self.head(self.encoder(x)))


class GateTimesZero(Encoder):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 3)

    def forward(self, x):
        return super().forward(x) + 0.0 * self.gate(x)


class Negate(torch.autograd.Function):
    """The identity, with the gradient of its negation: a backward with the wrong sign."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Identity(Negate):
    @staticmethod
    def backward(ctx, grad):
        return grad


class WrongSign(Encoder):
    def forward(self, x):
        return Negate.apply(super().forward(x))


class RightSign(Encoder):
    def forward(self, x):
        return Identity.apply(super().forward(x))


def layer_added_after_the_optimizer():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.append(nn.Linear(8, 3))
    return model, optimizer


def layer_added_before_the_optimizer():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model.append(nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def halves_on_both_sides(model):
    """8 rows: the first 4 far on the side where h.mean() > 0, the last 4 a little on the
    other; the whole batch is on the first side."""
    direction = model.linear.weight.sum(dim=0).sign()
    x = torch.cat([10.0 * direction.expand(4, -1), -2.0 * direction.expand(4, -1)])
    return x, torch.randint(0, 8, (8,), generator=torch.Generator().manual_seed(0))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return seeded(lambda: GPT2LMHeadModel(config))


def tiny_bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )
    return seeded(lambda: BertModel(config))


def tokens():
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
'''

PASSING = """
import functools

import pytest
import torch
from {package}.models import DynamicNet, PerSampleNet, RecursiveNet, RoutedRefineNet
from {package}.testing.training_check import TrainingResult
from helpers import *


@pytest.mark.parametrize("factory, scale", [
    (lambda: RoutedRefineNet(), 3.0),
    (lambda: DynamicNet(in_features=8, out_features=3, tolerance=0.3), 4.0),
    (lambda: PerSampleNet(8), 1.0),
], ids=["routed", "loop", "per-sample"])
def test_example_models_learn(training_check, factory, scale):
    result = training_check(seeded(factory), batch(scale), cross_entropy)
    assert isinstance(result, TrainingResult)
    assert result.final_loss < result.losses[0] and len(result.losses) == 5


def test_the_taken_branch_trains_the_refine_layer(training_check):
    result = training_check(seeded(RoutedRefineNet), batch(3.0), cross_entropy)
    (site,) = result.decisions
    assert site.location.source == "if hard.any():" and site.outcomes == ((True, 5),)


@pytest.mark.parametrize("factory", [Encoder, SqrtOfPositivesOnly, RightSign])
def test_fixed_models_learn(training_check, factory):
    training_check(seeded(factory), batch(), cross_entropy)


def test_an_optimizer_built_after_the_last_layer(training_check):
    model, optimizer = seeded(layer_added_before_the_optimizer)
    training_check(model, batch(), cross_entropy, optimizer=optimizer, steps=3)


def test_per_sample_decisions_accumulate_to_the_batch_gradient(training_check):
    result = training_check(seeded(lambda: PerSampleNet(8)), batch(), cross_entropy,
                            accumulation_steps=4)
    assert result.accumulation_steps == 4


def test_everything_is_put_back(training_check):
    model = seeded(RoutedRefineNet)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(3.0)
    cross_entropy(model(x), y).backward()
    optimizer.step()
    grads = {{n: p.grad.clone() for n, p in model.named_parameters()}}
    weights = {{n: p.detach().clone() for n, p in model.named_parameters()}}
    momentum = {{n: optimizer.state[p]["momentum_buffer"].clone()
                for n, p in model.named_parameters()}}
    rng = torch.get_rng_state()
    training_check(model, (x, y), cross_entropy, optimizer=optimizer)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]) and torch.equal(p.grad, grads[name])
        assert torch.equal(optimizer.state[p]["momentum_buffer"], momentum[name])
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_function_dict_inputs_and_an_optimizer_factory(training_check):
    model = seeded(RecursiveNet)
    head = seeded(lambda: torch.nn.Linear(8, 3), seed=1)
    result = training_check(
        lambda x, *, scale: head(model(x) * scale),
        ({{"x": torch.randn(4, 5, 8)}}, torch.tensor([0, 1, 2, 0])),
        cross_entropy,
        forward_kwargs={{"scale": 2.0}},
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    assert result.parameters == 4 and result.optimizer == "SGD (lr=0.1)"


def test_a_tiny_gpt2(training_check):
    ids = tokens()
    result = training_check(tiny_gpt2(), ({{"input_ids": ids, "labels": ids}}, None),
                            lambda output, _: output.loss)
    assert result.subject == "GPT2LMHeadModel"
"""

FAILING = """
import torch
from {package}.models import MeanGatedNet, RoutedRefineNet
from helpers import *


def test_a_branch_no_batch_takes(training_check):
    training_check(seeded(RoutedRefineNet), batch(0.1), cross_entropy)


def test_a_detach_that_stops_the_backward(training_check):
    training_check(seeded(DetachedEncoder), batch(), cross_entropy)


def test_an_optimizer_built_before_the_last_layer(training_check):
    model, optimizer = seeded(layer_added_after_the_optimizer)
    training_check(model, batch(), cross_entropy, optimizer=optimizer, steps=3)


def test_two_problems_at_once(training_check):
    model = seeded(DetachedEncoder)
    optimizer = torch.optim.Adam(model.encoder.parameters(), lr=0.01)
    training_check(model, batch(), cross_entropy, optimizer=optimizer)


def test_a_param_group_with_lr_zero(training_check):
    model = seeded(Encoder)
    optimizer = torch.optim.SGD([{{"params": model.encoder.parameters(), "lr": 0.0}},
                                 {{"params": model.head.parameters()}}], lr=0.1)
    training_check(model, batch(), cross_entropy, optimizer=optimizer)


def test_a_gate_multiplied_by_zero(training_check):
    training_check(seeded(GateTimesZero), batch(), cross_entropy,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_log_of_a_negative_number(training_check):
    training_check(seeded(LogOfLinear), batch(), lambda out, y: out.mean())


def test_sqrt_under_a_where(training_check):
    training_check(seeded(SqrtWherePositive), batch(), cross_entropy)


def test_a_backward_with_the_wrong_sign(training_check):
    training_check(seeded(WrongSign), batch(), cross_entropy,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.5))


def test_accumulating_a_summed_loss(training_check):
    training_check(seeded(Encoder), batch(), torch.nn.CrossEntropyLoss(reduction="sum"),
                   accumulation_steps=4)


def test_accumulating_a_batch_level_decision(training_check):
    model = seeded(lambda: MeanGatedNet(8, 8))
    training_check(model, halves_on_both_sides(model), cross_entropy, accumulation_steps=2)


def test_a_bert_trained_on_its_hidden_states(training_check):
    training_check(tiny_bert(), ({{"input_ids": tokens()}}, None),
                   lambda output, _: output.last_hidden_state.square().mean())


def test_a_batch_that_is_no_pair(training_check):
    training_check(seeded(Encoder), batch()[0], cross_entropy)


def test_zero_steps(training_check):
    training_check(seeded(Encoder), batch(), cross_entropy, steps=0)


def test_a_forward_keyword_as_an_option(training_check):
    training_check(seeded(Encoder), batch(), cross_entropy, scale=2.0)
"""

# For each failing test: the lines its report must hold, in this order (fnmatch patterns
# in which "[" stands for itself).
EXPECTED_FAILURES = {
    "test_a_branch_no_batch_takes": [
        "E*ParametersWithoutGradient: 2 of 6 parameters of RoutedRefineNet were never given a "
        "gradient in 5 steps, so training never changes them:",
        "E*refine.weight, refine.bias: reached only when `if hard.any():` at *models.py:* is "
        "True, never the case here (False all 5 times in 5 steps): train or test with batches "
        "that take that side too",
    ],
    "test_a_detach_that_stops_the_backward": [
        "E*ParametersWithoutGradient: 2 of 4 parameters of DetachedEncoder were never given a "
        "gradient in 5 steps*",
        "E*encoder.weight, encoder.bias: cut off the graph by .detach() at helpers.py:* "
        "`h = torch.tanh(self.encoder(x)).detach()`*Remove the cut if it should learn*",
    ],
    "test_an_optimizer_built_before_the_last_layer": [
        "E*ParametersNotInOptimizer: the optimizer (Adam (lr=0.01)) does not hold 2 of 4 "
        "trainable parameters of Sequential, so optimizer.step() never changes them:",
        "E*2.weight, 2.bias",
        "E*Build the optimizer from model.parameters() once the model is complete*",
    ],
    "test_two_problems_at_once": [  # the first raised, the others in its message
        "E*ParametersNotInOptimizer: the optimizer (Adam (lr=0.01)) does not hold 2 of 4 "
        "trainable parameters of DetachedEncoder*",
        "E*head.weight, head.bias",
        "E*also:",
        "E*  ParametersWithoutGradient: 2 of 4 parameters of DetachedEncoder were never given "
        "a gradient*",
        "E*      encoder.weight, encoder.bias: cut off the graph by .detach() at *",
    ],
    "test_a_param_group_with_lr_zero": [
        "E*ParametersNotUpdated: 2 of 4 parameters of Encoder got a gradient but did not "
        "change in 5 steps of SGD (lr=0, 0.1):",
        "E*encoder.weight, encoder.bias: its param group has lr=0",
    ],
    "test_a_gate_multiplied_by_zero": [
        "E*ParametersNotUpdated: 2 of 6 parameters of GateTimesZero got a gradient but did not "
        "change*",
        "E*gate.weight, gate.bias: its gradient was zero in every step*",
    ],
    "test_log_of_a_negative_number": [
        "E*NonFiniteValues: LogOfLinear: the loss is nan at step 1 of 5",
        "E*origin (the first operation that turned finite values into NaN or inf): NaN made by "
        "log of * at element [*] (torch.float32): the logarithm of a negative number, forward "
        "in the model (LogOfLinear) at helpers.py:*",
        "E*return torch.log(self.head(self.encoder(x)))",
    ],
    "test_sqrt_under_a_where": [
        "E*NonFiniteValues: SqrtWherePositive: the gradient of encoder.weight has * NaN of 64 "
        "elements (first at [*]: nan) at step 1 of 5; the loss was finite (*)",
        "E*origin (the first operation that turned finite values into NaN or inf): NaN made by "
        "sqrt of * (torch.float32): the square root of a negative number, forward in the model "
        "(SqrtWherePositive) at helpers.py:*",
        "E*return self.head(torch.where(h > 0, torch.sqrt(h), 0.0))",
        "E*The forward made it and the loss did not carry it (a value torch.where or a mask "
        "discarded): its gradient is NaN all the same.",
    ],
    "test_a_backward_with_the_wrong_sign": [
        "E*LossNotDecreasing: the loss of WrongSign did not decrease in 5 steps of SGD (lr=0.5) "
        "on one repeated batch: * at step 1, * after the last step (each step's loss: *). "
        "The steps went uphill*gradients that point the wrong way*",
    ],
    "test_accumulating_a_summed_loss": [
        "E*AccumulationMismatch: accumulating the gradients of micro-batches (each loss divided "
        "by their number) does not give the gradient of the whole batch:",
        "E*grad of encoder.weight: * of 64 elements differ beyond rtol=0.0001, atol=1e-05 for "
        "torch.float32*",
        "E*cause: the accumulated gradient is 0.25 times the whole batch's: with the loss summed "
        "over the batch (reduction='sum'), divide it by the batch size*",
    ],
    "test_accumulating_a_batch_level_decision": [
        "E*AccumulationMismatch: *",
        "E*cause: micro-batch 2 decided False at *models.py:* `if h.mean() > 0:` where the whole "
        "batch decided True: the forward decides on the whole batch at once*",
    ],
    "test_a_bert_trained_on_its_hidden_states": [
        "E*ParametersWithoutGradient: 2 of * parameters of BertModel were never given a gradient*",
        "E*pooler.dense.weight, pooler.dense.bias: used at *modeling_bert.py:*, but the result "
        "does not depend on it through autograd*",
    ],
    "test_a_batch_that_is_no_pair": [
        "E*TypeError: training_check: batch must be a pair (inputs, targets)*got Tensor",
    ],
    "test_zero_steps": [
        "E*ValueError: training_check: steps=0 is not allowed: expected an int >= 1",
    ],
    "test_a_forward_keyword_as_an_option": [
        "E*TypeError: training_check() got unknown keyword argument(s) 'scale': its options "
        "are optimizer, steps, *; keyword arguments of the forward go in "
        "forward_kwargs={'scale': ...}",
    ],
}


run_session = partial(sessions.run_session, helpers=HELPERS)


def test_models_that_learn_pass_and_report(plugin_pytester):
    result = run_session(plugin_pytester, PASSING, "-v")
    result.assert_outcomes(passed=12)
    result.stdout.fnmatch_lines(
        [
            "training_check RoutedRefineNet: 5 steps of Adam (lr=0.001) on one repeated batch: "
            "loss * -> * (-*%); all 6 parameters got a gradient and changed",
            "  *models.py:* `if hard.any():`: True x5",
            "training_check PerSampleNet: *; 4 accumulated micro-batches give the whole batch's "
            "gradient",
        ],
        consecutive=False,
    )


def test_each_planted_bug_fails_with_its_cause(plugin_pytester):
    result = run_session(plugin_pytester, FAILING)
    result.assert_outcomes(failed=len(EXPECTED_FAILURES))
    assert_failures(result, EXPECTED_FAILURES)
