"""The checks side by side on one shared floor: what they share, and that none reaches another.

- The generated project's ``tests/test_architecture.py`` passes as generated, and fails
  when a check imports another check or the plugin imports torch, when ARCHITECTURE.md
  misses a module (a package's module too) or an import from ``testing/`` outside it,
  and when two classes of the package share a name.
- What the floor raises names the check that runs it: the same model fault under
  ``compile_check``, ``export_check`` and ``autograd_determinism`` gets each check's own
  failure class and name, and no private class escapes.
- The floor's pieces, called directly: nested values through pytree (dataclasses too),
  typed run keys, locations that keep their parts, ``torch._grouped_mm`` (no float64
  kernel) computed in float64 through its equivalent, equal to torch's float32 kernel.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE, module_environment
from sessions import failure_reports


@pytest.fixture
def package(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return lambda name: importlib.import_module(f"{DEFAULT_PACKAGE}.testing.{name}")


def architecture_tests(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The project's own ``tests/test_architecture.py``, run as the project runs it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_architecture.py",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=project,
        env=module_environment(project),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_architecture_test_passes_as_generated(default_project: Path):
    run = architecture_tests(default_project, "-v", "-n0")  # one process: the -v lines as below
    assert run.returncode == 0, run.stdout + run.stderr
    # One test per check, the checks found from the package itself.
    checks = ("compile_check", "ddp_check", "determinism", "export_check", "finite_check")
    for check in (*checks, "gradcheck", "training_check"):
        assert f"test_a_check_imports_no_other_check[{check}] PASSED" in run.stdout
    assert "12 passed" in run.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("module", "added", "expected"),
    [
        (
            "compile_check",
            "from .. import gradcheck  # noqa: E402, F401\n",  # compile_check/__init__.py
            "importing dynamic_model.testing.compile_check imports the check module(s) gradcheck",
        ),
        (
            "plugin",
            "import torch  # noqa: E402, F401\n",
            "importing dynamic_model.testing.plugin imports torch",
        ),
        # A new module that is no floor module counts as a check: importing it from a check fails.
        (
            "export_check",
            "from . import shortcut  # noqa: E402, F401\n",
            "importing dynamic_model.testing.export_check imports the check module(s) shortcut",
        ),
    ],
    ids=["check-imports-check", "plugin-imports-torch", "unlisted-module"],
)
def test_architecture_test_fails_on_a_forbidden_import(
    default_project: Path, tmp_path: Path, module: str, added: str, expected: str
):
    project = Path(shutil.copytree(default_project, tmp_path / "project"))
    testing = project / "src" / DEFAULT_PACKAGE / "testing"
    (testing / "shortcut.py").write_text('"""A helper placed beside the checks."""\n')
    source = (
        testing / module / "__init__.py"
        if (testing / module).is_dir()
        else testing / f"{module}.py"
    )
    source.write_text(source.read_text() + added)
    run = architecture_tests(project)
    assert run.returncode == 1, run.stdout + run.stderr
    assert expected in run.stdout


def without_line(text: str, line_start: str) -> str:
    """``text`` without the one line that starts with ``line_start``."""
    lines = text.splitlines(keepends=True)
    found = [line for line in lines if line.startswith(line_start)]
    assert len(found) == 1, (line_start, found)
    return "".join(line for line in lines if line not in found)


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        (
            lambda project, testing: (project / "ARCHITECTURE.md").write_text(
                without_line((project / "ARCHITECTURE.md").read_text(), "| `determinism.py` |")
            ),
            "does not match the modules of {src}: testing/determinism.py.",
        ),
        (
            lambda project, testing: (project / "ARCHITECTURE.md").write_text(
                without_line((project / "ARCHITECTURE.md").read_text(), "  screen.py ")
            ),
            "does not match the modules of {src}: gradcheck/screen.py.",
        ),
        (
            lambda project, testing: (testing / "shortcut.py").write_text('"""A helper."""\n'),
            "does not match the modules of {src}: testing/shortcut.py.",
        ),
        (
            lambda project, testing: (testing.parent / "train.py").write_text(
                (testing.parent / "train.py").read_text()
                + "from .testing.gradcheck import gradcheck  # noqa: E402, F401\n"
            ),
            "not listed: [('train.py', 'testing.gradcheck')], listed but not imported: []",
        ),
        (
            lambda project, testing: (testing / "export_check.py").write_text(
                (testing / "export_check.py").read_text() + "\n\nclass _Stopped:\n    pass\n"
            ),
            "classes that share a name: testing/export_check.py:",
        ),
    ],
    ids=[
        "check-unnamed",
        "package-module-unnamed",
        "new-module-unnamed",
        "import-unlisted",
        "class-name-shared",
    ],
)
def test_architecture_test_fails_on_an_omission_or_a_shared_name(
    default_project: Path, tmp_path: Path, plant, expected: str
):
    project = Path(shutil.copytree(default_project, tmp_path / "project"))
    src = project / "src" / DEFAULT_PACKAGE
    plant(project, src / "testing")
    run = architecture_tests(project)
    assert run.returncode == 1, run.stdout + run.stderr
    assert expected.format(src=src) in run.stdout, run.stdout


SESSION = f"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from {DEFAULT_PACKAGE}.testing.compile_check import CompileCheckFailure
from {DEFAULT_PACKAGE}.testing.determinism import DeterminismFailure
from {DEFAULT_PACKAGE}.testing.export_check import ExportCheckFailure
from {DEFAULT_PACKAGE}.testing.failures import CheckFailure
from {DEFAULT_PACKAGE}.testing.gradcheck import GradcheckFailure


class Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.layer.weight.clamp_(-0.1, 0.1)
        return self.layer(x)


def unpool(x):
    pooled, indices = nn.functional.max_pool1d(x, 2, return_indices=True)
    return nn.functional.max_unpool1d(pooled, indices, 2)


layer = nn.Linear(4, 4)


def reentrant(x):
    return checkpoint(layer, x, use_reentrant=True)


def test_each_check_has_its_own_failure_class():
    assert issubclass(GradcheckFailure, CheckFailure) and issubclass(CheckFailure, AssertionError)
    names = [c.check for c in (GradcheckFailure, DeterminismFailure, CompileCheckFailure,
                               ExportCheckFailure)]
    assert names == ["gradcheck", "autograd_determinism", "compile_check", "export_check"]


def test_parameter_changed_in_place_under_compile_check(compile_check):
    torch.manual_seed(0)
    with pytest.raises(CompileCheckFailure, match="changed the trainable parameter layer.weight"):
        compile_check(Clipped(), torch.randn(2, 4), backend="aot_eager")


def test_parameter_changed_in_place_under_autograd_determinism(autograd_determinism):
    torch.manual_seed(0)
    with pytest.raises(DeterminismFailure, match="changed the trainable parameter layer.weight"):
        autograd_determinism(Clipped(), torch.randn(2, 4))


def test_no_deterministic_kernel_under_compile_check(compile_check):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    try:
        compile_check(unpool, torch.randn(1, 1, 4), backend="aot_eager")
    finally:
        torch.use_deterministic_algorithms(False)


def test_reentrant_checkpoint_under_compile_check(compile_check):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="which compile_check supports$"):
        compile_check(reentrant, torch.randn(2, 4, requires_grad=True), backend="aot_eager")


def test_reentrant_checkpoint_under_autograd_determinism(autograd_determinism):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="which autograd_determinism supports$"):
        autograd_determinism(reentrant, torch.randn(2, 4, requires_grad=True))


def test_meta_input_names_the_check_that_runs(export_check):
    with pytest.raises(ValueError, match="^export_check: input x is on the meta device"):
        export_check(lambda x: x * 2, torch.empty(3, device="meta"))
"""


