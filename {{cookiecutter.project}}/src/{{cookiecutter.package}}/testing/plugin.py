"""The project's pytest plugin: GPU tests on request, one GPU per xdist worker, isolated tests.

- ``pytest --gpu`` runs the tests that use the ``gpu`` fixture or carry
  ``@pytest.mark.gpu``; without it they are skipped, and with it but no usable CUDA
  pytest stops with a usage error that names the cause.
- ``pytest --gpu -n N`` gives each xdist worker its own GPU through its
  ``CUDA_VISIBLE_DEVICES``; ``-n auto`` starts one worker per GPU.
- After each GPU test: synchronize, so an asynchronous CUDA error fails the test that
  caused it; after its teardown, report CUDA memory the test left allocated.
- Around each test's body: a snapshot of torch's global settings and RNGs; a test
  that changes one and does not restore it fails, and the next test starts clean.

The hooks are thin: the decisions live in :mod:`.gpus` and :mod:`.global_state`.
Loading this module does not import torch.
"""

from __future__ import annotations

import gc
import os
import re
from typing import Any

import pytest

from . import global_state, gpus

# Every project made from this template ships a copy of this module, and two of them
# can be installed in one environment. The first copy pytest loads registers the
# plugin under this name; the others see it registered and add nothing, so options
# are not added twice (which would stop pytest).
PLUGIN_NAME = "torch-gpu-testing"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
HOW_TO_RUN_GPU_TESTS = "needs a CUDA GPU: run pytest --gpu to run GPU tests"
GPU_MARKER = "gpu"
KEEPS_CUDA_MEMORY_MARKER = "keeps_cuda_memory"
CHANGES_GLOBAL_STATE_MARKER = "changes_global_state"
MEMORY_AT_CALL = pytest.StashKey["list[int] | None"]()


class AfterTestCheckFailed(AssertionError):
    """A check run after the test's body failed (leaked state or memory, a CUDA error).

    Its report shows the message alone: a traceback would point into the plugin.
    """


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin(PLUGIN_NAME):
        pluginmanager.register(TorchTestingPlugin(), PLUGIN_NAME)


