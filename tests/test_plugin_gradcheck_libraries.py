"""``gradcheck`` on code nobody here wrote, as users import it, and on user habits around it.

Tiny random configurations of transformers' Mixtral and Llama (nothing downloaded),
torchdiffeq's adaptive solver, torch-geometric layers and user-style models (adaptive
computation time, a spectral-normed layer, a closure's float32 constant, an integer
input): each correct one passes and says what the check did for it (Mixtral's experts,
through ``torch._grouped_mm``, which has no float64 kernel, computed in float64 all the
same); each failure says what happened in words a user can act on. Every session is a
real pytest session of the fixture.
"""

from __future__ import annotations

import pytest
from gradcheck_sessions import check_session

pytestmark = pytest.mark.usefixtures("one_torch_thread")


LIBRARIES = """
import pytest
import torch
from torch import nn
from helpers import *


def mixtral(experts=None, hidden=16):
    from transformers import MixtralConfig, MixtralModel

    config = MixtralConfig(
        vocab_size=32, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )
    if experts is not None:
        config._experts_implementation = experts
    return MixtralModel(config)


def test_mixtral_with_an_op_that_has_no_float64_kernel(gradcheck):
    torch.manual_seed(0)
    model = mixtral()
    embeddings = torch.randn(1, 5, 16, requires_grad=True)
    result = gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state, embeddings)
    assert_grouped_mm_in_float64(result)


def assert_grouped_mm_in_float64(result):
    \"\"\"torch._grouped_mm, which has no float64 kernel, computed in float64 all the same.\"\"\"
    (substituted,) = result.substituted
    assert substituted.startswith("torch._grouped_mm as a float64 matmul per group (at ")
    assert "integrations/moe.py:" in substituted
    assert "computed in float64 through an equivalent where no float64 kernel exists" in str(
        result
    )
    assert result.narrowed == ()
    tolerances = result.sensitivity.tolerances
    assert (tolerances.dtype, tolerances.eps, tolerances.rtol) == ("float64", 1e-6, 1e-4)


def mixtral_experts():
    \"\"\"The sparse MoE block of a one-layer Mixtral: hidden size 8, 4 experts, 2 per token,
    its experts through torch._grouped_mm (transformers' default).\"\"\"
    return mixtral(hidden=8).layers[0].mlp


def test_mixtral_experts_in_float64(gradcheck):
    torch.manual_seed(0)
    block = mixtral_experts()
    assert_grouped_mm_in_float64(gradcheck(block, torch.randn(1, 5, 8, requires_grad=True)))


def test_mixtral_experts_with_a_doubled_gradient(gradcheck):
    torch.manual_seed(0)
    block = mixtral_experts()
    block.experts.down_proj.register_hook(lambda grad: 2 * grad)
    gradcheck(block, torch.randn(1, 5, 8, requires_grad=True))


def test_mixtral_experts_with_a_gradient_one_percent_off(gradcheck):
    torch.manual_seed(0)
    block = mixtral_experts()
    block.experts.down_proj.register_hook(lambda grad: 1.01 * grad)
    gradcheck(block, torch.randn(1, 5, 8, requires_grad=True))


def test_mixtral_with_a_zero_router_is_a_loop_boundary_of_a_parameter(gradcheck):
    torch.manual_seed(0)
    model = mixtral(experts="eager")  # a Python loop over the experts that got tokens
    with torch.no_grad():
        model.layers[0].mlp.gate.weight.zero_()  # every expert ties: top-k picks by index
    gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state,
              torch.randn(1, 5, 16, requires_grad=True))


def test_mixtral_routed_in_a_python_loop(gradcheck):
    torch.manual_seed(0)
    model = mixtral(experts="eager")
    gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state,
              torch.randn(1, 5, 16, requires_grad=True))


def test_a_backward_hook_deep_in_mixtral(gradcheck):
    torch.manual_seed(0)
    model = mixtral()
    attention = model.layers[0].self_attn
    attention.o_proj.register_full_backward_hook(lambda module, grads, _: (1.5 * grads[0],))
    gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state,
              torch.randn(1, 5, 16, requires_grad=True))


def test_llama(gradcheck):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = LlamaModel(config)
    gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state,
              torch.randn(1, 5, 16, requires_grad=True))


def test_torch_geometric_layers(gradcheck):
    from torch_geometric.nn import GATConv, GCNConv

    torch.manual_seed(0)
    edges = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 3, 0]])
    gradcheck(GCNConv(4, 3), torch.randn(4, 4, requires_grad=True), edges)
    gradcheck(GATConv(4, 3, heads=2), torch.randn(4, 4, requires_grad=True), edges)


def test_an_adaptive_ode_solver_on_both_sides_of_its_branches(gradcheck):
    from torchdiffeq import odeint

    torch.manual_seed(0)
    field = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))
    times = torch.tensor([0.0, 0.5, 1.0])
    result = gradcheck(
        lambda y0: odeint(lambda t, y: field(y), y0, times, method="dopri5", rtol=1e-7, atol=1e-9),
        torch.randn(3, 2, requires_grad=True),
        branches="all",
    )
    assert any(side.found for side in result.branches)
    assert all(side.found or side.reason for side in result.branches)


class SpectralNormed(nn.Module):
    \"\"\"nn.utils.spectral_norm: each forward in train mode updates u and v.\"\"\"

    def __init__(self):
        super().__init__()
        self.layer = nn.utils.spectral_norm(nn.Linear(3, 4))

    def forward(self, x):
        return torch.tanh(self.layer(x))


def test_buffers_updated_by_every_forward(gradcheck):
    torch.manual_seed(0)
    model = SpectralNormed()
    u = model.layer.weight_u.clone()
    result = gradcheck(model, torch.randn(2, 3, requires_grad=True))
    assert result.held_buffers == ("layer.weight_u", "layer.weight_v")
    assert "restored before each evaluation" in str(result)
    assert torch.equal(model.layer.weight_u, u)  # the model's own buffers untouched


def test_a_float32_constant_of_a_closure_is_reported_once(gradcheck):
    torch.manual_seed(0)
    scale = torch.rand(4)
    layer = nn.Linear(4, 4)

    def scaled(x):
        assert scale.dim() == 1 and scale.is_floating_point() and len(scale) == 4
        return layer(x) * scale + scale  # LINE-FIRST-USE

    result = gradcheck(scaled, torch.randn(2, 4, requires_grad=True))
    assert len(result.widened) == 1, result.widened
    assert "first used by Tensor.mul at test_session.py:" in result.widened[0]


def test_an_integer_input_that_reaches_a_floating_point_op(gradcheck):
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    gradcheck(lambda x, tokens: layer(tokens) + x, torch.randn(2, 2, requires_grad=True),
              torch.ones(2, 3, dtype=torch.long))


def test_integer_inputs_are_passed_as_they_are(gradcheck):
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 3)
    mask = torch.tensor([True, False, True])
    gradcheck(lambda ids, mask: embedding(ids) * mask[:, None], torch.tensor([1, 4, 7]), mask)
"""

