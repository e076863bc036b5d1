"""``pytest --decisions``: decision coverage of the project's own data-dependent code.

Each session runs in its own interpreter (``runpytest_subprocess``), as a user's does.
The models live in a folder of their own given with ``--decisions-source``; the
default project's package (always a source) is used through ``MeanGatedNet``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE
from filesystems import READ_ONLY, in_private_mounts

GATED_MODEL = """
import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.mean() > 0:
            return torch.relu(h)
        return torch.tanh(h)


def unrolled(x):
    steps = int(x.abs().sum().ceil())
    for _ in range(steps):
        x = x * 0.5
    return x


def scale_of(x):
    return x.max().item()
"""

ONE_SIDE = """
import torch
from mymodels import Gated


def test_positive_side():
    torch.manual_seed(0)
    model = Gated()
    with torch.no_grad():
        model.linear.bias.fill_(10.0)
    model(torch.randn(3, 4))
"""

OTHER_SIDE = """
import torch
from mymodels import Gated


def test_negative_side():
    torch.manual_seed(0)
    model = Gated()
    with torch.no_grad():
        model.linear.bias.fill_(-10.0)
    model(torch.randn(3, 4))
"""

LOOPS_AND_NUMBERS = """
import pytest
import torch
from mymodels import scale_of, unrolled


@pytest.mark.parametrize("total", [1.0, 2.5, 4.0])
def test_unrolled(total):
    unrolled(torch.full((2,), total / 2))


def test_scale():
    assert scale_of(torch.tensor([1.0, 7.5])) == 7.5


def test_decisions_outside_the_sources_are_not_listed():
    x = torch.tensor([1.0, -2.0])
    if x.sum() < 0:  # this test file is no source
        x = torch.nn.functional.normalize(x, dim=0)  # neither is torch
    assert x.abs().max().item() > 0
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(mymodels=GATED_MODEL)
    return pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--decisions-source", "mymodels.py", *args
    )


def report(result: pytest.RunResult) -> str:
    text = result.stdout.str()
    return text[text.index("data-dependent decisions") :]


def test_a_branch_tested_on_one_side_is_reported_and_fails_under_strict(plugin_pytester):
    plugin_pytester.makepyfile(test_one_side=ONE_SIDE)
    result = run(plugin_pytester, "--decisions")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "*= data-dependent decisions =*",
            "Each row is a line of the project's code that turned tensor data into a Python *",
            "branches count each outcome of the condition as written (True: `if not x:` ran its "
            "body; an outcome never seen is untested code)*",
            "mymodels.py:12: if h.mean() > 0:",
            "    branch: True x1, False x0 (never False)",
            "    reached by 1 test(s): test_one_side.py::test_positive_side",
        ]
    )
    strict = run(plugin_pytester, "--decisions-strict")
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(
        [
            "--decisions-strict: 1 branch(es) saw one outcome only; add tests that take the "
            "other side:",
            "  mymodels.py:12: never False",
            "*1 passed*",
        ]
    )


def test_strict_passes_once_a_test_takes_the_other_side(plugin_pytester):
    plugin_pytester.makepyfile(test_one_side=ONE_SIDE, test_other_side=OTHER_SIDE)
    result = run(plugin_pytester, "--decisions-strict")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["mymodels.py:12: if h.mean() > 0:", "    branch: True x1, False x1"]
    )
    assert "--decisions-strict:" not in result.stdout.str()


def test_loop_counts_and_numbers_and_only_the_sources(plugin_pytester):
    plugin_pytester.makepyfile(test_loops=LOOPS_AND_NUMBERS)
    result = run(plugin_pytester, "--decisions")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "mymodels.py:18: steps = int(x.abs().sum().ceil())",
            "    number: 3 values, min 1, max 4, 3 distinct",
            "mymodels.py:25: return x.max().item()",
            "    number: 1 values, min 7.5, max 7.5, 1 distinct",
        ]
    )
    shown = report(result)
    assert "test_loops.py" not in shown.split("short test summary")[0].split("reached by")[0]
    assert "torch/" not in shown
    assert "x.sum() < 0" not in shown


