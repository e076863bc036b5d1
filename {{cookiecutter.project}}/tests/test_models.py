"""The example models against the worked values of the seed documents, branch by branch."""

import pytest
import torch

from {{ cookiecutter.package }} import (
    DynamicNet,
    MeanGatedNet,
    PerSampleNet,
    RecursiveNet,
    conditional_model,
    forward_with_condition,
)
from {{ cookiecutter.package }}.models import EarlyExitNet


def test_product_rule_values():
    x = torch.tensor(2.0, requires_grad=True)
    w = torch.tensor(3.0, requires_grad=True)
    (w * x**2).backward()
    assert x.grad.item() == 12.0
    assert w.grad.item() == 4.0


def test_polynomial_gradient():
    x = torch.tensor(2.0, requires_grad=True)
    (x**2 + 3 * x + 1).backward()
    assert x.grad.item() == 7.0


def test_chain_rule_values():
    x = torch.tensor(2.0, requires_grad=True)
    w = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(0.5, requires_grad=True)
    ((w * x + b) ** 2).backward()
    assert (x.grad.item(), w.grad.item(), b.grad.item()) == (5.0, 10.0, 5.0)


@pytest.mark.parametrize(("flag", "expected"), [(True, [4.0, 6.0]), (False, [12.0, 27.0])])
def test_conditional_model_differentiates_the_branch_taken(flag, expected):
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    conditional_model(x, flag=flag).backward()
    assert x.grad.tolist() == expected


@pytest.mark.parametrize(
    ("threshold", "power"), [(0.5, 2), (10.0, 3)], ids=["square-branch", "cube-branch"]
)
def test_forward_with_condition_takes_branch_by_mean(threshold, power):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    forward_with_condition(x, threshold).sum().backward()
    expected = power * x.detach() ** (power - 1)
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize(
    ("bias", "activation", "slope"),
    [(0.5, torch.relu, 1.0), (-0.5, torch.tanh, 1 - torch.tanh(torch.tensor(-0.5)).item() ** 2)],
    ids=["relu-branch", "tanh-branch"],
)
def test_mean_gated_net_picks_activation_by_sign(bias, activation, slope):
    model = MeanGatedNet(4, 4)
    with torch.no_grad():
        model.linear.weight.zero_()
        model.linear.bias.fill_(bias)
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    torch.testing.assert_close(out, activation(torch.full((3, 4), bias)))
    out.sum().backward()
    # Each of the 3 rows contributes the slope of the branch taken to every bias.
    torch.testing.assert_close(model.linear.bias.grad, torch.full((4,), 3 * slope))


def test_per_sample_net_branches_per_row_and_keeps_input_intact():
    model = PerSampleNet(2)
    with torch.no_grad():
        model.linear.weight.copy_(torch.eye(2))
        model.linear.bias.zero_()
    x = torch.tensor([[1.0, 2.0], [-1.0, -2.0]], requires_grad=True)
    before = x.detach().clone()
    out = model(x)
    torch.testing.assert_close(out[0], torch.relu(before[0]))
    torch.testing.assert_close(out[1], torch.tanh(before[1]))
    out.sum().backward()
    torch.testing.assert_close(x.grad[0], torch.ones(2))
    torch.testing.assert_close(x.grad[1], 1 - torch.tanh(before[1]) ** 2)
    assert torch.equal(x.detach(), before)


def test_dynamic_net_loop_count_depends_on_data():
    torch.manual_seed(0)  # the block's random weights decide whether activations stay high
    model = DynamicNet(in_features=4, hidden=4, out_features=2, max_steps=3, tolerance=0.5)
    calls = []
    model.block.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model.encoder.bias.zero_()
    model(torch.zeros(2, 4)).sum().backward()  # tanh(0) = 0 is already below the tolerance
    assert len(calls) == 0
    assert model.block[0].weight.grad is None  # the block was not in this graph
    with torch.no_grad():
        model.encoder.weight.fill_(10.0)
    out = model(torch.ones(2, 4))  # saturated activations never drop below it
    assert len(calls) == 3
    out.sum().backward()
    assert model.block[0].weight.grad is not None


@pytest.mark.parametrize(("steps", "merges"), [(1, 0), (2, 1), (5, 4), (8, 7)])
def test_recursive_net_merges_steps_minus_one_times(steps, merges):
    model = RecursiveNet(3)
    calls = []
    model.merge.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, steps, 3, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 3)
    assert len(calls) == merges
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_recursive_net_rejects_empty_sequence():
    with pytest.raises(ValueError, match="non-empty"):
        RecursiveNet(3)(torch.randn(2, 0, 3))


@pytest.mark.parametrize(
    ("confidence", "depth"), [(0.0, 1), (1.0, 3)], ids=["exits-after-one-block", "goes-through"]
)
def test_early_exit_depth_follows_the_confidence(confidence, depth):
    torch.manual_seed(0)
    model = EarlyExitNet(8, blocks=3, confidence=confidence)
    x = torch.randn(4, 8)
    h = x
    for block in model.blocks[:depth]:
        h = block(h)
    assert torch.equal(model(x), model.exits[depth - 1](h))
