"""``pytest -n N``: each xdist worker's torch gets its share of the cores, said in the header.

Each worker's torch would start as many threads as the machine has cores, so N workers
run N times as many threads as there are cores and small float64 ops (gradient checks)
wait on each other. The plugin gives each worker ``cores // N`` threads (at least one)
through its ``OMP_NUM_THREADS``, leaves a variable the user set alone, and the ini option
``torch_worker_threads`` (``auto``, ``off`` or a number) changes it. The decision is a
plain function; the sessions are real ``pytest -n 2`` runs with real workers.
"""

from __future__ import annotations

import os

from conftest import DEFAULT_PACKAGE, PLUGIN_MODULE

WORKER_TEST = """
import os

import torch


def test_threads(request):
    expected = request.config.getoption("expected")
    if expected == "default":
        assert "OMP_NUM_THREADS" not in os.environ
    else:
        assert os.environ["OMP_NUM_THREADS"] == expected
        assert torch.get_num_threads() == int(expected)
"""

CONFTEST = """
def pytest_addoption(parser):
    parser.addoption("--expected", default="default")
"""


DECISIONS = """
import pytest
from {package}.testing.plugin import worker_threads


@pytest.mark.parametrize(
    ("setting", "cores", "workers", "environ", "threads"),
    [
        ("auto", 2, 2, {{}}, 1),
        ("auto", 16, 3, {{}}, 5),
        ("auto", 4, 8, {{}}, 1),  # more workers than cores: still one each
        ("auto", 16, 2, {{"OMP_NUM_THREADS": "4"}}, None),  # the user's own setting wins
        ("3", 16, 2, {{"OMP_NUM_THREADS": "4"}}, 3),  # ... unless the ini option names a number
        ("off", 16, 2, {{}}, None),
    ],
)
def test_threads_per_worker(setting, cores, workers, environ, threads):
    decision = worker_threads(setting, cores, workers, environ)
    assert decision.threads == threads
    assert str(decision).startswith("torch threads per xdist worker: ")


def test_a_bad_setting_names_the_option():
    with pytest.raises(pytest.UsageError, match="torch_worker_threads = 'many' is not allowed"):
        worker_threads("many", 2, 2, {{}})
"""


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_the_share_is_a_plain_function_of_the_setting_cores_and_workers(plugin_pytester):
    plugin_pytester.makepyfile(test_decisions=DECISIONS.format(package=DEFAULT_PACKAGE))
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=7)


def test_each_worker_gets_its_share_and_the_header_says_so(plugin_pytester, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plugin_pytester.makeconftest(CONFTEST)
    plugin_pytester.makepyfile(test_threads=WORKER_TEST)
    share = max(1, cores() // 2)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-n", "2", f"--expected={share}"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"torch threads per xdist worker: {share} ({cores()} cores // 2 workers, *"]
    )


def test_the_ini_option_turns_it_off(plugin_pytester, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plugin_pytester.makeconftest(CONFTEST)
    plugin_pytester.makepyfile(test_threads=WORKER_TEST)
    result = plugin_pytester.runpytest_subprocess(
        "-p", PLUGIN_MODULE, "-n", "2", "-o", "torch_worker_threads=off"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["torch threads per xdist worker: torch's default (torch_worker_threads = off)"]
    )


def test_no_line_without_workers(plugin_pytester):
    plugin_pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = plugin_pytester.runpytest_subprocess("-p", PLUGIN_MODULE)
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("torch threads per xdist worker*")
