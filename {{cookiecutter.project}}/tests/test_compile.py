"""The example models under ``torch.compile`` and ``torch.export``: parity, graph breaks, export.

``compile_check(model, *inputs, backend=...)`` runs forward and backward eagerly and
compiled from the same state and compares outputs and gradients; it returns each
graph break and recompilation with the line that caused it. ``export_check(model,
*inputs)`` exports the model and runs the program against eager; on a data-dependent
branch it fails naming the line and showing the ``torch.cond`` rewrite.
``backend="aot_eager"`` traces and differentiates like inductor without generating
code, which keeps these tests fast; the inductor variants run with ``pytest --gpu``.
"""

import pytest
import torch

from {{ cookiecutter.package }} import (
    CondGatedNet,
    DynamicNet,
    MeanGatedNet,
    PerSampleNet,
    RecursiveNet,
    forward_with_condition,
)
from {{ cookiecutter.package }}.testing.export_check import ExportBlocked
from {{ cookiecutter.package }}.train import build_model, synthetic_data

# model, input shape, the source of each line where torch.compile breaks the graph
MODELS = {
    "branch per call": (MeanGatedNet, (4, 8), ["if h.mean() > 0:"]),
    "branch per sample": (
        PerSampleNet,
        (4, 8),
        ["rows = [torch.relu(row) if row.sum() > 0 else torch.tanh(row) for row in h]"],
    ),
    "loop length decided by the data": (
        lambda: DynamicNet(in_features=8, hidden=16),
        (4, 8),
        ["if h.abs().mean() < self.tolerance:"],
    ),
    "recursion": (RecursiveNet, (2, 5, 8), []),
    "branch written with torch.cond": (CondGatedNet, (4, 8), []),
}


@pytest.mark.parametrize("case", MODELS)
def test_compiled_models_match_eager(compile_check, case):
    make, shape, breaks = MODELS[case]
    result = compile_check(make(), torch.randn(shape), backend="aot_eager")
    assert [graph_break.source for graph_break in result.graph_breaks] == breaks
    for graph_break in result.graph_breaks:
        assert graph_break.decision == "Tensor.__bool__"
        assert "models.py:" in graph_break.location


def test_dynamic_net_as_train_compiles_it(compile_check):
    """``train --compile``'s model and a batch of its data: the loop's data-dependent
    ``if`` makes torch.compile run the whole forward eagerly (train's first step says
    "nothing was compiled"); a rewrite that removes the break turns this test red."""
    inputs, _ = synthetic_data(64, seed=0)
    result = compile_check(build_model(), inputs, backend="aot_eager")
    (graph_break,) = result.graph_breaks
    assert graph_break.source == "if h.abs().mean() < self.tolerance:"
    assert graph_break.whole_function_eager


def test_a_python_number_recompiles(compile_check):
    x = torch.randn(5, requires_grad=True)
    result = compile_check(
        forward_with_condition, inputs_list=[(x, 0.5), (x, 1.5)], backend="aot_eager"
    )
    assert len(result.recompiles) == 1
    assert "`threshold` was 0.5 when compiled and is now 1.5" in result.recompiles[0].guard


def both_sides(model):
    """Inputs for which ``h.mean() > 0`` and ``h.mean() <= 0``: relu and tanh."""
    direction = model.linear.weight.sum(dim=0).sign().expand(4, -1)
    sides = [(10.0 * direction,), (-10.0 * direction,)]
    with torch.no_grad():
        assert [bool(model.linear(x).mean() > 0) for (x,) in sides] == [True, False]
    return sides


def test_torch_cond_version_exports_and_matches_on_both_sides(compile_check, export_check):
    gated, rewritten = MeanGatedNet(), CondGatedNet()
    rewritten.load_state_dict(gated.state_dict())
    sides = both_sides(gated)
    compile_check(rewritten, inputs_list=sides, backend="aot_eager", max_graph_breaks=0)
    program = export_check(rewritten, inputs_list=sides)
    for (x,) in sides:
        torch.testing.assert_close(program.module()(x), gated(x))


def test_export_refusal_names_the_line_and_the_rewrite(export_check):
    with pytest.raises(ExportBlocked) as refusal:
        export_check(MeanGatedNet(), torch.randn(4, 8))
    assert "models.py:" in refusal.value.location
    assert refusal.value.decision.op == "Tensor.__bool__"
    assert "torch.cond(h.mean() > 0, lambda h: torch.relu(h), lambda h: torch.tanh(h)" in str(
        refusal.value
    )


@pytest.mark.parametrize("case", ["branch per call", "recursion"])
def test_inductor_matches_eager_on_gpu(gpu, compile_check, case):
    make, shape, breaks = MODELS[case]
    result = compile_check(make().to(gpu), torch.randn(shape, device=gpu), backend="inductor")
    assert len(result.graph_breaks) == len(breaks)
