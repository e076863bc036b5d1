"""Prove that forward and backward of a model are bitwise reproducible, and say where not.

:func:`autograd_determinism` runs a model (or function) forward and backward several
times, each from the same parameters, buffers, RNG states and inputs, pulls a
fixed random cotangent back through every floating-point output, and compares
outputs, parameter gradients, input gradients and updated buffers bit for bit.
Only when two runs differ does it pay for localization: it reruns under a
``TorchDispatchMode`` that fingerprints every aten op of forward and backward
and a ``TorchFunctionMode`` that records data-dependent Python decisions, and
reports the first op or branch where the runs part.

:func:`deterministic_mode` is the environment the ``autograd_determinism``
fixture gives a test: deterministic algorithms, deterministic cuDNN, seeded
RNGs, all undone afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..gpus import version_tuple
from . import calls, control_flow, decisions, global_state, options, processes, python_attributes
from .comparison import (
    as_bits,
    bitwise_equal,
    describe_tensor_difference,
    differing,
    same_value,
)
from .failures import CheckFailure
from .naming import describe_callable
from .op_sites import GraphTagger, ModuleStack, op_site
from .parameter_use import located
from .runs import Cotangents, Key, Kind, Run, run_once
from .subject import Subject
from .trees import named_leaves

__all__ = [
    "CHILD_DEADLINE",
    "DEFAULT_SEED",
    "CublasWorkspaceAction",
    "DeterminismError",
    "DeterminismFailure",
    "DeterminismResult",
    "NondeterministicOpError",
    "autograd_determinism",
    "bitwise_equal",
    "cublas_workspace_action",
    "describe_tensor_difference",
    "deterministic_mode",
    "seed_everything",
]

DEFAULT_SEED = 0
# Seconds the fresh process of cross_process=True may take before it is killed: it
# imports torch (2 to 5 s), unpickles the model and runs one forward and backward, which
# a model a unit test can run takes seconds for; ten minutes leave room for a large model
# on a loaded CI machine, and a hung child (a deadlock in a thread pool, a forward waiting
# on a lock the parent held at the fork) still fails the test instead of hanging it.
CHILD_DEADLINE = 600.0
_OPTIONS = ("forward_kwargs", "runs", "cross_process", "cotangent_seed", "child_deadline")

# torch checked CUBLAS_WORKSPACE_CONFIG under deterministic mode until
# pytorch/pytorch#161749 removed the check (torch 2.10): since CUDA 11 torch gives
# every handle/stream its own cuBLAS workspace, which is what cuBLAS needs.
CUBLAS_CONFIG_CHECKED_BEFORE = (2, 10)
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")

NO_DETERMINISTIC_IMPLEMENTATION = "does not have a deterministic implementation"
CUBLAS_NOT_DETERMINISTIC = "it uses CuBLAS"

_LISTED_DIFFERENCES = 5
_RANDOM_OPS = frozenset(
    {
        *("bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "exponential_"),
        *("geometric_", "cauchy_", "log_normal_", "random_", "rand", "randn", "randint"),
        *("randperm", "rand_like", "randn_like", "randint_like", "multinomial"),
        *("native_dropout", "poisson", "rrelu_with_noise"),
    }
)


class DeterminismFailure(CheckFailure):
    """Two runs from identical starting conditions gave different results."""

    check = "autograd_determinism"


DeterminismError = DeterminismFailure  # its name before every check's failures were *Failure


class NondeterministicOpError(DeterminismFailure):
    """An op has no deterministic implementation, so deterministic mode refused to run it."""


# --- the environment of the fixture --------------------------------------------------


class CublasWorkspaceAction(enum.Enum):
    """What the installed torch needs done about ``CUBLAS_WORKSPACE_CONFIG``."""

    SET = "set"  # set it now, CUDA has not started yet
    # Set it, and warn: CUDA already started, and if cuBLAS ran too, its handle keeps
    # the workspace it was created with.
    TOO_LATE = "too late"


def cublas_workspace_action(
    torch_version: str, cuda_built: bool, cuda_initialized: bool, configured: str | None
) -> CublasWorkspaceAction | None:
    """What to do about ``CUBLAS_WORKSPACE_CONFIG``; ``None``: nothing (torch no longer
    checks it, no CUDA, or it is already set to a deterministic value)."""
    if not cuda_built or configured in DETERMINISTIC_CUBLAS_CONFIGS:
        return None
    if version_tuple(torch_version)[:2] >= CUBLAS_CONFIG_CHECKED_BEFORE:
        return None
    return CublasWorkspaceAction.TOO_LATE if cuda_initialized else CublasWorkspaceAction.SET


def _configure_cublas_workspace() -> None:
    action = cublas_workspace_action(
        torch.__version__,
        torch.version.cuda is not None,
        torch.cuda.is_initialized(),
        os.environ.get(CUBLAS_WORKSPACE_VARIABLE),
    )
    if action is not None:
        os.environ[CUBLAS_WORKSPACE_VARIABLE] = DETERMINISTIC_CUBLAS_CONFIGS[0]
    if action is CublasWorkspaceAction.TOO_LATE:
        warnings.warn(
            f"torch {torch.__version__} needs {CUBLAS_WORKSPACE_VARIABLE}="
            f"{DETERMINISTIC_CUBLAS_CONFIGS[0]} (or {DETERMINISTIC_CUBLAS_CONFIGS[1]}) before "
            "cuBLAS starts, and CUDA had already started when the autograd_determinism "
            "fixture set it: if cuBLAS ran before, matmuls may stay nondeterministic. Set it "
            f"in the environment that runs pytest: {CUBLAS_WORKSPACE_VARIABLE}="
            f"{DETERMINISTIC_CUBLAS_CONFIGS[0]} pytest ...",
            stacklevel=3,
        )


def seed_everything(seed: int = DEFAULT_SEED) -> None:
    """Seed Python's ``random``, torch on CPU and every CUDA device, and NumPy if imported."""
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


