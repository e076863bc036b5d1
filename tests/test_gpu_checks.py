"""The GPU check scripts (benchmarks/gpu_checks/) run as their dry run does on a CPU machine.

The GPU run itself needs an NVIDIA GPU; the dry run runs the same steps, skips what
needs CUDA, and must catch what would break the GPU run: a wrong path, flag or module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEMPLATE_DIR, copy_template, tool

GPU_CHECKS = TEMPLATE_DIR / "benchmarks" / "gpu_checks"
STEPS = ["environment", "plugin", "determinism", "gradcheck", "commands", "compile"]
EIGHT_MINUTES = 480
ROW = re.compile(r"^\| (?P<check>.+?) \| (?P<result>.+?) \| (?P<seconds>[\d.]+) \|$", re.MULTILINE)


def run_all(
    out: Path, *arguments: str, script: Path = GPU_CHECKS / "all.sh", **variables: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run all.sh with OUT=out and this interpreter as PYTHON; its summary's rows by check."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECKS_")}
    environ.update(OUT=str(out), PYTHON=sys.executable, **variables)
    environ.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", str(script), *arguments],
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    rows = {match["check"]: match["result"] for match in ROW.finditer(summary)}
    return result, rows


def test_dry_run_runs_every_step_and_skips_only_what_needs_cuda(tmp_path: Path):
    result, rows = run_all(tmp_path, "--dry-run")

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.endswith((tmp_path / "summary.md").read_text())
    for step in STEPS:
        assert rows.pop(f"**{step}** (whole step)") == "**passed**", step
        assert "=== PASS bake" in (tmp_path / f"{step}.log").read_text() or step == "environment"
    results = set(rows.values())
    assert results == {"passed", "skipped (dry run: needs CUDA)"}, rows
    # What the GPU run is for is skipped; what runs on a CPU too ran.
    for check in [
        "environment: torch sees CUDA",
        "plugin: memory facts: allocator and driver",
        "plugin: pytest --gpu -n 2, both workers on GPU 0",
        "plugin: no false leak report from CUDA library workspaces; a global tensor reported",
        "plugin: device-side assert fails the test that caused it",
        "determinism: autograd_determinism on CUDA",
        "gradcheck: gradcheck on CUDA in float64",
        "commands: doctor --require-gpu",
        "commands: torchrun --nproc_per_node 1, NCCL",
    ]:
        assert rows[check] == "skipped (dry run: needs CUDA)", check
    for check in [
        "environment: python packages",
        *(f"{step}: collect the tests without --gpu" for step in STEPS[1:]),
        "commands: resumed run bitwise equal to the whole run",
        "commands: DDP over gloo, 2 ranks on one cpu device",
        "commands: train throughput, cpu against cpu",
    ]:
        assert rows[check] == "passed", check
    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped; 0 step\(s\) failed", result.stdout, re.M)


def test_a_moved_module_and_a_hanging_step_fail_the_dry_run(tmp_path: Path):
    clone = copy_template(tmp_path / "template")
    checks = clone / "benchmarks" / "gpu_checks"
    gradcheck_script = checks / "gradcheck_gpu.sh"
    script = gradcheck_script.read_text()
    moved = "from dynamic_model.testing.gradcheck import"
    assert moved in script
    gradcheck_script.write_text(script.replace(moved, "from dynamic_model.testing.grad import"))
    environment_script = checks / "environment_gpu.sh"
    environment_script.write_text(
        environment_script.read_text().replace("\nfinish_checks\n", "\nsleep 60\nfinish_checks\n")
    )
    all_script = checks / "all.sh"
    all_script.write_text(all_script.read_text().replace("environment:20 ", "environment:1 "))

    result, rows = run_all(
        tmp_path / "out", "--dry-run", "gradcheck", "environment", script=all_script
    )

    assert result.returncode == 1, result.stdout + result.stderr
    assert rows["**environment** (whole step)"] == "**failed (the step ran past its 3 s)**"
    assert rows["**gradcheck** (whole step)"] == "**failed (exit status 1; see gradcheck.log)**"
    assert rows["gradcheck: bake"] == "passed"
    assert rows["gradcheck: collect the tests without --gpu"] == (
        "failed (exit status 2, expected 0)"
    )
    assert (
        "No module named 'dynamic_model.testing.grad'"
        in (tmp_path / "out" / "gradcheck.log").read_text()
    )
    assert not any(check.startswith(("plugin", "commands")) for check in rows)
    assert "; 2 step(s) failed;" in result.stdout


def test_copied_project_where_cookiecutter_is_missing(tmp_path: Path):
    result, rows = run_all(tmp_path, "--dry-run", "plugin", "gradcheck", GPU_CHECKS_BAKE="copy")

    assert result.returncode == 0, result.stdout + result.stderr
    assert rows["plugin: collect the tests without --gpu"] == "passed"
    assert rows["gradcheck: collect the tests without --gpu"] == "passed"


def test_an_unknown_step_is_refused(tmp_path: Path):
    result, _ = run_all(tmp_path, "--dry-run", "plugins")

    assert result.returncode == 2
    assert result.stderr == (
        "all.sh: unknown step or option 'plugins'; steps: environment plugin determinism "
        "gradcheck commands compile; option: --dry-run\n"
    )
    assert not (tmp_path / "summary.md").exists()


def test_step_time_limits_add_up_to_under_eight_minutes():
    listed = re.search(r"^all_steps=\((.*)\)$", (GPU_CHECKS / "all.sh").read_text(), re.M)
    assert listed is not None
    limits = dict(entry.split(":") for entry in listed[1].split())
    assert list(limits) == STEPS
    assert sum(map(int, limits.values())) <= EIGHT_MINUTES - 10  # all.sh's own seconds
    for step in STEPS:
        assert (GPU_CHECKS / f"{step}_gpu.sh").is_file()


PROBE = r"""
source "$GPU_CHECKS_DIR/lib.sh" "$@"
check "passes" --status 3 --expect "^out" -- sh -c 'echo out; exit 3'
check "wrong status" -- sh -c 'exit 3'
check "missing output" --expect "^there$" -- echo here
check "too slow" --timeout 1 -- sleep 30
check "needs a module" --needs no_such_module_for_gpu_checks -- false
check "needs CUDA" --cuda -- sh -c 'echo ran; exit 0'
check "misspelt option" --exepct x -- true
finish_checks
"""


@pytest.mark.parametrize("dry_run", [False, True], ids=["gpu-run", "dry-run"])
def test_check_records_each_result(tmp_path: Path, dry_run: bool):
    probe = tmp_path / "probe_gpu.sh"
    probe.write_text(PROBE)
    results = tmp_path / "results.tsv"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECKS_")}
    environ.update(
        GPU_CHECKS_DIR=str(GPU_CHECKS), GPU_CHECKS_RESULTS=str(results), PYTHON=sys.executable
    )

    run = subprocess.run(
        ["bash", str(probe), *(["--dry-run"] if dry_run else [])],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert run.returncode == 1, run.stdout + run.stderr
    assert "probe: 4 check(s) FAILED" in run.stdout
    rows = [line.split("\t") for line in results.read_text().splitlines()]
    assert {step for step, *_ in rows} == {"probe"}
    assert {name: result for _, name, result, _ in rows} == {
        "passes": "passed",
        "wrong status": "failed (exit status 3, expected 0)",
        "missing output": "failed (missing: ^there$)",
        "too slow": "failed (timed out after 1 s)",
        "needs a module": f"skipped ({sys.executable} cannot import no_such_module_for_gpu_checks)",
        "needs CUDA": "skipped (dry run: needs CUDA)" if dry_run else "passed",
        "misspelt option": "failed (the script passes check an unknown option: --exepct)",
    }
    assert "=== needs CUDA: sh -c" in run.stdout
    assert ("\nran\n" in run.stdout) is not dry_run


def test_scripts_pass_shellcheck():
    scripts = sorted(GPU_CHECKS.glob("*.sh"))
    assert {script.name for script in scripts} >= {f"{step}_gpu.sh" for step in STEPS}
    result = subprocess.run(
        [tool("shellcheck"), "-x", *(str(s.relative_to(TEMPLATE_DIR)) for s in scripts)],
        cwd=TEMPLATE_DIR,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout
