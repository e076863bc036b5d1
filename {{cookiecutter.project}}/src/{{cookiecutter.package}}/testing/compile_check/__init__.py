"""Check that ``torch.compile`` computes what eager PyTorch computes, and say where it breaks.

:func:`compile_check` runs a model (or function) once eagerly and once compiled, each
forward and backward from the same parameters, buffers, RNG states and inputs
(:mod:`..subject`, :mod:`..runs`), and compares the outputs and the gradients of
every parameter and input that requires grad within tolerances chosen by dtype. It
returns what the compiler did: each graph break once, at the line that caused it
(the user's line, then the library lines under it: :mod:`..frames`), with torch's
``GBxxxx`` id, explanation and hint from its graph break registry, the
data-dependent decision recorded there by :mod:`..control_flow`, and the rewrite
that removes it where :mod:`..rewrites` has one; each recompilation with the guard
that failed, in words, and its line. A run that fails only under torch.compile is
a :class:`CompiledRunFailed` naming the backend, the phase and the user's line; an
error the eager run raises too is the model's own and comes out as it is.

The package's modules, top down (imports run downwards only): this one holds the
entry, its options, the comparison of the runs and the failure of a compiled run;
:mod:`.graph_breaks` reads each break from dynamo's records, :mod:`.recompiles` puts
each recompilation's guard in words, both from private records of torch that they
name; :mod:`.results` holds the failures and the result. torch's records are cleared
by ``torch.compiler.reset()``, which every check calls before and after itself, so
checks stay independent.

Cost: one eager and one compiled forward and backward per input set, plus the
compilation itself.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import control_flow, options, python_attributes, torch_logs
from ..calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from ..comparison import DEFAULT_TOLERANCES, close_mismatch, differing, tolerances_for
from ..failures import CheckFailure, most_fundamental, quoted
from ..frames import (
    CallPath,
    Origin,
    call_path,
    frames_in_text,
    origin,
    stack_frames,
    traceback_frames,
)
from ..naming import describe_callable
from ..runs import Cotangents, Phase, Run, RunProgress, run_once
from ..subject import Subject
from .graph_breaks import graph_break_records, graph_breaks, raised_graph_break, traced_frames
from .recompiles import InputSet, recompiles, refused_recompile
from .results import (
    CompileCheckFailure,
    CompileCheckResult,
    CompiledRunFailed,
    CompileMismatch,
    EagerFallback,
    FailedPhase,
    GraphBreak,
    Recompile,
    TooManyGraphBreaks,
    TooManyRecompiles,
    indented,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "CompileCheckFailure",
    "CompileCheckResult",
    "CompileMismatch",
    "CompiledRunFailed",
    "EagerFallback",
    "FailedPhase",
    "GraphBreak",
    "Recompile",
    "TooManyGraphBreaks",
    "TooManyRecompiles",
    "compile_check",
    "tolerances_for",
]

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_LISTED = 5


# --- arguments --------------------------------------------------------------------------


def _validate(backend, mode, dynamic, max_graph_breaks, max_recompiles, rtol, atol) -> None:
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            usual = sorted(name for name in known if name.islower() and name.count("_") <= 1)
            raise options.refuse(
                "compile_check",
                "backend",
                backend,
                f"a callable or the name of a registered torch.compile backend, such as "
                f"{', '.join(usual)}",
            )
    else:
        options.function(
            "compile_check", "backend", backend, "a registered backend name or a callable"
        )
    options.choice("compile_check", "mode", mode, MODES)
    if mode is not None and backend != "inductor":
        raise options.refuse(
            "compile_check",
            "mode",
            mode,
            f"None with backend={backend!r} (a mode needs backend='inductor')",
        )
    options.flag("compile_check", "dynamic", dynamic, optional=True)
    for name, value in (("max_graph_breaks", max_graph_breaks), ("max_recompiles", max_recompiles)):
        options.whole_number("compile_check", name, value, minimum=0, optional=True)
    for name, value in (("rtol", rtol), ("atol", atol)):
        options.number("compile_check", name, value, zero=True, optional=True)


# --- comparing the runs -----------------------------------------------------------------

_SIDES = ("eager", "compiled")


def _mismatch(
    eager: Run,
    compiled: Run,
    rtol: float | None,
    atol: float | None,
    input_set: int,
    changed: Sequence[python_attributes.AttributeChange],
) -> CompileMismatch | None:
    """The compiled run's first result that differs from eager's, the others listed;
    ``changed``: the Python attributes the eager run changed, so the compiled run started
    from other values (the likely cause, named)."""

    def close(a: Any, b: Any) -> bool:
        return close_mismatch("", a, b, rtol, atol, _SIDES) is None

    found = differing(eager.values, compiled.values, close)
    if not found:
        return None
    key, others = found[0], [str(other) for other in found[1:]]
    if key in eager.values and key in compiled.values:
        mismatch = close_mismatch(
            str(key), eager.values[key], compiled.values[key], rtol, atol, _SIDES
        )
        assert mismatch is not None
        description, index = mismatch.description, mismatch.index
    else:
        side = "eager" if key in eager.values else "the compiled run"
        description, index = f"{key}: only {side} has it", None
    lines = [
        f"torch.compile's result differs from eager's for input set {input_set} (both ran "
        "forward and backward from the same parameters, buffers, RNG states and inputs):",
        f"  {description}",
    ]
    if others:
        more = len(others) - _LISTED
        lines.append(
            f"  also differ: {', '.join(others[:_LISTED])}"
            + (f" and {more} more" if more > 0 else "")
        )
    lines += python_attributes.described(
        changed, "so the compiled run started from other values than eager's"
    )
    return CompileMismatch(
        "\n".join(lines),
        name=str(key),
        index=index,
        eager=eager.values.get(key),
        compiled=compiled.values.get(key),
        input_set=input_set,
    )


# --- the check ----------------------------------------------------------------------------


@contextlib.contextmanager
def _fresh_compiler(backend: Any, strict_breaks: bool) -> Iterator[None]:
    """Dynamo without earlier compilations, with the settings the check needs; undone after.

    ``strict_breaks``: torch's own strict mode (``error_on_graph_break``), which stops
    at the first graph break with the break's exception (its type, line and cause).
    """
    torch.compiler.reset()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(report_guard_failures=True))
        if strict_breaks:
            stack.enter_context(torch._dynamo.error_on_graph_break(True))
        if backend == "inductor":
            import torch._inductor.config as inductor_config

            # Inductor draws random numbers with its own generator unless told to fall
            # back to eager's, which the check needs for the same dropout masks.
            stack.enter_context(inductor_config.patch(fallback_random=True))
        try:
            yield
        finally:
            torch.compiler.reset()


@control_flow.without_torch_function_modes()
def compile_check(
    model_or_fn: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    inputs_list: list[tuple] | None = None,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    max_graph_breaks: int | None = None,
    max_recompiles: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **unknown: Any,
) -> CompileCheckResult:
    """Run ``model_or_fn`` eagerly and under ``torch.compile``; results must agree.

    For each input set (``inputs``, then each tuple of ``inputs_list``) both runs
    start from the same parameters, buffers and RNG states and fresh copies of the
    inputs; a fixed random cotangent is pulled back through every floating-point
    output. Compared: the outputs, the gradients of every parameter and input that
    requires grad, and the buffers the forward changed, with ``rtol``/``atol`` or
    the dtype's :data:`DEFAULT_TOLERANCES`. ``backend``, ``mode`` and ``dynamic`` go
    to ``torch.compile``. The model and inputs are left as they were, and dynamo's
    caches are cleared before and after.

    ``max_graph_breaks=0`` compiles in torch's strict mode
    (``torch._dynamo.error_on_graph_break``), which stops at the first break;
    ``max_recompiles=0`` runs every input set after the first under
    ``torch.compiler.set_stance("fail_on_recompile")``, which stops at the first
    compilation after the first input set.

    Raises :class:`CompileMismatch` naming the first differing output or gradient and
    element; :class:`CompiledRunFailed` when the compiled run raises where the eager
    run did not (an error of the eager run is the model's own and comes out as it
    is); :class:`TooManyGraphBreaks`/:class:`TooManyRecompiles` listing every break
    or recompilation when there are more than ``max_graph_breaks`` or
    ``max_recompiles``. A mismatch stops the runs; it is raised first, the budgets
    exceeded by the runs until then listed in its message after ``also:``
    (:func:`..failures.most_fundamental`). Returns a :class:`CompileCheckResult`.
    """
    __tracebackhide__ = True
    reject_unknown_keywords("compile_check", unknown, _OPTIONS)
    options.function("compile_check", "model_or_fn", model_or_fn, "an nn.Module or a callable")
    kwargs = forward_kwargs_of("compile_check", forward_kwargs)
    sets = input_sets("compile_check", inputs, inputs_list)
    _validate(backend, mode, dynamic, max_graph_breaks, max_recompiles, rtol, atol)
    backend_name = backend if isinstance(backend, str) else describe_callable(backend)
    above = _caller_frames()
    started = time.perf_counter()
    decisions: list[control_flow.Decision] = []
    compared: set[str] = set()
    mismatch = None
    recompilations: list[Recompile] = []
    seen: set[tuple[object, str]] = set()
    with (
        torch_logs.quiet(),
        _fresh_compiler(backend, strict_breaks=max_graph_breaks == 0),
        graph_break_records() as records,
    ):
        compiled_target = torch.compile(model_or_fn, backend=backend, mode=mode, dynamic=dynamic)
        for number, arguments in enumerate(sets):
            subject = Subject(model_or_fn, arguments, kwargs, failure=CompileCheckFailure)
            cotangents = Cotangents(0)
            try:
                before_eager = python_attributes.snapshot(subject.named_modules())
                with control_flow.record_decisions() as log:
                    eager = _eager_run(subject, cotangents)
                decisions.extend(log)
                before_compiled = python_attributes.snapshot(subject.named_modules())
                input_set = InputSet(
                    number,
                    decisions,
                    log,
                    dict(subject.named_inputs(subject.args, subject.kwargs)),
                    before_compiled,
                )
                progress = RunProgress()
                try:
                    with (
                        torch.compiler.set_stance("fail_on_recompile")
                        if max_recompiles == 0 and number > 0
                        else contextlib.nullcontext()
                    ):
                        compiled = run_once(
                            subject, cotangents, call=compiled_target, progress=progress
                        )
                except CheckFailure:
                    raise
                except Exception as error:  # the model ran eagerly: torch.compile failed
                    raise _compiled_failure(
                        error,
                        progress.phase,
                        backend_name,
                        above,
                        input_set,
                        strict_breaks=max_graph_breaks == 0,
                        forward_line=functools.partial(
                            _forward_line, subject, cotangents, compiled_target
                        ),
                    ) from None
            finally:
                subject.reset()
            recompilations += recompiles(seen, input_set)
            mismatch = _mismatch(
                eager,
                compiled,
                rtol,
                atol,
                number,
                python_attributes.changes(before_eager, before_compiled),
            )
            compared.update(str(key) for key in eager.values)
            del eager, compiled
            if mismatch is not None:  # the budgets count what ran until then
                break
        breaks = tuple(graph_breaks(records.records, decisions))
    # A wrong result first; then graph breaks before recompilations: a break splits the
    # code into frames compiled and guarded each on its own, so breaks change where
    # recompilations happen, not the other way round.
    failure = most_fundamental(
        [
            found
            for found in (
                mismatch,
                _over_budget(breaks, max_graph_breaks, "max_graph_breaks", TooManyGraphBreaks),
                _over_budget(
                    tuple(recompilations), max_recompiles, "max_recompiles", TooManyRecompiles
                ),
            )
            if found is not None
        ]
    )
    if failure is not None:
        raise failure
    return CompileCheckResult(
        function=describe_callable(model_or_fn),
        backend=backend_name,
        input_sets=len(sets),
        compared=tuple(sorted(compared)),
        graph_breaks=breaks,
        recompiles=tuple(recompilations),
        seconds=time.perf_counter() - started,
    )


_OPTIONS = (
    "forward_kwargs",
    "inputs_list",
    "backend",
    "mode",
    "dynamic",
    "max_graph_breaks",
    "max_recompiles",
    "rtol",
    "atol",
)
_EAGER_NOTE = (
    "compile_check: the eager run (without torch.compile) raised this, so it is the model's "
    "own error, not torch.compile's"
)


def _caller_frames() -> tuple[tuple[str, int], ...]:
    """The frames that called the check (the test's line), outermost first."""
    return tuple(stack_frames(sys._getframe(1)))


def _eager_run(subject: Subject, cotangents: Cotangents) -> Run:
    """The eager run; its error is the model's own, and is marked as such for the report."""
    try:
        return run_once(subject, cotangents)
    except Exception as error:
        model_error = not isinstance(error, CheckFailure) and not _raised_by_plugin(error)
        if model_error and hasattr(error, "add_note"):  # Python 3.11 and later
            error.add_note(_EAGER_NOTE)
        raise


def _raised_by_plugin(error: BaseException) -> bool:
    """Whether this plugin raised ``error`` itself (not an op it passed on for the model)."""
    innermost = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        innermost = frame
    return (
        innermost is not None
        and origin(innermost.f_code.co_filename) is Origin.PLUGIN
        and innermost.f_code.co_name not in control_flow.MODE_HANDLERS
    )


def _compiled_failure(
    error: Exception,
    phase: Phase,
    backend: str,
    above: tuple[tuple[str, int], ...],
    input_set: InputSet,
    *,
    strict_breaks: bool,
    forward_line: Callable[[], CallPath],
) -> CompileCheckFailure:
    """What a compiled run that raised (where the eager run did not) tells the user.

    ``forward_line`` finds, for a failed backward, the forward line of the op whose
    backward failed (a backward has no line of its own).
    """
    from torch._dynamo.exc import TorchDynamoException

    number = input_set.number
    found = raised_graph_break(error, above, input_set.decisions) if strict_breaks else None
    if found is not None:
        return TooManyGraphBreaks(
            f"a graph break, and max_graph_breaks=0 allows none (torch.compile stopped at "
            f"it: torch._dynamo.error_on_graph_break):\n{indented(found)}",
            (found,),
        )
    recompile = refused_recompile(error, input_set)
    if recompile is not None:
        return TooManyRecompiles(
            f"a recompilation for input set {number}, and max_recompiles=0 allows none "
            "(torch.compile stopped at it: torch.compiler.set_stance('fail_on_recompile')):\n"
            f"{indented(recompile)}",
            (recompile,),
        )
    compiling = isinstance(error, TorchDynamoException)
    inner = getattr(error, "inner_exception", None)  # BackendCompilerFailed: the backend's
    first = quoted(inner if isinstance(inner, Exception) else error)
    failed = FailedPhase.COMPILE if compiling else FailedPhase(phase.value)
    if failed is FailedPhase.BACKWARD:
        path = forward_line()
    else:
        stack = traced_frames(error) or traceback_frames(error)
        path = call_path([*above, *stack])
    where = {
        FailedPhase.COMPILE: f"while compiling the {phase.value} of input set {number}",
        FailedPhase.FORWARD: f"in the compiled forward of input set {number}",
        FailedPhase.BACKWARD: f"in the compiled backward of input set {number}",
    }[failed]
    lines = [
        f"torch.compile (backend {backend}) failed {where}; eager PyTorch ran the same forward "
        "and backward without error, so this is torch.compile's failure, not the model's:",
        f"  {first}",
    ]
    if failed is FailedPhase.BACKWARD and path:
        lines.append("  the backward of the op made at:")
    lines += path.lines(indent="  ")
    return CompiledRunFailed(
        "\n".join(lines),
        backend=backend,
        phase=failed,
        input_set=number,
        path=path,
        torch_error=error,
    )


def _forward_line(subject: Subject, cotangents: Cotangents, call: Any) -> CallPath:
    """The forward line of the op whose compiled backward failed, with the way there.

    Autograd's anomaly mode records, for each op of the forward, the stack that made
    it, and names that stack when the op's backward fails; the compiled run is
    repeated once in that mode, only to read it.
    """
    with (
        warnings.catch_warnings(record=True) as caught,
        torch.autograd.detect_anomaly(check_nan=False),
    ):
        warnings.simplefilter("always")
        try:
            run_once(subject, cotangents, call=call)
        except Exception:  # the failure is reported already; this run only names its line
            pass
        finally:
            subject.reset()
    for warning in caught:
        text = str(warning.message)
        if "Traceback of forward call that caused the error" in text:
            return call_path(frames_in_text(text))
    return CallPath(None)


def _over_budget(
    found: tuple, budget: int | None, option: str, error: type[CompileCheckFailure]
) -> CompileCheckFailure | None:
    if budget is None or len(found) <= budget:
        return None
    what = "graph breaks" if error is TooManyGraphBreaks else "recompilations"
    listed = "\n".join(indented(entry) for entry in found)
    return error(f"{len(found)} {what}, more than {option}={budget}:\n{listed}", found)
