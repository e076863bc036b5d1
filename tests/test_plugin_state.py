"""Isolation of torch's global state: ``testing.global_state`` and the plugin's check per test."""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE

# torch.use_deterministic_algorithms imports torch._inductor on its first call. In-process
# pytester sessions drop the modules imported during the session, and importing
# torch._inductor a second time registers its test operators twice (a RuntimeError):
# make that first call here, outside every session.
torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled())


@pytest.fixture
def global_state(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    """The default project's ``testing.global_state`` module; state is restored after the test."""
    monkeypatch.syspath_prepend(str(default_project / "src"))
    module = importlib.import_module(f"{DEFAULT_PACKAGE}.testing.global_state")
    start = module.snapshot()
    yield module
    module.restore(start)


def set_threads_other_than_current() -> None:
    torch.set_num_threads(2 if torch.get_num_threads() == 1 else 1)


def flip_cudnn_deterministic() -> None:
    torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic


# (what the change is reported as, the change)
CHANGES = [
    (
        "torch.get_default_dtype(): torch.float32 -> torch.float64",
        lambda: torch.set_default_dtype(torch.float64),
    ),
    (
        "torch.get_default_device(): device(type='cpu') -> device(type='meta')",
        lambda: torch.set_default_device("meta"),
    ),
    ("torch.is_grad_enabled(): True -> False", lambda: torch.set_grad_enabled(False)),
    (
        "anomaly mode (torch.is_anomaly_enabled(), check_nan): (False, True) -> (True, False)",
        lambda: torch.set_anomaly_enabled(True, check_nan=False),
    ),
    (
        "deterministic algorithms (torch.are_deterministic_algorithms_enabled(), warn_only): "
        "(False, False) -> (True, True)",
        lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    ),
    (
        "torch.utils.deterministic.fill_uninitialized_memory: True -> False",
        lambda: setattr(torch.utils.deterministic, "fill_uninitialized_memory", False),
    ),
    (
        "torch.backends.cudnn.enabled: True -> False",
        lambda: setattr(torch.backends.cudnn, "enabled", False),
    ),
    ("torch.backends.cudnn.deterministic: ", flip_cudnn_deterministic),
    (
        "torch.backends.cudnn.benchmark: False -> True",
        lambda: setattr(torch.backends.cudnn, "benchmark", True),
    ),
    (
        "torch.get_float32_matmul_precision(): 'highest' -> 'high'",
        lambda: torch.set_float32_matmul_precision("high"),
    ),
    (
        "torch.backends.mkldnn.matmul.fp32_precision: 'none' -> 'bf16'",
        lambda: torch.set_float32_matmul_precision("medium"),
    ),
    (
        "torch.backends.cuda.matmul.fp32_precision: 'none' -> 'tf32'",
        lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    ),
    (
        "torch.backends.cudnn.conv.fp32_precision: 'tf32' -> 'ieee'",
        lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    ),
    (
        "torch.backends.mkldnn.matmul.fp32_precision: 'none' -> 'bf16'",
        lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    ),
    (
        "torch.backends.fp32_precision: 'none' -> 'ieee'",
        lambda: setattr(torch.backends, "fp32_precision", "ieee"),
    ),
    (
        # The legacy flag: reported and restored through the new API.
        "torch.backends.cuda.matmul.fp32_precision: 'none' -> 'tf32'",
        lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    ),
    (
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction: True -> False",
        lambda: setattr(
            torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False
        ),
    ),
    (
        "torch.backends.cuda.flash_sdp_enabled(): True -> False",
        lambda: torch.backends.cuda.enable_flash_sdp(False),
    ),
    ("torch.get_num_threads(): ", set_threads_other_than_current),
]


@pytest.mark.parametrize(
    ("reported", "change"), CHANGES, ids=[line.split(":")[0] for line, _ in CHANGES]
)
def test_each_setting_reported_and_restored(global_state, reported, change):
    before = global_state.snapshot()
    change()
    changed = global_state.differences(before, global_state.snapshot())
    assert any(line.startswith(reported) for line in changed), changed
    global_state.restore(before)
    assert global_state.differences(before, global_state.snapshot()) == []
    # Restoring through the new API leaves nothing that makes the legacy API raise.
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is True


def test_unchanged_state_has_no_differences(global_state):
    before = global_state.snapshot()
    assert global_state.differences(before, global_state.snapshot()) == []
    assert before == global_state.snapshot()


@pytest.mark.parametrize(
    ("name", "reseed", "draw"),
    [
        ("torch CPU RNG", lambda: torch.manual_seed(1234), lambda: torch.rand(4).tolist()),
        ("random (Python)", lambda: random.seed(1234), lambda: [random.random() for _ in range(4)]),
        (
            "numpy.random (global RNG)",
            lambda: np.random.seed(1234),
            lambda: np.random.rand(4).tolist(),
        ),
    ],
)
def test_reseeding_and_draws_are_no_differences_and_are_undone(global_state, name, reseed, draw):
    before = global_state.snapshot()
    first = draw()
    reseed()
    draw()
    after = global_state.snapshot()
    assert after != before  # the generator's state is part of the snapshot ...
    assert global_state.differences(before, after) == []  # ... but never a difference
    global_state.restore(before)
    assert global_state.snapshot() == before
    assert draw() == first
    assert name in {rng.name for rng in before.rngs}


def test_snapshot_imports_nothing(default_project):
    """Without torch and NumPy imported, a snapshot covers ``random`` and imports neither."""
    module_path = default_project / "src" / DEFAULT_PACKAGE / "testing" / "global_state.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('global_state', {str(module_path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['global_state'] = module\n"
        "spec.loader.exec_module(module)\n"
        "state = module.snapshot()\n"
        "module.restore(state)\n"
        "assert state.settings == (), state.settings\n"
        "assert [rng.name for rng in state.rngs] == ['random (Python)']\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- the check around every test ----------------------------------------------------

ISOLATION_TESTS = """
import random

import numpy as np
import pytest
import torch

SESSION_SEED = torch.initial_seed()
PYTHON_STATE = random.getstate()
NUMPY_KEYS = np.random.get_state()[1].tolist()
THREADS = torch.get_num_threads()


def test_leaves_deterministic_mode_on():
    torch.use_deterministic_algorithms(True)


def test_starts_clean_after_deterministic_mode():
    assert not torch.are_deterministic_algorithms_enabled()


def test_changes_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_starts_clean_after_dtype():
    assert torch.get_default_dtype() == torch.float32


def test_reseeds_the_rng():
    torch.manual_seed(0)


def test_reseeds_python_and_numpy():
    random.seed(1)
    np.random.seed(1)


class SelfSeedingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.linear = torch.nn.Linear(3, 2)


def test_model_that_seeds_itself():
    assert SelfSeedingModel().linear.weight.shape == (2, 3)


def test_starts_clean_after_reseed():
    assert torch.initial_seed() == SESSION_SEED
    assert random.getstate() == PYTHON_STATE
    assert np.random.get_state()[1].tolist() == NUMPY_KEYS


def test_draws_random_numbers():
    torch.randn(3)
    random.random()


def test_seeds_inside_fork_rng():
    with torch.random.fork_rng():
        torch.manual_seed(0)


def test_restores_what_it_changes():
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_fixture_sets_state_for_its_test(deterministic):
    assert torch.are_deterministic_algorithms_enabled()


@pytest.fixture(scope="module")
def seeded_module():
    torch.manual_seed(1234)


def test_module_fixture_seeds(seeded_module):
    assert torch.initial_seed() == 1234


def test_module_fixture_seed_kept(seeded_module):
    assert torch.initial_seed() == 1234


@pytest.mark.changes_global_state
def test_intended_change():
    torch.set_num_threads(THREADS + 1)


def test_threads_restored_after_intended_change():
    assert torch.get_num_threads() == THREADS


def test_fails_and_leaks():
    torch.set_default_dtype(torch.float16)
    assert False, "the test's own failure"


def test_starts_clean_after_a_failure():
    assert torch.get_default_dtype() == torch.float32
"""


def test_leaks_fail_the_test_that_leaked_and_the_next_starts_clean(plugin_pytester):
    plugin_pytester.makepyfile(test_isolation=ISOLATION_TESTS)
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "-p", "no:randomly")
    result.assert_outcomes(passed=15, failed=3)
    failed = {
        line.split(" - ")[0].split("::")[1]
        for line in result.stdout.lines
        if line.startswith("FAILED")
    }
    assert failed == {
        "test_leaves_deterministic_mode_on",
        "test_changes_default_dtype",
        "test_fails_and_leaks",
    }
    result.stdout.fnmatch_lines(
        [
            "*_ test_leaves_deterministic_mode_on _*",
            "AfterTestCheckFailed: the test changed torch's global settings and did not "
            "restore them*",
            "  deterministic algorithms (torch.are_deterministic_algorithms_enabled(), "
            "warn_only): (False, False) -> (True, False)",
            "*_ test_changes_default_dtype _*",
            "  torch.get_default_dtype(): torch.float32 -> torch.float64",
            "*_ test_fails_and_leaks _*",
            "*AssertionError: the test's own failure*",
        ]
    )
    # The short summary repeats messages in full under CI=true: count the failure reports.
    reports = result.stdout.str().split("short test summary info")[0]
    assert reports.count("did not restore them") == 2
    assert "RNG:" not in reports