@contextlib.contextmanager
def deterministic_mode(seed: int = DEFAULT_SEED) -> Iterator[None]:
    """Deterministic algorithms and cuDNN, filled uninitialized memory, seeded RNGs.

    Everything is put back on exit, also when the block raises.
    """
    before = global_state.snapshot()
    cublas_config = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
    try:
        _configure_cublas_workspace()
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        seed_everything(seed)
        yield
    finally:
        global_state.restore(before)
        if cublas_config is None:
            os.environ.pop(CUBLAS_WORKSPACE_VARIABLE, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VARIABLE] = cublas_config


# --- one run, with deterministic mode's refusals told apart -----------------------------


class _NondeterministicOpRaised(Exception):
    def __init__(self, error: RuntimeError) -> None:
        super().__init__(str(error))
        self.error = error


def _run(
    subject: Subject,
    cotangents: Cotangents,
    recording: contextlib.AbstractContextManager[Any] | None = None,
) -> Run:
    """:func:`.runs.run_once`; an op that deterministic mode refused raises
    ``_NondeterministicOpRaised``, which the check turns into its own error."""
    try:
        return run_once(subject, cotangents, recording=recording)
    except RuntimeError as error:
        if NO_DETERMINISTIC_IMPLEMENTATION in str(error) or CUBLAS_NOT_DETERMINISTIC in str(error):
            raise _NondeterministicOpRaised(error) from error
        raise


# --- localization: op fingerprints and decisions -------------------------------------


def _fingerprint(value: Any) -> Any:
    """A position-sensitive hash of a tensor's bits; integer sums wrap, so it is exact."""
    if isinstance(value, torch.Tensor):
        bits = as_bits(value).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device)
        weights = weights * 2654435761 + 40503
        return (
            value.dtype,
            tuple(value.shape),
            int((bits * weights).sum()),
            int((bits ^ weights).sum()),
        )
    if isinstance(value, list | tuple):
        return tuple(_fingerprint(item) for item in value)
    plain = value is None or isinstance(value, bool | int | float | complex | str | bytes)
    return value if plain else type(value).__name__


@dataclasses.dataclass
class _OpRecord:
    op: str
    site: str
    inputs: tuple
    outputs: Any
    explicit_generator: bool


