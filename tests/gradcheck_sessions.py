"""The gradcheck fixture's sessions, which the test_plugin_gradcheck* modules share: the
models and autograd Functions of their ``helpers.py``, and running them in this process."""

from __future__ import annotations

from functools import partial

import sessions
from conftest import DEFAULT_PACKAGE
from sessions import SEEDED

HELPERS = f'''
import torch
from torch import nn
from {DEFAULT_PACKAGE}.models import MeanGatedNet, forward_with_condition
from {DEFAULT_PACKAGE}.testing.gradcheck import (
    BranchBoundary, NonDifferentiablePoint, WrongGradient,
)


{SEEDED}


class LinearFunction(torch.autograd.Function):
    """y = x @ w.T with a hand-written backward; subclasses plant mistakes in it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @classmethod
    def grads(cls, g, x, w):
        return g @ w, g.t() @ x

    @classmethod
    def backward(cls, ctx, g):
        return cls.grads(g, *ctx.saved_tensors)


class ScaledInputGrad(LinearFunction):
    @classmethod
    def grads(cls, g, x, w):
        return 1.05 * (g @ w), g.t() @ x


class TransposedWeight(LinearFunction):
    @classmethod
    def grads(cls, g, x, w):
        return g @ w.t(), g.t() @ x


class WrongWeightGrad(LinearFunction):
    @classmethod
    def grads(cls, g, x, w):
        return g @ w, 0.9 * (g.t() @ x)


class OneWrongWeightElement(LinearFunction):
    @classmethod
    def grads(cls, g, x, w):
        grad_w = g.t() @ x
        grad_w[100, 7] += 0.5
        return g @ w, grad_w


class Linear(nn.Module):
    def __init__(self, function, size=4):
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(torch.randn(size, size))

    def forward(self, x):
        return self.function.apply(x, self.weight)


class Wide(nn.Module):
    """About 85,000 parameters: fast mode by default."""

    def __init__(self, function=LinearFunction):
        super().__init__()
        self.l1 = nn.Linear(64, 256)
        self.l2 = Linear(function, 256)
        self.l3 = nn.Linear(256, 10)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class SquareMissingTerm(torch.autograd.Function):
    """x * w * x whose backward forgets one of the two x factors' terms."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w * x

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * x, g * x * x


class NegatedSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -g * x.cos()


class Cube(torch.autograd.Function):
    """x**3: the backward is right, but it detaches x, so its own derivative is wrong."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x.detach() ** 2


class CorrectCube(Cube):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x**2


class TopOneMixture(nn.Module):
    """Each row goes to the expert with the highest gate score (top-1 routing)."""

    def __init__(self, experts=3, features=4, expert=lambda size: nn.Linear(size, size)):
        super().__init__()
        self.gate = nn.Linear(features, experts)
        self.experts = nn.ModuleList(expert(features) for _ in range(experts))

    def forward(self, x):
        scores = self.gate(x)
        weight, index = scores.softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (index == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
        return out


def mean_gated_at_boundary():
    """A MeanGatedNet whose mean activation is 0 for this input: relu and tanh meet there."""
    model = seeded(lambda: MeanGatedNet(4, 4))
    x = seeded(lambda: torch.randn(3, 4), seed=1)
    with torch.no_grad():
        model.linear.bias -= model.linear(x).mean()
    return model, x.requires_grad_()


def state_of(module):
    return {{
        name: (t.dtype, t.device, t.requires_grad, t.grad, t.detach().clone())
        for name, t in list(module.named_parameters()) + list(module.named_buffers())
    }}


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for name, (dtype, device, requires_grad, grad, value) in before.items():
        dtype2, device2, requires_grad2, grad2, value2 = after[name]
        assert (dtype, device, requires_grad, grad) == (dtype2, device2, requires_grad2, grad2)
        assert torch.equal(value, value2), name
'''

run_session = partial(sessions.run_session, helpers=HELPERS, in_process=True)
check_session = partial(sessions.check_session, helpers=HELPERS, in_process=True)