def test_the_floor_raises_the_failure_of_the_check_that_runs_it(plugin_pytester):
    plugin_pytester.makepyfile(test_session=SESSION)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, failed=1)
    (lines,) = failure_reports(result).values()
    report = "\n".join(lines)
    # The model's own error under deterministic mode: torch's, not a private class of another
    # check, and no other check named.
    assert "RuntimeError: max_unpooling2d_forward_out does not have a deterministic" in report
    assert "_NondeterministicOpRaised" not in report
    assert "autograd_determinism" not in report


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: dict
    note: str = "kept"


Pair = collections.namedtuple("Pair", "first second")


def test_nested_values_are_named_by_their_pytree_path(package):
    trees = package("trees")
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    value = (Output(a, {"mask": b, "steps": 3}), [Pair(c, None)])
    assert [(name, type(leaf).__name__) for name, leaf in trees.named_leaves(value, "output")] == [
        ("output[0].logits", "Tensor"),
        ("output[0].aux['mask']", "Tensor"),
        ("output[0].aux['steps']", "int"),
        ("output[0].note", "str"),
        ("output[1][0].first", "Tensor"),
        ("output[1][0].second", "NoneType"),
    ]
    doubled = trees.map_tensors(lambda t: t * 2, value)
    assert isinstance(doubled[0], Output)
    assert isinstance(doubled[1][0], Pair)
    assert torch.equal(doubled[0].logits, 2 * a)
    assert doubled[0].aux["steps"] == 3
    assert torch.equal(doubled[1][0].first, 2 * c)
    assert doubled[0].note == "kept"
    assert trees.named_leaves(a, "x") == [("x", a)]