class _OpRecorder(TorchDispatchMode):
    """Fingerprints inputs and outputs of every aten op, in forward and backward."""

    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.ops: list[_OpRecord] = []
        self.failed_site: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            inputs = _fingerprint((*args, *kwargs.values()))
        try:
            result = func(*args, **kwargs)
        except RuntimeError:
            self.failed_site = str(op_site(self.modules, sys._getframe(1)))
            raise
        generator = kwargs.get("generator")
        with torch._C.DisableTorchFunction():
            outputs = _fingerprint(result)
        self.ops.append(
            _OpRecord(
                str(func),
                str(op_site(self.modules, sys._getframe(1))),
                inputs,
                outputs,
                generator is not None and generator is not torch.default_generator,
            )
        )
        return result


@dataclasses.dataclass
class _RecordedRun:
    decisions: control_flow.DecisionLog
    recorder: _OpRecorder
    # Python threads other than this one that were alive or started during the run:
    # the recorders see only this thread's ops.
    threads: tuple[str, ...]
    # torch.initial_seed() after the run: it changes only when the run reseeds.
    seed_after: int


def _recorded_run(subject: Subject, cotangents: Cotangents) -> _RecordedRun:
    modules = ModuleStack(subject.roots)
    recorder = _OpRecorder(modules)
    logs: list[control_flow.DecisionLog] = []
    current = threading.current_thread()
    # Pool threads started before the run still run its work; others (pytest's, xdist's) do not.
    threads = {
        t.name
        for t in threading.enumerate()
        if t is not current and t.name.startswith("ThreadPoolExecutor")
    }

    def started(frame: FrameType, event: str, argument: Any) -> None:
        threads.add(threading.current_thread().name)  # called once as each new thread starts

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        threading.settrace(started)
        try:
            with (
                modules,
                control_flow.record_decisions() as decisions,
                GraphTagger(modules),
                recorder,
            ):
                logs.append(decisions)
                yield
        finally:
            threading.settrace(None)  # type: ignore[arg-type]

    with contextlib.suppress(_NondeterministicOpRaised):  # recorded as failed_site
        _run(subject, cotangents, recording())
    return _RecordedRun(logs[0], recorder, tuple(sorted(threads)), torch.initial_seed())


def _first_op_difference(
    a: list[_OpRecord],
    b: list[_OpRecord],
    other_threads: bool = False,
    changed: Sequence[python_attributes.AttributeChange] = (),
) -> str | None:
    """Where the op records part; ``changed``: the Python attributes a run changes, the
    likely source of a difference that no earlier op explains."""
    attributes = ", ".join(change.name for change in changed)
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        number = index + 1
        if x.op != y.op:
            return (
                f"the runs stop doing the same ops at op #{number}: {x.op} ({x.site}) in run 1, "
                f"{y.op} ({y.site}) in run 2; every op before it computed identical values, "
                "so the branch was decided by something outside torch's ops "
                + (
                    f"(the Python attributes the forward changes: {attributes}, above)"
                    if changed
                    else "(the clock, the OS, a generator or global state the check does not reset)"
                )
            )
        if x.inputs != y.inputs:
            argument = next(
                i for i, (p, q) in enumerate(zip(x.inputs, y.inputs, strict=False)) if p != q
            )
            source = (
                f"the Python attributes the forward changes between runs ({attributes}, above)"
                if changed
                else "ops on other threads, which the recorder does not see"
                if other_threads
                else "outside torch's ops (NumPy, Python's random, the clock, the OS, a tensor "
                "built from Python values)"
            )
            return (
                f"first differing op: #{number} {x.op} ({x.site}): its argument {argument} "
                "differs although every earlier op computed identical values, so that data "
                f"came from {source}"
            )
        if x.outputs != y.outputs:
            cause = "so this op itself is not deterministic"
            if x.op.split(".")[1] in _RANDOM_OPS or "dropout" in x.op:
                cause = (
                    "so this random op drew different numbers: it used a generator whose "
                    "state is not reset between runs"
                    + (
                        " (an explicit torch.Generator; seed it from a fixed seed right before "
                        "use, or use the global RNG)"
                        if x.explicit_generator
                        else ""
                    )
                )
            return (
                f"first differing op: #{number} {x.op} ({x.site}): same inputs in both "
                f"runs, different outputs, {cause}"
            )
    if len(a) != len(b):
        return (
            f"run 1 ran {len(a)} ops, run 2 ran {len(b)}; the first {min(len(a), len(b))} matched"
        )
    return None


