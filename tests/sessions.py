"""What the tests of the testing plugin share: a real pytest session with the default
project's plugin loaded, and reading the failure reports it printed."""

from __future__ import annotations

import re

import pytest
import torch._dynamo  # noqa: F401
from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE

# torch.utils.checkpoint imports torch._dynamo on first use. Imported here first, before
# pytester snapshots sys.modules, it stays across the in-process sessions, which otherwise
# drop it after the first session and import it again, registering its operator libraries
# twice.

# `seeded(factory, seed=0)`, for the helpers.py of a session: the model ``factory`` builds
# from torch's RNG seeded with ``seed``, the caller's RNG left as it was.
SEEDED = """\
def seeded(factory, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()"""


def run_session(
    pytester: pytest.Pytester,
    source: str,
    *args: str,
    helpers: str | None = None,
    in_process: bool = False,
    template: bool = True,
) -> pytest.RunResult:
    """A pytest session of ``source`` (as ``test_session.py``, with ``helpers`` as
    ``helpers.py`` beside it, none if None) with the plugin loaded, run with ``args``.

    ``source`` is a ``str.format`` template in which ``{package}`` names the default
    project's package (other braces doubled); with ``template=False`` it is the file's
    text as is (e.g. an f-string already holding the package).

    By default the session runs in a fresh interpreter, as a user's does: the compile,
    training, DDP and determinism checks leave state no later session may see (dynamo's
    caches and operator libraries, which an in-process run would drop and import again,
    forked ranks, CPU threads). ``in_process=True`` runs it in this process, which has
    torch imported already: gradcheck's many sessions leave no such state, and each
    saves an interpreter start and a torch import.
    """
    files = {"test_session": source.format(package=DEFAULT_PACKAGE) if template else source}
    if helpers is not None:
        files["helpers"] = helpers
    pytester.makepyfile(**files)
    run = pytester.runpytest if in_process else pytester.runpytest_subprocess
    return run("-p", PLUGIN_MODULE, "-p", "no:cacheprovider", *args)


def failure_reports(result: pytest.RunResult) -> dict[str, list[str]]:
    """Each failed test's report lines, by test name."""
    reports: dict[str, list[str]] = {}
    current = None
    for line in result.outlines:
        header = re.fullmatch(r"_{3,} (test_\w+) _{3,}", line)
        if header:
            current = reports.setdefault(header.group(1), [])
        elif re.match(r"={3,} ", line):
            current = None
        elif current is not None:
            current.append(line)
    return reports


# What no failure message may show: torch's symbolic-shape internals (unbacked and
# backed symbols, sympy relations, fake tensors, dynamo's stack slots and locals) and
# the names of the exceptions torch raises for them.
INTERNALS = re.compile(
    r"\b[us]\d+\b|\bEq\(|FakeTensor\(|___stack|L\['|GuardOnDataDependent|PendingUnbacked|TorchRuntimeError"
)


def assert_no_internals(result: pytest.RunResult) -> None:
    """No failure message of the session (its ``E`` lines) shows torch's internals."""
    for name, lines in failure_reports(result).items():
        shown = [line for line in lines if line.startswith("E ") and INTERNALS.search(line)]
        assert not shown, f"{name}: {shown}"


def assert_failures(
    result: pytest.RunResult, expected: dict[str, list[str]]
) -> dict[str, pytest.LineMatcher]:
    """Exactly the tests of ``expected`` failed, each report holding its lines in order
    (fnmatch patterns in which "[" stands for itself); each report, to check further."""
    reports = failure_reports(result)
    assert reports.keys() == expected.keys(), result.stdout.str()
    assert_no_internals(result)
    matchers = {}
    for name, lines in expected.items():
        matchers[name] = pytest.LineMatcher(reports[name])
        matchers[name].fnmatch_lines(
            [line.replace("[", "[[]") for line in lines], consecutive=False
        )
    return matchers


def check_session(
    pytester: pytest.Pytester,
    source: str,
    *,
    passed: int,
    expected: dict[str, list[str]],
    helpers: str | None = None,
    in_process: bool = False,
) -> pytest.RunResult:
    """Run ``source`` as a session (see `run_session`): ``passed`` tests pass, the
    ``expected`` ones fail so."""
    result = run_session(pytester, source, helpers=helpers, in_process=in_process)
    result.assert_outcomes(passed=passed, failed=len(expected))
    assert_failures(result, expected)
    return result
