"""Check that ``torch.compile`` computes what eager PyTorch computes, and say where it breaks.

:func:`compile_check` runs a model (or function) once eagerly and once compiled, each
forward and backward from the same parameters, buffers, RNG states and inputs
(:mod:`.subject`, :mod:`.runs`), and compares the outputs and the gradients of
every parameter and input that requires grad within tolerances chosen by dtype. It
returns what the compiler did: each graph break with its reason in words, the user's
``file:line`` and source line, and the data-dependent decision recorded there by
:mod:`.control_flow` (``Tensor.__bool__`` for ``if h.mean() > 0``); each
recompilation with the guard that failed, in words, and its line.

Where torch offers no public record, this module reads two of its private ones and
says so where it does: the ``graph_breaks`` logging artifact (the records
``TORCH_LOGS=graph_breaks`` prints; its first line names the user's line) and
``torch._dynamo.utils.guard_failures`` (the guard failure behind each recompilation,
kept whatever the logging settings). Both are cleared by ``torch.compiler.reset()``,
which every check calls before and after itself, so checks stay independent.

Cost: one eager and one compiled forward and backward per input set, plus the
compilation itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import control_flow
from .calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from .comparison import DEFAULT_TOLERANCES, close_mismatch, differing, tolerances_for
from .failures import CheckFailure
from .naming import describe_callable
from .runs import Cotangents, Run, run_once
from .subject import Subject

__all__ = [
    "DEFAULT_TOLERANCES",
    "CompileCheckFailure",
    "CompileCheckResult",
    "CompileMismatch",
    "GraphBreak",
    "Recompile",
    "TooManyGraphBreaks",
    "TooManyRecompiles",
    "compile_check",
    "tolerances_for",
]

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_LISTED = 5

_BREAK_HEADER = re.compile(r"^Graph break (?:\(.*?\) )?in user code at (?P<file>.+):(?P<line>\d+)$")
_WRAPPERS = ("Encountered graph break when attempting to trace", "Failed to handle graph break")
_WHOLE_FUNCTION_EAGER = "Failed to handle graph break gracefully"
# Reasons of older torch versions, which had no graph break types yet.
_OLD_REASONS = {"generic_jump": "Data-dependent branching"}
# "(e.g. `if my_tensor.sum() > 0:`)": an example in parentheses, code in backticks.
_PARENTHESES = re.compile(r"\s*\((?:[^()`]|`[^`]*`)+\)")
_GUARD_ID = re.compile(r"^(?P<id>\d+/\d+): (?P<guard>.*)$", re.S)
_STACK_FILE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<function>.+)_at_(?P<line>\d+)$")
_SIZE = re.compile(
    r"tensor '(?P<name>.+)' size mismatch at index (?P<dim>\d+)\. "
    r"expected (?P<expected>\d+), actual (?P<actual>\d+)"
)
_MISMATCH = re.compile(r"tensor '(?P<name>.+)' (?P<what>[\w ]+?) mismatch\. (?P<rest>.*)")
_EQUALS = re.compile(r"^(?P<variable>\S+) == (?P<value>.+)$")
_LOCAL = re.compile(r"^L\['(?P<name>[^']+)'\]$")


class CompileCheckFailure(CheckFailure):
    """``compile_check`` failed; the message says what and where."""

    check = "compile_check"


class CompileMismatch(CompileCheckFailure):
    """The compiled run's ``name`` (an output, a gradient, a buffer) differs from eager's."""

    def __init__(
        self,
        message: str,
        *,
        name: str,
        index: tuple[int, ...] | None,
        eager: Any,
        compiled: Any,
        input_set: int,
    ) -> None:
        super().__init__(message)
        self.name, self.index, self.input_set = name, index, input_set
        self.eager, self.compiled = eager, compiled


class TooManyGraphBreaks(CompileCheckFailure):
    """More graph breaks than ``max_graph_breaks``; ``graph_breaks`` lists them all."""

    def __init__(self, message: str, graph_breaks: tuple[GraphBreak, ...]) -> None:
        super().__init__(message)
        self.graph_breaks = graph_breaks


class TooManyRecompiles(CompileCheckFailure):
    """More recompilations than ``max_recompiles``; ``recompiles`` lists them all."""

    def __init__(self, message: str, recompiles: tuple[Recompile, ...]) -> None:
        super().__init__(message)
        self.recompiles = recompiles


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where ``torch.compile`` split the graph, and why.

    ``reason`` is torch's, in words (``Data-dependent branching``), ``location`` the
    user's ``file:line``, ``source`` that line. ``decision`` names the data-dependent
    decision made there in the eager run (``Tensor.__bool__``, ``Tensor.item``), or is
    ``None`` when the break has another cause. ``whole_function_eager``: torch.compile
    gave up on the function holding the line (a break inside a loop or a comprehension)
    and runs all of it eagerly.
    """

    reason: str
    location: control_flow.Location
    source: str
    decision: str | None
    whole_function_eager: bool

    def __str__(self) -> str:
        decided = f" (decision {self.decision})" if self.decision else ""
        eager = (
            "; torch.compile runs this whole function eagerly" if self.whole_function_eager else ""
        )
        return f"graph break at {self.location}: `{self.source}`: {self.reason}{decided}{eager}"


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A recompilation: the compiled code's guard ``guard`` failed on a later call.

    ``guard`` says in words what changed; ``location``/``source`` are the user's line
    the guard was made for (the function's first line when torch does not say);
    ``function`` is the compiled function, ``code after the graph break at <line>``
    for the rest of a function after a graph break. ``torch_guard`` is torch's text.
    """

    function: str
    guard: str
    location: control_flow.Location
    source: str
    torch_guard: str

    def __str__(self) -> str:
        return f"recompiled {self.function} at {self.location}: `{self.source}`: {self.guard}"


@dataclasses.dataclass(frozen=True)
class CompileCheckResult:
    """A passing check: what was compared, the graph breaks, the recompilations.

    ``str()`` of it is the report ``pytest -v`` shows.
    """

    function: str
    backend: str
    input_sets: int
    compared: tuple[str, ...]
    graph_breaks: tuple[GraphBreak, ...]
    recompiles: tuple[Recompile, ...]
    seconds: float

    def __str__(self) -> str:
        lines = [
            f"compile_check {self.function} (backend {self.backend}): {len(self.compared)} "
            f"outputs and gradients match eager on {self.input_sets} input set(s); "
            f"{len(self.graph_breaks)} graph break(s), {len(self.recompiles)} recompile(s); "
            f"{self.seconds:.2f} s"
        ]
        lines += [f"  {entry}" for entry in (*self.graph_breaks, *self.recompiles)]
        return "\n".join(lines)


# --- arguments --------------------------------------------------------------------------


def _validate(backend, mode, dynamic, max_graph_breaks, max_recompiles, rtol, atol) -> None:
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            usual = sorted(name for name in known if name.islower() and name.count("_") <= 1)
            raise ValueError(
                f"compile_check: backend={backend!r} is not a torch.compile backend; "
                f"expected a callable or a registered name such as {', '.join(usual)}"
            )
    elif not callable(backend):
        raise TypeError(f"compile_check: backend must be a name or a callable, got {backend!r}")
    if mode not in MODES:
        allowed = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"compile_check: mode={mode!r} is not allowed: expected one of {allowed}")
    if mode is not None and backend != "inductor":
        raise ValueError(f"compile_check: mode={mode!r} needs backend='inductor', got {backend!r}")
    if dynamic not in (None, True, False):
        raise TypeError(f"compile_check: dynamic must be None, True or False, got {dynamic!r}")
    for name, value in (("max_graph_breaks", max_graph_breaks), ("max_recompiles", max_recompiles)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(
                f"compile_check: {name} must be None or a whole number >= 0, got {value!r}"
            )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value < 0
        ):
            raise ValueError(f"compile_check: {name} must be None or a number >= 0, got {value!r}")


# --- what the compiler reports ------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _graph_break_records() -> Iterator[_Records]:
    """The ``graph_breaks`` logging artifact's records made inside the block.

    Private surface: the artifact's loggers (``<module>.__graph_breaks``, registered by
    ``torch._logging.getArtifactLogger``) are the only record of a break that compiles
    no graph (torch.compile giving up on a whole function). Unless the user turned the
    artifact on (``TORCH_LOGS=graph_breaks``), the records are kept from the terminal.
    """
    records = _Records()
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith("torch.") and name.endswith(".__graph_breaks")
    ]
    saved = [(logger, logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        if not logger.isEnabledFor(logging.DEBUG):
            logger.setLevel(logging.DEBUG)
            logger.propagate = False
        logger.addHandler(records)
    try:
        yield records
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(records)
            logger.setLevel(level)
            logger.propagate = propagate


def _graph_breaks(
    messages: list[str], decisions: Sequence[control_flow.Decision]
) -> list[GraphBreak]:
    """One entry per distinct break (a line and a reason), in the order torch met them."""
    decided: dict[control_flow.Location, str] = {}
    for decision in decisions:
        decided.setdefault(decision.location, decision.op)
    found: dict[tuple[control_flow.Location, str], GraphBreak] = {}
    for message in messages:
        head, _, rest = message.partition("\n")
        matched = _BREAK_HEADER.match(head)
        if matched is None:
            continue
        filename, line = matched["file"], int(matched["line"])
        reason = rest.partition("Graph Break Reason: ")[2].partition("\nUser code traceback:")[0]
        whole_function = _WHOLE_FUNCTION_EAGER in reason
        while reason.startswith(_WRAPPERS):
            reason = reason.partition("\n\n")[2] or reason.partition("\n")[2]
        kind, _, details = reason.strip().partition("\n")
        kind = next((words for raw, words in _OLD_REASONS.items() if kind.startswith(raw)), kind)
        explanation = next(
            (
                text.strip().removeprefix("Explanation:").strip()
                for text in details.splitlines()
                if text.strip().startswith("Explanation:")
            ),
            "",
        )
        sentences = _PARENTHESES.sub("", explanation).strip().split(". ")
        if kind.lower() in sentences[0].lower():  # "Detected data-dependent branching"
            sentences = sentences[1:]
        explanation = ". ".join(sentences)
        words = f"{kind}: {explanation}" if explanation else kind
        location = control_flow.Location(filename, line)
        key = (location, kind)
        earlier = found.get(key)
        found[key] = GraphBreak(
            reason=words,
            location=location,
            source=location.source,
            decision=decided.get(location),
            whole_function_eager=whole_function or bool(earlier and earlier.whole_function_eager),
        )
    return list(found.values())


def _recompiles(decisions: Sequence[control_flow.Decision]) -> list[Recompile]:
    """Each recompilation since the last reset, from the guard failures torch keeps.

    Private surface: ``torch._dynamo.utils.guard_failures`` maps each compiled code
    object to the failure reasons of its cached entries (``"<frame>/<entry>: <guard>"``);
    a recompilation lists every entry it tried, newest first, so each new entry number
    starts one recompilation.
    """
    from torch._dynamo.utils import guard_failures

    found = []
    for code, reasons in list(guard_failures.items()):
        seen: set[str] = set()
        for reason in reasons:
            matched = _GUARD_ID.match(str(reason).strip())
            if matched is None or matched["id"] in seen:
                continue
            seen.add(matched["id"])
            found.append(_recompile(code, matched["guard"], decisions))
    return found


def _recompile(code: Any, text: str, decisions: Sequence[control_flow.Decision]) -> Recompile:
    guard, _, stack = text.partition("\nUser stack trace:")
    guard = guard.split("  #")[0].strip()
    frames = _STACK_FILE.findall(stack)
    filename, line = (
        (frames[-1][0], int(frames[-1][1])) if frames else (code.co_filename, code.co_firstlineno)
    )
    resumed = _RESUME.match(code.co_name)
    function = code.co_name
    made_at = None
    if resumed:
        made_at = control_flow.Location(code.co_filename, int(resumed["line"]))
        function = f"{resumed['function']} (the code after its graph break at {made_at})"
    location = control_flow.Location(filename, line)
    return Recompile(
        function=function,
        guard=_guard_in_words(guard, made_at, decisions),
        location=location,
        source=location.source,
        torch_guard=guard,
    )


def _guard_in_words(
    guard: str, made_at: control_flow.Location | None, decisions: Sequence[control_flow.Decision]
) -> str:
    size = _SIZE.search(guard)
    if size:
        return (
            f"input {size['name']} has size {size['actual']} in dimension {size['dim']}, the "
            f"compiled code was specialized for {size['expected']} (pass dynamic=True, or "
            "torch._dynamo.mark_dynamic, to compile once for all sizes)"
        )
    mismatch = _MISMATCH.search(guard)
    if mismatch:
        return f"input {mismatch['name']}: its {mismatch['what']} changed ({mismatch['rest']})"
    equals = _EQUALS.match(guard)
    if equals:
        variable, value = equals["variable"], equals["value"]
        local = _LOCAL.match(variable)
        if local or (variable.isidentifier() and not variable.startswith("___")):
            subject = f"the Python value {local['name'] if local else variable}"
        elif variable.startswith("___stack") and made_at:
            made = next((d for d in decisions if d.location == made_at), None)
            how = f" by {made.op}" if made else ""
            subject = f"the Python number made from a tensor{how} at {made_at}"
        else:
            subject = variable
        return (
            f"{subject} was {value} when compiled and is not now: the compiled code is "
            "specialized on that value, so each new value compiles again (keep it a tensor)"
        )
    return guard


# --- comparing the runs -----------------------------------------------------------------

_SIDES = ("eager", "compiled")


def _compare(
    eager: Run, compiled: Run, rtol: float | None, atol: float | None, input_set: int
) -> None:
    __tracebackhide__ = True

    def close(a: Any, b: Any) -> bool:
        return close_mismatch("", a, b, rtol, atol, _SIDES) is None

    found = differing(eager.values, compiled.values, close)
    if not found:
        return
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
    raise CompileMismatch(
        "\n".join(lines),
        name=str(key),
        index=index,
        eager=eager.values.get(key),
        compiled=compiled.values.get(key),
        input_set=input_set,
    )


# --- the check ----------------------------------------------------------------------------


@contextlib.contextmanager
def _fresh_compiler(backend: Any) -> Iterator[None]:
    """Dynamo without earlier compilations, with the settings the check needs; undone after."""
    torch.compiler.reset()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(report_guard_failures=True))
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

    Raises :class:`CompileMismatch` naming the first differing output or gradient and
    element, :class:`TooManyGraphBreaks`/:class:`TooManyRecompiles` listing every
    break or recompilation when there are more than ``max_graph_breaks`` or
    ``max_recompiles``. Returns a :class:`CompileCheckResult`.
    """
    __tracebackhide__ = True
    reject_unknown_keywords("compile_check", unknown, _OPTIONS)
    if not callable(model_or_fn):
        raise TypeError(
            f"compile_check: model_or_fn must be an nn.Module or a callable, got "
            f"{type(model_or_fn).__name__}"
        )
    kwargs = forward_kwargs_of("compile_check", forward_kwargs)
    sets = input_sets("compile_check", inputs, inputs_list)
    _validate(backend, mode, dynamic, max_graph_breaks, max_recompiles, rtol, atol)
    started = time.perf_counter()
    decisions: list[control_flow.Decision] = []
    compared: set[str] = set()
    with _fresh_compiler(backend), _graph_break_records() as records:
        compiled_target = torch.compile(model_or_fn, backend=backend, mode=mode, dynamic=dynamic)
        for number, arguments in enumerate(sets):
            subject = Subject(model_or_fn, arguments, kwargs, failure=CompileCheckFailure)
            cotangents = Cotangents(0)
            try:
                with control_flow.record_decisions() as log:
                    eager = run_once(subject, cotangents)
                decisions.extend(log)
                compiled = run_once(subject, cotangents, call=compiled_target)
            finally:
                subject.reset()
            _compare(eager, compiled, rtol, atol, number)
            compared.update(str(key) for key in eager.values)
            del eager, compiled
        graph_breaks = tuple(_graph_breaks(records.messages, decisions))
        recompiles = tuple(_recompiles(decisions))
    _check_budget(graph_breaks, max_graph_breaks, "max_graph_breaks", TooManyGraphBreaks)
    _check_budget(recompiles, max_recompiles, "max_recompiles", TooManyRecompiles)
    return CompileCheckResult(
        function=describe_callable(model_or_fn),
        backend=backend if isinstance(backend, str) else describe_callable(backend),
        input_sets=len(sets),
        compared=tuple(sorted(compared)),
        graph_breaks=graph_breaks,
        recompiles=recompiles,
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


def _check_budget(found: tuple, budget: int | None, option: str, error: type) -> None:
    __tracebackhide__ = True
    if budget is None or len(found) <= budget:
        return
    what = "graph breaks" if error is TooManyGraphBreaks else "recompilations"
    listed = "\n".join(f"  {entry}" for entry in found)
    raise error(f"{len(found)} {what}, more than {option}={budget}:\n{listed}", found)
