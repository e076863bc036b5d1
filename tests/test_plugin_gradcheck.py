"""The gradcheck fixture in real pytest sessions: what must pass, what must fail and how it says so.

The sessions run in this process (torch is imported here first, so they share it),
each with many tests, to keep the template's test time down.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import PLUGIN_MODULE
from gradcheck_sessions import run_session
from sessions import assert_failures, failure_reports

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PASSING = """
import pytest
import torch
from torch import nn
from {package} import (
    DynamicNet, MeanGatedNet, PerSampleNet, RecursiveNet, conditional_model,
    forward_with_condition,
)
from helpers import *


def test_seed_examples(gradcheck):
    x, w = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    gradcheck(lambda x, w: w * x**2, x, w, gradgrad=True)
    gradcheck(lambda x: x**2 + 3 * x + 1, x)
    b = torch.tensor(0.5, requires_grad=True)
    gradcheck(lambda x, w, b: (w * x + b) ** 2, x, torch.tensor(1.0, requires_grad=True), b)
    for flag in (True, False):
        gradcheck(conditional_model, torch.tensor([2.0, 3.0], requires_grad=True), flag)


@pytest.mark.parametrize("factory, shape", [
    (lambda: MeanGatedNet(8, 8), (4, 8)),
    (lambda: PerSampleNet(8), (4, 8)),
    (lambda: DynamicNet(in_features=8, hidden=8, out_features=3), (4, 8)),
    (lambda: RecursiveNet(3), (2, 5, 3)),
], ids=["branch", "per-sample-branches", "data-dependent-loop", "recursion"])
def test_dynamic_models(gradcheck, factory, shape):
    model = seeded(factory)
    x = seeded(lambda: torch.randn(shape), seed=1).requires_grad_()
    before, x_before = state_of(model), x.detach().clone()
    result = gradcheck(model, x, gradgrad=True)
    assert result.orders == (1, 2) and not result.fast
    assert_same_state(before, state_of(model))
    assert x.dtype == torch.float32 and x.requires_grad and x.grad is None
    assert torch.equal(x.detach(), x_before)


def test_dropout_and_batch_norm_training_mode(gradcheck):
    model = seeded(lambda: nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 2)
    ))
    x = seeded(lambda: torch.randn(4, 5), seed=1).requires_grad_()
    before, rng = state_of(model), torch.get_rng_state()
    gradcheck(model, x)
    assert_same_state(before, state_of(model))
    assert model.training and torch.equal(torch.get_rng_state(), rng)


def test_correct_custom_function_first_and_second_order(gradcheck):
    x = seeded(lambda: torch.randn(3, 2), seed=1).requires_grad_()
    gradcheck(CorrectCube.apply, x, gradgrad=True)
    gradcheck(Linear(LinearFunction), x.detach()[:, :1].expand(3, 4).clone().requires_grad_())


def test_dict_and_nested_outputs_and_kwargs(gradcheck):
    def heads(x, *, scale):
        return {{"sum": (scale * x).sum(), "parts": [x.sin(), (x.cos(), "label", 3)]}}

    x = seeded(lambda: torch.randn(3), seed=1).requires_grad_()
    gradcheck(heads, x, forward_kwargs={{"scale": torch.tensor(2.0, requires_grad=True)}},
              gradgrad=True)


def test_complex_inputs(gradcheck):
    z = seeded(lambda: torch.randn(3, dtype=torch.complex64), seed=1).requires_grad_()
    gradcheck(lambda z: (z * z.conj() + z**2).real, z)


def test_large_model_fast_mode(gradcheck):
    model = seeded(Wide)
    x = seeded(lambda: torch.randn(8, 64), seed=1).requires_grad_()
    result = gradcheck(model, x, gradgrad=True)
    assert result.fast and result.elements > 80_000