class TorchTestingPlugin:
    """The plugin's hooks and the ``gpu`` fixture; one instance per pytest session."""

    def __init__(self) -> None:
        self.gpu_enabled = False
        self.distributed = False
        self.in_worker = False
        self.visible: list[str] = []
        self.worker_devices: list[str] = []
        self.queried_gpus: list[gpus.GpuInfo] | None = None
        self.driver: str | None = None
        self.cuda_checked_here = False
        self.warmed_up: set[int] = set()
        self.in_setup = False
        self.before_fixtures: global_state.GlobalState | None = None
        self.wider_fixture_ran = False

    def pytest_addoption(self, parser: pytest.Parser) -> None:
        group = parser.getgroup("gpu", "GPU tests (torch)")
        group.addoption(
            "--gpu",
            action="store_true",
            default=False,
            help="run the tests that need a CUDA GPU (the gpu fixture or the gpu marker); "
            "with -n, each xdist worker gets its own GPU, and -n auto starts one per GPU",
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(self, early_config: pytest.Config) -> None:
        # Every plugin is loaded by now, and xdist's hooks are needed before configure.
        if early_config.pluginmanager.has_plugin("xdist"):
            early_config.pluginmanager.register(XdistHooks(self), f"{PLUGIN_NAME}-xdist")

    def pytest_configure(self, config: pytest.Config) -> None:
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
            f"{CHANGES_GLOBAL_STATE_MARKER}: the test changes torch's global state on purpose; "
            "it is still restored after the test, but not reported",
        )
        self.gpu_enabled = config.getoption("gpu")
        self.in_worker = hasattr(config, "workerinput")
        if not self.gpu_enabled or self.in_worker:
            return  # xdist workers check CUDA at their first GPU test
        self.distributed = config.getoption("dist", "no") != "no" and bool(
            config.getoption("tx", None)
        )
        reason = gpus.cuda_unavailable_reason(
            initialize=not self.distributed, known_gpus=self.machine_gpus()
        )
        if reason is not None:
            raise pytest.UsageError(f"--gpu was given, but CUDA is not usable: {reason}")
        self.cuda_checked_here = not self.distributed
        self.driver = gpus.driver_version()
        self.visible = gpus.visible_devices(os.environ.get(VISIBLE_DEVICES), self.machine_gpus())
        if self.distributed and self.visible:
            workers = xdist_worker_count(config.getoption("tx"))
            self.worker_devices = gpus.assign_devices(self.visible, workers)

    def machine_gpus(self) -> list[gpus.GpuInfo]:
        """The GPUs ``nvidia-smi`` lists, asked once per session (it takes a while)."""
        if self.queried_gpus is None:
            self.queried_gpus = gpus.query_gpus()
        return self.queried_gpus

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if not self.gpu_enabled:
            return ["GPU tests: skipped (run pytest --gpu to run them)"]
        return gpu_report_lines(
            self.driver, self.machine_gpus(), self.visible, self.worker_devices, self.distributed
        )

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        skip = pytest.mark.skip(reason=HOW_TO_RUN_GPU_TESTS)
        for item in items:
            if is_gpu_test(item):
                gpus_needed(item)  # a wrong count is reported with or without --gpu
                if not self.gpu_enabled:
                    item.add_marker(skip)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self.before_fixtures = None
        self.wider_fixture_ran = False
        if self.gpu_enabled and is_gpu_test(item):
            self.check_gpus_for(item)
        self.in_setup = True
        try:
            return (yield)
        finally:
            self.in_setup = False

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]):
        # Function-scoped fixtures may change global state for their test; the state
        # before the first of them is put back after teardown. A wider fixture set up
        # or torn down here changes it for other tests too, so then nothing is undone.
        if self.in_setup:
            if fixturedef.scope != "function":
                self.wider_fixture_ran = True
            elif self.before_fixtures is None:
                self.before_fixtures = global_state.snapshot()
        return (yield)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        if fixturedef.scope != "function":
            self.wider_fixture_ran = True

    def check_gpus_for(self, item: pytest.Item) -> None:
        """Fail if CUDA is unusable here; skip if the test needs more GPUs than visible."""
        if not self.cuda_checked_here:
            reason = gpus.cuda_unavailable_reason()
            if reason is not None:
                raise AssertionError(f"--gpu was given, but CUDA is not usable here: {reason}")
            self.cuda_checked_here = True
        import torch

        needed = gpus_needed(item)
        visible = torch.cuda.device_count()
        if visible < needed:
            hint = "; each xdist worker has one GPU: run it without -n" if self.in_worker else ""
            pytest.skip(
                f"needs {needed} GPUs, {visible} visible to this test process "
                f"({VISIBLE_DEVICES}={os.environ.get(VISIBLE_DEVICES, '<unset>')}){hint}"
            )
        for index in range(needed):
            if index not in self.warmed_up:
                warm_up_device(index)
                self.warmed_up.add(index)

    @pytest.fixture
    def gpu(self) -> Any:
        """The ``torch.device`` of this test process's GPU; the test is skipped without --gpu.

        Under pytest-xdist each worker sees only its own GPU, so this is always ``cuda:0``.
        """
        import torch

        return torch.device("cuda", 0)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        gpu_test = self.gpu_enabled and is_gpu_test(item)
        check_memory = gpu_test and item.get_closest_marker(KEEPS_CUDA_MEMORY_MARKER) is None
        item.stash[MEMORY_AT_CALL] = None
        before = global_state.snapshot()
        memory = cuda_memory_allocated(gpus_needed(item)) if check_memory else None
        try:
            result = yield
        except BaseException as error:
            global_state.restore(before)
            if gpu_test:
                note_cuda_error(error, gpus_needed(item))
            raise
        if gpu_test:
            synchronize_or_fail(gpus_needed(item))
        after = global_state.snapshot()
        leaked = global_state.differences(before, after, rng_draws=False)
        if after != before:
            global_state.restore(before)
        if leaked and item.get_closest_marker(CHANGES_GLOBAL_STATE_MARKER) is None:
            raise AfterTestCheckFailed(global_state_message(leaked))
        # Checked at teardown, and only after a passing body: a failure's traceback
        # still holds the test's tensors.
        item.stash[MEMORY_AT_CALL] = memory
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item):
        try:
            result = yield
        finally:
            self.undo_fixture_changes()
        # Measured once the function-scoped fixtures are gone: a fixture's model that the
        # test moved to the GPU is freed by now, a tensor the test kept is not.
        allocated = item.stash.get(MEMORY_AT_CALL, None)
        if allocated is not None:
            # pytest drops the test's fixture values right after teardown; drop them now.
            funcargs = getattr(item, "funcargs", None)
            if isinstance(funcargs, dict):
                funcargs.clear()
            leaks = cuda_memory_leaks(allocated)
            if leaks:
                raise AfterTestCheckFailed("\n".join(leaks))
        return result

    def undo_fixture_changes(self) -> None:
        before, self.before_fixtures = self.before_fixtures, None
        if before is not None and not self.wider_fixture_ran and global_state.snapshot() != before:
            global_state.restore(before)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, call: pytest.CallInfo[None]):
        report = yield
        if call.excinfo is not None and isinstance(call.excinfo.value, AfterTestCheckFailed):
            report.longrepr = f"{AfterTestCheckFailed.__name__}: {call.excinfo.value}"
        return report


