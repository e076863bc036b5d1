"""The plugin's GPU side: ``--gpu``, the ``gpu`` fixture and marker, one GPU per xdist worker.

The machine running these tests has no GPU. The decisions are plain functions of the
driver's facts, tested here on every cause; the sessions run against a fake
``nvidia-smi`` (and a torch that claims a CUDA runtime) where a GPU machine is needed
only to get past the start-up check, never to run a kernel.
"""

from __future__ import annotations

import importlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    DEFAULT_PACKAGE,
    PLUGIN_MODULE,
    TEMPLATE_DIR,
    ProjectEnv,
    module_environment,
)

USAGE_ERROR = 4
H200 = "NVIDIA H200"
UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
UUID_C = "GPU-cccccccc-1111-2222-3333-444444444444"
needs_no_usable_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a usable GPU"
)


@pytest.fixture
def gpus(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    """The default project's ``gpus`` module."""
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return importlib.import_module(f"{DEFAULT_PACKAGE}.gpus")


def make_gpu(gpus, index: int, uuid: str, name: str = H200):
    return gpus.GpuInfo(
        index=index, uuid=uuid, name=name, memory_mib=143771, compute_capability="9.0"
    )


def install_fake_nvidia_smi(bin_dir: Path, driver: str, uuids: list[str]) -> None:
    """An ``nvidia-smi`` that answers the two queries the plugin makes."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    rows = "\\n".join(f"{i}, {uuid}, {H200}, 143771, 9.0" for i, uuid in enumerate(uuids))
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *--query-gpu=driver_version*) echo "{driver}" ;;\n'
        f"  *--query-gpu=index*) printf '{rows}\\n' ;;\n"
        "  *) exit 6 ;;\n"
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_nvidia_smi(gpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``fake_nvidia_smi(driver, uuids)``: the driver facts come from a fake ``nvidia-smi``.

    It goes first on PATH (for this process and the ones it starts), and this
    process's ``/proc/driver/nvidia/version`` is hidden.
    """

    def fake(driver: str = "580.65.06", uuids: tuple[str, ...] = (UUID_A, UUID_B)) -> None:
        bin_dir = tmp_path / "fake-bin"
        install_fake_nvidia_smi(bin_dir, driver, list(uuids))
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setattr(gpus, "PROC_DRIVER_VERSION", tmp_path / "no-proc-driver")

    return fake


FAKE_CUDA_BUILD_CONFTEST = f"""
import os

import torch
from {DEFAULT_PACKAGE} import gpus

# A CUDA 13.0 build of torch whose driver facts come from the fake nvidia-smi on PATH
# (or the file named by FAKE_PROC_DRIVER_VERSION). Loaded before the plugin's start-up
# check; nothing here or there initializes CUDA.
torch.version.cuda = "13.0"
gpus.PROC_DRIVER_VERSION = gpus.Path(
    os.environ.get("FAKE_PROC_DRIVER_VERSION", "/nonexistent/proc/driver/nvidia/version")
)
"""


@pytest.fixture
def fake_cuda_machine(plugin_pytester, fake_nvidia_smi):
    """``fake_cuda_machine(driver, uuids)``: the pytester's sessions (run them with
    ``runpytest_subprocess``) see a CUDA build of torch and the fake ``nvidia-smi``.

    xdist workers take their ``sys.path`` from the controller's start, so sessions with
    ``-n`` must run in a subprocess that has the project's ``src`` on PYTHONPATH.
    """

    def fake(driver: str = "580.65.06", uuids: tuple[str, ...] = (UUID_A, UUID_B)) -> None:
        fake_nvidia_smi(driver, uuids)
        plugin_pytester.makeconftest(FAKE_CUDA_BUILD_CONFTEST)

    return fake


# --- plain functions ---------------------------------------------------------------


def test_minimum_drivers_are_the_templates_table(gpus):
    """The project's one table of minimum drivers is cookiecutter.json's, and covers every
    CUDA build the template offers."""
    compatibility = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())["_compatibility"]
    table = {str(major): version for major, version in gpus.MIN_DRIVER_BY_CUDA_MAJOR.items()}
    assert table == compatibility["min_driver_by_cuda_major"]
    offered = {cuda for builds in compatibility["torch_cuda"].values() for cuda in builds}
    assert all(gpus.minimum_driver(cuda) is not None for cuda in offered)