def test_parameter_error_not_seen_by_inputs_only_check(gradcheck):
    gradcheck(seeded(lambda: Linear(WrongWeightGrad)), torch.randn(3, 4, requires_grad=True),
              params=False)


def test_wrong_second_order_not_seen_by_first_order_check(gradcheck):
    gradcheck(Cube.apply, seeded(lambda: torch.randn(4), seed=1).requires_grad_())


def test_boundary_avoided_on_request(gradcheck):
    model, x = mean_gated_at_boundary()
    result = gradcheck(model, x, avoid_boundaries=True)
    assert result.moved >= 1


def test_model_unchanged_after_a_failure(gradcheck):
    model = seeded(lambda: Linear(WrongWeightGrad))
    x = torch.randn(3, 4, requires_grad=True)
    before = state_of(model)
    with pytest.raises(WrongGradient):
        gradcheck(model, x)
    assert_same_state(before, state_of(model))
    assert x.grad is None
"""

FAILING = """
import torch
from {package} import DynamicNet, forward_with_condition
from helpers import *


def x34():
    return seeded(lambda: torch.randn(3, 4), seed=1).requires_grad_()


def test_backward_off_by_small_factor(gradcheck):
    gradcheck(seeded(lambda: Linear(ScaledInputGrad)), x34())


def test_backward_missing_a_term(gradcheck):
    gradcheck(SquareMissingTerm.apply, x34(), torch.randn(3, 4, requires_grad=True))


def test_backward_wrong_sign(gradcheck):
    gradcheck(NegatedSin.apply, x34())


def test_backward_transposed_weight(gradcheck):
    gradcheck(seeded(lambda: Linear(TransposedWeight)), x34())


def test_parameter_only_error(gradcheck):
    gradcheck(seeded(lambda: Linear(WrongWeightGrad)), x34())


def test_wrong_second_order(gradcheck):
    gradcheck(Cube.apply, seeded(lambda: torch.randn(4), seed=1).requires_grad_(), gradgrad=True)


def test_fast_mode_names_the_element(gradcheck):
    x = seeded(lambda: torch.randn(8, 64), seed=1).requires_grad_()
    gradcheck(seeded(lambda: Wide(OneWrongWeightElement)), x)


def test_branch_boundary(gradcheck):
    gradcheck(*mean_gated_at_boundary())


def test_branch_boundary_of_a_function(gradcheck):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    gradcheck(forward_with_condition, x, 2.5)


def test_loop_boundary_in_fast_mode(gradcheck):
    model = seeded(lambda: DynamicNet(in_features=8, hidden=16, out_features=4))
    x = seeded(lambda: torch.randn(4, 8), seed=1)
    with torch.no_grad():  # the loop's stopping test sits exactly on its threshold
        model.tolerance = float(torch.tanh(model.encoder(x)).abs().mean())
    gradcheck(model, x.requires_grad_(), fast=True)


def test_python_number_in_the_forward(gradcheck):
    gradcheck(lambda x: x * x.norm().item(), x34())


def test_detached_output(gradcheck):
    gradcheck(lambda x: 2 * x.detach(), x34())


def test_kink(gradcheck):
    gradcheck(torch.relu, torch.tensor([1.0, 0.0, -1.0], requires_grad=True))


def test_nothing_to_check(gradcheck):
    gradcheck(seeded(lambda: Linear(LinearFunction)), torch.randn(3, 4), params=False)


def test_integer_input(gradcheck):
    gradcheck(lambda i: i.double() * 2, torch.arange(3))


def test_no_floating_point_output(gradcheck):
    gradcheck(lambda x: x.argmax(), torch.randn(3, requires_grad=True))


def test_bad_option(gradcheck):
    gradcheck(torch.sin, torch.randn(3, requires_grad=True), eps=0)
