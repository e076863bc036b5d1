"""The project's pytest plugin: GPU tests on request, one GPU per xdist worker, isolated tests.

The project's own pytest configuration loads it (``-p <package>.testing.plugin`` in
``addopts``); it is no ``pytest11`` entry point, so installing the project leaves
every other pytest run in that environment alone, and two projects installed side
by side each use their own copy.

- ``pytest --gpu`` runs the tests that use the ``gpu`` fixture or carry
  ``@pytest.mark.gpu``; without it they are skipped, and with it but no usable CUDA
  pytest stops with a usage error that names the cause.
- ``pytest --gpu -n N`` gives each xdist worker its own GPU through its
  ``CUDA_VISIBLE_DEVICES``; ``-n auto`` starts one worker per GPU.
- ``pytest -n N``: each xdist worker's torch uses ``cores // N`` threads (at least
  one, through its ``OMP_NUM_THREADS``), so N workers do not oversubscribe the cores;
  the report header says how many. The ini option ``torch_worker_threads`` (``auto``,
  ``off`` or a number) changes it; an ``OMP_NUM_THREADS`` already set is left alone.
- After each GPU test: synchronize, so an asynchronous CUDA error fails the test that
  caused it; after its teardown, report CUDA memory the test left allocated.
- Around each test: a snapshot of torch's global settings and random number
  generators. Every generator is put back silently after the test (seeding is what
  tests do); a changed setting is put back too and, as the ini option
  ``torch_global_state`` says, fails the test (``fail``, the default), warns
  (``warn``) or goes unreported (``off``).
- ``pytest --decisions``: which data-dependent decisions of the project's own code
  the tests made, with what outcomes (:mod:`.decisions`); ``--decisions-strict``
  fails the session when a branch saw one outcome only.
- The fixtures ``gpu``, ``autograd_determinism`` and ``gradcheck``.
- The fixtures ``compile_check`` (eager against ``torch.compile``, forward and
  backward, with every graph break and recompilation traced to the user's line) and
  ``export_check`` (``torch.export`` against eager, and the rewrite that makes a
  data-dependent model exportable).
- The fixtures ``training_check`` (a few real optimizer steps on one batch: every
  parameter gets a gradient, is held by the optimizer and changes, the loss falls) and
  ``ddp_check`` (the model under real DistributedDataParallel in N processes: unused
  parameters, mismatched collectives and ranks that disagree, named by the decision).
- The fixture ``finite_check`` (forward and backward finite; otherwise the op that made
  the first NaN or inf, forward or backward, at the user's line, with its input values).

The hooks are thin: the decisions live in :mod:`..gpus` and :mod:`.global_state`.
Loading this module does not import torch.
"""

from __future__ import annotations

import enum
import functools
import gc
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .. import gpus
from .._files import FileError, write_atomically
from . import global_state

__all__ = [
    "AfterTestCheckFailed",
    "GlobalStatePolicy",
    "TorchGlobalStateWarning",
    "WorkerThreads",
    "worker_threads",
]

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
HOW_TO_RUN_GPU_TESTS = "needs a CUDA GPU: run pytest --gpu to run GPU tests"
GPU_MARKER = "gpu"
KEEPS_CUDA_MEMORY_MARKER = "keeps_cuda_memory"
CHANGES_GLOBAL_STATE_MARKER = "changes_global_state"
GLOBAL_STATE_INI = "torch_global_state"
THREADS_INI = "torch_worker_threads"
# torch sizes its intra-op thread pool from this variable when it is imported.
THREADS_VARIABLE = "OMP_NUM_THREADS"


class GlobalStatePolicy(enum.Enum):
    """What a test that leaves one of torch's global settings changed gets."""

    FAIL = "fail"
    WARN = "warn"
    OFF = "off"


@dataclass(frozen=True)
class WorkerThreads:
    """How many threads torch uses in each xdist worker (``None``: as torch decides), and why.

    ``str()`` is the line of the report header.
    """

    threads: int | None
    reason: str

    def __str__(self) -> str:
        count = "torch's default" if self.threads is None else str(self.threads)
        return f"torch threads per xdist worker: {count} ({self.reason})"


