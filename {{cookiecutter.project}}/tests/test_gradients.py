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
from {{ cookiecutter.package }}.models import CheckpointedNet, EarlyExitNet, TopKMixture
from {{ cookiecutter.package }}.testing.gradcheck import WrongGradient


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
    "top-k mixture of experts": (lambda: TopKMixture(8, experts=4, k=2), (6, 8)),
    "early exit": (lambda: EarlyExitNet(8, confidence=0.5), (5, 8)),
    "checkpointed block": (lambda: CheckpointedNet(8), (4, 8)),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients(gradcheck, name):
    torch.manual_seed(0)
    factory, shape = MODELS[name]
    model = factory()
    x = torch.randn(shape, requires_grad=True)
    gradcheck(model, x)


@pytest.mark.parametrize("name", MODELS)
def test_model_forward_and_backward_stay_finite(finite_check, name):
    """No NaN or inf in outputs and gradients; a failure would name the op that made it."""
    torch.manual_seed(0)
    factory, shape = MODELS[name]
    finite_check(factory(), torch.randn(shape, requires_grad=True))


def test_wrappers_of_models_check_their_parameters(gradcheck):
    torch.manual_seed(0)
    model = EarlyExitNet(8, confidence=0.5)
    x = torch.randn(5, 8)
    result = gradcheck(lambda x: model(x).softmax(-1), x)
    assert "parameter model.blocks.0.0.weight" in [name for name, _ in result.tensors]
    assert any(w.startswith("Tensor.float()") for w in result.widened)  # float32 made wide


def test_gradient_hook_that_scales_is_found(gradcheck):
    torch.manual_seed(0)
    model = MeanGatedNet(8, 8)
    model.linear.weight.register_hook(lambda grad: grad * 0.5)  # what training would see
    x = torch.randn(4, 8)
    with pytest.raises(WrongGradient, match="gradient hook") as failure:
        gradcheck(model, x)
    assert failure.value.tensor == "parameter linear.weight"


class OneWrongElement(torch.autograd.Function):
    """``x @ weight.T`` whose backward gets one element of the weight's gradient wrong."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight = grad.t() @ x
        grad_weight[10, 20] += 1.4
        return grad @ weight, grad_weight


def test_one_wrong_element_in_a_large_weight_is_found_in_fast_mode(gradcheck):
    torch.manual_seed(0)
    layer = nn.Linear(64, 64, bias=False)
    x = torch.randn(4, 64)
    with pytest.raises(WrongGradient) as failure:
        gradcheck(lambda x: OneWrongElement.apply(x, layer.weight), x)  # 4,096: fast mode
    assert (failure.value.tensor, failure.value.index) == ("parameter layer.weight", (10, 20))
    assert "fast mode" in str(failure.value)


def test_second_order_through_recursion(gradcheck):
    torch.manual_seed(0)
    model = RecursiveNet(3)
    x = torch.randn(2, 4, 3, requires_grad=True)
    gradcheck(model, x, gradgrad=True)


def test_dropout_and_batch_norm_in_training_mode(gradcheck):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.3))
    x = torch.randn(5, 6, requires_grad=True)
    running_mean = model[1].running_mean.clone()
    gradcheck(model, x)
    assert torch.equal(model[1].running_mean, running_mean)  # checked on copies


def test_large_model_switches_to_fast_mode(gradcheck):
    torch.manual_seed(0)
    model = DynamicNet(in_features=64, hidden=128, out_features=8)
    x = torch.randn(8, 64, requires_grad=True)
    result = gradcheck(model, x)
    assert result.fast


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients_on_gpu(gpu, gradcheck, name):
    torch.manual_seed(0)
    factory, shape = MODELS[name]
    model = factory().to(gpu)
    x = torch.randn(shape).to(gpu, requires_grad=True)
    gradcheck(model, x, gradgrad=True)