"""

# For each failing test: the lines its failure report must hold, in this order
# (fnmatch patterns in which "[" stands for itself).
EXPECTED_FAILURES = {
    "test_backward_off_by_small_factor": [
        "E**WrongGradient: wrong first-order gradient of Linear: the error enters in the custom "
        "autograd Function ScaledInputGrad (its backward at helpers.py:*), applied at "
        "helpers.py:* in the model (Linear)",
        "E*on its own, at the inputs it got there: d output[*] / d input x[*]: numerical *, "
        "analytical *",
        "E*it reaches input x[*",
        "E*d output[*] / d input x[*]: numerical *, analytical *",
        "E*12 of 12 elements of input x are wrong; in all of them the analytical gradient"
        " is 1.05 times the numerical one",
        "E*checked Linear (float64, eps=1e-06, atol=* from the rounding of outputs up to *, "
        "rtol=0.0001), slow mode (*",
    ],
    "test_backward_missing_a_term": [
        "E**WrongGradient: wrong first-order gradient of SquareMissingTerm.apply: the error "
        "enters in the custom autograd Function SquareMissingTerm (its backward at helpers.py:*)",
        "E*it reaches input inputs[0][*",
        "*the analytical gradient is 0.5 times the numerical one",
    ],
    "test_backward_wrong_sign": ["*WrongGradient*", "*the analytical gradient has the wrong sign*"],
    "test_backward_transposed_weight": [
        "E**WrongGradient: wrong first-order gradient of Linear: the error enters in the custom "
        "autograd Function TransposedWeight (its backward at helpers.py:*)*",
        "E*it reaches input x[*",
        "E*d output[*] / d input x[*]: numerical *, analytical *",
    ],
    "test_parameter_only_error": [
        "E**WrongGradient: wrong first-order gradient of Linear: the error enters in the custom "
        "autograd Function WrongWeightGrad *",
        "E*on its own, at the inputs it got there: d output[*] / d input w[*]: numerical *",
        "E*it reaches parameter weight[*",
        "*in all of them the analytical gradient is 0.9 times the numerical one",
    ],
    "test_wrong_second_order": [
        "E**WrongGradient: wrong second-order gradient of Cube.apply with respect to input "
        "inputs[0][*",
        "E*d (gradient of input inputs[0][*]) / d input inputs[0][*]: numerical *, analytical 0 *",
        "E*second order: *",
    ],
    "test_fast_mode_names_the_element": [
        "E**WrongGradient: wrong first-order gradient of Wide: the error enters in the custom "
        "autograd Function OneWrongWeightElement (its backward at helpers.py:*), applied at "
        "helpers.py:* in l2 (Linear)",
        "E*on its own, at the inputs it got there: d * / d input w[100, 7]: numerical *",
        "E*it reaches parameter l2.weight[100, 7]:",
        "E*d output[*] / d parameter l2.weight[100, 7]: numerical *, analytical 0.5 *",
        "E*narrowed down in * s by checking parts on their own (1 autograd Function call); the "
        "diagnosis made * evaluations, *x the * of the check",
        "E*checked Wide (float64, *), fast mode (85,258 elements > FAST_MODE_ABOVE=2,048*"
        "; the failing tensor was then rechecked element by element",
    ],
    "test_branch_boundary": [
        "E**BranchBoundary: cannot check the gradient of MeanGatedNet here: the point is within"
        " eps of a branch boundary at decision #1 (*models.py:*): moving * by *eps sends that "
        "decision the other way (an if, a comparison)",
        "E*at the point: decision #1: Tensor.__bool__ -> * at *models.py:*",
        "E*with * eps (1e-06): decision #1: Tensor.__bool__ -> * at *models.py:*",
        "*this is not a wrong gradient",
        "*avoid_boundaries=True*",
    ],
    "test_branch_boundary_of_a_function": [
        "E**BranchBoundary: cannot check the gradient of forward_with_condition here: the "
        "point is within eps of a branch boundary at decision #1 (*models.py:*): moving input "
        "x[0, 0] by +eps sends that decision the other way*",
        "E*at the point: decision #1: Tensor.__bool__ -> False at *",
        "E*with input x[0, 0] + eps (1e-06): decision #1: Tensor.__bool__ -> True at *",
    ],
    "test_loop_boundary_in_fast_mode": [
        "E*BranchBoundary: cannot check the gradient of DynamicNet here: the point is within "
        "eps of a branch boundary at decision #1 (*models.py:*): moving parameter encoder.* by "
        "*eps *",
        "E*checked DynamicNet (float64, *), fast mode (fast=True: *; the failing tensor was then"
        " rechecked element by element",
    ],
    "test_python_number_in_the_forward": [
        "E*WrongGradient: wrong first-order gradient of test_python_number_in_the_forward.<lambda>"
        " with respect to input x[*",
        "*the analytical gradient is 0 there: the backward misses this dependence*",
        "E*note: Tensor.item at test_session.py:* (decision #1) returned * at the point and * "
        "with this element moved: autograd does not see through Python numbers*",
    ],
    "test_detached_output": [
        "E*GradcheckFailure: wrong first-order gradient of test_detached_output.<lambda>: autograd"
        " connects none of its floating-point outputs (output) to the checked tensors*",
    ],
    "test_kink": [
        "E**NonDifferentiablePoint: cannot check the gradient of relu at input inputs[0][1]: "
        "the function is not differentiable there *",
        "E*d output[1] / d input inputs[0][1]: from the left 0, from the right 1, central 0.5; "
        "analytical 0 (the left-hand derivative)",
    ],
    "test_nothing_to_check": [
        "E*ValueError: gradcheck: nothing to check: no input requires grad and params=False",
    ],
    "test_integer_input": [
        "E*ValueError: gradcheck: nothing to check: *",
        "E*integer tensors have no gradient: input i (torch.int64); *",
    ],
    "test_no_floating_point_output": [
        "E*TypeError: gradcheck: test_no_floating_point_output.<lambda> returned a torch.int64 "
        "tensor, which holds no floating-point tensor*",
    ],
    "test_bad_option": ["E*ValueError: gradcheck: eps=0 is not allowed: expected a number > 0"],
}


def test_correct_models_pass_and_report_their_mode(plugin_pytester):
    result = run_session(plugin_pytester, PASSING, "-v")
    result.assert_outcomes(passed=14)
    result.stdout.fnmatch_lines(
        [
            "gradcheck DynamicNet: first and second order passed in * s, slow mode (* elements"
            " <= FAST_MODE_ABOVE=2,048: every element), 7 tensor(s) (input x, parameter "
            "encoder.weight, *; sensitivity: a relative error of 0.01% caught in 5 of 7 tensors; "
            "gradient 0 at the point in parameter block.0.weight, parameter block.0.bias: an "
            "error above atol caught there (float64, eps=1e-06, atol=* from the rounding of "
            "outputs up to *, rtol=0.0001)",
            "gradcheck Wide: first and second order passed in * s, fast mode (85,258 elements > "
            "FAST_MODE_ABOVE=2,048: one random direction per tensor, screened for single wrong "
            "elements; fast=False checks every element), 6 tensor(s) *; sensitivity: a relative "
            "error of 0.0*% caught in every tensor (float64, *)",
            "gradcheck MeanGatedNet: first order passed in *, at a point moved * off a boundary; "
            "sensitivity: *",
        ],
        consecutive=False,
    )


def test_wrong_gradients_and_misuse_fail_with_their_cause(plugin_pytester):
    result = run_session(plugin_pytester, FAILING)
    result.assert_outcomes(failed=len(EXPECTED_FAILURES))
    for name, report in assert_failures(result, EXPECTED_FAILURES).items():
        if (
            "Boundary" in EXPECTED_FAILURES[name][0]
            or "NonDifferentiable" in EXPECTED_FAILURES[name][0]
        ):
            report.no_fnmatch_line("*wrong*-order gradient*")


CALLING_CONVENTION = """
import functools