def test_version_tuple_and_minimum_driver(gpus):
    assert gpus.version_tuple("580.65.06") == (580, 65, 6)
    assert gpus.version_tuple("12.6") == (12, 6)
    assert gpus.minimum_driver("12.6") == "525.60.13"
    assert gpus.minimum_driver("13.0") == "580.65.06"
    assert gpus.minimum_driver("11.8") is None
    with pytest.raises(ValueError, match="'abc'"):
        gpus.version_tuple("abc")


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release "
            "Build  (dvs-builder@U16)  Sun Jul 27 06:54:38 UTC 2025\nGCC version:  gcc 12\n",
            "580.65.06",
        ),
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n",
            "550.54.15",
        ),
        ("nothing useful\n", None),
    ],
)
def test_driver_version_from_proc(gpus, text, version):
    assert gpus.parse_proc_driver_version(text) == version


def test_gpu_query_parsed(gpus):
    text = f"0, {UUID_A}, {H200}, 143771, 9.0\n1, {UUID_B}, NVIDIA A100-SXM4-80GB, 81920, 8.0\n"
    assert gpus.parse_gpu_query(text) == [
        make_gpu(gpus, 0, UUID_A),
        gpus.GpuInfo(1, UUID_B, "NVIDIA A100-SXM4-80GB", 81920, "8.0"),
    ]
    assert "140.4 GiB, compute capability 9.0" in make_gpu(gpus, 0, UUID_A).describe()


def test_driver_facts_from_nvidia_smi(gpus, fake_nvidia_smi):
    fake_nvidia_smi(driver="570.12.34", uuids=(UUID_A,))
    assert gpus.driver_version() == "570.12.34"
    assert gpus.query_gpus() == [make_gpu(gpus, 0, UUID_A)]


def test_no_driver_facts_without_nvidia_smi(gpus, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(gpus, "PROC_DRIVER_VERSION", tmp_path / "missing")
    assert gpus.driver_version() is None
    assert gpus.query_gpus() == []


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        ("0,1", ["0", "1"]),
        (" 1 , 0 ", ["1", "0"]),
        (f"{UUID_B},{UUID_A}", [UUID_B, UUID_A]),
        ("MIG-0f6a1c2d-aaaa-bbbb-cccc-000000000000", ["MIG-0f6a1c2d-aaaa-bbbb-cccc-000000000000"]),
        ("", []),
        ("-1", []),
        ("none", []),
        ("0,-1,1", ["0"]),
    ],
)
def test_cuda_visible_devices_parsed_like_cuda(gpus, value, entries):
    assert gpus.parse_visible_devices(value) == entries


def test_visible_devices(gpus):
    machine = [make_gpu(gpus, 0, UUID_A), make_gpu(gpus, 1, UUID_B)]
    assert gpus.visible_devices(None, machine) == ["0", "1"]
    assert gpus.visible_devices("1", machine) == ["1"]
    assert gpus.visible_devices("GPU-bbbb", machine) == ["GPU-bbbb"]
    assert gpus.visible_devices("0,5,1", machine) == ["0"]  # CUDA stops at a bad entry
    assert gpus.visible_devices("GPU-ffff,0", machine) == []
    assert gpus.visible_devices("", machine) == []
    assert gpus.visible_devices("3,2", []) == ["3", "2"]  # GPUs unknown: taken as given
    assert gpus.gpu_for_entry("GPU-bbbb", machine) == machine[1]
    assert gpus.gpu_for_entry(f"MIG-{UUID_A}/1/0", machine) == machine[0]
    assert gpus.gpu_for_entry("7", machine) is None


@pytest.mark.parametrize(
    ("visible", "workers", "assigned"),
    [
        (["0", "1", "2", "3"], 4, ["0", "1", "2", "3"]),
        (["3", "1"], 2, ["3", "1"]),  # indices into the caller's list, not range(count)
        ([UUID_A, UUID_B], 2, [UUID_A, UUID_B]),
        (["MIG-x1", "MIG-x2"], 3, ["MIG-x1", "MIG-x2", "MIG-x1"]),
        (["0", "1"], 5, ["0", "1", "0", "1", "0"]),  # fewer GPUs than workers
        (["0"], 2, ["0", "0"]),
        (["0", "1", "2"], 2, ["0", "1"]),  # more GPUs than workers
    ],
)
def test_worker_assignment_round_robin(gpus, visible, workers, assigned):
    assert gpus.assign_devices(visible, workers) == assigned


def test_worker_assignment_needs_a_device(gpus):
    with pytest.raises(ValueError, match="no visible device"):
        gpus.assign_devices([], 2)