EXPECTED_LIBRARY_FAILURES = {
    "test_mixtral_experts_with_a_doubled_gradient": [
        "E*WrongGradient: wrong first-order gradient of MixtralSparseMoeBlock: the error enters "
        "in the gradient hook test_mixtral_experts_with_a_doubled_gradient.<lambda> "
        "(test_session.py:*) of parameter experts.down_proj",
        "E*of 512 elements of parameter experts.down_proj are wrong; in all of them the "
        "analytical gradient is 2 times the numerical one",
        "E*computed in float64 through an equivalent where no float64 kernel exists: "
        "torch._grouped_mm as a float64 matmul per group (at *integrations/moe.py:*)*",
        "E*checked MixtralSparseMoeBlock (float64, eps=1e-06, atol=* from the rounding of "
        "outputs up to *, rtol=0.0001)*",
    ],
    "test_mixtral_experts_with_a_gradient_one_percent_off": [
        "E*WrongGradient: wrong first-order gradient of MixtralSparseMoeBlock: the error enters "
        "in the gradient hook test_mixtral_experts_with_a_gradient_one_percent_off.<lambda> "
        "(test_session.py:*) of parameter experts.down_proj",
        "E*d output[*] / d parameter experts.down_proj[*]: numerical *, analytical * "
        "(difference *, allowed *: a relative error of 1%, * times what the check resolves "
        "there)",
        "E*of 512 elements of parameter experts.down_proj are wrong; in all of them the "
        "analytical gradient is 1.01 times the numerical one",
        "E*checked MixtralSparseMoeBlock (float64, eps=1e-06, atol=* from the rounding of "
        "outputs up to *, rtol=0.0001)*",
    ],
    "test_mixtral_with_a_zero_router_is_a_loop_boundary_of_a_parameter": [
        "E*BranchBoundary: cannot check the gradient of *<lambda> here: the point is within eps"
        " of a branch boundary at decision #* (*modeling_mixtral.py:*): moving parameter "
        "model.layers.0.mlp.gate.weight[*] by *eps changes how many times a loop runs",
        "E*the decision at *modeling_mixtral.py:* was made * time(s) at the point and * time(s) "
        "with parameter model.layers.0.mlp.gate.weight[*: a loop over the data *",
    ],
    "test_a_backward_hook_deep_in_mixtral": [
        "E*WrongGradient: wrong first-order gradient of *<lambda>: the error enters in the "
        "submodule model.layers.0.self_attn.o_proj (Linear): wrong on its own, with its backward "
        "hook(s) *<lambda> (test_session.py:*)",
        "E*narrowed down in * s by checking parts on their own (* module calls)*",
    ],
    "test_an_integer_input_that_reaches_a_floating_point_op": [
        "E*TypeError: gradcheck: input tokens is a torch.int64 tensor, and "
        "torch.nn.functional.linear at test_session.py:* fails on it (RuntimeError: mat1 and "
        "mat2 must have the same dtype*): integer and boolean inputs are passed to the forward "
        "as they are*",
    ],
}