def worker_threads(
    setting: str, cores: int, workers: int, environ: Mapping[str, str]
) -> WorkerThreads:
    """The thread count of each of ``workers`` xdist workers sharing ``cores`` cores.

    ``setting`` is the ``torch_worker_threads`` ini value: ``auto`` (``cores // workers``,
    at least 1, unless ``OMP_NUM_THREADS`` is set already), ``off`` or a whole number.
    Each worker's torch would otherwise start as many threads as the machine has cores:
    N workers then run N times as many threads as cores, and small ops wait on each other.
    """
    value = setting.strip()
    if value == "off":
        return WorkerThreads(None, f"{THREADS_INI} = off")
    if value == "auto":
        if THREADS_VARIABLE in environ:
            return WorkerThreads(
                None, f"{THREADS_VARIABLE}={environ[THREADS_VARIABLE]} is set: left as it says"
            )
        threads = max(1, cores // max(workers, 1))
        return WorkerThreads(
            threads,
            f"{cores} cores // {workers} workers, so the workers do not oversubscribe the "
            f"cores; {THREADS_INI} = off leaves torch's default",
        )
    if value.isdigit() and int(value) >= 1:
        return WorkerThreads(int(value), f"{THREADS_INI} = {value}")
    raise pytest.UsageError(
        f"{THREADS_INI} = {setting!r} is not allowed: expected auto, off or a whole number "
        ">= 1 (in [tool.pytest.ini_options] or -o)"
    )


def _cores() -> int:
    """The cores this process may run on (its affinity: taskset, a container's cpuset)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


class AfterTestCheckFailed(AssertionError):
    """A check run after the test's body failed (leaked state or memory, a CUDA error).

    Its report shows the message alone: a traceback would point into the plugin.
    """


class TorchGlobalStateWarning(pytest.PytestWarning):
    """A test left one of torch's global settings changed (``torch_global_state = warn``)."""


@dataclass
class _Session:
    """What the plugin knows for the whole pytest session (in ``config.stash``)."""

    gpu_enabled: bool
    policy: GlobalStatePolicy
    in_worker: bool
    distributed: bool = False
    visible: list[str] = field(default_factory=list)
    worker_devices: list[str] = field(default_factory=list)
    driver: str | None = None
    cuda_checked: bool = False
    warmed_up: set[int] = field(default_factory=set)
    known_gpus: list[gpus.GpuInfo] | None = None
    threads: WorkerThreads | None = None  # with xdist workers, on the controller
    # The test whose fixtures are being set up or torn down now.
    fixtures_of: pytest.Item | None = None

    def machine_gpus(self) -> list[gpus.GpuInfo]:
        """The GPUs ``nvidia-smi`` lists, asked once per session (it takes a while)."""
        if self.known_gpus is None:
            self.known_gpus = gpus.query_gpus()
        return self.known_gpus


@dataclass
class _Test:
    """What the plugin keeps for one test (in ``item.stash``)."""

    before_fixtures: global_state.GlobalState | None = None
    wider_fixture_ran: bool = False
    memory_at_call: list[int] | None = None


_SESSION = pytest.StashKey[_Session]()
_TEST = pytest.StashKey[_Test]()
_DECISIONS_OUTPUT = "torch_decisions"
_DECISION_HOOKS = f"{__name__}.decisions"
# The package this plugin belongs to, and the plugin's own folder (not the user's code).
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_PLUGIN_DIR = Path(__file__).resolve().parent
# The package's modules whose decisions are the project's machinery, not the models the
# tests are about: the private plumbing of training (checkpoints, data, metrics,
# preemption, lifetime, progress, files, digests, commands) and the command modules.
# A decision there (a checkpoint's step, a loss read for the log) is no branch of a
# model; --decisions-source with one of these files counts it all the same.
_PLUMBING_MODULES = (
    "_checkpoint.py",
    "_command.py",
    "_data.py",
    "_digest.py",
    "_files.py",
    "_lifetime.py",
    "_metrics.py",
    "_preemption.py",
    "_progress.py",
    "doctor.py",
    "gpus.py",
    "launch.py",
    "train.py",
)
# The project's tests, relative to its root: helpers and models written there count.
_TESTS_FOLDER = "tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu", "GPU tests (torch)")
    group.addoption(
        "--gpu",
        action="store_true",
        default=False,
        help="run the tests that need a CUDA GPU (the gpu fixture or the gpu marker); "
        "with -n, each xdist worker gets its own GPU, and -n auto starts one per GPU",
    )
    decisions = parser.getgroup("decisions", "decision coverage (torch)")
    decisions.addoption(
        "--decisions",
        action="store_true",
        default=False,
        help="report which data-dependent decisions (if on a tensor, .item(), int(), loop "
        "counts) of the project's own code the tests made, and their outcomes",
    )
    decisions.addoption(
        "--decisions-source",
        action="append",
        default=[],
        metavar="PATH",
        help="another folder or file whose decisions count (repeatable; the project's "
        "package, less its training plumbing and commands, and its tests folder always "
        "count); implies --decisions",
    )
    decisions.addoption(
        "--decisions-json",
        metavar="PATH",
        default=None,
        help="write the decision report as JSON to PATH; implies --decisions",
    )
    decisions.addoption(
        "--decisions-strict",
        action="store_true",
        default=False,
        help="fail the session (exit code 1) when a branch saw only one outcome; implies "
        "--decisions",
    )
    parser.addini(
        GLOBAL_STATE_INI,
        "what a test that leaves a torch global setting changed gets: fail (default), "
        "warn or off; the setting and every RNG are restored after each test in any case",
        default=GlobalStatePolicy.FAIL.value,
    )
    parser.addini(
        THREADS_INI,
        "torch threads in each pytest-xdist worker: auto (cores // workers, at least 1; an "
        "OMP_NUM_THREADS already set wins), off (torch's default) or a whole number",
        default="auto",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Every plugin is loaded by now, and xdist's hooks are needed before configure.
    if early_config.pluginmanager.has_plugin("xdist"):
        early_config.pluginmanager.register(_XdistHooks(early_config), f"{__name__}.xdist")


def global_state_policy(value: str) -> GlobalStatePolicy:
    """The ``torch_global_state`` ini value as a policy; a usage error names a bad one."""
    try:
        return GlobalStatePolicy(value.strip())
    except ValueError:
        allowed = ", ".join(policy.value for policy in GlobalStatePolicy)
        raise pytest.UsageError(
            f"{GLOBAL_STATE_INI} = {value!r} is not allowed: expected one of {allowed} "
            "(in [tool.pytest.ini_options] or -o)"
        ) from None


def _session(config: pytest.Config) -> _Session:
    if _SESSION not in config.stash:
        config.stash[_SESSION] = _Session(
            gpu_enabled=config.getoption("gpu"),
            policy=global_state_policy(config.getini(GLOBAL_STATE_INI)),
            in_worker=hasattr(config, "workerinput"),
        )
    return config.stash[_SESSION]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{GPU_MARKER}(count=1): the test needs count CUDA GPUs; skipped unless pytest "
        "--gpu, and when fewer GPUs are visible to the test process",
    )
    config.addinivalue_line(
        "markers",
        f"{KEEPS_CUDA_MEMORY_MARKER}: the test keeps CUDA memory allocated on purpose "
        "(a cache, a module-level tensor); no leak check after it",
    )
    config.addinivalue_line(
        "markers",
        f"{CHANGES_GLOBAL_STATE_MARKER}: the test changes torch's global settings on purpose; "
        "they are still restored after the test, but not reported",
    )
    session = _session(config)
    _start_decision_coverage(config)
    if session.in_worker:
        return  # xdist workers check CUDA at their first GPU test
    session.distributed = config.getoption("dist", "no") != "no" and bool(
        config.getoption("tx", None)
    )
    if session.distributed:
        workers = _xdist_worker_count(config.getoption("tx"))
        session.threads = worker_threads(config.getini(THREADS_INI), _cores(), workers, os.environ)
    if not session.gpu_enabled:
        return
    reason = gpus.cuda_unavailable_reason(
        initialize=not session.distributed, known_gpus=session.machine_gpus()
    )
    if reason is not None:
        raise pytest.UsageError(f"--gpu was given, but CUDA is not usable: {reason}")
    session.cuda_checked = not session.distributed
    session.driver = gpus.driver_version()
    session.visible = gpus.visible_devices(os.environ.get(VISIBLE_DEVICES), session.machine_gpus())
    if session.distributed and session.visible:
        workers = _xdist_worker_count(config.getoption("tx"))
        session.worker_devices = gpus.assign_devices(session.visible, workers)