def diagnose(module, **facts):
    """``diagnose_cuda`` on a working machine's facts, with ``facts`` changed."""
    defaults = {
        "torch_version": "2.13.0+cu130",
        "cuda_runtime": "13.0",
        "driver": "580.65.06",
        "cuda_visible_devices": None,
        "gpus": [make_gpu(module, 0, UUID_A)],
    }
    return module.diagnose_cuda(**{**defaults, **facts})


def test_diagnosis_of_a_working_machine(gpus):
    assert diagnose(gpus) is None
    assert diagnose(gpus, cuda_runtime="12.6", driver="525.60.13") is None
    assert diagnose(gpus, cuda_visible_devices="0") is None
    assert diagnose(gpus, gpus=None) is None  # no nvidia-smi: nothing known to be wrong


def test_diagnosis_cpu_only_build(gpus):
    reason = diagnose(gpus, torch_version="2.13.0+cpu", cuda_runtime=None, driver=None)
    assert "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None)" in reason


def test_diagnosis_no_driver(gpus):
    assert "no NVIDIA driver found" in diagnose(gpus, driver=None, gpus=[])


@pytest.mark.parametrize(
    ("runtime", "driver", "minimum"),
    [("13.0", "575.51.03", "580.65.06"), ("12.6", "470.256.02", "525.60.13")],
)
def test_diagnosis_driver_older_than_cuda_runtime(gpus, runtime, driver, minimum):
    reason = diagnose(gpus, cuda_runtime=runtime, driver=driver)
    assert f"NVIDIA driver {driver} is older than {minimum}" in reason
    assert f"CUDA {runtime} that torch 2.13.0+cu130 was built with" in reason


@pytest.mark.parametrize("value", ["", "-1", "none", "GPU-ffff", "4"])
def test_diagnosis_cuda_visible_devices_hides_every_gpu(gpus, value):
    assert f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" in diagnose(
        gpus, cuda_visible_devices=value
    )


def test_diagnosis_driver_without_gpus(gpus):
    assert "sees no GPU" in diagnose(gpus, gpus=[])


@needs_no_usable_cuda
def test_cuda_unavailable_reason_here(gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    expected = "CPU-only build" if torch.version.cuda is None else "hides every GPU"
    assert expected in gpus.cuda_unavailable_reason()
    assert expected in gpus.cuda_unavailable_reason(initialize=False)


# --- pytest sessions ---------------------------------------------------------------

GPU_TESTS = """
import pytest

def test_cpu():
    pass

def test_with_fixture(gpu):
    assert gpu.type == "cuda"

@pytest.mark.gpu
def test_with_marker():
    pass

@pytest.mark.gpu(count=2)
def test_two_gpus():
    pass

@pytest.mark.keeps_cuda_memory
@pytest.mark.changes_global_state
def test_other_markers():
    pass
"""


def test_gpu_option_in_its_own_group(plugin_pytester):
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "--help")
    result.stdout.re_match_lines([r"GPU tests \(torch\):", r"\s+--gpu\s+run the tests that need"])


def test_gpu_tests_skipped_without_gpu_option(plugin_pytester):
    plugin_pytester.makepyfile(test_gpu=GPU_TESTS)
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "--strict-markers", "-rs")
    result.assert_outcomes(passed=2, skipped=3)
    result.stdout.fnmatch_lines(["GPU tests: skipped (run pytest --gpu to run them)"])
    reason = "needs a CUDA GPU: run pytest --gpu to run GPU tests"
    skips = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert len(skips) == 1, "a CPU run prints one line for every GPU test it skipped"
    assert skips[0].startswith("SKIPPED [3] ")
    assert skips[0].endswith(reason)


def test_markers_registered(plugin_pytester):
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.gpu(count=1): *",
            "@pytest.mark.keeps_cuda_memory: *",
            "@pytest.mark.changes_global_state: *",
        ]
    )


