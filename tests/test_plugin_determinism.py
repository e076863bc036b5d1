"""The ``autograd_determinism`` fixture in real pytest sessions, and the helpers behind it.

Each session runs in its own interpreter (``runpytest_subprocess``) with the default
project's plugin loaded, so what a user sees is what is checked: outcomes and the
failure messages. Helpers that are plain functions are tested directly.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import time
from functools import partial
from pathlib import Path

import pytest
import sessions
import torch
from conftest import DEFAULT_PACKAGE

# The sessions' sources are f-strings, their package filled in already.
run_session = partial(sessions.run_session, template=False)


def failure_section(result: pytest.RunResult, test_name: str) -> str:
    """The text pytest printed for one failing test (its ``___ test_name ___`` section)."""
    text = result.stdout.str()
    match = re.search(rf"_{{3,}} {test_name} _{{3,}}\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", text, re.S)
    assert match, f"no failure section for {test_name} in:\n{text}"
    return match.group(1)


@pytest.fixture
def package(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return lambda name: importlib.import_module(f"{DEFAULT_PACKAGE}.testing.{name}")


PASSING = f"""
import dataclasses
import random

import pytest
import torch
from torch import nn

from {DEFAULT_PACKAGE}.models import (
    DynamicNet, MeanGatedNet, PerSampleNet, RecursiveNet, forward_with_condition,
)


def test_dynamic_net_loop_length_depends_on_data(autograd_determinism):
    model = DynamicNet(tolerance=0.3)
    x = torch.randn(8, 16) * 4
    result = autograd_determinism(model, x, runs=3)
    assert set(result.parameter_grads) == {{name for name, _ in model.named_parameters()}}
    assert all(p.grad is None for p in model.parameters())  # .grad is left alone


def test_recursion(autograd_determinism):
    autograd_determinism(RecursiveNet(), torch.randn(4, 5, 8))


def test_data_dependent_branches(autograd_determinism):
    autograd_determinism(PerSampleNet(), torch.randn(6, 8))
    autograd_determinism(MeanGatedNet(), torch.randn(6, 8))
    result = autograd_determinism(
        forward_with_condition, torch.randn(5), forward_kwargs={{"threshold": 0.0}}
    )
    assert set(result.input_grads) == {{"x"}}  # no parameters: inputs are differentiated


def test_seeded_dropout(autograd_determinism):
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 2)).train()
    autograd_determinism(model, torch.randn(16, 8), runs=4)


def test_noise_from_global_rngs(autograd_determinism):
    layer = nn.Linear(8, 8)

    def noisy(x):
        h = layer(x) + 0.1 * torch.randn(4, 8) + random.random()
        while h.abs().max() > 1:  # loop length set by the noise
            h = h * 0.5
        return h

    autograd_determinism(noisy, torch.randn(4, 8))


def test_tuple_dict_and_nested_outputs(autograd_determinism):
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x, scale=1.0):
            h = self.body(x) * scale
            return {{"logits": h, "parts": (h.sum(1), [h.mean(), h.argmax(1)]), "steps": 3}}

    result = autograd_determinism(Heads(), torch.randn(3, 4), forward_kwargs={{"scale": 2.0}})
    assert set(result.outputs) == {{"logits", "parts", "steps"}}
    assert result.outputs["parts"][1][1].dtype == torch.int64
    assert not result.outputs["logits"].requires_grad


def test_dataclass_output(autograd_determinism):
    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        aux: dict

    layer = nn.Linear(4, 4)
    output = lambda x: Output(layer(x), {{"h": layer(x).sum(), "n": 3}})
    assert autograd_determinism(output, torch.randn(2, 4)).outputs.aux["n"] == 3


def test_batchnorm_in_training_mode(autograd_determinism):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU()).train()
    start = {{name: value.clone() for name, value in model.state_dict().items()}}
    result = autograd_determinism(model, torch.randn(16, 4))
    assert "1.running_mean" in result.buffers  # updated by the run, compared across runs
    for name, value in model.state_dict().items():
        assert torch.equal(value, start[name]), name


