"""compile_check's messages in the user's terms, in real pytest sessions: each recompilation
names the Python number, argument, attribute or size that changed, with its value when
compiled and now; each graph break on a data-dependent op names the user's expression;
a forward that changes a Python attribute is named as the cause of a mismatch. No
message shows torch's own symbols (``___stack0``, ``L['x']``, ``u0``, ``Eq(``).
"""

from __future__ import annotations

from sessions import SEEDED, assert_failures, assert_no_internals, failure_reports, run_session

# torch's symbols, which no message of the plugin may show.
HELPERS = f'''
import torch
from torch import nn


{SEEDED}


def halved_steps_times(x):
    steps = int(x.sum().item())
    for _ in range(steps):
        x = x * 0.5
    return x


def row_sums(x):
    return x.sum(dim=1) * 2


def scaled(x, factor: float):
    return x * factor


class CountsCalls(nn.Module):
    """Counts its calls in a Python attribute; the output does not depend on it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


class ScalesByCalls(CountsCalls):
    """Scales its output by the number of calls so far: each run computes another thing."""

    def forward(self, x):
        self.calls += 1
        return self.linear(x) * self.calls


class ScalesByAConstant(CountsCalls):
    """ScalesByCalls with a scale the forward reads and never changes."""

    def __init__(self):
        super().__init__()
        self.scale = 2

    def forward(self, x):
        return self.linear(x) * self.scale


def item(x):
    s = x.sum().item()
    return x * s


def tolist(x):
    n = x.long().tolist()
    return x * n[0]


def nonzero(x):
    idx = x.nonzero()
    return x[idx[:, 0]] * 2


def masked(x):
    y = x[x > 0]
    return y * 2


def unique(x):
    u = torch.unique(x.detach().round())
    return x * u.shape[0]


def loop_over_values(x):
    total = x.new_zeros(())
    for v in x.long().tolist():
        total = total + x * v
    return total


def no_data_dependent_op(x):
    return torch.where(x > 0, x * 2, x)
'''

PASSING = """
import torch
from helpers import *


def test_recompiles_in_words(compile_check):
    ones = [(torch.full((1,), float(v)),) for v in (1, 3)]
    (steps,) = compile_check(halved_steps_times, inputs_list=ones, backend="aot_eager").recompiles
    assert steps.guard.startswith("the Python number `steps` (from `int(x.sum().item())` at "
                                  "helpers.py:")
    assert ") was 1.0 when compiled and is now 3.0" in steps.guard
    (size,) = compile_check(row_sums, inputs_list=[(torch.randn(2, 5),), (torch.randn(2, 8),)],
                            backend="aot_eager").recompiles
    assert size.guard.startswith("input x has size 8 in dimension 1, the compiled code was "
                                 "specialized for 5")
    (argument,) = compile_check(scaled, inputs_list=[(torch.randn(3), 0.5), (torch.randn(3), 1.5)],
                                backend="aot_eager").recompiles
    assert argument.guard.startswith("the Python argument `factor` was 0.5 when compiled and is "
                                     "now 1.5")
    (attribute,) = compile_check(CountsCalls(), inputs_list=[(torch.randn(2, 4),)] * 2,
                                 backend="aot_eager").recompiles
    assert attribute.guard.startswith("the Python attribute `CountsCalls.calls` was 1 when "
                                      "compiled and is now 3")
    assert "the forward changes it: `self.calls += 1` at helpers.py:" in attribute.guard


def test_what_does_not_change_does_not_recompile(compile_check):
    same = [(torch.full((1,), 3.0),)] * 2
    assert compile_check(halved_steps_times, inputs_list=same, backend="aot_eager",
                         max_recompiles=0).recompiles == ()
    assert compile_check(scaled, inputs_list=[(torch.randn(3), 0.5), (torch.randn(3), 0.5)],
                         backend="aot_eager", max_recompiles=0).recompiles == ()


def test_no_data_dependent_op_no_break(compile_check):
    result = compile_check(no_data_dependent_op, torch.randn(4), backend="aot_eager",
                           max_graph_breaks=0)
    assert result.graph_breaks == ()


def test_an_attribute_the_forward_only_reads_matches(compile_check):
    compile_check(seeded(ScalesByAConstant), torch.randn(2, 4), backend="aot_eager")
"""

FAILING = """
import torch
from helpers import *


def test_a_data_dependent_number(compile_check):
    compile_check(halved_steps_times, inputs_list=[(torch.full((1,), v),) for v in (1.0, 3.0)],
                  backend="aot_eager", max_recompiles=0)


def test_a_size(compile_check):
    compile_check(row_sums, inputs_list=[(torch.randn(2, 5),), (torch.randn(2, 8),)],
                  backend="aot_eager", max_recompiles=0)


def test_an_attribute(compile_check):
    compile_check(CountsCalls(), inputs_list=[(torch.randn(2, 4),)] * 2, backend="aot_eager",
                  max_recompiles=0)


def test_an_argument(compile_check):
    compile_check(scaled, inputs_list=[(torch.randn(3), 0.5), (torch.randn(3), 1.5)],
                  backend="aot_eager", max_recompiles=0)


def test_a_count_in_an_attribute_mismatches(compile_check):
    compile_check(seeded(ScalesByCalls), torch.randn(2, 4), backend="aot_eager")


def test_break_item(compile_check):
    compile_check(item, torch.randn(4), backend="aot_eager", max_graph_breaks=0)


def test_break_tolist(compile_check):
    compile_check(tolist, torch.randn(4), backend="aot_eager", max_graph_breaks=0)


def test_break_nonzero(compile_check):
    compile_check(nonzero, torch.randn(4), backend="aot_eager", max_graph_breaks=0)


def test_break_masked(compile_check):
    compile_check(masked, torch.randn(4), backend="aot_eager", max_graph_breaks=0)


def test_break_unique(compile_check):
    compile_check(unique, torch.randn(4), backend="aot_eager", max_graph_breaks=0)


def test_break_loop_over_values(compile_check):
    compile_check(loop_over_values, torch.randn(4), backend="aot_eager", max_graph_breaks=0)
"""