class XdistHooks:
    """Hooks that exist only with pytest-xdist: one GPU per worker."""

    def __init__(self, plugin: TorchTestingPlugin) -> None:
        self.plugin = plugin

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_auto_num_workers(self, config: pytest.Config) -> int | None:
        if not config.getoption("gpu") or os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
            return None  # the user's own choice wins
        visible = gpus.visible_devices(os.environ.get(VISIBLE_DEVICES), self.plugin.machine_gpus())
        return len(visible) or None

    def pytest_xdist_setupnodes(self, specs: list[Any]) -> None:
        # The environment of the worker's interpreter is set before it imports anything,
        # so CUDA there starts with only its own GPU visible.
        if not (self.plugin.gpu_enabled and self.plugin.visible):
            return
        devices = gpus.assign_devices(self.plugin.visible, len(specs))
        for spec, device in zip(specs, devices, strict=True):
            spec.env[VISIBLE_DEVICES] = device


def xdist_worker_count(tx: list[str]) -> int:
    """How many workers xdist starts for these ``--tx`` specs (``3*popen`` is three)."""
    count, spec_times = 0, re.compile(r"(\d+)\*")
    for spec in tx:
        times = spec_times.match(spec)
        count += int(times.group(1)) if times else 1
    return count


def is_gpu_test(item: pytest.Item) -> bool:
    return (
        "gpu" in getattr(item, "fixturenames", ())
        or item.get_closest_marker(GPU_MARKER) is not None
    )


def gpus_needed(item: pytest.Item) -> int:
    marker = item.get_closest_marker(GPU_MARKER)
    count = marker.kwargs.get("count", 1) if marker is not None else 1
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.gpu(count={count!r}): count must be a whole number >= 1"
        )
    return count


def gpu_report_lines(
    driver: str | None,
    gpu_infos: list[gpus.GpuInfo],
    visible: list[str],
    worker_devices: list[str],
    distributed: bool,
) -> list[str]:
    """The report header with --gpu; CUDA is queried only when no xdist workers run the tests."""
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines = [
        f"GPU tests: on; torch {torch.__version__}, CUDA runtime {torch.version.cuda}, "
        f"NVIDIA driver {driver}, cuDNN {cudnn}"
    ]
    if gpu_infos:
        for entry in visible:
            info = gpus.gpu_for_entry(entry, gpu_infos)
            lines.append(f"  GPU {entry}: {info.describe() if info else 'MIG instance'}")
    elif not distributed:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(
                f"  cuda:{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                f"compute capability {props.major}.{props.minor}"
            )
    if worker_devices:
        pairs = ", ".join(f"gw{i} -> {device}" for i, device in enumerate(worker_devices))
        lines.append(f"  xdist workers ({VISIBLE_DEVICES}): {pairs}")
    elif distributed:
        lines.append(
            "  xdist workers: GPUs unknown (no nvidia-smi), so every worker sees the "
            f"caller's {VISIBLE_DEVICES} and uses its first GPU"
        )
    return lines


