"""compile_check, export_check and --decisions on code nobody here wrote: small random
configurations of transformers' Mixtral MoE block, torchdiffeq's adaptive dopri5 solver and
torch-geometric's SAGEConv (installed by tests/run without their dependencies, so torch
stays the pinned CPU build; nothing is downloaded: the models are built from configs).

Two real pytest sessions, each in its own interpreter: one compiles and exports (with
``backend="aot_eager"``), one records decisions with the libraries' files as sources.
Every verdict is asserted, and every message by its lines.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import PLUGIN_MODULE
from sessions import assert_failures

for _library in ("transformers", "torchdiffeq", "torch_geometric"):
    pytest.importorskip(_library, reason=f"{_library} is in requirements-libraries.txt")

LIBRARY_MODELS = '''
import torch
from torch import nn
from torch_geometric.nn import SAGEConv
from torchdiffeq import odeint
from transformers import MixtralConfig, MixtralModel


def mixtral_moe(experts_implementation):
    """The sparse MoE block of a one-layer Mixtral: 4 experts, 2 per token, random weights."""
    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        max_position_embeddings=16, experts_implementation=experts_implementation,
    )
    return MixtralModel(config).layers[0].mlp


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, t, y):
        return self.net(y)


class NeuralODE(nn.Module):
    """y(0.1) from y(0), by torchdiffeq's adaptive dopri5."""

    def __init__(self):
        super().__init__()
        self.field = Field()

    def forward(self, y0):
        t = torch.tensor([0.0, 0.1], dtype=y0.dtype)
        return odeint(self.field, y0, t, method="dopri5", rtol=1e-2, atol=1e-2)[-1]