_RECOMPILE = (
    "E*TooManyRecompiles: a recompilation for input set 1, and max_recompiles=0 allows none "
    "(torch.compile stopped at it: torch.compiler.set_stance('fail_on_recompile')):"
)
_BREAK = "E*TooManyGraphBreaks: a graph break, and max_graph_breaks=0 allows none*"
EXPECTED = {
    "test_a_data_dependent_number": [
        _RECOMPILE,
        "E*recompiled halved_steps_times (the code after its graph break at helpers.py:*) at "
        "helpers.py:*: `steps = int(x.sum().item())`: the Python number `steps` (from "
        "`int(x.sum().item())` at helpers.py:*) was 1.0 when compiled and is now 3.0: the "
        "compiled code is specialized on that value, so each new value compiles again (keep it "
        "a tensor)",
    ],
    "test_a_size": [
        _RECOMPILE,
        "E*recompiled row_sums at helpers.py:*: `def row_sums(x):`: input x has size 8 in "
        "dimension 1, the compiled code was specialized for 5 (pass dynamic=True, or "
        "torch._dynamo.mark_dynamic, to compile once for all sizes)",
    ],
    "test_an_attribute": [
        _RECOMPILE,
        "E*recompiled forward at helpers.py:*: `self.calls += 1`: the Python attribute "
        "`CountsCalls.calls` was 1 when compiled and is now 3: the compiled code is specialized "
        "on that value, so each new value compiles again (keep it out of the forward, or in a "
        "tensor; the forward changes it: `self.calls += 1` at helpers.py:*)",
    ],
    "test_an_argument": [
        _RECOMPILE,
        "E*recompiled scaled at helpers.py:*: `return x * factor`: the Python argument `factor` "
        "was 0.5 when compiled and is now 1.5: the compiled code is specialized on that value, "
        "so each new value compiles again (pass it as a tensor)",
    ],
    "test_a_count_in_an_attribute_mismatches": [
        "E*CompileMismatch: torch.compile's result differs from eager's for input set 0*",
        "E*The forward changes Python attributes of the model, which the check does not put "
        "back between runs (it puts back parameters, buffers and RNG states), so the compiled "
        "run started from other values than eager's:",
        "E*ScalesByCalls.calls: 0 -> 1 (`self.calls += 1` at helpers.py:*)",
        "E*Keep such state out of the forward, or in a buffer (register_buffer)*",
    ],
    "test_break_item": [
        _BREAK,
        "E*graph break at helpers.py:*: `s = x.sum().item()`: * `x.sum().item()` reads a "
        "tensor's value into Python (decision Tensor.item)",
    ],
    "test_break_tolist": [
        _BREAK,
        "E*graph break at helpers.py:*: `n = x.long().tolist()`: * `x.long().tolist()` reads a "
        "tensor's value into Python (decision Tensor.tolist)",
    ],
    "test_break_nonzero": [
        _BREAK,
        "E*graph break at helpers.py:*: `idx = x.nonzero()`: Dynamic shape operator (GB0036): "
        "`x.nonzero()` makes a size that depends on the data",
    ],
    "test_break_masked": [
        _BREAK,
        "E*graph break at helpers.py:*: `y = x[x > 0]`: Dynamic shape operator (GB0036): the "
        "boolean-mask indexing `x[x > 0]` makes a size that depends on the data (as many "
        "elements as the mask holds)",
    ],
    "test_break_unique": [
        _BREAK,
        "E*graph break at helpers.py:*: `u = torch.unique(x.detach().round())`: Dynamic shape "
        "operator (GB0036): `torch.unique(x.detach().round())` makes a size that depends on the "
        "data",
    ],
    "test_break_loop_over_values": [
        _BREAK,
        "E*graph break at helpers.py:*: `for v in x.long().tolist():`: * the loop over "
        "`x.long().tolist()` reads a tensor's values into Python (decision Tensor.tolist)",
    ],
}


def test_messages_in_the_users_terms(plugin_pytester):
    passing = run_session(plugin_pytester, PASSING, helpers=HELPERS)
    passing.assert_outcomes(passed=4)
    failing = run_session(plugin_pytester, FAILING, helpers=HELPERS)
    failing.assert_outcomes(failed=len(EXPECTED))
    assert_failures(failing, EXPECTED)
    assert_no_internals(failing)
    aten = [
        line
        for lines in failure_reports(failing).values()
        for line in lines
        if line.startswith("E ") and "aten." in line
    ]
    assert not aten