def test_a_loop_over_a_tensor_count_is_a_loop_count(plugin_pytester):
    plugin_pytester.makepyfile(
        loopy="def repeat(x, n):\n    for _ in range(n):\n        x = x + 1\n    return x\n",
        test_loopy=(
            "import torch\nfrom loopy import repeat\n\n"
            "def test_repeat():\n"
            "    assert repeat(torch.zeros(1), torch.tensor(3)).item() == 3\n"
        ),
    )
    result = run(plugin_pytester, "--decisions-source", "loopy.py")
    result.stdout.fnmatch_lines(
        ["loopy.py:2: for _ in range(n):", "    loop count: 1 values, min 3, max 3, 1 distinct"]
    )


def test_the_projects_package_is_a_source_and_the_json_report(plugin_pytester):
    plugin_pytester.makepyfile(
        test_gated=(
            "import torch\nfrom dynamic_model import MeanGatedNet\n\n"
            "def test_gated():\n    torch.manual_seed(0)\n    MeanGatedNet()(torch.randn(4, 8))\n"
        )
    )
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "--decisions-json", "decisions.json"
    )
    assert result.ret == 0, result.stdout.str()
    data = json.loads((plugin_pytester.path / "decisions.json").read_text())
    (site,) = data["sites"]
    assert site["path"].endswith("dynamic_model/models.py")
    assert site["source"] == "if h.mean() > 0:"
    assert site["kind"] == "branch"
    assert sum(site["outcomes"].values()) == 1
    assert len(site["missing_outcomes"]) == 1
    assert site["tests"] == ["test_gated.py::test_gated"]
    assert "testing/" not in json.dumps(data)  # the plugin's own decisions are not listed
    result.stdout.fnmatch_lines(["decision report written to *decisions.json"])


def test_workers_send_their_records_to_the_controller(plugin_pytester):
    plugin_pytester.makepyfile(test_one_side=ONE_SIDE, test_other_side=OTHER_SIDE)
    result = run(plugin_pytester, "--decisions-strict", "-n", "2", "--dist", "loadfile")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "mymodels.py:12: if h.mean() > 0:",
            "    branch: True x1, False x1",
            "    reached by 2 test(s): test_one_side.py::test_positive_side, "
            "test_other_side.py::test_negative_side",
        ]
    )


def test_without_the_option_nothing_is_recorded(plugin_pytester):
    plugin_pytester.makepyfile(test_one_side=ONE_SIDE, mymodels=GATED_MODEL)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE)
    assert result.ret == 0
    assert "data-dependent decisions" not in result.stdout.str()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--decisions-source", "missing/"],
            "ERROR: --decisions-source 'missing/': no such file or folder (relative to *)",
        ),
        (
            ["--decisions-json", "nowhere/report.json"],
            "ERROR: --decisions-json 'nowhere/report.json': the folder */nowhere does not exist",
        ),
    ],
)
def test_bad_paths_are_usage_errors(plugin_pytester, args, message):
    plugin_pytester.makepyfile("def test_nothing():\n    pass\n")
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


CONDITIONS = """
import torch


def cleaned(x):
    if not torch.isfinite(x).all():
        x = torch.nan_to_num(x)
    assert (x > -100).all(), "far too negative"
    while not (x.abs().sum() < 1):
        x = x / 2
    return x


def gate(x):
    if x.sum() > 0:
        return x * 2
    return x * 3


def positive_root(x):
    assert (x > 0).all(), "x must be positive"
    return x.sqrt()
"""

CONDITION_TESTS = """
import torch
from conditions import cleaned, gate, positive_root


def test_cleaned():
    cleaned(torch.tensor([3.0, -1.0]))


def test_gate(gradcheck):
    gradcheck(gate, torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True),
              branches="all")


def test_probe_points_that_fail(gradcheck):
    gradcheck(positive_root, torch.tensor([1e-7, 1.0], dtype=torch.float64, requires_grad=True))
"""