import pytest
import torch
from torch import nn
from helpers import *


def normalized(x, eps=1e-5):  # a forward parameter named like the fixture's option
    assert eps == 0.1  # the forward's eps, not the finite-difference step
    return x / (x.norm() + eps)


def test_forward_kwargs_reach_the_forward(gradcheck):
    result = gradcheck(normalized, torch.randn(5, requires_grad=True),
                       forward_kwargs={{"eps": 0.1}}, eps=1e-6)
    assert [name for name, _ in result.tensors] == ["input x"]


def test_modules_behind_wrappers_are_checked(gradcheck):
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    before = state_of(net)
    names = {{
        "lambda": [n for n, _ in gradcheck(lambda x: net(x), x).tensors],
        "method": [n for n, _ in gradcheck(net.forward, x).tensors],
        "partial": [n for n, _ in gradcheck(functools.partial(nn.Sequential.forward, net), x)
                    .tensors],
    }}
    assert names["lambda"][0] == "parameter net.0.weight" and len(names["lambda"]) == 4
    assert names["method"][0] == "parameter 0.weight"
    assert len(names["partial"]) == 4
    assert_same_state(before, state_of(net))


def test_unknown_keyword(gradcheck):
    gradcheck(normalized, torch.randn(5, requires_grad=True), eps=1e-6, scale=0.1)