def test_run_keys_are_typed_and_read_as_before(package):
    runs = package("runs")
    assert [
        str(runs.Key(kind, name))
        for kind, name in [
            (runs.Kind.OUTPUT, "output[0]"),
            (runs.Kind.PARAMETER_GRAD, "fc.weight"),
            (runs.Kind.INPUT_GRAD, "x"),
            (runs.Kind.BUFFER, "bn.running_mean"),
        ]
    ] == [
        "output[0]",
        "grad of fc.weight",
        "grad of input x",
        "buffer bn.running_mean after the run",
    ]


def test_a_location_keeps_its_parts(package, tmp_path: Path):
    control_flow = package("control_flow")
    source = tmp_path / "model.py"
    source.write_text("def f(x):\n    if x.sum() > 0:\n        return x\n")
    location = control_flow.Location(str(source), 2)
    assert location.endswith("model.py:2")
    assert location.line == 2
    assert location.filename == str(source)
    assert location.source == "if x.sum() > 0:"
    copy = pickle.loads(pickle.dumps(location))
    assert copy == location
    assert copy.line == 2
    assert copy.filename == str(source)
    assert str(control_flow.UNKNOWN_LOCATION) == "<unknown location>"
    assert control_flow.UNKNOWN_LOCATION.source == ""


def grouped_mm_layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``torch._grouped_mm``'s operands on each layout, 3 groups, the second one empty."""
    torch.manual_seed(0)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # end offsets: rows 0-2, none, 3-7
    return {
        "2D x 3D": (torch.randn(8, 4), torch.randn(3, 4, 8), offs),
        # transformers' MoE experts: tokens sorted by expert, weights (E, out, in) transposed
        "2D x 3D, transposed weights": (torch.randn(8, 4), torch.randn(3, 8, 4).mT, offs),
        "3D x 2D": (torch.randn(3, 4, 4), torch.randn(4, 8), offs),
        "2D x 2D, groups along K": (torch.randn(4, 8), torch.randn(8, 4), offs),
        "3D x 3D": (torch.randn(3, 4, 8), torch.randn(3, 8, 4), None),
    }


@pytest.mark.parametrize("layout", list(grouped_mm_layouts()))
def test_grouped_mm_is_computed_in_float64_as_a_matmul_per_group(package, layout: str):
    float64 = package("float64")
    a, b, offs = grouped_mm_layouts()[layout]
    a, b = a.requires_grad_(), b.requires_grad_()
    expected = torch._grouped_mm(a, b, offs=offs)  # torch's float32 kernel
    cotangent = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (a, b), cotangent)
    mode = float64.Float64Mode()
    wide_a, wide_b = a.double(), b.double()
    with mode:
        out = torch._grouped_mm(wide_a, wide_b, offs=offs)  # the user's line
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), expected)
    grads = torch.autograd.grad(out, (a, b), cotangent.double())
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)
    (substitution,) = mode.substituted.values()
    assert substitution.location.filename == __file__
    assert substitution.location.source.endswith("# the user's line")
    assert str(substitution) == (
        f"torch._grouped_mm as a float64 matmul per group (at {substitution.location})"
    )
    assert not mode.narrowed


def test_grouped_mm_rows_past_the_last_offset_are_zero_in_float64(package):
    """The kernel leaves them unwritten (they hold whatever memory held); the rows before
    are the kernel's."""
    float64 = package("float64")
    torch.manual_seed(0)
    a, b = torch.randn(8, 4), torch.randn(3, 4, 8)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    with float64.Float64Mode():
        out = torch._grouped_mm(a.double(), b.double(), offs=offs)
    torch.testing.assert_close(out[:5].float(), torch._grouped_mm(a, b, offs=offs)[:5])
    assert torch.equal(out[5:], torch.zeros(3, 8, dtype=torch.float64))


def test_grouped_mm_calls_the_kernel_refuses_are_refused_in_float64(package):
    """A bias (not supported by torch 2.13's kernels) and int64 offsets fail in float64 as
    they do in float32: no equivalent makes them work."""
    float64 = package("float64")
    torch.manual_seed(0)
    a, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    mode = float64.Float64Mode()
    with mode, pytest.raises(RuntimeError, match="got Double"):
        torch._grouped_mm(a, b, offs=offs, bias=torch.zeros(8, dtype=torch.float64))
    with mode, pytest.raises(RuntimeError, match="got Double"):
        torch._grouped_mm(a, b, offs=offs.long())
    assert not mode.substituted
    assert not mode.narrowed