def test_conditions_count_as_written_and_probes_apart(plugin_pytester):
    """``if not x:`` counts True when its body ran; gradcheck's finite differences and branch
    search count at check probes, and a probe point that raised counts nothing."""
    plugin_pytester.makepyfile(conditions=CONDITIONS, test_conditions=CONDITION_TESTS)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--decisions-source", "conditions.py"
    )
    # positive_root's check passes: at eps=1e-8 the square root curves within the step
    # (a truncation error of 1% at 1e-7), which the half step settles.
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "conditions.py:5: if not torch.isfinite(x).all():",
            "    branch: True x0, False x1 (never True)",
            'conditions.py:7: assert (x > -100).all(), "far too negative"',
            "    branch: True x1, False x0 (never False)",
            "conditions.py:8: while not (x.abs().sum() < 1):",
            "    branch: True x3, False x1",
            "conditions.py:14: if x.sum() > 0:",
            "    branch: True x1, False x0 (never False); at check probes: True x*, False x*",
            'conditions.py:20: assert (x > 0).all(), "x must be positive"',
            # The probe points that raised (finite differences below 0) count nothing; those
            # gradcheck then takes with a smaller step count at check probes.
            "    branch: True x1, False x0 (never False); at check probes: True x*, False x0",
            "    reached by 1 test(s): test_conditions.py::test_probe_points_that_fail",
        ]
    )
    probed = result.stdout.str().split("conditions.py:14:")[1].split("reached by")[0]
    assert "; at check probes: True x" in probed
    assert ", False x0\n" not in probed  # the other side, seen at the branch search's probes


COMPILED = """
import torch
from dynamic_model import MeanGatedNet


def test_compiled(compile_check):
    torch.manual_seed(0)
    model = MeanGatedNet()
    result = compile_check(model, torch.randn(4, 8), backend="aot_eager")
    assert [b.source for b in result.graph_breaks] == ["if h.mean() > 0:"]
    model(torch.randn(4, 8))
"""


def test_compile_and_export_checks_see_the_model_not_the_recorder(plugin_pytester):
    """torch.compile traces active torch function modes: the recorder is set aside."""
    plugin_pytester.makepyfile(test_compiled=COMPILED)
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "--decisions")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*dynamic_model/models.py:*: if h.mean() > 0:"])


NON_FINITE = """
import torch
from mymodels import scale_of


def test_nan():
    assert scale_of(torch.tensor([float("nan")])) != 0


def test_infinities():
    assert scale_of(torch.tensor([float("inf")])) == float("inf")
    assert scale_of(torch.tensor([-float("inf")])) == -float("inf")
"""


def strict_json(text: str):
    """``text`` parsed as JSON proper: ``NaN`` and ``Infinity``, which jq and JavaScript
    refuse, fail the test."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in the JSON report, which strict parsers reject")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "xdist"])
def test_non_finite_numbers_in_the_json_report(plugin_pytester, workers):
    """.item() of nan and of both infinities: strings in the JSON, numbers in the report
    (and across xdist workers, whose records reach the controller as JSON too)."""
    plugin_pytester.makepyfile(test_non_finite=NON_FINITE)
    result = run(plugin_pytester, "--decisions-json", "decisions.json", *workers)
    assert result.ret == 0, result.stdout.str()
    (site,) = strict_json((plugin_pytester.path / "decisions.json").read_text())["sites"]
    outcomes = site["outcomes"]
    assert (outcomes["count"], outcomes["min"], outcomes["max"]) == (3, "-inf", "inf")
    assert sorted(outcomes["distinct_values"]) == ["-inf", "inf", "nan"]
    result.stdout.fnmatch_lines(
        [
            "mymodels.py:25: return x.max().item()",
            "    number: 3 values, min -inf, max inf, 3 distinct",
        ]
    )


def test_a_report_into_a_read_only_folder(plugin_pytester):
    """One line says the report could not be written; the tests' summary and exit status
    stay, and nothing lands in the folder."""
    plugin_pytester.makepyfile(test_one_side=ONE_SIDE, mymodels=GATED_MODEL)
    reports = plugin_pytester.path / "reports"
    reports.mkdir()
    command = (
        f'exec "$PYTHON" -m pytest -p {PLUGIN_MODULE} -p no:cacheprovider '
        "--decisions-source mymodels.py --decisions-json reports/decisions.json"
    )
    result = in_private_mounts(
        f"{READ_ONLY} && {command}",
        env={**os.environ, "FOLDER": str(reports), "PYTHON": sys.executable},
        cwd=plugin_pytester.path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert (
        f"--decisions-json: cannot write {reports / 'decisions.json'}: Read-only file system "
        "(nothing written)"
    ) in lines
    assert "1 passed" in lines[-1]
    assert "Traceback" not in result.stdout + result.stderr
    assert list(reports.iterdir()) == []


# --- routed models, the processes checks start, and the default scope -------------------
#
# These sessions keep their models and tests in the project's tests/ folder, which counts
# without --decisions-source.

ROUTED_MODELS = """
import torch
from torch import nn