class GraphSAGE(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = SAGEConv(4, 8)

    def forward(self, x, edge_index):
        return self.conv(x, edge_index).relu()


def graph(nodes, edges):
    return torch.randn(nodes, 4), torch.randint(0, nodes, (2, edges))
'''

CHECKS = """
import torch
from libmodels import GraphSAGE, NeuralODE, graph, mixtral_moe


def test_mixtral_default_experts_compile_whole_and_export(compile_check, export_check):
    block, x = mixtral_moe("grouped_mm"), torch.randn(2, 5, 16)
    assert compile_check(block, x, backend="aot_eager", max_graph_breaks=0).graph_breaks == ()
    export_check(block, x)


def test_mixtral_eager_experts_break_inside_transformers(compile_check):
    result = compile_check(mixtral_moe("eager"), torch.randn(2, 5, 16), backend="aot_eager")
    found = {(b.gb_id, b.location) for b in result.graph_breaks}
    assert len(found) == len(result.graph_breaks), result  # each break once
    assert ("GB0036", "transformers/models/mixtral/modeling_mixtral.py:79") in found
    assert ("GB0170", "transformers/models/mixtral/modeling_mixtral.py:83") in found
    for graph_break in result.graph_breaks:
        assert graph_break.path.user.filename.endswith("test_checks.py")
        assert graph_break.rewrite is None  # a library's line: nothing of the user's
    print(result)


def test_mixtral_eager_experts_do_not_export(export_check):
    export_check(mixtral_moe("eager"), torch.randn(2, 5, 16))


def test_dopri5_backward_fails_only_compiled(compile_check):
    torch.manual_seed(0)
    compile_check(NeuralODE(), torch.randn(3, 2), backend="aot_eager")


def test_dopri5_does_not_export(export_check):
    torch.manual_seed(0)
    export_check(NeuralODE(), torch.randn(3, 2))


def test_sage_refuses_another_edge_count(export_check):
    torch.manual_seed(0)
    export_check(GraphSAGE(), inputs_list=[graph(6, 12), graph(6, 15)])


def test_sage_exports_with_the_dynamic_shapes_suggested(export_check):
    torch.manual_seed(0)
    dim = torch.export.Dim.DYNAMIC
    export_check(GraphSAGE(), inputs_list=[graph(6, 12), graph(7, 15)],
                 dynamic_shapes={"x": {0: dim}, "edge_index": {1: dim}})


def test_sage_recompiles_for_another_graph(compile_check):
    torch.manual_seed(0)
    result = compile_check(GraphSAGE(), inputs_list=[graph(6, 12), graph(6, 15)],
                           backend="aot_eager")
    (recompile,) = result.recompiles
    assert recompile.guard.startswith(
        "input edge_index has size 15 in dimension 1, the compiled code was specialized for 12"
    )
"""

# For each failing test: the lines its report must hold, in this order (fnmatch patterns
# in which "[" stands for itself).
EXPECTED_FAILURES = {
    "test_mixtral_eager_experts_do_not_export": [
        "E*ExportBlocked: torch.export cannot export MixtralSparseMoeBlock: the size of "
        "`expert_hit`, made by nonzero() at transformers/models/mixtral/modeling_mixtral.py:79, "
        "depends on the data (* over 1 call in the eager run), and decides the number of passes "
        "of the loop at transformers/models/mixtral/modeling_mixtral.py:81, read by a loop over "
        "it:",
        "E*79: expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()",
        "E*81: for expert_idx in expert_hit:",
        "E*reached from your code:",
        'E*at test_checks.py:*: `export_check(mixtral_moe("eager"), torch.randn(2, 5, 16))`',
        "E*in transformers/models/mixtral/modeling_mixtral.py:*: `hidden_states = self.experts(*",
        "E*in transformers/models/mixtral/modeling_mixtral.py:81: `for expert_idx in expert_hit:`",
        "E*Verified rewrite (the check built it, exported it, and compared its outputs and "
        "gradients with eager's on 13 input sets, on which the size made at "
        "transformers/models/mixtral/modeling_mixtral.py:79 was 2 to 4): transformers runs the "
        "experts as `batched_mm`, with no loop over the experts hit and no size that depends "
        "on the routing, when the model is built with",
        'E*config = MixtralConfig(..., experts_implementation="batched_mm")',
        "E*torch.export.draft_export stopped too: *",
    ],
    "test_dopri5_backward_fails_only_compiled": [
        "E*CompiledRunFailed: torch.compile (backend aot_eager) failed in the compiled backward "
        "of input set 0; eager PyTorch ran the same forward and backward without error, so this "
        "is torch.compile's failure, not the model's:",
        "E*RuntimeError: Output 0 of Slice is a view and its base or another view of its base "
        "has been modified inplace.*",
        "E*the backward of the op made at:",
        'E*at libmodels.py:*: `return odeint(self.field, y0, t, method="dopri5", *`',
        "E*in torchdiffeq/_impl/odeint.py:*",
        "E*more library frame(s)",
        "E*in torchdiffeq/_impl/rk_common.py:*: `yi = y0 + torch.sum(k[..., :i + 1] * *`",
    ],
    "test_dopri5_does_not_export": [
        "E*ExportBlocked: torch.export cannot export NeuralODE: its forward makes a "
        "data-dependent decision at torchdiffeq/_impl/misc.py:*:",
        "E*assert diff.all() or (~diff).all(), *",
        "E*reached from your code:",
        'E*at libmodels.py:*: `return odeint(self.field, y0, t, method="dopri5", *`',
        "E*in torchdiffeq/_impl/odeint.py:*",
        "E*decision in the eager run: Tensor.__bool__ -> True at torchdiffeq/_impl/misc.py:*",
        "E*The decision is made inside torchdiffeq, not in your code*",
        "E*torch.export.draft_export stopped too: *",
    ],
    "test_sage_refuses_another_edge_count": [
        "E*ProgramRefused: The program exported from GraphSAGE refused input set 1: input "
        "edge_index has 15 in dimension 1; the program was exported with 12 there (torch: Guard "
        "failed: edge_index.size()[1] == 12)",
        "E*to accept every input set's sizes, export with",
        "E*dynamic_shapes={'x': None, 'edge_index': {1: torch.export.Dim.DYNAMIC}}",
    ],
}


def test_library_models_compile_export_and_fail_with_their_cause(plugin_pytester):
    plugin_pytester.makepyfile(libmodels=LIBRARY_MODELS, test_checks=CHECKS)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "-s"
    )
    reports = assert_failures(result, EXPECTED_FAILURES)
    result.assert_outcomes(passed=4, failed=len(EXPECTED_FAILURES))
    for report in reports.values():
        for noise in ["*torch.__trace*", "*Captured log call*", "*Unable to find user code*"]:
            report.no_fnmatch_line(noise)
    # A break inside the library names its line, torch's id and the user's way there.
    result.stdout.fnmatch_lines(
        [
            "*compile_check MixtralSparseMoeBlock (backend aot_eager): * graph break(s)*",
            "  graph break at transformers/models/mixtral/modeling_mixtral.py:79: `expert_hit = "
            "*.nonzero()`: Dynamic shape operator (GB0036): `torch.greater(expert_mask.sum("
            "dim=(-1, -2)), 0).nonzero()` makes a size that depends on the data",
            "      reached from your code:",
            '      at test_checks.py:*: `result = compile_check(mixtral_moe("eager"), *`',
            "        in transformers/models/mixtral/modeling_mixtral.py:79: *",
            "      torch's hint: Enable tracing of dynamic shape operators with *",
        ],
        consecutive=False,
    )


def _library_file(module: str) -> str:
    return str(Path(importlib.import_module(module).__file__))


DECISIONS = """
import torch
from libmodels import NeuralODE, mixtral_moe


def test_mixtral_eager_experts_route_tokens():
    torch.manual_seed(0)
    mixtral_moe("eager")(torch.randn(2, 5, 16))


def test_mixtral_one_token_repeated_reaches_two_experts():
    torch.manual_seed(0)
    mixtral_moe("eager")(torch.randn(16).expand(2, 5, 16).clone())


def test_dopri5_solves():
    torch.manual_seed(0)
    NeuralODE()(torch.randn(3, 2))


def test_dopri5_gradients(gradcheck):
    torch.manual_seed(0)
    gradcheck(NeuralODE(), torch.randn(3, 2, dtype=torch.float64, requires_grad=True))
"""


def test_library_decisions_count_as_written_and_probes_apart(plugin_pytester):
    plugin_pytester.makepyfile(libmodels=LIBRARY_MODELS, test_decisions=DECISIONS)
    sources = [
        _library_file("torchdiffeq._impl.rk_common"),
        _library_file("transformers.models.mixtral.modeling_mixtral"),
    ]
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider",
        *(f"--decisions-source={source}" for source in sources),
    )  # fmt: skip
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*torchdiffeq/_impl/rk_common.py:267: if not torch.isfinite(dt):",
            "    branch: True x0, False x* (never True); at check probes: True x0, False x*",
            "*torchdiffeq/_impl/rk_common.py:284: assert t0 + dt > t0, *",
            "    branch: True x*, False x0 (never False); at check probes: True x*, False x0",
            # Which experts got tokens: all 4 for random tokens, 2 for one token repeated.
            "*mixtral/modeling_mixtral.py:79: expert_hit = *.nonzero()",
            "    size: 2 to 4 in 2 calls; never 0 *",
            "*mixtral/modeling_mixtral.py:81: for expert_idx in expert_hit:",
            "    loop count: 2 values, min 2, max 4, 2 distinct",
            "*mixtral/modeling_mixtral.py:83: if expert_idx == self.num_experts:",
            "    branch: True x0, False x* (never True)",
            "    reached by 2 test(s): test_decisions.py::test_mixtral_eager_experts_route_tokens, "
            "test_decisions.py::test_mixtral_one_token_repeated_reaches_two_experts",
            "*mixtral/modeling_mixtral.py:85: top_k_pos, token_idx = torch.where(*)",
            "    size: * in 6 calls; never 0 *",
        ],
        consecutive=False,
    )
    # The test's own forwards only: dopri5 takes a few steps from each of two starting
    # points (the eager forward, gradcheck's point), not the hundreds of its probes.
    own = result.stdout.str().split("rk_common.py:267:")[1].split("\n")[1]
    assert int(own.split("False x")[1].split(" ")[0]) < 20, own