def test_meta_model(gradcheck):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    gradcheck(model, torch.randn(2, 4))


def test_fake_input(gradcheck):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(2, 4, requires_grad=True)
    gradcheck(torch.sin, x)


def test_wrong_parameter_gradient_behind_a_lambda(gradcheck):
    model = seeded(lambda: Linear(WrongWeightGrad))
    gradcheck(lambda x: model(x), torch.randn(3, 4))
"""

EXPECTED_CONVENTION_FAILURES = {
    "test_unknown_keyword": [
        "E*TypeError: gradcheck() got unknown keyword argument(s) 'scale': its options are "
        "params, gradgrad, fast, eps, atol, rtol, avoid_boundaries, branches; keyword arguments "
        "of the forward go in forward_kwargs={'scale': ...}",
    ],
    "test_meta_model": [
        "E*ValueError: gradcheck: parameter weight is on the meta device: it has a shape and a "
        "dtype but no values*",
    ],
    "test_fake_input": [
        "E*ValueError: gradcheck: input inputs[0] is a FakeTensor (device cpu): *",
    ],
    "test_wrong_parameter_gradient_behind_a_lambda": [
        "E*WrongGradient: wrong first-order gradient of "
        "test_wrong_parameter_gradient_behind_a_lambda.<lambda>: the error enters in the custom "
        "autograd Function WrongWeightGrad (its backward at helpers.py:*), applied at "
        "helpers.py:* in model (Linear)",
        "E*it reaches parameter model.weight[*",
    ],
}


def test_calling_convention_and_wrapped_modules(plugin_pytester):
    result = run_session(plugin_pytester, CALLING_CONVENTION)
    result.assert_outcomes(passed=2, failed=len(EXPECTED_CONVENTION_FAILURES))
    assert_failures(result, EXPECTED_CONVENTION_FAILURES)


HABITS = """
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from helpers import *


class Recurrent(nn.Module):
    \"\"\"float32 habits: a state made with the default dtype, softmax in float32, casts.\"\"\"

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 4)
        for step in x.unbind(1):
            h = self.cell(step, h)
        logits = self.head(h)
        probabilities = torch.softmax(logits.float(), dim=-1).to(torch.float32)  # LINE-CAST
        position = torch.arange(4, dtype=torch.float) / 4
        return probabilities.half().float() + position

    def encode(self, x):
        return self.head(torch.tanh(x))