class TopKMoE(nn.Module):
    def __init__(self, experts=4, dim=8, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        weights, expert_ids = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx, slot = (expert_ids == e).nonzero(as_tuple=True)
            if idx.numel() == 0:
                continue
            out.index_add_(0, idx, weights[idx, slot, None] * expert(x[idx]))
        return out


class EarlyExit(nn.Module):
    def __init__(self, dim=8, max_steps=4):
        super().__init__()
        self.halting = nn.Linear(dim, 1)
        self.layer = nn.Linear(dim, dim)
        self.max_steps = max_steps

    def forward(self, x):
        steps = self.halting(x).sigmoid().mean() * self.max_steps
        for _ in range(int(steps.ceil())):
            x = torch.tanh(self.layer(x))
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if x.mean() > 0:
            return torch.relu(self.linear(x))
        return torch.tanh(self.linear(x))


class PerSample(Gated):
    def forward(self, x):
        rows = []
        for row in x:
            rows.append(torch.relu(self.linear(row)) if row.mean() > 0 else self.linear(row))
        return torch.stack(rows)
"""

ROUTED_TESTS = """
import pytest
import torch
from routed import EarlyExit, TopKMoE


def moe(dead_expert):
    model = TopKMoE()
    if dead_expert:  # the router never picks expert 3: it trains on nothing
        with torch.no_grad():
            model.router.bias[3] = -100.0
    return model


@pytest.mark.parametrize("batch", [6, 16])
def test_moe(batch, dead_expert):
    torch.manual_seed(0)
    moe(dead_expert)(torch.randn(batch, 8))


@pytest.mark.parametrize("halting", [-5.0, 0.0, 5.0])
def test_early_exit(halting):
    torch.manual_seed(0)
    model = EarlyExit()
    with torch.no_grad():
        model.halting.bias.fill_(halting)
    model(torch.randn(3, 8))
"""

EXPERT_LINE = "tests/routed.py:17: idx, slot = (expert_ids == e).nonzero(as_tuple=True)"


def routed_session(pytester: pytest.Pytester, tests: dict[str, str], *args: str):
    folder = pytester.path / "tests"
    folder.mkdir()
    (folder / "routed.py").write_text(ROUTED_MODELS)
    for name, text in tests.items():
        (folder / f"{name}.py").write_text(text)
    return pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--decisions", "tests", *args
    )


@pytest.mark.parametrize("dead_expert", [False, True], ids=["every expert", "a dead expert"])
def test_data_dependent_sizes_say_how_often_they_were_empty(plugin_pytester, dead_expert):
    """The top-k MoE's per-expert nonzero is a size row: with every expert chosen it is
    never 0; with a router that never picks expert 3, one call in four is."""
    conftest = f"import pytest\n\n@pytest.fixture\ndef dead_expert():\n    return {dead_expert}\n"
    result = routed_session(
        plugin_pytester,
        {"conftest": conftest, "test_routed": ROUTED_TESTS},
        "--decisions-json",
        "decisions.json",
    )
    assert result.ret == 0, result.stdout.str()
    sizes = (
        "    size: 0 to * in 8 calls; 0 in 2 of 8 calls (an empty result: the code that uses it "
        "ran on no rows there)"
        if dead_expert
        else "    size: * to * in 8 calls; never 0 (no test had it select nothing)"
    )
    result.stdout.fnmatch_lines(
        [
            EXPERT_LINE,
            sizes,
            "    reached by 2 test(s): tests/test_routed.py::test_moe[16], "
            "tests/test_routed.py::test_moe[6]",
            "tests/routed.py:33: for _ in range(int(steps.ceil())):",
            "    loop count: 3 values, min 1, max 4, 3 distinct",
        ]
    )
    sites = json.loads((plugin_pytester.path / "decisions.json").read_text())["sites"]
    (size,) = [site for site in sites if site["kind"] == "size"]
    assert size["ops"] == ["Tensor.nonzero"]
    assert size["outcomes"]["count"] == 8
    assert size["outcomes"]["zeros"] == (2 if dead_expert else 0)
    assert (size["outcomes"]["min"] == 0) == dead_expert


def test_sizes_of_masks_unique_and_loops_over_a_tensor(plugin_pytester):
    plugin_pytester.makepyfile(
        sized="""
import torch


def selected(x):
    kept = x[x > 0]
    labels = torch.unique(kept.round())
    for label in labels:
        kept = kept + label
    return torch.where(x > 1)[0], torch.masked_select(x, x < -5)
""",
        test_sized="""
import torch
from sized import selected


def test_selected():
    torch.manual_seed(0)
    selected(torch.tensor([0.5, 2.0, -1.0, 3.2]))
""",
    )
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--decisions-source", "sized.py"
    )
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "sized.py:5: kept = x[x > 0]",
            "    size: 3 to 3 in 1 calls; never 0 *",
            "sized.py:6: labels = torch.unique(kept.round())",
            "    size: 3 to 3 in 1 calls; never 0 *",
            "sized.py:7: for label in labels:",
            "    loop count: 1 values, min 3, max 3, 1 distinct",
            "sized.py:9: return torch.where(x > 1)[0], torch.masked_select(x, x < -5)",
            # torch.where's 2 rows and masked_select's nothing, on one line
            "    size: 0 to 2 in 2 calls; 0 in 1 of 2 calls *",
        ]
    )


DDP_TESTS = """
import torch
from routed import PerSample


def batches():
    torch.manual_seed(1)
    return torch.randn(2, 8) + 1.0, torch.randn(2, 8) - 1.0


def test_ranks(ddp_check):
    torch.manual_seed(0)
    ddp_check(PerSample(), *batches(), steps=2)


def test_one_process():
    torch.manual_seed(0)
    PerSample()(batches()[0])
"""

GATE_LINE = "tests/routed.py:44: if x.mean() > 0:"
SAMPLE_LOOP = "tests/routed.py:52: for row in x:"
SAMPLE_GATE = (
    "tests/routed.py:53: rows.append(torch.relu(self.linear(row)) if row.mean() > 0 else "
    "self.linear(row))"
)


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "xdist"])
def test_decisions_in_ddp_ranks_count_for_the_test(plugin_pytester, workers):
    """Rank 0's batch takes the branch, rank 1's not: both outcomes, for the test that ran
    the check; the test that runs the model in its own process sees one side."""
    result = routed_session(plugin_pytester, {"test_ddp": DDP_TESTS}, *workers)
    assert result.ret == 0, result.stdout.str()
    # Each rank's two samples in each of two steps, and the test's own forward.
    result.stdout.fnmatch_lines(
        [
            SAMPLE_LOOP,
            "    loop count: 5 values, min 2, max 2, 1 distinct",
            SAMPLE_GATE,
            "    branch: True x6, False x4",
            "    reached by 2 test(s): tests/test_ddp.py::test_one_process, "
            "tests/test_ddp.py::test_ranks",
        ]
    )


def test_a_single_process_sees_one_side(plugin_pytester):
    result = routed_session(plugin_pytester, {"test_ddp": DDP_TESTS}, "-k", "test_one_process")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([SAMPLE_GATE, "    branch: True x2, False x0 (never False)"])


DETERMINISM_TESTS = """
import torch
from routed import Gated


def test_fresh_process(autograd_determinism):
    torch.manual_seed(0)
    autograd_determinism(Gated(), torch.full((4, 8), -1.0), runs=3, cross_process=True)
"""


def test_the_fresh_process_of_autograd_determinism_counts(plugin_pytester):
    """Three runs, the last in a fresh interpreter: three decisions."""
    result = routed_session(plugin_pytester, {"test_determinism": DETERMINISM_TESTS})
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([GATE_LINE, "    branch: True x0, False x3 (never True)"])


PLUMBING_TESTS = f"""
import torch
from {DEFAULT_PACKAGE}._metrics import RunningMean


def test_running_mean():
    torch.manual_seed(0)
    mean = RunningMean(torch.device("cpu"))
    mean.add(torch.tensor(2.0), 4)
    assert mean.value() == 2.0
"""


def test_the_projects_plumbing_is_no_source_and_an_empty_report_says_where_it_looked(
    plugin_pytester, default_project
):
    """RunningMean.value's .item() is training plumbing (_metrics.py): not counted unless
    given with --decisions-source; the empty report names the folders and the option."""
    result = routed_session(plugin_pytester, {"test_plumbing": PLUMBING_TESTS})
    assert result.ret == 0, result.stdout.str()
    package = default_project / "src" / DEFAULT_PACKAGE
    result.stdout.fnmatch_lines(
        [
            f"(no data-dependent decisions found: looked in {package} (not _checkpoint.py, "
            "_command.py, _data.py, _digest.py, _files.py, _lifetime.py, _metrics.py, "
            "_preemption.py, _progress.py, doctor.py, gpus.py, launch.py, testing/, train.py); "
            "tests; add a folder or file with --decisions-source PATH)"
        ]
    )
    metrics = package / "_metrics.py"
    given = plugin_pytester.runpytest_subprocess(
        # One argument: pytest takes a separate absolute path for a rootdir candidate.
        *("-p", PLUGIN_MODULE, "-p", "no:cacheprovider", f"--decisions-source={metrics}")
    )
    assert given.ret == 0, given.stdout.str()
    given.stdout.fnmatch_lines([f"{metrics}:*: return self.total().item() / max(self.count, 1)"])


ASSERTING_TESTS = """
import torch


def clipped(x):
    if x.abs().max() > 1:  # the test module's own code: a decision of the code under test
        return x.clamp(-1, 1)
    return x


def test_clipped():
    torch.manual_seed(0)
    x = torch.randn(4) * 3
    assert torch.equal(clipped(x), x.clamp(-1, 1))
    assert bool((clipped(x) <= 1).all()), "clipped above 1"
"""


def test_a_tests_assertions_are_no_decisions_but_its_code_is(plugin_pytester):
    """An ``assert`` in a test module holds every time in a passing run: counted, it would
    read "never False" and fail --decisions-strict; a branch in the same module counts."""
    result = routed_session(plugin_pytester, {"test_asserting": ASSERTING_TESTS})
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "tests/test_asserting.py:6: if x.abs().max() > 1:  # the test module's own code*",
            "    branch: True x2, False x0 (never False)",
        ]
    )
    result.stdout.no_fnmatch_line("*assert torch.equal*")
    result.stdout.no_fnmatch_line("*assert bool(*")


UNUSED_TESTS = """
import pytest
import torch
from torch import nn


class Refined(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.refine = nn.Linear(8, 8)

    def forward(self, x):
        h = self.encoder(x)
        if x.mean() > 0:
            h = self.refine(h)
        return h


def test_ranks(ddp_check):
    torch.manual_seed(0)
    first, second = torch.randn(2, 8) + 1.0, torch.randn(2, 8) - 1.0
    with pytest.raises(AssertionError, match="UnusedParameters|never given a gradient|unused"):
        ddp_check(Refined(), first, second, steps=2)
"""


def test_a_check_that_trains_again_for_its_remedy_counts_the_steps_once(plugin_pytester):
    """ddp_check's UnusedParameters trains the same steps again with
    find_unused_parameters=True to measure the remedy: the failing launch stops at step 1,
    where rank 0 took the branch and rank 1 did not, counted once (True x1, False x1);
    the remedy's two steps again would make it True x3, False x3."""
    result = routed_session(plugin_pytester, {"test_unused": UNUSED_TESTS})
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["tests/test_unused.py:15: if x.mean() > 0:", "    branch: True x1, False x1"]
    )