def test_library_models_and_user_habits(plugin_pytester):
    result = check_session(plugin_pytester, LIBRARIES, passed=9, expected=EXPECTED_LIBRARY_FAILURES)
    report = "\n".join(result.outlines)
    assert "the input is within eps" not in report


PROBES = """
import torch
from torch import nn


def positive_part(x):
    assert (x >= 0).all(), "negative input"  # a library's check of its input
    return x**2 + x


def test_the_model_refuses_a_finite_difference_input(gradcheck):
    x = torch.tensor([4.0, 5e-7, 1.0], dtype=torch.float64, requires_grad=True)
    result = gradcheck(positive_part, x)
    (note,) = result.refused
    assert note.startswith("the model raised at input x[1] - 1e-06 (AssertionError: negative")
    assert note.endswith("checked with eps=1e-07 instead")
    assert result.tolerances[0] == 1e-7


def test_the_model_refuses_every_step_near_the_point(gradcheck):
    gradcheck(positive_part, torch.tensor([4.0, 0.0, 1.0], dtype=torch.float64,
                                          requires_grad=True))
"""

EXPECTED_PROBE_FAILURES = {
    "test_the_model_refuses_every_step_near_the_point": [
        "E*RefusedProbe: cannot check the gradient of positive_part here: the model raises at "
        "the finite-difference inputs near the point, down to eps=1e-08",
        "E*with input x[1] - 1e-08: AssertionError: negative input (raised at test_session.py:*)",
        "E*at the point itself it runs: this is not a wrong gradient",
    ],
}


def test_an_exception_at_a_probe_point_is_never_the_verdict(plugin_pytester):
    check_session(plugin_pytester, PROBES, passed=1, expected=EXPECTED_PROBE_FAILURES)