def pytest_report_header(config: pytest.Config) -> list[str]:
    session = _session(config)
    lines = [
        f"torch global state: {GLOBAL_STATE_INI} = {session.policy.value} "
        "(settings and RNGs restored after each test)"
    ]
    if session.threads is not None:
        lines.append(str(session.threads))
    if not session.gpu_enabled:
        return [*lines, "GPU tests: skipped (run pytest --gpu to run them)"]
    return lines + _gpu_report_lines(session)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    session = _session(item.config)
    item.stash[_TEST] = _Test()
    if _is_gpu_test(item):
        # A test with a wrong count is not skipped: it fails, with or without --gpu.
        problem = _gpu_marker_problem(item)
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        if not session.gpu_enabled:
            # Raised here, not as each test's mark: pytest -ra folds skips by where they
            # were raised, so a CPU run prints one line for all the GPU tests.
            pytest.skip(HOW_TO_RUN_GPU_TESTS)
        _check_gpus_for(item, session)
    session.fixtures_of = item
    try:
        return (yield)
    finally:
        session.fixtures_of = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest):
    # Function-scoped fixtures may change global state for their test; the state
    # before the first of them is put back after teardown. A wider fixture set up
    # or torn down here changes it for other tests too, so then nothing is undone.
    item = _session(request.config).fixtures_of
    if item is not None:
        test = item.stash[_TEST]
        if fixturedef.scope != "function":
            test.wider_fixture_ran = True
        elif test.before_fixtures is None:
            test.before_fixtures = global_state.snapshot()
    return (yield)