FIXTURE_CHANGES = """
import pytest
import torch

SESSION_SEED = torch.initial_seed()


@pytest.fixture
def deterministic_never_undone():
    torch.use_deterministic_algorithms(True)


@pytest.fixture
def seeded():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def float64_for_the_module():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_with_a_fixture_that_never_undoes(deterministic_never_undone):
    assert torch.are_deterministic_algorithms_enabled()


def test_after_it_starts_clean():
    assert not torch.are_deterministic_algorithms_enabled()


def test_seeded_by_a_fixture(seeded):
    assert torch.initial_seed() == 0


def test_seed_undone_after_it():
    assert torch.initial_seed() == SESSION_SEED


def test_module_fixture_state(float64_for_the_module, seeded):
    assert torch.get_default_dtype() == torch.float64


def test_module_fixture_state_kept(float64_for_the_module, seeded):
    assert torch.get_default_dtype() == torch.float64
"""


def test_changes_made_by_function_fixtures_are_undone_after_teardown(plugin_pytester):
    plugin_pytester.makepyfile(
        test_fixtures=FIXTURE_CHANGES,
        # The module fixture's own teardown, at the end of its module, puts float32 back.
        test_fixtures_z="import torch\n\ndef test_dtype():\n"
        "    assert torch.get_default_dtype() == torch.float32\n",
    )
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "-p", "no:randomly")
    result.assert_outcomes(passed=7)