@pytest.mark.parametrize("count", ["0", "'2'", "True"])
def test_bad_gpu_count_fails_that_test_only(plugin_pytester, count):
    plugin_pytester.makepyfile(
        "import pytest\n\n"
        f"@pytest.mark.gpu(count={count})\ndef test_bad_marker():\n    pass\n\n"
        "@pytest.mark.gpu(count=2)\ndef test_good_marker():\n    pass\n\n"
        "def test_other():\n    pass\n"
    )
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE)
    result.assert_outcomes(passed=1, skipped=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_bad_marker*",
            f"@pytest.mark.gpu(count={count}): count must be a whole number >= 1",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")


STARTUP_PROBE = """
from pathlib import Path

def test_ran():
    Path("ran").write_text("yes")
"""


def assert_stopped_before_tests(pytester, result, message: str) -> None:
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --gpu was given, but CUDA is not usable: *{message}*"])
    assert not (pytester.path / "ran").exists()


@needs_no_usable_cuda
@pytest.mark.parametrize("visible", [None, ""])
def test_gpu_option_without_cuda_is_a_usage_error(plugin_pytester, monkeypatch, visible):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plugin_pytester.makepyfile(STARTUP_PROBE)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--gpu")
    cause = "CPU-only build" if torch.version.cuda is None else "hides every GPU"
    assert_stopped_before_tests(plugin_pytester, result, cause)


@needs_no_usable_cuda
@pytest.mark.parametrize(
    ("driver", "visible", "message"),
    [
        ("580.65.06", "", "CUDA_VISIBLE_DEVICES='' hides every GPU"),
        ("580.65.06", "GPU-ffff", "CUDA_VISIBLE_DEVICES='GPU-ffff' hides every GPU"),
        (
            "550.54.15",
            None,
            "NVIDIA driver 550.54.15 is older than 580.65.06, the minimum for CUDA 13.0",
        ),
    ],
)
@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_gpu_option_names_the_cause(
    plugin_pytester, fake_cuda_machine, monkeypatch, driver, visible, message, workers
):
    fake_cuda_machine(driver=driver)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plugin_pytester.makepyfile(STARTUP_PROBE)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--gpu", *workers)
    assert_stopped_before_tests(plugin_pytester, result, message)


RECORD_WORKER_ENV = """
import os
from pathlib import Path

import pytest

@pytest.mark.parametrize("n", range(8))
def test_record(n):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    Path(worker).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
"""


def recorded_worker_env(pytester) -> dict[str, str]:
    return {path.name: path.read_text() for path in pytester.path.glob("gw*")}


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (f"{UUID_B},{UUID_A}", {"gw0": UUID_B, "gw1": UUID_A}),
        (None, {"gw0": "0", "gw1": "1"}),
        ("1", {"gw0": "1", "gw1": "1"}),  # one GPU for two workers: they share it
    ],
)
def test_each_worker_gets_its_gpu(
    plugin_pytester, fake_cuda_machine, monkeypatch, visible, expected
):
    fake_cuda_machine()
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--gpu", "-n", "2")
    result.assert_outcomes(passed=8)
    assert recorded_worker_env(plugin_pytester) == expected
    pairs = ", ".join(f"{worker} -> {device}" for worker, device in expected.items())
    result.stdout.fnmatch_lines(
        [
            "GPU tests: on; torch *, CUDA runtime 13.0, NVIDIA driver 580.65.06, cuDNN *",
            f"  GPU *: {H200}, 140.4 GiB, compute capability 9.0, GPU-*",
            f"  xdist workers (CUDA_VISIBLE_DEVICES): {pairs}",
        ]
    )


def test_tx_specs_get_one_gpu_each(plugin_pytester, fake_cuda_machine, monkeypatch):
    fake_cuda_machine()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "--gpu", "--tx", "2*popen", "--dist", "load"
    )
    result.assert_outcomes(passed=8)
    assert recorded_worker_env(plugin_pytester) == {"gw0": "0", "gw1": "1"}
    result.stdout.fnmatch_lines(["  xdist workers (CUDA_VISIBLE_DEVICES): gw0 -> 0, gw1 -> 1"])


def test_workers_keep_the_callers_devices_without_gpu_option(plugin_pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUID_A},{UUID_B}")
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-n", "2")
    result.assert_outcomes(passed=8)
    assert recorded_worker_env(plugin_pytester) == {
        "gw0": f"{UUID_A},{UUID_B}",
        "gw1": f"{UUID_A},{UUID_B}",
    }