def pytest_fixture_post_finalizer(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> None:
    item = _session(request.config).fixtures_of
    if item is not None and fixturedef.scope != "function":
        item.stash[_TEST].wider_fixture_ran = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    session = _session(item.config)
    test = item.stash.setdefault(_TEST, _Test())
    gpu_test = session.gpu_enabled and _is_gpu_test(item)
    check_memory = gpu_test and item.get_closest_marker(KEEPS_CUDA_MEMORY_MARKER) is None
    before = global_state.snapshot()
    memory = _cuda_memory_allocated(_gpus_needed(item)) if check_memory else None
    try:
        result = yield
    except BaseException as error:
        global_state.restore(before)
        if gpu_test:
            _note_cuda_error(error, _gpus_needed(item))
        raise
    if gpu_test:
        _synchronize_or_fail(_gpus_needed(item))
    after = global_state.snapshot()
    if after != before:
        global_state.restore(before)
    if (
        session.policy is not GlobalStatePolicy.OFF
        and item.get_closest_marker(CHANGES_GLOBAL_STATE_MARKER) is None
    ):
        changed = global_state.differences(before, after)
        if changed:
            _report_global_state(item, session.policy, changed)
    # Checked at teardown, and only after a passing body: a failure's traceback
    # still holds the test's tensors.
    test.memory_at_call = memory
    return result


def _report_global_state(item: pytest.Item, policy: GlobalStatePolicy, changed: list[str]) -> None:
    message = _global_state_message(changed, policy)
    if policy is GlobalStatePolicy.FAIL:
        raise AfterTestCheckFailed(message)
    path, line, _ = item.reportinfo()
    warnings.warn_explicit(
        TorchGlobalStateWarning(f"{item.nodeid}: {message}"),
        TorchGlobalStateWarning,
        filename=str(path),
        lineno=(line or 0) + 1,
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    session = _session(item.config)
    test = item.stash.setdefault(_TEST, _Test())
    session.fixtures_of = item
    try:
        result = yield
    finally:
        session.fixtures_of = None
        _undo_fixture_changes(test)
    # Measured once the function-scoped fixtures are gone: a fixture's model that the
    # test moved to the GPU is freed by now, a tensor the test kept is not.
    if test.memory_at_call is not None:
        # pytest drops the test's fixture values right after teardown; drop them now.
        funcargs = getattr(item, "funcargs", None)
        if isinstance(funcargs, dict):
            funcargs.clear()
        leaks = _cuda_memory_leaks(test.memory_at_call)
        if leaks:
            raise AfterTestCheckFailed("\n".join(leaks))
    return result


def _undo_fixture_changes(test: _Test) -> None:
    before, test.before_fixtures = test.before_fixtures, None
    if before is not None and not test.wider_fixture_ran and global_state.snapshot() != before:
        global_state.restore(before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(call: pytest.CallInfo[None]):
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, AfterTestCheckFailed):
        report.longrepr = f"{AfterTestCheckFailed.__name__}: {call.excinfo.value}"
    return report


def _start_decision_coverage(config: pytest.Config) -> None:
    """Register the decision-coverage hooks when ``--decisions`` (or an option implying it)
    was given; a bad path is a usage error naming the option."""
    sources = config.getoption("decisions_source")
    json_path = config.getoption("decisions_json")
    strict = config.getoption("decisions_strict")
    if not (config.getoption("decisions") or sources or json_path or strict):
        return
    base = config.invocation_params.dir
    resolved = []
    for source in sources:
        path = base / source
        if not path.exists():
            raise pytest.UsageError(
                f"--decisions-source {source!r}: no such file or folder (relative to {base})"
            )
        resolved.append(path)
    json_file = base / json_path if json_path else None
    if json_file is not None and not json_file.parent.is_dir():
        raise pytest.UsageError(
            f"--decisions-json {json_path!r}: the folder {json_file.parent} does not exist"
        )
    from .decisions import Coverage

    tests = config.rootpath / _TESTS_FOLDER
    defaults = [_PACKAGE_DIR, *([tests] if tests.is_dir() else [])]
    plumbing = [_PACKAGE_DIR / name for name in _PLUMBING_MODULES]
    excluded = [_PLUGIN_DIR, *(path for path in plumbing if path.is_file())]
    coverage = Coverage([*defaults, *resolved], config.rootpath, excluded=excluded)
    config.pluginmanager.register(_DecisionHooks(coverage, json_file, strict), _DECISION_HOOKS)


class _DecisionHooks:
    """``--decisions``: record each test's decisions, merge the workers', report at the end."""

    def __init__(self, coverage: Any, json_file: Path | None, strict: bool) -> None:
        self.coverage = coverage
        self.json_file = json_file
        self.strict = strict
        self.json_error: FileError | None = None  # reported in the summary, not as a crash

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        from .decisions import recording

        with recording(self.coverage, item.nodeid):
            return (yield)

    def merge_worker(self, workeroutput: dict[str, Any]) -> None:
        self.coverage.merge_json(workeroutput.get(_DECISIONS_OUTPUT, []))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if hasattr(config, "workeroutput"):
            config.workeroutput[_DECISIONS_OUTPUT] = self.coverage.to_json()["sites"]
            return
        if self.json_file is not None:
            report = json.dumps(self.coverage.to_json(), indent=2, allow_nan=False)
            try:
                write_atomically(self.json_file, report, durable=False)  # a report
            except FileError as error:
                self.json_error = error
        if self.strict and self.coverage.one_sided() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if hasattr(config, "workeroutput"):
            return
        terminalreporter.write_sep("=", "data-dependent decisions")
        for line in self.coverage.report_lines():
            terminalreporter.write_line(line)
        one_sided = self.coverage.one_sided()
        if self.strict and one_sided:
            terminalreporter.write_line(
                f"--decisions-strict: {len(one_sided)} branch(es) saw one outcome only; "
                "add tests that take the other side:",
                red=True,
            )
            for site in one_sided:
                missing = site.missing_outcomes
                never = "never reached" if len(missing) == 2 else f"never {missing[0]}"
                terminalreporter.write_line(f"  {site.path}:{site.line}: {never}", red=True)
        if self.json_error is not None:
            terminalreporter.write_line(f"--decisions-json: {self.json_error}", red=True)
        elif self.json_file is not None:
            terminalreporter.write_line(f"decision report written to {self.json_file}")


class _XdistHooks:
    """Hooks that exist only with pytest-xdist: one GPU per worker, and the checks' report
    lines, which a worker cannot write to the terminal, written by the controller."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # xdist gives the controller's copy of a worker's report its ``node``; a report of
        # this process's own test was written live already. Later phases' reports repeat
        # the call's sections.
        if getattr(report, "node", None) is None or report.when != "call":
            return
        if self.config.get_verbosity() <= 0:
            return
        for title, text in report.sections:
            if title in _REPORT_SECTIONS:
                _write_live(self.config, text)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_auto_num_workers(self, config: pytest.Config) -> int | None:
        if not config.getoption("gpu") or os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
            return None  # the user's own choice wins
        visible = gpus.visible_devices(
            os.environ.get(VISIBLE_DEVICES), _session(config).machine_gpus()
        )
        return len(visible) or None

    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: list[Any]) -> None:
        # The environment of the worker's interpreter is set before it imports anything,
        # so torch there starts with its share of the cores, and CUDA with only its own
        # GPU visible.
        session = _session(config)
        if session.threads is not None and session.threads.threads is not None:
            for spec in specs:
                spec.env[THREADS_VARIABLE] = str(session.threads.threads)
        if not (session.gpu_enabled and session.visible):
            return
        devices = gpus.assign_devices(session.visible, len(specs))
        for spec, device in zip(specs, devices, strict=True):
            spec.env[VISIBLE_DEVICES] = device

    def pytest_testnodedown(self, node: Any) -> None:
        # On the controller, once per worker: what its tests' decisions were.
        decision_hooks = node.config.pluginmanager.get_plugin(_DECISION_HOOKS)
        if decision_hooks is not None:
            decision_hooks.merge_worker(getattr(node, "workeroutput", {}))


def _xdist_worker_count(tx: list[str]) -> int:
    """How many workers xdist starts for these ``--tx`` specs (``3*popen`` is three)."""
    count, spec_times = 0, re.compile(r"(\d+)\*")
    for spec in tx:
        times = spec_times.match(spec)
        count += int(times.group(1)) if times else 1
    return count


def _is_gpu_test(item: pytest.Item) -> bool:
    return (
        "gpu" in getattr(item, "fixturenames", ())
        or item.get_closest_marker(GPU_MARKER) is not None
    )


def _gpu_count(item: pytest.Item) -> object:
    marker = item.get_closest_marker(GPU_MARKER)
    return marker.kwargs.get("count", 1) if marker is not None else 1


def _gpu_marker_problem(item: pytest.Item) -> str | None:
    """Why the test's ``gpu`` marker is wrong, or None."""
    count = _gpu_count(item)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return f"@pytest.mark.gpu(count={count!r}): count must be a whole number >= 1"
    return None


def _gpus_needed(item: pytest.Item) -> int:
    """The GPUs the test needs (its marker checked at setup)."""
    count = _gpu_count(item)
    assert isinstance(count, int)
    return count


def _check_gpus_for(item: pytest.Item, session: _Session) -> None:
    """Fail if CUDA is unusable here; skip if the test needs more GPUs than visible."""
    if not session.cuda_checked:
        reason = gpus.cuda_unavailable_reason()
        if reason is not None:
            raise AssertionError(f"--gpu was given, but CUDA is not usable here: {reason}")
        session.cuda_checked = True
    import torch

    needed = _gpus_needed(item)
    visible = torch.cuda.device_count()
    if visible < needed:
        hint = "; each xdist worker has one GPU: run it without -n" if session.in_worker else ""
        pytest.skip(
            f"needs {needed} GPUs, {visible} visible to this test process "
            f"({VISIBLE_DEVICES}={os.environ.get(VISIBLE_DEVICES, '<unset>')}){hint}"
        )
    for index in range(needed):
        if index not in session.warmed_up:
            _warm_up_device(index)
            session.warmed_up.add(index)


def _gpu_report_lines(session: _Session) -> list[str]:
    """The report header with --gpu; CUDA is queried only when no xdist workers run the tests."""
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines = [
        f"GPU tests: on; torch {torch.__version__}, CUDA runtime {torch.version.cuda}, "
        f"NVIDIA driver {session.driver}, cuDNN {cudnn}"
    ]
    known = session.machine_gpus()
    if known:
        for entry in session.visible:
            info = gpus.gpu_for_entry(entry, known)
            lines.append(f"  GPU {entry}: {info.describe() if info else 'MIG instance'}")
    elif not session.distributed:
        lines.extend(
            f"  cuda:{index}: {gpus.torch_gpu(index).describe()}"
            for index in range(torch.cuda.device_count())
        )
    if session.worker_devices:
        pairs = ", ".join(f"gw{i} -> {device}" for i, device in enumerate(session.worker_devices))
        lines.append(f"  xdist workers ({VISIBLE_DEVICES}): {pairs}")
    elif session.distributed:
        lines.append(
            "  xdist workers: GPUs unknown (no nvidia-smi), so every worker sees the "
            f"caller's {VISIBLE_DEVICES} and uses its first GPU"
        )
    return lines


def _warm_up_device(index: int) -> None:
    """Make CUDA allocate what it keeps for the process's lifetime on this device (the
    context, the RNG's state), so the first GPU test's memory check does not count it.
    """
    import torch

    with torch.random.fork_rng(devices=[index]):
        torch.randn(1, device=torch.device("cuda", index))


def _cuda_memory_allocated(devices: int) -> list[int]:
    import torch

    return [torch.cuda.memory_allocated(index) for index in range(devices)]


def _synchronize_or_fail(devices: int) -> None:
    """Wait for the test's kernels, so an asynchronous CUDA error fails this test."""
    import torch

    try:
        for index in range(devices):
            torch.cuda.synchronize(index)
    except RuntimeError as error:
        raise AfterTestCheckFailed(
            "CUDA reported an error while finishing this test's kernels (an asynchronous "
            "error from a kernel the test launched; CUDA_LAUNCH_BLOCKING=1 shows the "
            f"line). Later GPU tests in this process fail too.\n{error}"
        ) from error


def _note_cuda_error(error: BaseException, devices: int) -> None:
    """Add an asynchronous CUDA error to a failing test's own error, where it belongs."""
    try:
        _synchronize_or_fail(devices)
    except AfterTestCheckFailed as cuda_error:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(str(cuda_error))


def _cuda_memory_leaks(before: list[int]) -> list[str]:
    """Messages for the devices on which the test left more memory allocated than it found."""
    import torch

    now = _cuda_memory_allocated(len(before))
    if all(after <= start for start, after in zip(before, now, strict=True)):
        return []
    gc.collect()
    # cuBLAS keeps a workspace in the caching allocator after the first matmul.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    now = _cuda_memory_allocated(len(before))
    return [
        f"cuda:{index}: the test left {after - start} bytes ({(after - start) / 2**20:.2f} MiB) "
        f"of CUDA memory allocated ({start} when its body started, {after} after its "
        "teardown and a garbage collection): a tensor is still referenced (a global, a "
        "cache, a class attribute); free it, or mark the test "
        f"@pytest.mark.{KEEPS_CUDA_MEMORY_MARKER} if that is intended"
        for index, (start, after) in enumerate(zip(before, now, strict=True))
        if after > start
    ]


def _global_state_message(changed: list[str], policy: GlobalStatePolicy) -> str:
    lines = "\n".join(f"  {line}" for line in changed)
    quieter = " or ".join(
        candidate.value
        for candidate in (GlobalStatePolicy.WARN, GlobalStatePolicy.OFF)
        if candidate is not policy
    )
    return (
        "the test changed torch's global settings and did not restore them (restored now, "
        f"so the next test starts clean):\n{lines}\nUndo the change in the test (try/finally, "
        "a context manager such as torch.device(...) or torch.no_grad()), mark the test "
        f"@pytest.mark.{CHANGES_GLOBAL_STATE_MARKER} if the change is intended, or set "
        f"{GLOBAL_STATE_INI} = {quieter} in the pytest configuration"
    )


# The checks whose fixtures report their results (``_reporting``), as the sections pytest
# names them: "Captured <name> call".
_REPORT_SECTIONS = frozenset(
    f"Captured {name} call"
    for name in (
        "autograd_determinism", "gradcheck", "compile_check", "export_check",
        "finite_check", "training_check", "ddp_check",
    )
)  # fmt: skip


def _reporting(
    request: pytest.FixtureRequest,
    name: str,
    check: Callable[..., Any],
    report: Callable[[Any], str] = str,
) -> Callable[..., Any]:
    """``check`` whose result, as ``report`` words it, goes into the test's report section
    ``name`` (and, with ``-v``, to the terminal at once). It keeps ``check``'s name,
    docstring and signature, for ``help()`` and editors."""

    @functools.wraps(check)
    def checked(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        result = check(*args, **kwargs)
        text = report(result)
        request.node.add_report_section("call", name, text)
        if request.config.get_verbosity() > 0:
            _write_live(request.config, text)
        return result

    return checked


def _write_live(config: pytest.Config, line: str) -> None:
    """Write a line to the terminal now, past output capturing (no terminal under xdist)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.fixture
def gpu() -> Any:
    """The ``torch.device`` of this test process's GPU; the test is skipped without --gpu.

    Under pytest-xdist each worker sees only its own GPU, so this is always ``cuda:0``.
    """
    import torch

    return torch.device("cuda", 0)


@pytest.fixture
def autograd_determinism(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``autograd_determinism(model_or_fn, /, *inputs, forward_kwargs=None, runs=3, ...)``:
    bitwise check.

    For the whole test: deterministic algorithms, deterministic cuDNN (no benchmark),
    filled uninitialized memory and seeded RNGs; all restored afterwards, also when
    the test fails. The callable runs ``model_or_fn(*inputs, **forward_kwargs)``
    forward and backward ``runs`` times from the same parameters, buffers, RNG states
    and inputs and fails, naming the first differing tensor and the op or branch
    where the runs part, unless all agree bit for bit. Options are keyword-only; any
    other keyword is a ``TypeError``: the forward's keyword arguments go in
    ``forward_kwargs``. It returns the first run's outputs and gradients.
    See :func:`.determinism.autograd_determinism` for the options.
    """
    from . import determinism

    with determinism.deterministic_mode():
        yield _reporting(request, "autograd_determinism", determinism.autograd_determinism)


@pytest.fixture
def gradcheck(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``gradcheck(model_or_fn, /, *inputs, forward_kwargs=None, params=True,
    gradgrad=False, fast=None, branches="point", ...)``.

    Compares autograd's gradients with finite differences, in float64 end to end, for
    the inputs that require grad and every parameter of the modules the callable
    reaches (second order too with ``gradgrad=True``), leaving the model, the inputs
    and the global state as they were. Parameter gradient hooks are part of the
    checked gradient. ``branches="all"`` checks the other side of each branch
    decision too. A wrong gradient is narrowed down to where it enters (a gradient
    hook, a custom autograd Function, the smallest submodule wrong on its own) and
    named with what it reaches (the tensor and element, the numbers); a point on a
    branch boundary, a kink or a jump is said to be one instead. Options are
    keyword-only; the forward's keyword arguments go in ``forward_kwargs``. With
    ``-v`` each check writes one line: what was checked, in which mode, where the
    forward's lower-precision dtypes were kept in float64, which branch sides were
    checked, and its sensitivity (the smallest relative error of each tensor's
    gradient it catches, with tolerances from the arithmetic unless ``atol``/``rtol``
    are given). See :func:`.gradcheck.gradcheck` for the options.
    """
    from .gradcheck import gradcheck as check

    return _reporting(request, "gradcheck", check)


@pytest.fixture
def compile_check(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``compile_check(model_or_fn, /, *inputs, forward_kwargs=None, backend="inductor", ...)``.

    Runs forward and backward eagerly and under ``torch.compile`` from the same
    parameters, buffers, RNG states and inputs (each tuple of ``inputs_list`` too) and
    compares outputs and gradients within tolerances chosen by dtype. A failure names
    the output or gradient, the numbers and the first differing element; a run that
    fails only compiled names the backend, the phase and the line; more graph breaks
    or recompilations than ``max_graph_breaks``/``max_recompiles`` fail listing each
    with its line. Returns the graph breaks (each once, with torch's GB id) and
    recompilations, each with the user's line and, for a break, the data-dependent
    decision made there. With ``-v`` each check writes its report. See
    :func:`.compile_check.compile_check`.
    """
    from .compile_check import compile_check as check

    return _reporting(request, "compile_check", check)


@pytest.fixture
def export_check(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``export_check(model_or_fn, /, *inputs, forward_kwargs=None, strict=False, ...)``.

    Exports with ``torch.export.export``, runs the ``ExportedProgram`` against eager on
    the inputs (and each tuple of ``inputs_list``) and returns it. When export fails on
    data-dependent control flow, the failure names the user's line and the decision,
    and shows the rewrite that exports (``torch.cond``, ``torch.where``, a loop of fixed
    length with a mask, ``torch.while_loop``). See :func:`.export_check.export_check`.
    """
    from .export_check import export_check as check
    from .export_check import summary

    return _reporting(request, "export_check", check, summary)


@pytest.fixture
def finite_check(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``finite_check(model_or_fn, /, *inputs, forward_kwargs=None, inputs_list=None)``.

    Runs forward and backward (the other checks' fixed random cotangents) and fails when
    an output, a gradient or a changed buffer is NaN or inf, naming the origin: the op
    that made the first one from values that had none, forward or backward (and of
    which forward call), the submodule, the user's line, the input values and the cause
    (``log`` of ``-0.31``, ``0/0``, a softmax over an all ``-inf`` row), with the
    decisions on the way; a NaN or inf already in an input, a parameter or a buffer is
    named as such. With ``-v`` each check writes its report. See
    :func:`.finite_check.finite_check`.
    """
    from .finite_check import finite_check as check

    return _reporting(request, "finite_check", check)


@pytest.fixture
def training_check(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``training_check(model, (inputs, targets), /, loss_fn, optimizer=None, steps=5,
    accumulation_steps=None, ...)``.

    Runs ``steps`` real optimizer steps on the one batch, each from the same RNG states,
    and puts the model, ``.grad``, the optimizer's state and the RNGs back. Fails
    naming the parameters never given a gradient (with the branch decision that would
    give them one), those the optimizer does not hold, those that got a gradient and
    did not change, the first NaN or inf (step, tensor, the op at the user's line), a
    loss that does not fall, and accumulated micro-batch gradients that are not the
    whole batch's. With ``-v`` each check writes its report. See
    :func:`.training_check.training_check`.
    """
    from .training_check import training_check as check

    return _reporting(request, "training_check", check)


@pytest.fixture
def ddp_check(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Any]:
    """``ddp_check(model_or_fn, /, *inputs_per_rank, world_size=None, backend="gloo",
    steps=3, find_unused_parameters=None, static_graph=None, timeout=60.0, ...)``.

    Trains the model under real ``DistributedDataParallel`` in one process per batch
    (gloo on the CPU, NCCL on GPUs when asked), against one process on the batches
    concatenated; this process never joins the group, and every process it starts is
    ended whatever happens. Fails naming parameters unused on some ranks (the decision
    and each rank's outcome, and what ``find_unused_parameters=True`` costs here),
    collectives called differently per rank (the line, each rank's count), ranks that
    decide differently on the same samples, gradients that differ from one process,
    and a rank that raised, died or hung. With ``-v`` each check writes its report:
    the decisions per rank, whether ``find_unused_parameters`` is needed and
    ``static_graph=True`` safe. The processes' files go in pytest's temporary folder
    (``--basetemp``). See :func:`.ddp_check.ddp_check`.
    """
    from .ddp_check import ddp_check

    check = functools.partial(ddp_check, temp_root=tmp_path_factory.getbasetemp())
    return _reporting(request, "ddp_check", functools.update_wrapper(check, ddp_check))
