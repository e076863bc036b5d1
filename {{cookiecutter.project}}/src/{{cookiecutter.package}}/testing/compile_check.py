"""Check that ``torch.compile`` computes what eager PyTorch computes, and say where it breaks.

:func:`compile_check` runs a model (or function) once eagerly and once compiled, each
forward and backward from the same parameters, buffers, RNG states and inputs
(:mod:`.subject`, :mod:`.runs`), and compares the outputs and the gradients of
every parameter and input that requires grad within tolerances chosen by dtype. It
returns what the compiler did: each graph break once, at the line that caused it
(the user's line, then the library lines under it: :mod:`.frames`), with torch's
``GBxxxx`` id, explanation and hint from its graph break registry, the
data-dependent decision recorded there by :mod:`.control_flow`, and the rewrite
that removes it where :mod:`.rewrites` has one; each recompilation with the guard
that failed, in words, and its line. A run that fails only under torch.compile is
a :class:`CompiledRunFailed` naming the backend, the phase and the user's line; an
error the eager run raises too is the model's own and comes out as it is.

Where torch offers no public record, this module reads private ones and says so
where it does: the ``graph_breaks`` logging artifact (the records
``TORCH_LOGS=graph_breaks`` prints) with the exception torch is handling when it
writes one (its ``gb_type``, ``real_stack`` and cause),
``torch._dynamo.utils.guard_failures`` (the guard failure behind each
recompilation) and the registry file ``torch/_dynamo/graph_break_registry.json``.
The first two are cleared by ``torch.compiler.reset()``, which every check calls
before and after itself, so checks stay independent.

Cost: one eager and one compiled forward and backward per input set, plus the
compilation itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import control_flow, options, torch_logs
from .calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from .comparison import DEFAULT_TOLERANCES, close_mismatch, differing, tolerances_for
from .failures import CheckFailure, most_fundamental, quoted
from .frames import (
    CallPath,
    Origin,
    call_path,
    frames_in_text,
    origin,
    stack_frames,
    traceback_frames,
)
from .naming import describe_callable
from .rewrites import rewrite
from .runs import Cotangents, Phase, Run, RunProgress, run_once
from .subject import Subject

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

_DYNAMO_DIR = os.path.dirname(torch._dynamo.__file__) + os.sep
_BREAK_HEADER = re.compile(r"^Graph break (?:\(.*?\) )?in user code at (?P<file>.+):(?P<line>\d+)$")
# What torch puts before the graph break itself when it reports one.
_WRAPPERS = (
    "Encountered graph break when attempting to trace",
    "Encountered graph break that we cannot resume from",
    "Failed to handle graph break",
)
_NESTED = "\n\n*** While handling this graph break, another graph break occurred: ***"
# Reasons of older torch versions, which had no graph break types yet.
_OLD_REASONS = {"generic_jump": "Data-dependent branching"}
# "(e.g. `if my_tensor.sum() > 0:`)": an example in parentheses, code in backticks.
_PARENTHESES = re.compile(r"\s*\((?:[^()`]|`[^`]*`)+\)")
# torch's hints that tell the user nothing about their code.
_GENERIC_HINTS = ("report an issue", "file an issue", "unlikely that dynamo will ever")
_DATA_DEPENDENT_BRANCHING = "Data-dependent branching"
_BACKEND_EXCEPTION = "Backend compiler exception"
_GUARD_ID = re.compile(r"^(?P<id>\d+/\d+): (?P<guard>.*)$", re.S)
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<function>.+)_at_(?P<line>\d+)$")
_SIZE = re.compile(
    r"tensor '(?P<name>.+)' size mismatch at index (?P<dim>\d+)\. "
    r"expected (?P<expected>\d+), actual (?P<actual>\d+)"
)
_MISMATCH = re.compile(r"tensor '(?P<name>.+)' (?P<what>[\w ]+?) mismatch\. (?P<rest>.*)")
_EXPECTED_TENSOR = re.compile(
    r"expected type of '(?P<name>[^']+)' to be a tensor type.*found (?P<found><class '[^']+'>)"
)
_TYPE_ID = re.compile(
    r"^___check_type_id\((?P<variable>.+), \d+\)(?:, type=<class '(?P<type>[^']+)'>)?$"
)
_OBJECT_ID = re.compile(r"^___check_obj_id\((?P<variable>.+), \d+\)")
_LENGTH = re.compile(r"^len\((?P<variable>.+)\) == (?P<value>\d+)$")
_RANGE = re.compile(r"^___normalize_range_iter\((?P<variable>.+)\) == \((?P<range>[-\d, ]+)\)$")
_EQUALS = re.compile(r"^(?P<variable>\S+) == (?P<value>.+)$")
# "2 <= x.size()[0]": the range a dynamic size was compiled for.
_SIZE_RANGE = re.compile(r"(?P<name>[\w.\[\]'\"]+)\.size\(\)\[(?P<dim>\d+)\]")
_NONE = re.compile(r"^(?P<variable>\S+) is (?P<negation>not )?None$")
_EMPTY = re.compile(r"^(?P<negation>not )?(?P<variable>[\w.\[\]'\"]+)$")
_LOCAL = re.compile(r"^[LG]\['(?P<name>[^']+)'\]$")
_STACK = re.compile(r"^___stack\d+$")


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


class FailedPhase(enum.Enum):
    """Where a compiled run failed: compiling, or running the compiled forward or backward."""

    COMPILE = "compile"
    FORWARD = "forward"
    BACKWARD = "backward"


class CompiledRunFailed(CompileCheckFailure):
    """The model ran eagerly, and raised under ``torch.compile``.

    ``phase`` is a :class:`FailedPhase`: dynamo or the backend failed while compiling,
    or the compiled forward or backward failed while running; ``torch_error`` is
    torch's exception, ``path`` the user's line and the library lines under it where
    torch says which line it was running.
    """

    def __init__(
        self,
        message: str,
        *,
        backend: str,
        phase: FailedPhase,
        input_set: int,
        path: CallPath,
        torch_error: BaseException,
    ) -> None:
        super().__init__(message)
        self.backend, self.phase, self.input_set = backend, phase, input_set
        self.path, self.torch_error = path, torch_error


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


class EagerFallback(enum.Enum):
    """What torch.compile runs eagerly because of a graph break, beyond the line itself."""

    NONE = ""
    REST_OF_FUNCTION = "torch.compile runs the rest of this function eagerly"
    WHOLE_FUNCTION = "torch.compile runs this whole function eagerly"


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where ``torch.compile`` split the graph, and why.

    ``kind`` is torch's graph break type (``Data-dependent branching``), ``gb_id`` its
    id in torch's registry (``GB0170``), ``explanation`` torch's one line about it
    and ``hint`` torch's first hint that is about the user's code. ``location`` is
    the line that caused the break, ``source`` its code; ``path`` is the user's way
    there: the innermost frame in the user's files, then the library frames under
    it, the last of them ``location`` when it is a library's. ``decision`` names the
    data-dependent decision the eager run made at that line (``Tensor.__bool__``,
    ``Tensor.item``), ``None`` when the break has another cause. ``rewrite`` is the
    code that removes the break, where there is one. ``fallback`` says what torch
    runs eagerly besides.
    """

    kind: str
    gb_id: str | None
    explanation: str
    location: control_flow.Location
    source: str
    path: CallPath
    decision: str | None
    fallback: EagerFallback
    hint: str | None
    rewrite: str | None

    @property
    def reason(self) -> str:
        """``kind: explanation``, the break's reason in words."""
        return f"{self.kind}: {self.explanation}" if self.explanation else self.kind

    @property
    def whole_function_eager(self) -> bool:
        """torch.compile gave up on the function holding the line and runs all of it eagerly."""
        return self.fallback is EagerFallback.WHOLE_FUNCTION

    def __str__(self) -> str:
        kind = f"{self.kind} ({self.gb_id})" if self.gb_id else self.kind
        reason = f"{kind}: {self.explanation}" if self.explanation else kind
        decided = f" (decision {self.decision})" if self.decision else ""
        eager = f"; {self.fallback.value}" if self.fallback.value else ""
        lines = [f"graph break at {self.location}: `{self.source}`: {reason}{decided}{eager}"]
        if self.path.library:  # the line is a library's: the user's way there
            lines.append("    reached from your code:")
            lines += self.path.lines(indent="    ")
        if self.hint:
            lines.append(f"    torch's hint: {self.hint}")
        if self.rewrite:
            lines += [f"    {line}" for line in self.rewrite.splitlines()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A recompilation: the compiled code's guard ``guard`` failed on a later call.

    ``guard`` says in words what changed; ``location``/``source`` are the line the
    guard was made for (the function's first line when torch does not say), ``path``
    the lines that lead there; ``function`` is the compiled function, ``code after
    the graph break at <line>`` for the rest of a function after a graph break.
    ``torch_guard`` is torch's text.
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
        lines += [_indented(entry) for entry in (*self.graph_breaks, *self.recompiles)]
        return "\n".join(lines)


def _indented(entry: object, first: str = "  ") -> str:
    head, *rest = str(entry).splitlines()
    return "\n".join([first + head, *(f"  {line}" for line in rest)])


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


# --- what the compiler reports ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BreakRecord:
    """One ``graph_breaks`` record: torch's text, the exception it was handling, the
    frames above the compiled code (the user's call into it), outermost first."""

    message: str
    error: BaseException | None
    above: tuple[tuple[str, int], ...]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[_BreakRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # torch writes the record while it handles the graph break's exception
        # (private surface: symbolic_convert's log_graph_break), which holds the
        # break's type, the traced stack and the cause.
        self.records.append(_BreakRecord(record.getMessage(), sys.exc_info()[1], _above_dynamo()))


def _above_dynamo() -> tuple[tuple[str, int], ...]:
    """The frames of this thread's stack above torch.compile's, outermost first."""
    frames = []
    for filename, line in stack_frames(sys._getframe(1)):
        if filename.startswith(_DYNAMO_DIR):
            break
        frames.append((filename, line))
    return tuple(frames)


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


@functools.cache
def _registry() -> dict[str, tuple[str, dict[str, Any]]]:
    """torch's graph break registry: each break type's ``GBxxxx`` id and newest entry."""
    path = os.path.join(os.path.dirname(torch._dynamo.__file__), "graph_break_registry.json")
    try:
        with open(path, encoding="utf-8") as stream:
            registry = json.load(stream)
    except (OSError, ValueError):  # an older torch without the file
        return {}
    return {
        entry["Gb_type"]: (gb_id, entry) for gb_id, entries in registry.items() for entry in entries
    }


def _graph_breaks(
    records: Sequence[_BreakRecord], decisions: Sequence[control_flow.Decision]
) -> list[GraphBreak]:
    """One entry per distinct break (its type at the line that caused it), in torch's order."""
    decided: dict[control_flow.Location, str] = {}
    for decision in decisions:
        decided.setdefault(decision.location, decision.op)
    found: dict[tuple[str, control_flow.Location], tuple[GraphBreak, BaseException | None]] = {}
    for record in records:
        read = _graph_break(record, decided)
        if read is None:
            continue
        graph_break, cause = read
        key = (graph_break.kind, graph_break.location)
        if key in found:
            order = list(EagerFallback)
            earlier = found[key][0]
            fallback = max(earlier.fallback, graph_break.fallback, key=order.index)
            graph_break = dataclasses.replace(earlier, fallback=fallback)
            cause = found[key][1] or cause
        found[key] = (graph_break, cause)
    return [_with_rewrite(graph_break, cause) for graph_break, cause in found.values()]


def _graph_break(
    record: _BreakRecord, decided: dict[control_flow.Location, str]
) -> tuple[GraphBreak, BaseException | None] | None:
    """The break a record reports (without its rewrite, made once per break by
    :func:`_with_rewrite`), and the exception behind it."""
    head, _, rest = record.message.partition("\n")
    header = _BREAK_HEADER.match(head)
    error = record.error if isinstance(getattr(record.error, "gb_type", None), str) else None
    if header is None and error is None:
        return None
    reason = rest.partition("Graph Break Reason: ")[2].partition("\nUser code traceback:")[0]
    fallback = EagerFallback.NONE
    if "Failed to handle graph break gracefully" in reason:
        fallback = EagerFallback.WHOLE_FUNCTION
    elif "cannot resume from" in reason:
        fallback = EagerFallback.REST_OF_FUNCTION
    # torch's record says what broke; the exception is there only where torch logs the
    # break while it handles it (strict mode raises it, with no record).
    text = reason or (getattr(error, "msg", None) or "" if error is not None else "")
    while text.startswith(_WRAPPERS):
        text = text.partition("\n\n")[2] or text.partition("\n")[2]
    text = text.partition(_NESTED)[0]  # the first break, which the others came from
    kind, explanation, hints = _parts(text)
    traced = _stack_frames(getattr(error, "real_stack", None))
    if header and (not traced or traced[-1] != (header["file"], int(header["line"]))):
        traced = [(header["file"], int(header["line"]))]  # the exception is another break's
    frames = [*record.above, *traced]
    cause = _cause(error)
    if cause is not None:
        frames += [
            f for f in traceback_frames(cause) if origin(f[0]) in (Origin.USER, Origin.LIBRARY)
        ]
    path = call_path(frames)
    location = path.innermost
    if location is None:
        return None
    gb_id, entry = _registry().get(kind, (None, {}))
    explanation = explanation or _plain(entry.get("Explanation", ""))
    hints = hints or [hint for hint in entry.get("Hints", []) if "{" not in hint]
    hint = next((h for h in hints if not any(g in h.lower() for g in _GENERIC_HINTS)), None)
    graph_break = GraphBreak(
        kind=kind,
        gb_id=gb_id,
        explanation=_one_line(kind, explanation),
        location=location,
        source=location.source,
        path=path,
        decision=decided.get(location),
        fallback=fallback,
        hint=hint,
        rewrite=None,
    )
    return graph_break, cause


def _with_rewrite(graph_break: GraphBreak, cause: BaseException | None) -> GraphBreak:
    """The break with our rewrite, where we have one (it then replaces a hint of torch's
    that does not apply, as "report an issue to the backend" for a data-dependent op)."""
    ours = _our_rewrite(graph_break.kind, graph_break.location, cause, graph_break.decision)
    if ours is None:
        return graph_break
    hint = None if graph_break.kind == _BACKEND_EXCEPTION else graph_break.hint
    return dataclasses.replace(graph_break, rewrite=ours, hint=hint)


def _parts(text: str) -> tuple[str, str, list[str]]:
    """A graph break message's type, explanation and hints (torch's format_graph_break_message)."""
    lines = text.strip().splitlines()
    kind = lines[0].strip() if lines else ""
    kind = next((words for raw, words in _OLD_REASONS.items() if kind.startswith(raw)), kind)
    explanation, hints, current = "", [], None
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("Explanation:"):
            explanation = stripped.removeprefix("Explanation:").strip()
            current = "explanation"
        elif stripped.startswith("Hint:"):
            hints.append(stripped.removeprefix("Hint:").strip())
            current = "hint"
        elif not stripped or stripped.startswith("Developer debug context:"):
            current = None
        elif current == "explanation":
            explanation += " " + stripped
        elif current == "hint":
            hints[-1] += " " + stripped
    return kind, explanation, hints


def _plain(explanation: str) -> str:
    """A registry explanation fit to show: not a template or a variable name."""
    return "" if "{" in explanation or explanation.isidentifier() else explanation


def _one_line(kind: str, explanation: str) -> str:
    sentences = _PARENTHESES.sub("", explanation).strip().split(". ")
    if sentences and kind.lower() in sentences[0].lower():  # "Detected data-dependent branching"
        sentences = sentences[1:]
    return ". ".join(sentences)


def _stack_frames(stack: Any) -> list[tuple[str, int]]:
    return [(frame.filename, frame.lineno or 0) for frame in stack or ()]


def _cause(error: BaseException | None) -> BaseException | None:
    """The exception behind a graph break (a backend's failure), when torch kept it."""
    cause = getattr(error, "__cause__", None)
    while isinstance(getattr(cause, "inner_exception", None), BaseException):
        cause = cause.inner_exception  # BackendCompilerFailed wraps the backend's error
    return cause


def _reads_tensor_data(error: BaseException | None) -> bool:
    """Whether ``error`` says that traced code read a tensor's data into Python."""
    while error is not None:
        name = type(error).__name__
        if name in ("DataDependentOutputException", "GuardOnDataDependentSymNode") or (
            "_local_scalar_dense" in str(error)
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def _our_rewrite(
    kind: str,
    where: control_flow.Location | None,
    cause: BaseException | None,
    decision_op: str | None,
) -> str | None:
    if where is None or origin(where.filename) is not Origin.USER:
        return None  # a library's line: nothing of the user's to rewrite there
    if kind == _DATA_DEPENDENT_BRANCHING:
        return rewrite(where, None) if decision_op else None
    if kind == _BACKEND_EXCEPTION and _reads_tensor_data(cause):
        return (
            f"The backend traced this line, which reads a tensor's values into Python "
            f"(`{where.source}`), and a graph cannot: keep it out of the graph by making "
            "the function that holds it an operator of its own (torch.library.custom_op with "
            "a register_fake), as a custom op's backward that loops over .tolist() must be "
            "in turn."
        )
    return None


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
            found.append(
                _recompile(
                    code.co_name, code.co_filename, code.co_firstlineno, matched["guard"], decisions
                )
            )
    return found


def _recompile(
    name: str,
    filename: str,
    first_line: int,
    text: str,
    decisions: Sequence[control_flow.Decision],
) -> Recompile:
    """The recompilation of function ``name`` (defined at ``filename:first_line``) whose
    guard failed as torch's ``text`` says (the guard, then the user stack it was made for)."""
    guard, _, stack = text.partition("\nUser stack trace:")
    guard = guard.split("  #")[0].strip()
    path = call_path(frames_in_text(stack))
    location = path.innermost or control_flow.Location(filename, first_line)
    resumed = _RESUME.match(name)
    function = name
    made_at = None
    if resumed:
        made_at = control_flow.Location(filename, int(resumed["line"]))
        function = f"{resumed['function']} (the code after its graph break at {made_at})"
    return Recompile(
        function=function,
        guard=_guard_in_words(guard, made_at, decisions),
        location=location,
        source=location.source,
        torch_guard=guard,
    )


def _named(variable: str, made_at: control_flow.Location | None) -> str:
    """A guard's variable as the user wrote it (``L['x']`` is ``x``)."""
    local = _LOCAL.match(variable)
    if local:
        return local["name"]
    if _STACK.match(variable):
        after = f" the graph break at {made_at}" if made_at else " a graph break"
        return f"the value carried over{after}"
    if variable == ".0":
        return "the iterator the loop runs over"
    return variable


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
    expected = _EXPECTED_TENSOR.search(guard)
    if expected:
        return (
            f"{expected['name']} was a tensor when compiled and is a {expected['found'][8:-2]} "
            "now: the compiled code is specialized on the types of its inputs"
        )
    type_id = _TYPE_ID.match(guard)
    if type_id:
        was = f"was a {type_id['type']} when compiled and" if type_id["type"] else ""
        return (
            f"{_named(type_id['variable'], made_at)} {was} has another type now: the compiled "
            "code is specialized on the types of its inputs"
        ).replace("  ", " ")
    object_id = _OBJECT_ID.match(guard)
    if object_id:
        return (
            f"{_named(object_id['variable'], made_at)} is another object than when compiled: "
            "the compiled code is specialized on that object (a module, a function, a class)"
        )
    length = _LENGTH.match(guard)
    if length:
        return (
            f"the length of {_named(length['variable'], made_at)} was {length['value']} when "
            "compiled and is not now: torch.compile unrolls Python loops over a list, tuple "
            "or dict, so each new length compiles again"
        )
    loop = _RANGE.match(guard)
    if loop:
        return (
            f"a Python loop ran over range({loop['range']}) when compiled and over another "
            "range now: torch.compile unrolls Python loops, so each new length compiles again"
        )
    sized = _SIZE_RANGE.search(guard)
    if sized and any(op in guard for op in ("<", ">", "!=")):
        return (
            f"input {_named(sized['name'], made_at)} has a size in dimension {sized['dim']} "
            f"outside `{guard}`, which the compiled code was made for (the code is dynamic in "
            "that dimension; torch.compile specializes sizes 0 and 1)"
        )
    none = _NONE.match(guard)
    if none:
        was = "not None" if none["negation"] else "None"
        return (
            f"{_named(none['variable'], made_at)} was {was} when compiled and is not now: the "
            "compiled code is specialized on it"
        )
    equals = _EQUALS.match(guard)
    if equals:
        variable, value = equals["variable"], equals["value"]
        local = _LOCAL.match(variable)
        advice = "keep it a tensor"
        if local or (variable.isidentifier() and not variable.startswith("___")):
            subject = f"the Python value {local['name'] if local else variable}"
        elif _STACK.match(variable) and made_at:
            made = next((d for d in decisions if d.location == made_at), None)
            how = f" by {made.op}" if made else ""
            subject = f"the Python number made from a tensor{how} at {made_at}"
        else:
            subject, advice = variable, ""
        return (
            f"{subject} was {value} when compiled and is not now: the compiled code is "
            "specialized on that value, so each new value compiles again"
            + (f" ({advice})" if advice else "")
        )
    empty = _EMPTY.match(guard)
    if empty:
        was = "empty" if empty["negation"] else "not empty"
        return f"{_named(empty['variable'], made_at)} was {was} when compiled and is not now"
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
    ``max_recompiles``. Returns a :class:`CompileCheckResult`.
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
    with (
        torch_logs.quiet(),
        _fresh_compiler(backend, strict_breaks=max_graph_breaks == 0),
        _graph_break_records() as records,
    ):
        compiled_target = torch.compile(model_or_fn, backend=backend, mode=mode, dynamic=dynamic)
        for number, arguments in enumerate(sets):
            subject = Subject(model_or_fn, arguments, kwargs, failure=CompileCheckFailure)
            cotangents = Cotangents(0)
            try:
                with control_flow.record_decisions() as log:
                    eager = _eager_run(subject, cotangents)
                decisions.extend(log)
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
                        number,
                        above,
                        decisions,
                        strict_breaks=max_graph_breaks == 0,
                        forward_line=functools.partial(
                            _forward_line, subject, cotangents, compiled_target
                        ),
                    ) from None
            finally:
                subject.reset()
            _compare(eager, compiled, rtol, atol, number)
            compared.update(str(key) for key in eager.values)
            del eager, compiled
        graph_breaks = tuple(_graph_breaks(records.records, decisions))
        recompiles = tuple(_recompiles(decisions))
    # Graph breaks before recompilations: a break splits the code into frames compiled
    # and guarded each on its own, so breaks change where recompilations happen, not the
    # other way round.
    over_budget = most_fundamental(
        [
            failure
            for failure in (
                _over_budget(
                    graph_breaks, max_graph_breaks, "max_graph_breaks", TooManyGraphBreaks
                ),
                _over_budget(recompiles, max_recompiles, "max_recompiles", TooManyRecompiles),
            )
            if failure is not None
        ]
    )
    if over_budget is not None:
        raise over_budget
    return CompileCheckResult(
        function=describe_callable(model_or_fn),
        backend=backend_name,
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
_EAGER_NOTE = (
    "compile_check: the eager run (without torch.compile) raised this, so it is the model's "
    "own error, not torch.compile's"
)
_STANCE_FAILURE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_STANCE_WHERE = re.compile(
    r"filename: '(?P<file>[^']*)', function name: '(?P<function>[^']*)', line number: (?P<line>\d+)"
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
    number: int,
    above: tuple[tuple[str, int], ...],
    decisions: Sequence[control_flow.Decision],
    *,
    strict_breaks: bool,
    forward_line: Callable[[], CallPath],
) -> CompileCheckFailure:
    """What a compiled run that raised (where the eager run did not) tells the user.

    ``forward_line`` finds, for a failed backward, the forward line of the op whose
    backward failed (a backward has no line of its own).
    """
    from torch._dynamo.exc import TorchDynamoException

    if strict_breaks and isinstance(getattr(error, "gb_type", None), str):
        decided = {d.location: d.op for d in decisions}
        read = _graph_break(_BreakRecord("", error, above), decided)
        if read is not None:
            found = _with_rewrite(*read)
            return TooManyGraphBreaks(
                f"a graph break, and max_graph_breaks=0 allows none (torch.compile stopped at "
                f"it: torch._dynamo.error_on_graph_break):\n{_indented(found)}",
                (found,),
            )
    if str(error).startswith(_STANCE_FAILURE):
        recompile = _stance_recompile(str(error), decisions)
        return TooManyRecompiles(
            f"a recompilation for input set {number}, and max_recompiles=0 allows none "
            "(torch.compile stopped at it: torch.compiler.set_stance('fail_on_recompile')):\n"
            f"{_indented(recompile)}",
            (recompile,),
        )
    compiling = isinstance(error, TorchDynamoException)
    inner = getattr(error, "inner_exception", None)  # BackendCompilerFailed: the backend's
    first = quoted(inner if isinstance(inner, Exception) else error)
    failed = FailedPhase.COMPILE if compiling else FailedPhase(phase.value)
    if failed is FailedPhase.BACKWARD:
        path = forward_line()
    else:
        stack = _stack_frames(getattr(error, "real_stack", None)) or traceback_frames(error)
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


def _stance_recompile(message: str, decisions: Sequence[control_flow.Decision]) -> Recompile:
    """The recompilation ``set_stance("fail_on_recompile")`` refused, from its message."""
    where = _STANCE_WHERE.search(message)
    filename, function, line = (
        (where["file"], where["function"], int(where["line"])) if where else ("<unknown>", "?", 0)
    )
    failures = [
        line.strip().removeprefix("- ")
        for line in message.partition("triggered by the following guard failure(s):")[
            2
        ].splitlines()
    ]
    text = "\n".join(failures).strip()
    matched = _GUARD_ID.match(text)
    if matched is None:  # no earlier entry failed: this code was never compiled before
        location = control_flow.Location(filename, line)
        return Recompile(
            function=function,
            guard="first compiled now: the earlier input sets did not reach this code",
            location=location,
            source=location.source,
            torch_guard="",
        )
    return _recompile(function, filename, line, matched["guard"], decisions)


def _over_budget(
    found: tuple, budget: int | None, option: str, error: type[CompileCheckFailure]
) -> CompileCheckFailure | None:
    if budget is None or len(found) <= budget:
        return None
    what = "graph breaks" if error is TooManyGraphBreaks else "recompilations"
    listed = "\n".join(_indented(entry) for entry in found)
    return error(f"{len(found)} {what}, more than {option}={budget}:\n{listed}", found)