def _localize(
    subject: Subject,
    cotangents: Cotangents,
    attempts: int,
    changed: Sequence[python_attributes.AttributeChange] = (),
) -> list[str]:
    """Rerun under the recorders until a rerun differs from the first; say where.

    A rerun whose values differ but whose branches agree is kept, and reruns go on
    (up to ``attempts``) while the forward makes data-dependent decisions, because
    a rerun that also branches differently explains more.
    """
    reference = _recorded_run(subject, cotangents)
    found: list[str] = []
    threads: set[str] = set(reference.threads)
    for attempt in range(2, attempts + 2):
        other = _recorded_run(subject, cotangents)
        threads.update(other.threads)
        divergence = control_flow.first_divergence(reference.decisions, other.decisions)
        op_difference = _first_op_difference(
            reference.recorder.ops, other.recorder.ops, bool(threads), changed
        )
        if divergence or (op_difference and not found):
            found = [
                "Localized by rerunning under an op recorder until two reruns differed "
                f"(run 1 and run 2 below; {attempt} reruns):"
            ]
            if reference.seed_after != other.seed_after:
                found.append(
                    "the forward reseeds torch's global RNG, with a different seed in each run "
                    f"(torch.initial_seed() after the forward: {reference.seed_after} in run 1, "
                    f"{other.seed_after} in run 2): a seed from os.urandom, the clock or "
                    "torch.seed(). The check resets every generator before each run; the "
                    "reseed undoes that, so each random op after it (dropout, randn) draws "
                    "other numbers. Seed with a fixed value, or not inside the forward"
                )
            if divergence:
                found.append(control_flow.describe_divergence(divergence, run=2))
            if op_difference:
                found.append(op_difference)
        if divergence or (found and not reference.decisions):
            break
    if not found:
        found = [
            f"Not localized: {attempts + 1} reruns under the op recorder agreed with each other "
            "(the nondeterminism depends on timing, or the recorder changed it)"
        ]
    if threads:
        found.append(
            f"other Python threads ran during the runs ({', '.join(sorted(threads))}): the op "
            "recorder sees only the ops of the thread that called the model, so ops on those "
            "threads are missing from the record; ops racing on other threads (a thread pool "
            "writing into a shared tensor, or building parts of the graph, whose backward "
            "then adds up in another order) are the likely cause"
        )
    return found


# --- the check ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeterminismResult:
    """The first run's results (all runs agreed bit for bit).

    ``outputs`` has the structure the model returned, tensors detached.
    ``parameter_grads`` maps parameter names to gradients (``None`` where the
    backward pass did not reach the parameter); ``input_grads`` maps input names
    the same way: the forward's parameter name (``"x"``, ``"x[1]"`` inside a tuple),
    ``"inputs[i]"`` where the signature has none, the key of a ``forward_kwargs``
    entry (``"mask"``); messages call them ``input x``.
    ``buffers`` holds the buffers the forward changed, after the run. ``str()`` of
    the result is the line ``pytest -v`` reports.
    """

    outputs: Any
    parameter_grads: dict[str, torch.Tensor | None]
    input_grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    runs: int
    function: str  # the callable, as messages name it
    cross_process: bool
    seconds: float

    def __str__(self) -> str:
        leaves = named_leaves(self.outputs, "output")
        outputs = sum(isinstance(leaf, torch.Tensor) for _, leaf in leaves)
        grads = {**self.parameter_grads, **{f"input {k}": v for k, v in self.input_grads.items()}}
        unreached = [name for name, grad in grads.items() if grad is None]
        fresh = " (the last in a fresh process)" if self.cross_process else ""
        return (
            f"autograd_determinism {self.function}: {self.runs} runs{fresh} agreed bit for bit "
            f"in {self.seconds:.2f} s: {outputs} output tensor(s), "
            f"{len(self.parameter_grads)} parameter and {len(self.input_grads)} input "
            f"gradient(s)"
            + (f"; not reached by the backward: {', '.join(unreached)}" if unreached else "")
            + (f"; buffers the forward changes: {', '.join(self.buffers)}" if self.buffers else "")
        )