def test_isolation_is_quiet_for_clean_tests(plugin_pytester):
    plugin_pytester.makepyfile(
        "import torch\n\n"
        "def test_a():\n    torch.randn(2)\n\n"
        "def test_b():\n    assert torch.get_default_dtype() == torch.float32\n"
    )
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "-W", "error")
    result.assert_outcomes(passed=2)


def test_torch_free_suite_never_imports_torch(plugin_pytester):
    plugin_pytester.makeconftest(
        "import sys\n\n"
        "def pytest_sessionfinish():\n"
        "    assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    plugin_pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()


# --- torch_global_state = fail | warn | off ------------------------------------------

POLICY_TESTS = """
import pytest
import torch


def test_leaves_float64():
    torch.set_default_dtype(torch.float64)


def test_starts_clean():
    assert torch.get_default_dtype() == torch.float32


def test_seeds_inside_the_determinism_check(autograd_determinism):
    torch.manual_seed(1234)
    model = torch.nn.Linear(3, 2)
    autograd_determinism(model, torch.randn(4, 3))
"""


def test_default_policy_fails_a_changed_setting_but_not_a_reseed(plugin_pytester):
    plugin_pytester.makepyfile(test_policy=POLICY_TESTS)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "torch global state: torch_global_state = fail (settings and RNGs restored *",
            "FAILED test_policy.py::test_leaves_float64 - AfterTestCheckFailed*",
        ]
    )


def test_warn_policy_warns_with_the_change_and_passes(plugin_pytester):
    plugin_pytester.makepyfile(test_policy=POLICY_TESTS)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:randomly", "-o", "torch_global_state=warn"
    )
    result.assert_outcomes(passed=3, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*warnings summary*",
            "*/test_policy.py:5: TorchGlobalStateWarning: test_policy.py::test_leaves_float64: "
            "the test changed torch's global settings*",
            "    torch.get_default_dtype(): torch.float32 -> torch.float64",
        ]
    )


def test_off_policy_only_restores(plugin_pytester):
    plugin_pytester.makepyfile(test_policy=POLICY_TESTS)
    plugin_pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntorch_global_state = "off"\n')
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:randomly", "-W", "error"
    )
    result.assert_outcomes(passed=3)
    assert "torch_global_state = off" in result.stdout.str()
    assert "did not restore" not in result.stdout.str()


@pytest.mark.parametrize("value", ["strict", "", "FAIL!"])
def test_bad_policy_is_a_usage_error(plugin_pytester, value):
    plugin_pytester.makepyfile("def test_nothing():\n    pass\n")
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "-o", f"torch_global_state={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: torch_global_state = {value!r} is not allowed: expected one of fail, "
            "warn, off (in [[]tool.pytest.ini_options[]] or -o)"
        ]
    )