def test_float32_habits_inside_forward(gradcheck):
    model = seeded(Recurrent)
    x = seeded(lambda: torch.randn(2, 3, 3), seed=1)
    before = state_of(model)
    result = gradcheck(model, x.requires_grad_())
    assert any(w.startswith("Tensor.float() at test_session.py:") for w in result.widened)
    assert any("torch.arange(dtype=torch.float32)" in w for w in result.widened)
    assert "computed in float64 where the forward asks for less" in str(result)
    assert_same_state(before, state_of(model))


def test_complex64_inside_forward(gradcheck):
    layer = seeded(lambda: nn.Linear(3, 3))

    def spectrum(x):
        z = torch.zeros(3, dtype=torch.cfloat) + layer(x).to(torch.complex64)
        return (z * z).real

    result = gradcheck(spectrum, torch.randn(2, 3, requires_grad=True))
    assert any("torch.complex64" in w for w in result.widened)


def test_wrappers_of_modules(gradcheck):
    model = seeded(Recurrent)
    x = torch.randn(2, 4)
    experts = [seeded(lambda: nn.Linear(4, 4), seed=s) for s in range(2)]
    scale = torch.rand(4)  # a float32 constant in a closure

    def mixture(x, gate=model.head):
        return sum(e(x) for e in experts) * scale + gate(x)

    checked = {{
        "method": gradcheck(model.encode, x),
        "partial": gradcheck(functools.partial(Recurrent.encode, model), x),
        "closure and default": gradcheck(mixture, x),
    }}
    names = [n for n, _ in checked["closure and default"].tensors]
    assert names == ["parameter experts[0].weight", "parameter experts[0].bias",
                     "parameter experts[1].weight", "parameter experts[1].bias",
                     "parameter gate.weight", "parameter gate.bias"]
    assert "parameter head.weight" in [n for n, _ in checked["method"].tensors]
    assert any("a torch.float32 tensor made outside the check" in w
               for w in checked["closure and default"].widened)


def test_vmap_inside_forward(gradcheck):
    layer = seeded(lambda: nn.Linear(3, 3))
    result = gradcheck(lambda x: torch.func.vmap(lambda row: layer(row).sin())(x),
                       torch.randn(2, 3))
    assert [n for n, _ in result.tensors] == ["parameter layer.weight", "parameter layer.bias"]


def test_non_reentrant_checkpoint(gradcheck):
    model = seeded(Recurrent)
    block = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.2)))

    def forward(x):
        h = checkpoint(lambda h: block(h).float() + torch.ones(4), model.head(x),
                       use_reentrant=False)
        return model.encode(h)

    gradcheck(forward, torch.randn(3, 4, requires_grad=True))


def test_weight_and_spectral_norm(gradcheck):
    model = seeded(lambda: nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(3, 4)),
        nn.Tanh(),
        nn.utils.parametrizations.spectral_norm(nn.Linear(4, 2)),
    ))
    before = state_of(model)
    gradcheck(model, torch.randn(2, 3))
    assert_same_state(before, state_of(model))


def test_hooks_that_keep_the_gradient(gradcheck):
    model = seeded(lambda: nn.Linear(4, 3))
    model.weight.register_hook(lambda g: g.clone())
    model.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    gradcheck(model, torch.randn(2, 4, requires_grad=True))
    assert len(model.weight._backward_hooks) == 1 and model.weight.grad is None


def test_state_restored_after_a_failure_behind_a_lambda(gradcheck):
    model = seeded(lambda: Linear(WrongWeightGrad))
    model.weight.register_hook(lambda g: g)
    before, hooks = state_of(model), dict(model.weight._backward_hooks)
    with pytest.raises(WrongGradient):
        gradcheck(lambda x: model(x), torch.randn(3, 4))
    assert_same_state(before, state_of(model))
    assert dict(model.weight._backward_hooks) == hooks


def test_hook_scaling_a_parameter_gradient(gradcheck):
    layer = seeded(lambda: nn.Linear(4, 3))
    layer.weight.register_hook(lambda g: g * 0.5)  # LINE-HOOK
    gradcheck(layer, torch.randn(2, 4))


