"""Gradients of the example models against finite differences, with the gradcheck fixture.

Each check covers the inputs that require grad and every parameter, in float64, on
a copy: the models and tensors here are left as they are. ``pytest -v`` prints one
line per check saying what was checked and whether in slow (every element) or fast
(random directions) mode.
"""

import pytest
import torch
from torch import nn

from {{ cookiecutter.package }} import (
    DynamicNet,
    MeanGatedNet,
    PerSampleNet,
    RecursiveNet,
    conditional_model,
    forward_with_condition,
)


def seeded(factory, seed=0):
    """``factory()`` under a fixed seed, leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


def test_seed_examples(gradcheck):
    x = torch.tensor(2.0, requires_grad=True)
    w = torch.tensor(3.0, requires_grad=True)
    b = torch.tensor(0.5, requires_grad=True)
    gradcheck(lambda x, w: w * x**2, x, w, gradgrad=True)  # dy/dx = 12, dy/dw = 4
    gradcheck(lambda x: x**2 + 3 * x + 1, x, gradgrad=True)  # 7
    gradcheck(lambda x, w, b: (w * x + b) ** 2, x, torch.tensor(1.0, requires_grad=True), b)


@pytest.mark.parametrize("flag", [True, False])
def test_conditional_model(gradcheck, flag):
    gradcheck(conditional_model, torch.tensor([2.0, 3.0], requires_grad=True), flag, gradgrad=True)


@pytest.mark.parametrize("threshold", [0.5, 10.0], ids=["square-branch", "cube-branch"])
def test_forward_with_condition(gradcheck, threshold):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    gradcheck(forward_with_condition, x, threshold, gradgrad=True)


MODELS = {
    "mean-gated": (lambda: MeanGatedNet(8, 8), (4, 8)),
    "per-sample": (lambda: PerSampleNet(8), (4, 8)),
    "dynamic-loop": (lambda: DynamicNet(in_features=8, hidden=16, out_features=4), (4, 8)),
    "recursive": (lambda: RecursiveNet(4), (2, 5, 4)),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients(gradcheck, name):
    factory, shape = MODELS[name]
    model = seeded(factory)
    x = seeded(lambda: torch.randn(shape), seed=1).requires_grad_()
    gradcheck(model, x)


def test_second_order_through_recursion(gradcheck):
    model = seeded(lambda: RecursiveNet(3))
    x = seeded(lambda: torch.randn(2, 4, 3), seed=1).requires_grad_()
    gradcheck(model, x, gradgrad=True)


def test_dropout_and_batch_norm_in_training_mode(gradcheck):
    model = seeded(
        lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.3))
    )
    x = seeded(lambda: torch.randn(5, 6), seed=1).requires_grad_()
    running_mean = model[1].running_mean.clone()
    gradcheck(model, x)
    assert torch.equal(model[1].running_mean, running_mean)  # checked on copies


def test_large_model_switches_to_fast_mode(gradcheck):
    model = seeded(lambda: DynamicNet(in_features=64, hidden=128, out_features=8))
    x = seeded(lambda: torch.randn(8, 64), seed=1).requires_grad_()
    result = gradcheck(model, x)
    assert result.fast


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients_on_gpu(gpu, gradcheck, name):
    factory, shape = MODELS[name]
    model = seeded(factory).to(gpu)
    x = seeded(lambda: torch.randn(shape), seed=1).to(gpu).requires_grad_()
    gradcheck(model, x, gradgrad=True)