def warm_up_device(index: int) -> None:
    """Make CUDA allocate what it keeps for the process's lifetime on this device (the
    context, the RNG's state), so the first GPU test's memory check does not count it.
    """
    import torch

    with torch.random.fork_rng(devices=[index]):
        torch.randn(1, device=torch.device("cuda", index))


def cuda_memory_allocated(devices: int) -> list[int]:
    import torch

    return [torch.cuda.memory_allocated(index) for index in range(devices)]


def synchronize_or_fail(devices: int) -> None:
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


def note_cuda_error(error: BaseException, devices: int) -> None:
    """Add an asynchronous CUDA error to a failing test's own error, where it belongs."""
    try:
        synchronize_or_fail(devices)
    except AfterTestCheckFailed as cuda_error:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(str(cuda_error))


def cuda_memory_leaks(before: list[int]) -> list[str]:
    """Messages for the devices on which the test left more memory allocated than it found."""
    import torch

    now = cuda_memory_allocated(len(before))
    if all(after <= start for start, after in zip(before, now, strict=True)):
        return []
    gc.collect()
    # cuBLAS keeps a workspace in the caching allocator after the first matmul.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    now = cuda_memory_allocated(len(before))
    return [
        f"cuda:{index}: the test left {after - start} bytes ({(after - start) / 2**20:.2f} MiB) "
        f"of CUDA memory allocated ({start} when its body started, {after} after its "
        "teardown and a garbage collection): a tensor is still referenced (a global, a "
        "cache, a class attribute); free it, or mark the test "
        f"@pytest.mark.{KEEPS_CUDA_MEMORY_MARKER} if that is intended"
        for index, (start, after) in enumerate(zip(before, now, strict=True))
        if after > start
    ]


def global_state_message(leaked: list[str]) -> str:
    lines = "\n".join(f"  {line}" for line in leaked)
    return (
        "the test changed torch's global state and did not restore it (restored now, so "
        f"the next test starts clean):\n{lines}\nUndo the change in the test (try/finally, "
        "a context manager such as torch.random.fork_rng()), or mark the test "
        f"@pytest.mark.{CHANGES_GLOBAL_STATE_MARKER} if the change is intended"
    )


# Fixtures of the determinism and gradient checks follow (module level: pytest
# collects fixtures from this module like from a conftest.py).


@pytest.fixture
def autograd_determinism() -> Any:
    """``autograd_determinism(model_or_function, *inputs, runs=3, **kwargs)``: bitwise check.

    For the whole test: deterministic algorithms, deterministic cuDNN (no benchmark),
    filled uninitialized memory and seeded RNGs; all restored afterwards, also when
    the test fails. The callable runs forward and backward ``runs`` times from the
    same parameters, buffers, RNG states and inputs and fails, naming the first
    differing tensor and the op or branch where the runs part, unless all agree bit
    for bit. It returns the first run's outputs and gradients.
    See :func:`.determinism.check_determinism` for the options.
    """
    from .determinism import check_determinism, deterministic_mode

    with deterministic_mode():
        yield check_determinism


@pytest.fixture
def gradcheck(request: pytest.FixtureRequest) -> Any:
    """``gradcheck(model_or_function, *inputs, params=True, gradgrad=False, fast=None, ...)``.

    Compares autograd's gradients with finite differences, in float64, for the inputs
    that require grad and every parameter (second order too with ``gradgrad=True``),
    leaving the model, the inputs and the global state as they were. A failure names
    the tensor and element, the numbers, and whether the point sits on a branch
    boundary or a kink instead. With ``-v`` each check writes one line: what was
    checked and in which mode. See :func:`.gradcheck.gradcheck` for the options.
    """
    from .gradcheck import gradcheck as check

    def checked(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        result = check(*args, **kwargs)
        request.node.add_report_section("call", "gradcheck", str(result))
        if request.config.get_verbosity() > 0:
            write_live(request.config, str(result))
        return result

    return checked


def write_live(config: pytest.Config, line: str) -> None:
    """Write a line to the terminal now, past output capturing (no terminal under xdist)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)