def test_post_accumulate_hook_scaling_the_gradient(gradcheck):
    layer = seeded(lambda: nn.Linear(4, 3))
    layer.bias.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(2))
    gradcheck(layer, torch.randn(2, 4))


def test_module_backward_hook_scaling_the_input_gradient(gradcheck):
    layer = seeded(lambda: nn.Linear(4, 3))
    layer.register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0] * 3,))
    gradcheck(layer, torch.randn(2, 4, requires_grad=True), params=False)


def test_reentrant_checkpoint(gradcheck):
    layer = seeded(lambda: nn.Linear(4, 4))
    gradcheck(lambda x: checkpoint(layer, x, use_reentrant=True),
              torch.randn(2, 4, requires_grad=True))


def test_bits_of_a_float_tensor(gradcheck):
    gradcheck(lambda x: x.view(torch.int32).float() * x, torch.randn(4, requires_grad=True))
"""

EXPECTED_HABIT_FAILURES = {
    "test_hook_scaling_a_parameter_gradient": [
        "E*WrongGradient: wrong first-order gradient of Linear: the error enters in the gradient "
        "hook test_hook_scaling_a_parameter_gradient.<lambda> (test_session.py:*) of parameter "
        "weight",
        "E*it reaches parameter weight[*",
        "E*in all of them the analytical gradient is 0.5 times the numerical one",
        "E*parameter weight has gradient hook(s) test_hook_scaling_a_parameter_gradient.<lambda> "
        "(test_session.py:*): the gradient training sees goes through them*",
    ],
    "test_post_accumulate_hook_scaling_the_gradient": [
        "E*WrongGradient: wrong first-order gradient of Linear: the error enters in the gradient "
        "hook * (post-accumulate) of parameter bias",
        "E*it reaches parameter bias[*",
        "E*in all of them the analytical gradient is 2 times the numerical one",
        "E*parameter bias has gradient hook(s) * (post-accumulate)*",
    ],
    "test_module_backward_hook_scaling_the_input_gradient": [
        "E*WrongGradient: wrong first-order gradient of Linear with respect to input input[*",
        "E*in all of them the analytical gradient is 3 times the numerical one",
        "E*module backward hooks are part of the checked gradient too: the model: *",
    ],
    "test_reentrant_checkpoint": [
        "E*ValueError: torch.utils.checkpoint with use_reentrant=True: torch's reentrant "
        "checkpoint supports only loss.backward() without inputs=, not torch.autograd.grad*"
        "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)*",
    ],
    "test_bits_of_a_float_tensor": [
        "E*CannotStayFloat64: the forward reinterprets the bits of a floating-point tensor with "
        "Tensor.view(torch.int32) at test_session.py:*",
    ],
}


def test_float32_habits_wrappers_checkpoints_and_hooks(plugin_pytester):
    result = run_session(plugin_pytester, HABITS)
    result.assert_outcomes(passed=8, failed=len(EXPECTED_HABIT_FAILURES))
    assert_failures(result, EXPECTED_HABIT_FAILURES)


MESSAGES = """
import pytest
import torch
from torch import nn
from helpers import *


def mixture():
    model = seeded(TopOneMixture)
    x = seeded(lambda: torch.randn(8, 4), seed=1)
    return model, x


def test_mixture_of_experts_passes(gradcheck):
    model, x = mixture()
    gradcheck(model, x.requires_grad_())


def test_routing_tie_is_a_jump(gradcheck):
    model, x = mixture()
    with torch.no_grad():  # experts 0 and 1 get the same gate score: every row is a tie
        model.gate.weight[1] = model.gate.weight[0]
        model.gate.bias[1] = model.gate.bias[0]
    gradcheck(model, x.requires_grad_())


