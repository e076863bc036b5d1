"""Every example model is bitwise reproducible: forward, backward, every gradient.

``autograd_determinism(model, *inputs, runs=3)`` runs forward and backward three times
from the same parameters, buffers, RNG states and inputs and fails, naming the first
tensor that differs and the op or branch where the runs part, unless all runs agree
bit for bit. The GPU variants run with ``pytest --gpu``.
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
from {{ cookiecutter.package }}.models import CheckpointedNet, EarlyExitNet, TopKMixture

# (model or function, input shape, forward_kwargs), one per kind of dynamic graph.
CASES = {
    "loop length decided by the data": (lambda: DynamicNet(tolerance=0.3), (8, 16), {}),
    "branch per call": (MeanGatedNet, (6, 8), {}),
    "branch per sample": (PerSampleNet, (6, 8), {}),
    "recursion": (RecursiveNet, (4, 5, 8), {}),
    "branch on a tensor value": (lambda: forward_with_condition, (5,), {"threshold": 0.0}),
    "branch on an argument": (lambda: conditional_model, (3,), {"flag": False}),
    "top-k routing": (TopKMixture, (16, 8), {}),
    "early exit": (EarlyExitNet, (6, 8), {}),
    "activation checkpointing": (CheckpointedNet, (4, 8), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_example_models_are_bitwise_reproducible(autograd_determinism, case):
    make, shape, kwargs = CASES[case]
    autograd_determinism(make(), torch.randn(*shape) * 4, forward_kwargs=kwargs, runs=3)


def test_dropout_and_batch_norm_in_training_mode(autograd_determinism):
    # Dropout draws from the global RNG, which the check resets before every run;
    # batch norm updates its running statistics, which are reset and compared too.
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), DynamicNet(32)
    ).train()
    result = autograd_determinism(model, torch.randn(8, 16))
    assert "1.running_mean" in result.buffers
    assert set(result.parameter_grads) == {name for name, _ in model.named_parameters()}


def test_returns_the_reference_outputs_and_gradients(autograd_determinism):
    model = MeanGatedNet()
    x = torch.randn(4, 8, requires_grad=True)
    result = autograd_determinism(model, x)
    torch.testing.assert_close(result.outputs, model(x), rtol=0, atol=0)
    assert result.input_grads["x"].shape == x.shape
    assert x.grad is None  # the check differentiates copies of the inputs


@pytest.mark.parametrize("case", ["loop length decided by the data", "recursion"])
def test_example_models_are_bitwise_reproducible_on_gpu(autograd_determinism, gpu, case):
    make, shape, kwargs = CASES[case]
    model = make().to(gpu)
    autograd_determinism(model, torch.randn(*shape, device=gpu) * 4, forward_kwargs=kwargs, runs=3)
