"""The example models on a GPU: same branches, same values and gradients as on the CPU.

These tests run with ``pytest --gpu`` (``pytest --gpu -n auto``: one xdist worker per
GPU) and are skipped, with the reason, without it. The ``gpu`` fixture is this test
process's device; ``@pytest.mark.gpu(count=2)`` asks for two.
"""

import copy

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


def inputs(*shape: int) -> torch.Tensor:
    """Random inputs from a generator of their own, so the global RNG is left alone."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def assert_same_on_device(model: torch.nn.Module, x: torch.Tensor, device: torch.device):
    """Forward and backward on the CPU and on ``device``: outputs and every gradient agree."""
    on_device = copy.deepcopy(model).to(device)
    x_cpu = x.clone().requires_grad_()
    x_device = x.to(device).requires_grad_()
    out_cpu, out_device = model(x_cpu), on_device(x_device)
    torch.testing.assert_close(out_device.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
    out_cpu.sum().backward()
    out_device.sum().backward()
    torch.testing.assert_close(x_device.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-5)
    for (name, cpu_param), device_param in zip(
        model.named_parameters(), on_device.parameters(), strict=True
    ):
        if cpu_param.grad is None:  # not on the path the data took, on either device
            assert device_param.grad is None, name
            continue
        torch.testing.assert_close(
            device_param.grad.cpu(), cpu_param.grad, rtol=1e-4, atol=1e-5, msg=name
        )


def test_product_rule_values_on_gpu(gpu):
    x = torch.tensor(2.0, device=gpu, requires_grad=True)
    w = torch.tensor(3.0, device=gpu, requires_grad=True)
    (w * x**2).backward()
    assert (x.grad.item(), w.grad.item()) == (12.0, 4.0)


@pytest.mark.parametrize(("flag", "expected"), [(True, [4.0, 6.0]), (False, [12.0, 27.0])])
def test_conditional_model_on_gpu(gpu, flag, expected):
    x = torch.tensor([2.0, 3.0], device=gpu, requires_grad=True)
    conditional_model(x, flag=flag).backward()
    assert x.grad.device == gpu
    assert x.grad.tolist() == expected


@pytest.mark.parametrize(("threshold", "power"), [(0.5, 2), (10.0, 3)])
def test_branch_on_a_gpu_value(gpu, threshold, power):
    # ``x.mean() > threshold`` is decided on the GPU: the host waits for it, then branches.
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=gpu, requires_grad=True)
    forward_with_condition(x, threshold).sum().backward()
    torch.testing.assert_close(x.grad, power * x.detach() ** (power - 1))


@pytest.mark.parametrize("bias", [5.0, -5.0], ids=["relu-branch", "tanh-branch"])
def test_mean_gated_net_same_on_gpu(gpu, bias):
    model = MeanGatedNet(8, 8)
    with torch.no_grad():
        model.linear.bias.fill_(bias)  # far from the branch point on both devices
    assert_same_on_device(model, inputs(4, 8) * 0.1, gpu)


def test_per_sample_net_same_on_gpu(gpu):
    model = PerSampleNet(8)
    with torch.no_grad():
        model.linear.weight.copy_(torch.eye(8))
        model.linear.bias.zero_()
    x = torch.cat([torch.ones(3, 8), -torch.ones(3, 8)]) + 0.1 * inputs(6, 8)
    assert_same_on_device(model, x, gpu)


@pytest.mark.parametrize(("weight", "steps"), [(0.0, 0), (10.0, 3)])
def test_dynamic_net_same_loop_count_on_gpu(gpu, weight, steps):
    model = DynamicNet(in_features=4, hidden=8, out_features=2, max_steps=3, tolerance=0.5)
    with torch.no_grad():
        model.encoder.weight.fill_(weight)
        model.encoder.bias.zero_()
    calls = []
    model.block.register_forward_hook(lambda *_: calls.append(1))
    assert_same_on_device(model, torch.ones(2, 4), gpu)
    assert len(calls) == 2 * steps  # the same number of loop steps on the CPU and the GPU


@pytest.mark.parametrize("steps", [1, 5, 8])
def test_recursive_net_same_on_gpu(gpu, steps):
    assert_same_on_device(RecursiveNet(8), inputs(3, steps, 8), gpu)


@pytest.mark.gpu(count=2)
def test_same_result_on_two_gpus():
    # Skipped under ``pytest -n``: each xdist worker sees one GPU.
    model = RecursiveNet(8)
    x = inputs(3, 5, 8)
    first = copy.deepcopy(model).to("cuda:0")(x.to("cuda:0"))
    second = copy.deepcopy(model).to("cuda:1")(x.to("cuda:1"))
    torch.testing.assert_close(first.cpu(), second.cpu())