def test_model_and_inputs_are_left_unchanged(autograd_determinism):
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Linear(3, 3)

        def forward(self, x):
            x.mul_(2)  # modifies its input
            return self.scale(x)

    model, x = InPlace(), torch.randn(2, 3)
    x_before = x.clone()
    rng_before = torch.get_rng_state()
    autograd_determinism(model, x)
    assert torch.equal(x, x_before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_frozen_parameters_and_assigned_buffers_are_restored(autograd_determinism):
    class MomentumEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.online = nn.Linear(4, 4)
            self.target = nn.Linear(4, 4).requires_grad_(False)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            with torch.no_grad():
                for target, online in zip(self.target.parameters(), self.online.parameters()):
                    target.mul_(0.9).add_(0.1 * online)
            self.calls = self.calls + 1  # replaces the buffer
            return self.online(x) + self.target(x)

    model = MomentumEncoder()
    start = {{name: value.clone() for name, value in model.state_dict().items()}}
    result = autograd_determinism(model, torch.randn(2, 4))
    assert float(result.buffers["calls"]) == 1.0
    assert set(result.parameter_grads) == {{"online.weight", "online.bias"}}
    for name, value in model.state_dict().items():
        assert torch.equal(value, start[name]), name


def test_grad_attributes_and_their_hooks_are_left_alone(autograd_determinism):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []

    def step_in_backward(parameter):  # the "optimizer step in backward" pattern
        steps.append(parameter)
        optimizer.step()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(step_in_backward)
    model.weight.grad = torch.ones_like(model.weight)
    autograd_determinism(model, torch.randn(3, 4))
    assert steps == []
    assert torch.equal(model.weight.grad, torch.ones_like(model.weight))
    assert model.bias.grad is None


def test_fixture_turns_on_deterministic_settings(autograd_determinism):
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.initial_seed() == 0
"""


def test_reproducible_models_pass(plugin_pytester: pytest.Pytester) -> None:
    """And ``-v`` prints each call's result, ``str(result)``, as the other checks do."""
    result = run_session(plugin_pytester, PASSING, "-v")
    result.assert_outcomes(passed=12)
    result.stdout.fnmatch_lines(
        [
            "autograd_determinism DynamicNet: 3 runs agreed bit for bit in * s: 1 output "
            "tensor(s), * parameter and 0 input gradient(s)",
            "autograd_determinism test_dataclass_output.<lambda>: 3 runs agreed bit for bit in "
            "* s: 2 output tensor(s), 2 parameter and 0 input gradient(s)",
            "autograd_determinism Sequential: 3 runs agreed bit for bit in * s: 1 output "
            "tensor(s), 4 parameter and 0 input gradient(s); buffers the forward changes: "
            "1.running_mean, 1.running_var, 1.num_batches_tracked",
        ],
        consecutive=False,
    )


def test_under_xdist_the_controller_prints_each_result_once(plugin_pytester: pytest.Pytester):
    """A worker has no terminal: the controller writes the result lines the workers' reports
    carry, each call's once (not again for its teardown's report), and only with ``-v``."""

    def results(*args: str) -> list[str]:
        run = run_session(plugin_pytester, PASSING, *args)
        run.assert_outcomes(passed=12)
        lines = [line for line in run.outlines if line.startswith("autograd_determinism ")]
        return sorted(re.sub(r" in [\d.]+ s", "", line) for line in lines)

    serial = results("-v")
    assert len(serial) >= 12
    assert results("-v", "-n", "2") == serial
    assert results("-n", "2") == []


FAILING = """
import time

import pytest
import torch
from torch import nn


def test_generator_seeded_from_the_os(autograd_determinism):
    layer = nn.Linear(4, 4)

    def forward(x):
        generator = torch.Generator()
        generator.seed()
        return layer(x + torch.randn(x.shape, generator=generator))  # LINE-OS

    autograd_determinism(forward, torch.randn(2, 4))


def test_branch_on_entropy(autograd_determinism):
    layer = nn.Linear(4, 4)

    def forward(x):
        generator = torch.Generator()
        generator.seed()
        h = layer(x)
        # 16 branches on fresh entropy: two runs agree on all of them once in 65,536.
        for _ in range(16):
            if torch.rand((), generator=generator) > 0.5:  # LINE-BRANCH
                h = torch.relu(h)
            else:
                h = torch.tanh(h)
        return h

    autograd_determinism(forward, torch.randn(2, 4), runs=12)


def test_branch_on_the_clock(autograd_determinism):
    def forward(x):
        if time.perf_counter_ns() % 2:
            return x.sin()  # LINE-SIN
        return x.cos()  # LINE-COS

    autograd_determinism(forward, torch.randn(5), runs=12)


class NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        generator = torch.Generator()
        generator.seed()
        return grad * 2 + 1e-3 * torch.randn(grad.shape, generator=generator)  # LINE-NOISE


def test_noise_in_a_custom_backward(autograd_determinism):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(NoisyBackward.apply(self.encoder(x)))

    autograd_determinism(Net(), torch.randn(3, 4))


def test_noise_reaching_one_parameter(autograd_determinism):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            weight = NoisyBackward.apply(self.encoder[1].weight) / 2
            h = nn.functional.linear(self.encoder[0](x), weight, self.encoder[1].bias)
            return self.head(h)

    autograd_determinism(Net(), torch.randn(3, 4))


class OsNoise(nn.Module):
    def forward(self, x):
        generator = torch.Generator()
        generator.seed()
        return x + torch.randn(x.shape, generator=generator)  # LINE-MODULE


def test_noise_inside_a_submodule(autograd_determinism):
    model = nn.Sequential(nn.Linear(4, 4), OsNoise(), nn.Linear(4, 2))
    autograd_determinism(model, torch.randn(3, 4))


def test_op_without_deterministic_implementation(autograd_determinism):
    def forward(x):
        pooled, indices = nn.functional.max_pool1d(x, 2, return_indices=True)
        return nn.functional.max_unpool1d(pooled, indices, 2)  # LINE-UNPOOL

    autograd_determinism(forward, torch.randn(1, 1, 4))


def test_forward_changing_a_trainable_parameter(autograd_determinism):
    class Clipped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                self.layer.weight.clamp_(-0.1, 0.1)
            return self.layer(x)

    autograd_determinism(Clipped(), torch.randn(2, 4))


class PutBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        flat = torch.zeros(grad.numel())
        flat.put_(torch.arange(grad.numel()), grad.reshape(-1))  # LINE-PUT
        return flat.view_as(grad)


def test_op_without_deterministic_backward(autograd_determinism):
    layer = nn.Linear(4, 4)
    autograd_determinism(lambda x: PutBackward.apply(layer(x)), torch.randn(2, 4))
"""


def line_of(source: str, marker: str) -> int:
    """The line number of ``# marker`` in the file pytester writes (leading blank lines go)."""
    lines = source.lstrip("\n").splitlines()
    return next(n for n, line in enumerate(lines, 1) if f"# {marker}" in line)


_failing_runs: list[pytest.RunResult] = []


@pytest.fixture
def failing(plugin_pytester: pytest.Pytester) -> pytest.RunResult:
    """The session of failing cases, run once and read by every test below."""
    if not _failing_runs:
        result = run_session(plugin_pytester, FAILING)
        result.assert_outcomes(failed=9)
        _failing_runs.append(result)
    return _failing_runs[0]


def test_generator_seeded_from_the_os_fails(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_generator_seeded_from_the_os")
    assert "DeterminismFailure: Run 2 of 3 differs from run 1" in text
    assert "output: 8 of 8 elements differ, largest absolute difference" in text
    assert (
        f"first differing op: #1 aten.randn.generator (forward at test_session.py:"
        f"{line_of(FAILING, 'LINE-OS')})" in text
    )
    assert "an explicit torch.Generator" in text


def test_branch_on_entropy_names_the_decision(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_branch_on_entropy")
    line = line_of(FAILING, "LINE-BRANCH")
    assert re.search(
        rf"run \d+ took a different branch at decision #\d+ \(test_session.py:{line}\)", text
    )
    assert f"Tensor.__bool__ -> True at test_session.py:{line}" in text
    assert f"Tensor.__bool__ -> False at test_session.py:{line}" in text
    assert re.search(r"first differing op: #\d+ aten.rand.generator", text)


def test_branch_on_the_clock_names_the_diverging_ops(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_branch_on_the_clock")
    assert "the runs stop doing the same ops at op #1" in text
    assert f"test_session.py:{line_of(FAILING, 'LINE-SIN')}" in text
    assert f"test_session.py:{line_of(FAILING, 'LINE-COS')}" in text
    assert "decided by something outside torch's ops" in text


def test_noise_in_a_custom_backward_is_found_in_the_gradients(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_noise_in_a_custom_backward")
    first = re.search(r"differs from run 1 .*?:\nE\s+(.*)\n", text).group(1)
    assert first.startswith("grad of encoder.weight: 16 of 16 elements differ"), first
    assert "also differ: grad of encoder.bias" in text
    assert "output" not in text.split("Localized")[0]  # the outputs agreed
    assert (
        f"aten.randn.generator (backward (NoisyBackwardBackward) at test_session.py:"
        f"{line_of(FAILING, 'LINE-NOISE')})" in text
    )


def test_noise_reaching_one_parameter_names_it(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_noise_reaching_one_parameter")
    assert "grad of encoder.1.weight: 16 of 16 elements differ" in text
    assert "also differ" not in text
    for other in ("encoder.0.weight", "encoder.1.bias", "head.weight"):
        assert other not in text


def test_noise_inside_a_submodule_names_the_module(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_noise_inside_a_submodule")
    assert (
        "aten.randn.generator (forward in 1 (OsNoise) at test_session.py:"
        f"{line_of(FAILING, 'LINE-MODULE')})" in text
    )


def test_op_without_deterministic_implementation_is_reported(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_op_without_deterministic_implementation")
    assert (
        "NondeterministicOpError: max_unpooling2d_forward_out has no deterministic "
        "implementation on this device" in text
    )
    assert f"where: forward at test_session.py:{line_of(FAILING, 'LINE-UNPOOL')}" in text
    assert "warn_only=True" in text
    assert "on the CPU" in text
    assert "The above exception was the direct cause" not in text


def test_op_without_deterministic_backward_is_reported(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_op_without_deterministic_backward")
    assert "NondeterministicOpError: put_ has no deterministic implementation" in text
    assert (
        f"where: backward (PutBackwardBackward) at test_session.py:{line_of(FAILING, 'LINE-PUT')}"
        in text
    )


def test_forward_changing_a_trainable_parameter_is_named(failing: pytest.RunResult) -> None:
    text = failure_section(failing, "test_forward_changing_a_trainable_parameter")
    assert "The forward changed the trainable parameter layer.weight in place" in text


BACKWARD_ON_CPU_THREADS = """
import pytest
import torch
from torch import nn

from {package}.testing.determinism import DeterminismError, DeterminismFailure


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 64))
        self.index = torch.randint(0, 16, (100_000,))

    def forward(self, x):
        return self.weight[self.index] * x  # LINE-GATHER


def test_accumulating_backward(autograd_determinism):
    # Indexing's backward is index_put_(accumulate=True); with deterministic mode off
    # (here, for this test) its CPU kernel accumulates in parallel, in varying order.
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(DeterminismFailure) as raised:
            autograd_determinism(Gather(), torch.randn(100_000, 64), runs=10)
    finally:
        torch.use_deterministic_algorithms(True)
    assert DeterminismError is DeterminismFailure  # the name it had before, kept
    print(raised.value)
""".replace("{package}", DEFAULT_PACKAGE)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 CPU threads to race")
def test_builtin_backward_op_is_located_at_its_forward_call(
    plugin_pytester: pytest.Pytester,
) -> None:
    result = run_session(plugin_pytester, BACKWARD_ON_CPU_THREADS, "-s")
    result.assert_outcomes(passed=1)
    line = line_of(BACKWARD_ON_CPU_THREADS, "LINE-GATHER")
    result.stdout.fnmatch_lines(
        [
            "  grad of weight: * elements differ*",
            "first differing op: #* aten.index_put.default (backward (IndexBackward0) of "
            f"__getitem__ in the model (Gather) at test_session.py:{line}): same inputs in "
            "both runs, different outputs, so this op itself is not deterministic",
        ]
    )


ISOLATION = """
import random

import numpy as np
import torch

BEFORE = {}


def state():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.initial_seed(),
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state()[1].tobytes(),
    )


def same(a, b):
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


def test_1_record_state():
    BEFORE["state"] = state()


def test_2_fails(autograd_determinism):
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.initial_seed() == 0
    generator = torch.Generator()
    generator.seed()
    autograd_determinism(lambda x: x + torch.rand(3, generator=generator), torch.zeros(3))


def test_3_sees_the_state_from_before():
    assert same(state(), BEFORE["state"])
"""


def test_state_after_a_failing_test_is_as_before(plugin_pytester: pytest.Pytester) -> None:
    result = run_session(plugin_pytester, ISOLATION)
    result.assert_outcomes(passed=2, failed=1)


CROSS_PROCESS = """
import os
import subprocess
import sys
import time

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.layer(x))


class SaltedByProcess(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        # str hashes are salted per process (PYTHONHASHSEED): same in one process only.
        # Modulo 2**20, two processes draw the same value once in a million (modulo 1000
        # once in a thousand: the likely cause of this test failing once in CI).
        return self.layer(x) + hash("salt") % 2**20


class HangsInAFreshProcess(nn.Module):
    # Hangs in any process but the one that made it (as a forward waiting on a lock that
    # only the test's process ever releases), after starting a helper process of its own.
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.made_in = os.getpid()

    def forward(self, x):
        if os.getpid() != self.made_in:
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            with open("helper.pid", "w") as file:
                file.write(str(helper.pid))
            while True:
                time.sleep(0.1)
        return self.layer(x)


def test_cross_process_hangs(autograd_determinism):
    autograd_determinism(
        HangsInAFreshProcess(), torch.randn(2, 4), cross_process=True, child_deadline=20
    )


def test_cross_process_passes(autograd_determinism):
    autograd_determinism(Model(), torch.randn(2, 4), cross_process=True)


def test_cross_process_difference(autograd_determinism):
    autograd_determinism(SaltedByProcess(), torch.randn(2, 4), cross_process=True)


def test_cross_process_needs_picklable_models(autograd_determinism):
    layer = nn.Linear(4, 4)
    autograd_determinism(lambda x: layer(x), torch.randn(2, 4), cross_process=True)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no reaper collected has ended), after a moment for a
    SIGKILL to land."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_cross_process_run(plugin_pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    result = run_session(plugin_pytester, CROSS_PROCESS, "-v")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        ["autograd_determinism Model: 3 runs (the last in a fresh process) agreed bit for bit *"]
    )
    text = failure_section(result, "test_cross_process_hangs")
    hung = re.search(
        r"DeterminismFailure: autograd_determinism: the fresh process of cross_process=True "
        r"\(pid (\d+), run 3\) did not finish within child_deadline=20 s and was killed with "
        r"its process group; it was running the model forward and backward\.",
        text,
    )
    assert hung, text
    assert "Its stack, innermost first: test_session.py:" in text
    assert "`time.sleep(0.1)`" in text
    output = re.search(r"Its output \(stdout and stderr\) is in (/\S+)", text)
    assert output, text
    assert Path(output[1]).is_file()
    for pid in (int(hung[1]), int((plugin_pytester.path / "helper.pid").read_text())):
        assert not _running(pid), f"process {pid} outlived the deadline"
    text = failure_section(result, "test_cross_process_difference")
    assert "Run 3 of 3 (in a fresh process) differs from run 1" in text
    assert (
        "the in-process runs agreed, so the cause is state that differs between processes" in text
    )
    text = failure_section(result, "test_cross_process_needs_picklable_models")
    assert "TypeError: cross_process=True sends the model or function" in text
    assert "module level" in text


BAD_ARGUMENTS = """
import pytest
import torch


@pytest.mark.parametrize("runs, error", [(1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_runs(autograd_determinism, runs, error):
    with pytest.raises(error) as raised:
        autograd_determinism(torch.sin, torch.ones(2), runs=runs)
    assert str(raised.value) == (
        f"autograd_determinism: runs={runs!r} is not allowed: expected an int >= 2 "
        "(two runs to compare at least)"
    )


def test_not_callable(autograd_determinism):
    with pytest.raises(TypeError) as raised:
        autograd_determinism(3, torch.ones(2))
    assert str(raised.value) == (
        "autograd_determinism: model_or_fn=3 is not allowed: expected an nn.Module or a callable"
    )


def test_cross_process_not_a_flag(autograd_determinism):
    with pytest.raises(TypeError) as raised:
        autograd_determinism(torch.sin, torch.ones(2), cross_process=1)
    assert str(raised.value) == (
        "autograd_determinism: cross_process=1 is not allowed: expected True or False"
    )


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf")])
def test_child_deadline(autograd_determinism, deadline):
    with pytest.raises(ValueError) as raised:
        autograd_determinism(torch.sin, torch.ones(2), cross_process=True, child_deadline=deadline)
    assert str(raised.value) == (
        f"autograd_determinism: child_deadline={deadline!r} is not allowed: expected a number > 0"
    )
"""


def test_bad_arguments_are_named(plugin_pytester: pytest.Pytester) -> None:
    run_session(plugin_pytester, BAD_ARGUMENTS).assert_outcomes(passed=8)


CALLING_CONVENTION = """
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def scaled(x, runs=1, scale=1.0):  # parameters named like the fixture's option
    return torch.tanh(x) * runs * scale


def test_forward_kwargs_reach_the_forward(autograd_determinism):
    x = torch.randn(4, requires_grad=True)
    result = autograd_determinism(scaled, x, forward_kwargs={"runs": 5}, runs=2)
    assert result.runs == 2
    torch.testing.assert_close(result.outputs, torch.tanh(x.detach()) * 5)
    assert set(result.input_grads) == {"x"}


def test_inputs_without_a_signature_name_and_nested_inputs(autograd_determinism):
    x = torch.randn(3, requires_grad=True)
    assert set(autograd_determinism(torch.sin, x).input_grads) == {"inputs[0]"}
    pair = (torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))
    result = autograd_determinism(lambda xs, mask: xs[0] * xs[1] * mask, pair,
                                  forward_kwargs={"mask": torch.ones(3, requires_grad=True)})
    assert set(result.input_grads) == {"xs[0]", "xs[1]", "mask"}


def test_modules_behind_a_lambda_and_a_method(autograd_determinism):
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4)
    result = autograd_determinism(lambda x: net(x), x)
    assert set(result.parameter_grads) == {"net.0.weight", "net.0.bias"}
    assert set(autograd_determinism(net.forward, x).parameter_grads) == {"0.weight", "0.bias"}


def test_non_reentrant_checkpoint(autograd_determinism):
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4))
    result = autograd_determinism(lambda x: checkpoint(block, x, use_reentrant=False),
                                  torch.randn(3, 4, requires_grad=True))
    assert set(result.parameter_grads) == {"block.0.weight", "block.0.bias", "block.3.weight",
                                           "block.3.bias"}


def test_unknown_keyword(autograd_determinism):
    autograd_determinism(scaled, torch.randn(3), scale=2.0)


def test_forward_kwargs_not_a_mapping(autograd_determinism):
    autograd_determinism(scaled, torch.randn(3), forward_kwargs=[("scale", 2.0)])


def test_meta_model(autograd_determinism):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    autograd_determinism(model, torch.randn(2, 4))


def test_meta_input(autograd_determinism):
    autograd_determinism(nn.Linear(4, 4), torch.empty(2, 4, device="meta"))


def test_reentrant_checkpoint(autograd_determinism):
    layer = nn.Linear(4, 4)
    autograd_determinism(lambda x: checkpoint(layer, x, use_reentrant=True),
                         torch.randn(2, 4, requires_grad=True))
"""


def test_calling_convention_and_data_less_tensors(plugin_pytester: pytest.Pytester) -> None:
    result = run_session(plugin_pytester, CALLING_CONVENTION)
    result.assert_outcomes(passed=4, failed=5)
    text = failure_section(result, "test_unknown_keyword")
    assert (
        "TypeError: autograd_determinism() got unknown keyword argument(s) 'scale': its options "
        "are forward_kwargs, runs, cross_process, cotangent_seed, child_deadline; keyword "
        "arguments of the forward go in forward_kwargs={'scale': ...}" in text
    )
    text = failure_section(result, "test_forward_kwargs_not_a_mapping")
    assert "TypeError: autograd_determinism: forward_kwargs must be a mapping" in text
    text = failure_section(result, "test_meta_model")
    assert "ValueError: autograd_determinism: parameter 0.weight is on the meta device" in text
    assert "model.to_empty(device='cpu')" in text
    text = failure_section(result, "test_meta_input")
    assert "ValueError: autograd_determinism: input input is on the meta device" in text
    text = failure_section(result, "test_reentrant_checkpoint")
    assert "ValueError: torch.utils.checkpoint with use_reentrant=True" in text
    assert "use_reentrant=False" in text


THREADS_AND_RESEEDS = """
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from torch import nn

layer = nn.Linear(4, 4)
scales = [1e8, 1.0, -1e8, 3.0]


def part(x, scale, wait):
    time.sleep(wait)
    return x * scale


def pooled(x, in_completion_order):
    h = layer(x)
    waits = [b / 2550 for b in os.urandom(len(scales))] if in_completion_order else [0] * 4
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(part, h.detach(), s, w) for s, w in zip(scales, waits)]
        done = as_completed(futures) if in_completion_order else futures
        parts = [future.result() for future in done]
    total = parts[0]
    for other in parts[1:]:
        total = total + other  # LINE-SUM
    return h * total


def test_thread_pool_in_submission_order(autograd_determinism):
    autograd_determinism(pooled, torch.randn(2, 4), forward_kwargs={"in_completion_order": False})


def test_thread_pool_race(autograd_determinism):
    x = torch.randn(2, 4)
    autograd_determinism(pooled, x, forward_kwargs={"in_completion_order": True}, runs=6)


class Reseeding(nn.Module):
    def __init__(self, seed=None):
        super().__init__()
        self.seed = seed
        self.layer = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))

    def forward(self, x):
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        torch.manual_seed(seed)
        return self.layer(x)


def test_forward_reseeding_with_a_fixed_seed(autograd_determinism):
    autograd_determinism(Reseeding(seed=7).train(), torch.randn(4, 4))


def test_forward_reseeding_from_the_os(autograd_determinism):
    autograd_determinism(Reseeding().train(), torch.randn(4, 4))
"""


def test_thread_pools_and_reseeds_are_named(plugin_pytester: pytest.Pytester) -> None:
    result = run_session(plugin_pytester, THREADS_AND_RESEEDS)
    result.assert_outcomes(passed=2, failed=2)
    text = failure_section(result, "test_thread_pool_race")
    assert "so that data came from ops on other threads, which the recorder does not see" in text
    assert "other Python threads ran during the runs (ThreadPoolExecutor-" in text
    assert "came from outside torch's ops" not in text
    text = failure_section(result, "test_forward_reseeding_from_the_os")
    assert "the forward reseeds torch's global RNG, with a different seed in each run" in text
    assert "Seed with a fixed value, or not inside the forward" in text


PYTHON_ATTRIBUTES = """
import torch
from torch import nn


class CountsCalls(nn.Module):
    def __init__(self, scale_by_calls):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale_by_calls = scale_by_calls
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # LINE-CALLS
        return self.linear(x) * (self.calls if self.scale_by_calls else 1)


def test_a_count_the_output_does_not_use(autograd_determinism):
    torch.manual_seed(0)
    autograd_determinism(CountsCalls(scale_by_calls=False), torch.randn(2, 4))


def test_a_count_that_scales_the_output(autograd_determinism):
    torch.manual_seed(0)
    autograd_determinism(CountsCalls(scale_by_calls=True), torch.randn(2, 4))
"""


def test_a_python_attribute_the_forward_changes_is_named(plugin_pytester: pytest.Pytester) -> None:
    result = run_session(plugin_pytester, PYTHON_ATTRIBUTES)
    result.assert_outcomes(passed=1, failed=1)
    text = failure_section(result, "test_a_count_that_scales_the_output")
    assert (
        "The forward changes Python attributes of the model, which the check does not put back "
        "between runs (it puts back parameters, buffers and RNG states), so each run starts "
        "from other values:"
    ) in text
    assert (
        "  CountsCalls.calls: 0 -> 1 (`self.calls += 1  # LINE-CALLS` at test_session.py:1" in text
    )
    assert (
        "so that data came from the Python attributes the forward changes between runs "
        "(CountsCalls.calls, above)"
    ) in text
    assert "came from outside torch's ops" not in text
    sessions.assert_no_internals(result)


# --- plain helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "cuda_built", "initialized", "configured", "action"),
    [
        ("2.13.0", True, False, None, None),  # torch >= 2.10 does not check it
        ("2.10.0+cu126", True, True, None, None),
        ("2.9.1+cu128", True, False, None, "set"),
        ("2.9.1+cu128", True, True, None, "too late"),
        ("2.9.1+cu128", True, True, ":16:8", None),
        ("2.9.1+cu128", True, True, ":4096:2", "too late"),
        ("2.9.1+cpu", False, False, None, None),
    ],
)
def test_cublas_workspace_action(package, version, cuda_built, initialized, configured, action):
    determinism = package("determinism")
    expected = None if action is None else determinism.CublasWorkspaceAction(action)
    assert determinism.cublas_workspace_action(version, cuda_built, initialized, configured) is (
        expected
    )


@pytest.mark.parametrize("cuda_started", [False, True])
def test_deterministic_mode_sets_cublas_workspace_for_older_torch(
    package, monkeypatch: pytest.MonkeyPatch, cuda_started: bool
) -> None:
    determinism = package("determinism")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_started)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    warns = pytest.warns(UserWarning, match="CUDA had already started")
    with warns if cuda_started else contextlib.nullcontext(), determinism.deterministic_mode():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_mode_leaves_cublas_workspace_alone_on_current_torch(
    package, monkeypatch: pytest.MonkeyPatch
) -> None:
    determinism = package("determinism")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with determinism.deterministic_mode():
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_bitwise_equal_keeps_nan_and_signed_zero_apart(package) -> None:
    comparison = package("comparison")
    nan = torch.tensor([float("nan"), 1.0])
    assert comparison.bitwise_equal(nan, nan.clone())
    assert not torch.equal(nan, nan.clone())  # why a plain comparison would not do
    assert not comparison.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not comparison.bitwise_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert comparison.bitwise_equal(torch.ones(2, 3).t(), torch.ones(3, 2))
    assert comparison.bitwise_equal(torch.ones(2, dtype=torch.complex64), torch.ones(2) + 0j)
    assert comparison.bitwise_equal(torch.ones(2, dtype=torch.bfloat16), torch.ones(2).bfloat16())


@pytest.mark.parametrize("with_memcmp", [True, False], ids=["memcmp", "torch.equal"])
def test_bitwise_equal_sees_one_bit_anywhere(package, monkeypatch, with_memcmp) -> None:
    comparison = package("comparison")
    if not with_memcmp:
        monkeypatch.setattr(comparison, "_memcmp", lambda: None)
    torch.manual_seed(0)
    weight = torch.randn(1000, 1000)
    assert comparison.bitwise_equal(weight, weight.clone())
    for index in (0, 499_999, 999_999):
        changed = weight.clone().view(-1)
        changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf")))
        assert not comparison.bitwise_equal(weight, changed.view(1000, 1000))
    rows = weight[1:]  # a view with a storage offset
    assert comparison.bitwise_equal(rows, rows.clone())
    assert not comparison.bitwise_equal(rows, weight[:-1].clone())
    assert comparison.bitwise_equal(weight[:, 1:], weight[:, 1:].clone())  # not contiguous
    assert comparison.bitwise_equal(torch.empty(0, 3), torch.empty(0, 3))
    assert not comparison.bitwise_equal(torch.tensor([1, 2]), torch.tensor([1, 3]))


def test_describe_tensor_difference(package) -> None:
    comparison = package("comparison")
    a = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    b = torch.tensor([[1.0, 2.5], [-3.0, 4.0]])
    assert comparison.describe_tensor_difference("grad of w", a, b, 3) == (
        "grad of w: 3 of 4 elements differ, largest absolute difference 6, "
        "1 NaN in one run only (first at [0, 1]: 2 in run 1, 2.5 in run 3)"
    )
    zero = comparison.describe_tensor_difference("output", torch.zeros(2), -torch.zeros(2), 2)
    assert "equal values with different bits (0.0 and -0.0)" in zero


def test_decisions_and_their_divergence(package) -> None:
    control_flow = package("control_flow")

    def forward(x):
        if x.sum() > 0:  # decision 1
            return int(x.argmax()) + x[0].item()
        return len(x.tolist())

    with control_flow.record_decisions() as positive:
        forward(torch.tensor([1.0, 2.0]))
    with control_flow.record_decisions() as negative:
        forward(torch.tensor([-1.0, -2.0]))
    here = Path(__file__).name
    assert [(d.op, d.value) for d in positive] == [
        ("Tensor.__bool__", True),
        ("Tensor.__int__", 1),
        ("Tensor.item", 1.0),
    ]
    assert [d.op for d in negative] == ["Tensor.__bool__", "Tensor.tolist"]
    assert positive[0].location.endswith(f"{here}:{forward.__code__.co_firstlineno + 1}")
    k, first, second = control_flow.first_divergence(positive, negative)
    assert (k, first.value, second.value) == (1, True, False)
    assert control_flow.first_divergence(positive, positive) is None
    assert control_flow.describe_divergence((k, first, second)).startswith(
        f"run 2 took a different branch at decision #1 ({first.location})"
    )