class BothGradientsWrong(LinearFunction):
    @classmethod
    def grads(cls, g, x, w):
        return 1.05 * (g @ w), 0.9 * (g.t() @ x)


def test_bug_in_one_expert(gradcheck):
    model, x = mixture()
    model.experts[2] = seeded(lambda: Linear(BothGradientsWrong))
    gradcheck(model, x.requires_grad_())
"""

EXPECTED_MESSAGES = {
    "test_routing_tie_is_a_jump": [
        "E*OutputJump: cannot check the gradient of TopOneMixture at *: the outputs jump there "
        "(a discontinuity, such as argmax or top-k routing at a tie, *",
        "E*output[*] changes by * when * moves by eps (1e-06), and by about as much when it "
        "moves by eps/2*",
        "E*this is not a wrong gradient",
    ],
    "test_bug_in_one_expert": [
        "E*WrongGradient: wrong first-order gradient of TopOneMixture: the error enters in the "
        "custom autograd Function BothGradientsWrong (its backward at helpers.py:*), applied at "
        "helpers.py:* in experts.2 (Linear)",
        "E*it reaches input x[*",
        "E*also wrong: parameter experts.2.weight (16 of 16 elements)",
    ],
}


def test_jumps_and_the_parameters_of_a_wrong_expert_are_named(plugin_pytester):
    result = run_session(plugin_pytester, MESSAGES)
    result.assert_outcomes(passed=1, failed=len(EXPECTED_MESSAGES))
    assert_failures(result, EXPECTED_MESSAGES)
    assert "kink" not in failure_reports(result)["test_routing_tie_is_a_jump"][0]


def test_generated_gradient_tests_pass(plugin_pytester, default_project: Path):
    tests = default_project / "tests" / "test_gradients.py"
    result = plugin_pytester.runpytest(
        str(tests), "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "-m", "slow or not slow",
        "-n0",  # in this process, which has the project's src on sys.path
    )  # fmt: skip
    result.assert_outcomes(passed=25, skipped=7)


BAD_ARGUMENTS = """
import pytest
import torch

CASES = [
    ("model_or_fn", 3, TypeError, "an nn.Module or a callable"),
    ("eps", 0, ValueError, "a number > 0"),
    ("eps", "1e-6", TypeError, "a number > 0"),
    ("atol", -1e-5, ValueError, "a number >= 0"),
    ("rtol", float("nan"), ValueError, "a number >= 0"),
    ("gradgrad", 1, TypeError, "True or False"),
    ("avoid_boundaries", None, TypeError, "True or False"),
    ("fast", "yes", TypeError, "None or True or False"),
    ("params", 3, TypeError, "True, False or a list of parameter names"),
    ("branches", "every", ValueError, "one of 'point', 'all'"),
]


@pytest.mark.parametrize("option, value, error, expected", CASES)
def test_refused(gradcheck, option, value, error, expected):
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    if option == "model_or_fn":
        call = lambda: gradcheck(value, x)
    else:
        call = lambda: gradcheck(torch.sin, x, **{{option: value}})
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == (
        f"gradcheck: {{option}}={{value!r}} is not allowed: expected {{expected}}"
    )
"""


def test_bad_arguments_are_named_in_one_line(plugin_pytester: pytest.Pytester) -> None:
    """Each option refused with its name, the value and what is allowed, in the format all
    checks share; the wrong type a TypeError, a value out of bounds a ValueError."""
    run_session(plugin_pytester, BAD_ARGUMENTS).assert_outcomes(passed=10)


def test_fixture_is_listed_with_its_usage(plugin_pytester):
    plugin_pytester.makepyfile(
        test_imports=textwrap.dedent(
            """
            def test_fixture_is_a_callable(gradcheck):
                assert callable(gradcheck)
            """
        )
    )
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "--fixtures", "-p", "no:cacheprovider"
    )
    result.stdout.fnmatch_lines(["gradcheck -- *", "    ``gradcheck(model_or_fn, *"])