def _describe(key: Key, reference: Run, other: Run, run: int) -> str:
    """One line on how ``key`` differs between run 1 (``reference``) and ``other``."""
    if key not in reference.values or key not in other.values:
        return f"{key}: present only in {'run 1' if key in reference.values else f'run {run}'}"
    a, b = reference.values[key], other.values[key]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return describe_tensor_difference(str(key), a, b, run)

    def summary(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
        if value is None and key.kind in (Kind.PARAMETER_GRAD, Kind.INPUT_GRAD):
            return "None (the backward pass did not reach it)"
        return repr(value)

    return f"{key}: {summary(a)} in run 1, {summary(b)} in run {run}"


def _mismatch_report(differing_keys: list[Key], first: str, label: str) -> list[str]:
    lines = [
        f"{label} differs from run 1 although both started from the same parameters, "
        "buffers, RNG states and inputs:",
        f"  {first}",
    ]
    others = [str(key) for key in differing_keys[1:]]
    if others:
        listed = ", ".join(others[:_LISTED_DIFFERENCES])
        more = len(others) - _LISTED_DIFFERENCES
        lines.append(f"  also differ: {listed}" + (f" and {more} more" if more > 0 else ""))
    return lines


def _nondeterministic_op_error(
    subject: Subject, cotangents: Cotangents, raised: _NondeterministicOpRaised
) -> NondeterministicOpError:
    message = str(raised.error)
    rerun = _recorded_run(subject, cotangents)
    site = rerun.recorder.failed_site
    if CUBLAS_NOT_DETERMINISTIC in message and NO_DETERMINISTIC_IMPLEMENTATION not in message:
        return NondeterministicOpError(
            f"A cuBLAS op ({site or 'site unknown'}) refused to run deterministically: torch "
            f"{torch.__version__} needs "
            f"{CUBLAS_WORKSPACE_VARIABLE}={DETERMINISTIC_CUBLAS_CONFIGS[0]} "
            "set before CUDA starts. Set it in the environment that runs pytest.\n"
            f"torch said: {message}"
        )
    op = message.split(NO_DETERMINISTIC_IMPLEMENTATION)[0].strip() or "an op"
    lines = [
        f"{op} has no deterministic implementation on this device, and the check runs with "
        "torch.use_deterministic_algorithms(True), so torch refused to run it.",
        f"  where: {site or 'unknown (the op recorder did not see it again)'}",
        "Usual ways out:",
        "  - compute it with ops that are deterministic: scatter_add_/index_add_/index_put_"
        "(accumulate=True) on CUDA have deterministic versions, while put_, "
        "bincount/histc, and the backward of adaptive pooling, interpolate (linear modes), "
        "grid_sample and reflection padding have none; a one-hot matmul or sort + "
        "segment sum replaces scatter-style sums",
        "  - run just this op on the CPU (.cpu(), then .to(device)) where it is deterministic",
        "  - if exact reproducibility of this op does not matter: run it inside "
        "torch.use_deterministic_algorithms(True, warn_only=True) and restore the flag "
        "afterwards; then this test cannot prove the model bitwise reproducible",
        f"torch said: {message.split('. ')[0]}.",
    ]
    return NondeterministicOpError("\n".join(lines))


def autograd_determinism(
    model_or_fn: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: Mapping[str, Any] | None = None,
    runs: int = 3,
    cross_process: bool = False,
    cotangent_seed: int = DEFAULT_SEED,
    child_deadline: float = CHILD_DEADLINE,
    **unknown: Any,
) -> DeterminismResult:
    """Run forward and backward ``runs`` times from identical conditions; all must agree.

    Each run calls ``model_or_fn(*inputs, **forward_kwargs)``. Every run starts
    from the same parameters and buffers (of the modules the callable reaches: a
    module, a bound method, a ``functools.partial``, closures, defaults and globals
    holding modules), the same global RNG states (Python, NumPy, torch CPU and CUDA)
    and fresh copies of the inputs; the model and inputs are left as they were. A
    fixed random cotangent (seeded by ``cotangent_seed``) is pulled back through every
    floating-point output that requires grad, with ``torch.autograd.grad``, so
    ``.grad`` attributes are not touched. Gradients are taken for every parameter
    that requires grad and every floating-point input that requires grad; when
    nothing requires grad, for every floating-point input.

    ``cross_process=True`` makes the last run happen in a fresh Python process with
    the same thread count (model, function and inputs must be picklable); that process
    is killed with its process group when it takes more than ``child_deadline`` seconds
    (:data:`CHILD_DEADLINE`), and the failure says what it was running. Options are
    keyword-only; any other keyword is a ``TypeError``: the forward's keyword arguments
    go in ``forward_kwargs``.

    Raises :class:`DeterminismFailure` naming the first differing tensor, then the first
    aten op or Python decision where the runs part, or :class:`NondeterministicOpError`
    when an op has no deterministic implementation.
    """
    __tracebackhide__ = True
    calls.reject_unknown_keywords("autograd_determinism", unknown, _OPTIONS)
    kwargs = calls.forward_kwargs_of("autograd_determinism", forward_kwargs)
    options.function(
        "autograd_determinism", "model_or_fn", model_or_fn, "an nn.Module or a callable"
    )
    options.whole_number(
        "autograd_determinism", "runs", runs, minimum=2, why="two runs to compare at least"
    )
    options.flag("autograd_determinism", "cross_process", cross_process)
    options.whole_number("autograd_determinism", "cotangent_seed", cotangent_seed)
    options.number("autograd_determinism", "child_deadline", child_deadline)
    started = time.perf_counter()
    subject = Subject(model_or_fn, inputs, kwargs, failure=DeterminismFailure)
    cotangents = Cotangents(cotangent_seed)
    payload = b""
    attributes = python_attributes.snapshot(subject.named_modules())
    try:
        reference = _run(subject, cotangents)
        changed = python_attributes.changes(
            attributes, python_attributes.snapshot(subject.named_modules())
        )
        if cross_process:
            payload = _child_payload(subject, cotangents)
        for run in range(2, runs + 1):
            in_child = cross_process and run == runs
            other = (
                _run_in_child(payload, child_deadline, run)
                if in_child
                else _run(subject, cotangents)
            )
            differing_keys = differing(reference.values, other.values, same_value)
            first = _describe(differing_keys[0], reference, other, run) if differing_keys else ""
            del other  # freed before the next run, which then reuses its memory
            if differing_keys:
                label = f"Run {run} of {runs}" + (" (in a fresh process)" if in_child else "")
                lines = _mismatch_report(differing_keys, first, label)
                if in_child:
                    agreed = "the in-process runs agreed, so " if runs > 2 else ""
                    lines.append(
                        f"Only the run in a fresh process differs: {agreed}the cause is state "
                        "that differs between processes (thread pools, memory addresses, hash "
                        "seeds, lazily initialized state)."
                    )
                else:
                    lines += python_attributes.described(
                        changed, "so each run starts from other values"
                    )
                    lines.extend(_localize(subject, cotangents, max(runs, 3), changed))
                raise DeterminismFailure("\n".join(lines))
    except _NondeterministicOpRaised as raised:
        raise _nondeterministic_op_error(subject, cotangents, raised) from None
    finally:
        subject.reset()
    return DeterminismResult(
        outputs=reference.outputs,
        parameter_grads=reference.of_kind(Kind.PARAMETER_GRAD),
        input_grads=reference.of_kind(Kind.INPUT_GRAD),
        buffers=reference.of_kind(Kind.BUFFER),
        runs=runs,
        function=describe_callable(model_or_fn),
        cross_process=cross_process,
        seconds=time.perf_counter() - started,
    )


# --- the cross-process run ------------------------------------------------------------


def _child_payload(subject: Subject, cotangents: Cotangents) -> bytes:
    """The pickled request for a run in a fresh process: what to run and from which state."""
    subject.reset()
    start = global_state.snapshot()  # torch settings (thread count included) and RNG states
    payload = {
        "target": subject.target,
        "args": subject.args,
        "kwargs": subject.kwargs,
        "settings": start.settings,
        "rngs": {rng.name: rng.raw for rng in start.rngs},
        "cotangents": cotangents.samples,
        "cotangent_seed": cotangents.seed,
    }
    buffer = io.BytesIO()
    try:
        torch.save(payload, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            "cross_process=True sends the model or function and the inputs to a fresh "
            f"process by pickling, which failed: {error}. Define the model class or function "
            "at module level in an importable module (not inside a test function, not a "
            "lambda) and pass tensors and plain Python values as inputs."
        ) from error
    return buffer.getvalue()


def _run_in_child(payload: bytes, deadline: float, run: int) -> Run:
    """Run ``run`` in a fresh process, killed with its process group after ``deadline`` s.

    Its folder (request, response, output, stack) is removed when it succeeded and kept
    for the user to read when it did not.
    """
    __tracebackhide__ = True
    folder = Path(tempfile.mkdtemp(prefix="determinism-"))
    request, response = folder / "request.pt", folder / "response.pt"
    output, stack, stage = folder / "output.txt", folder / "stack.txt", folder / "stage.txt"
    request.write_bytes(payload)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # pytest --decisions: the fresh process's decisions count for the test too.
    counted = decisions.for_child(folder / "decisions")
    outcome = processes.run_to_deadline(
        [
            sys.executable,
            "-m",
            __name__,
            *map(str, (request, response, stack, stage)),
            "" if counted is None else counted.to_text(),
        ],
        env=environment,
        output=output,
        stack=stack,
        deadline=deadline,
    )
    decisions.merge_children(counted)
    process = f"the fresh process of cross_process=True (pid {outcome.pid}, run {run})"
    if outcome.returncode is None:
        doing = stage.read_text() if stage.exists() else _CHILD_STAGES[0]
        lines = [
            f"autograd_determinism: {process} did not finish within "
            f"child_deadline={deadline:g} s and was killed with its process group; it was "
            f"{doing}."
        ]
        if outcome.stack:
            shown = [located(outcome.stack[0]), *map(str, outcome.stack[1:4])]
            lines.append(f"Its stack, innermost first: {', '.join(shown)}")
        lines.append(f"Its output (stdout and stderr) is in {output}")
        raise DeterminismFailure("\n".join(lines))
    if outcome.returncode != 0:
        text = output.read_text(errors="replace").strip()
        raise DeterminismFailure(
            f"autograd_determinism: {process} failed (exit status {outcome.returncode}):\n"
            f"{text[-3000:]}\nIts whole output is in {output}"
        )
    loaded = torch.load(response, weights_only=False)
    shutil.rmtree(folder, ignore_errors=True)
    return Run(loaded["outputs"], loaded["values"])


# What the fresh process was doing, as it writes it to its stage file; the first before
# it writes anything.
_CHILD_STAGES = (
    "starting: importing torch and the model's modules",
    "unpickling the model and its inputs",
    "running the model forward and backward",
)


def _child_main(request: str, response: str, stack: str, stage: str, counted: str) -> None:
    stack_file = open(stack, "w")  # noqa: SIM115 (faulthandler writes to it until the end)
    processes.dump_stack_on_request(stack_file)
    Path(stage).write_text(_CHILD_STAGES[1])
    payload = torch.load(request, weights_only=False)
    global_state.restore(global_state.GlobalState(settings=payload["settings"], rngs=()))
    for rng in global_state.rng_states():
        if rng.name in payload["rngs"]:
            rng.set_state(payload["rngs"][rng.name])
    subject = Subject(
        payload["target"], payload["args"], payload["kwargs"], failure=DeterminismFailure
    )
    cotangents = Cotangents(payload["cotangent_seed"])
    cotangents.samples.update(payload["cotangents"])
    Path(stage).write_text(_CHILD_STAGES[2])
    result = _counted_run(subject, cotangents, counted)
    torch.save({"outputs": result.outputs, "values": result.values}, response)


def _counted_run(subject: Subject, cotangents: Cotangents, counted: str) -> Run:
    """The fresh process's run, its decisions counted for the test when ``counted`` holds
    the settings (:meth:`.decisions.ChildRecording.to_text`), written out also when it
    raised."""
    if not counted:
        return _run(subject, cotangents)
    settings = decisions.ChildRecording.from_text(counted)
    coverage = decisions.child_coverage(settings)
    try:
        with decisions.recording(coverage, settings.test):
            return _run(subject, cotangents)
    finally:
        decisions.save_for_parent(coverage, settings)


if __name__ == "__main__":
    _child_main(*sys.argv[1:6])