@pytest.mark.parametrize(
    ("visible", "expected", "header"),
    [
        (
            "0,1",
            {"gw0": "0", "gw1": "1"},
            "  xdist workers (CUDA_VISIBLE_DEVICES): gw0 -> 0, gw1 -> 1",
        ),
        (
            None,
            {"gw0": "<unset>", "gw1": "<unset>"},
            "  xdist workers: GPUs unknown (no nvidia-smi)*",
        ),
    ],
)
def test_workers_without_nvidia_smi(
    plugin_pytester, tmp_path, monkeypatch, visible, expected, header
):
    proc_version = tmp_path / "proc-driver-version"
    proc_version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Jul 2025\n")
    monkeypatch.setenv("FAKE_PROC_DRIVER_VERSION", str(proc_version))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no nvidia-smi
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plugin_pytester.makeconftest(FAKE_CUDA_BUILD_CONFTEST)
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--gpu", "-n", "2")
    result.assert_outcomes(passed=8)
    assert recorded_worker_env(plugin_pytester) == expected
    result.stdout.fnmatch_lines(
        ["GPU tests: on; torch *, CUDA runtime 13.0, NVIDIA driver 580.65.06, cuDNN *", header]
    )


@pytest.mark.parametrize(("uuids", "workers"), [((UUID_A, UUID_B, UUID_C), 3), ((UUID_A,), 1)])
def test_auto_starts_one_worker_per_gpu(
    plugin_pytester, fake_cuda_machine, monkeypatch, uuids, workers
):
    fake_cuda_machine(uuids=uuids)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--gpu", "-n", "auto")
    result.assert_outcomes(passed=8)
    assert sorted(recorded_worker_env(plugin_pytester).values()) == [
        str(index) for index in range(workers)
    ]


def test_auto_without_gpu_option_left_to_xdist(plugin_pytester, fake_cuda_machine, monkeypatch):
    fake_cuda_machine(uuids=(UUID_A, UUID_B, UUID_C))
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "1")
    plugin_pytester.makepyfile(RECORD_WORKER_ENV)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-n", "auto")
    result.assert_outcomes(passed=8)
    assert list(recorded_worker_env(plugin_pytester)) == ["gw0"]


# --- torch stays unimported, and two copies of the plugin ----------------------------

BLOCK_TORCH = """
import sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} imported while loading the plugin")

sys.meta_path.insert(0, BlockTorch())
"""


def test_loading_the_plugin_imports_no_torch(default_project):
    code = BLOCK_TORCH + f"import {PLUGIN_MODULE}\nassert 'torch' not in sys.modules\n"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=default_project,
        env=module_environment(default_project),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


FOREIGN_TESTS = """
import pytest
import torch


def test_leaves_deterministic_mode_on():
    torch.use_deterministic_algorithms(True)


def test_changes_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_no_fixtures_of_the_plugin(request):
    for name in ("gpu", "gradcheck", "autograd_determinism"):
        with pytest.raises(pytest.FixtureLookupError):
            request.getfixturevalue(name)
"""


@pytest.mark.slow
def test_two_projects_and_a_foreign_one_in_one_environment(bake, tmp_path):
    """Installed side by side, each project's pytest loads its own copy of the plugin, and
    a pytest run of anything else in that environment sees no plugin at all."""
    env = ProjectEnv(tmp_path / "venv")
    projects = {package: bake(project=package.replace("_", "-")) for package in ("alpha", "beta")}
    for project in projects.values():
        env.install(project)
    for package, project in projects.items():
        (project / "tests" / "test_own_copy.py").write_text(
            "import pytest\n\n"
            "def test_gpu_test(gpu):\n    pass\n\n"
            "@pytest.mark.gpu(count=2)\ndef test_marked():\n    pass\n\n"
            "def test_own_fixtures(gradcheck, autograd_determinism):\n"
            f"    assert gradcheck.__module__ == '{package}.testing.gradcheck'\n"
            f"    assert autograd_determinism.__module__ == '{package}.testing.determinism'\n"
        )
        assert env.run("pytest", "--help", cwd=project).stdout.count("--gpu ") == 1
        result = env.run(
            "pytest", "tests/test_own_copy.py", "-rs", "-p", "no:cacheprovider", cwd=project
        )
        assert "1 passed, 2 skipped" in result.stdout
        assert "needs a CUDA GPU: run pytest --gpu" in result.stdout
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "test_foreign.py").write_text(FOREIGN_TESTS)
    result = env.run("pytest", "-p", "no:cacheprovider", "-W", "error", cwd=foreign)
    assert "3 passed" in result.stdout
    assert "torch global state" not in result.stdout
    assert "GPU tests" not in result.stdout
    assert "--gpu" not in env.run("pytest", "--help", cwd=foreign).stdout
    assert "keeps_cuda_memory" not in env.run("pytest", "--markers", cwd=foreign).stdout
    unknown = env.run("pytest", "--gpu", cwd=foreign, check=False)
    assert unknown.returncode == USAGE_ERROR
    assert "unrecognized arguments: --gpu" in unknown.stderr


# --- the checks after GPU tests, against a fake CUDA runtime --------------------------
# The real thing runs in benchmarks/gpu_checks/plugin_gpu.sh on a GPU machine. Here
# torch.cuda's memory counter, synchronize and device queries are replaced so that the
# plugin's wiring (what is checked when, how it is reported) runs on every machine.

AFTER_TEST_CHECKS = """
import pytest
import torch

KEPT = []


class FakeCudaBlock:
    # Counts as allocated CUDA memory while it is alive.
    def __init__(self, size):
        self.size = size
        torch.cuda.fake_allocated[0] += size

    def __del__(self):
        getattr(torch.cuda, "fake_allocated", [0])[0] -= self.size


@pytest.fixture
def holder():
    return {}


def test_clean(gpu):
    block = FakeCudaBlock(100)
    del block


def test_planted_leak(gpu):
    KEPT.append(FakeCudaBlock(4096))


@pytest.mark.keeps_cuda_memory
def test_kept_on_purpose(gpu):
    KEPT.append(FakeCudaBlock(10))


def test_memory_held_by_a_function_fixture(gpu, holder):
    holder["model"] = FakeCudaBlock(500)


def test_asynchronous_error(gpu):
    torch.cuda.fake_pending_error[0] = "CUDA error: device-side assert triggered"


def test_fails_with_an_asynchronous_error_too(gpu):
    torch.cuda.fake_pending_error[0] = "CUDA error: an illegal memory access was encountered"
    assert False, "the test's own failure"


@pytest.mark.gpu(count=2)
def test_two_gpus():
    pass
"""


@pytest.fixture
def fake_cuda_runtime(gpus, monkeypatch):
    """One fake GPU for in-process sessions: nothing reaches a CUDA driver.

    Returns the device indices the plugin warmed up, in order.
    """
    plugin = importlib.import_module(PLUGIN_MODULE)
    warmed_up = []
    monkeypatch.setattr(plugin, "_warm_up_device", warmed_up.append)
    monkeypatch.setattr(gpus, "cuda_unavailable_reason", lambda **_: None)
    monkeypatch.setattr(torch.cuda, "fake_allocated", [0], raising=False)
    monkeypatch.setattr(torch.cuda, "fake_pending_error", [None], raising=False)

    def synchronize(device=None):
        error, torch.cuda.fake_pending_error[0] = torch.cuda.fake_pending_error[0], None
        if error:
            raise RuntimeError(error)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(
        torch.cuda, "memory_allocated", lambda device=None: torch.cuda.fake_allocated[0]
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: SimpleNamespace(
            name="Fake GPU", total_memory=80 * 2**30, major=9, minor=0, uuid=UUID_A[4:]
        ),
    )
    return warmed_up


def test_after_test_checks_of_gpu_tests(plugin_pytester, fake_cuda_runtime):
    plugin_pytester.makepyfile(test_after=AFTER_TEST_CHECKS)
    result = plugin_pytester.runpytest("-p", PLUGIN_MODULE, "--gpu", "-rsE", "-p", "no:randomly")
    result.assert_outcomes(passed=4, failed=2, errors=1, skipped=1)
    assert torch.cuda.fake_allocated == [4096 + 10]  # only what KEPT holds
    assert fake_cuda_runtime == [0]  # once, before the first GPU test is measured
    result.stdout.fnmatch_lines(
        [
            "GPU tests: on; torch *",
            f"  cuda:0: Fake GPU, 80.0 GiB, compute capability 9.0, {UUID_A}",
            "*_ ERROR at teardown of test_planted_leak _*",
            "AfterTestCheckFailed: cuda:0: the test left 4096 bytes (0.00 MiB) of CUDA memory "
            "allocated (0 when its body started, 4096 after its teardown*",
            "*_ test_asynchronous_error _*",
            "AfterTestCheckFailed: CUDA reported an error while finishing this test's kernels*",
            "CUDA error: device-side assert triggered",
            "*_ test_fails_with_an_asynchronous_error_too _*",
            "*AssertionError: the test's own failure*",
            "*CUDA error: an illegal memory access was encountered*",
            "SKIPPED [[]1[]] *needs 2 GPUs, 1 visible to this test process*",
        ]
    )
    errors = [line for line in result.stdout.lines if line.startswith("ERROR")]
    assert len(errors) == 1
    assert errors[0].startswith("ERROR test_after.py::test_planted_leak - AfterTestCheckFailed")
