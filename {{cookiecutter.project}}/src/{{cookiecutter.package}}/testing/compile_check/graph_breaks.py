"""Each graph break of a compiled run, once, at the line that caused it, from dynamo's records.

Private surface, read where torch offers no public record: the ``graph_breaks``
logging artifact (the records ``TORCH_LOGS=graph_breaks`` prints) with the exception
torch is handling when it writes one (its ``gb_type``, ``real_stack`` and cause), and
the registry file ``torch/_dynamo/graph_break_registry.json`` for each break type's
``GBxxxx`` id, explanation and hints. A break gets the data-dependent decision the
eager run recorded at its line (:mod:`..control_flow`) and the rewrite that removes it
where there is one (:mod:`..rewrites`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import control_flow
from ..frames import Origin, call_path, origin, stack_frames, traceback_frames
from ..rewrites import rewrite
from ..sources import parsed
from .results import EagerFallback, GraphBreak

__all__ = ["graph_break_records", "graph_breaks", "raised_graph_break", "traced_frames"]

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
# Breaks on an op whose output size depends on the data, and the aten op torch names
# for it (``aten.nonzero.default``) mapped to what a user calls (boolean masks too).
_SIZE_BREAKS = ("Dynamic shape operator",)
_ATEN_OP = re.compile(r"aten\.(?P<op>\w+)\.")
_SIZE_OPS = {
    "nonzero": ("nonzero", "argwhere", "where", "masked_select", "nonzero_static"),
    "_unique2": ("unique",),
    "unique_dim": ("unique",),
    "unique_consecutive": ("unique_consecutive",),
    "repeat_interleave": ("repeat_interleave",),
    "masked_select": ("masked_select",),
    "bincount": ("bincount",),
}
# Breaks on reading a tensor's value into Python, and the calls that read one.
_VALUE_BREAKS = ("Data dependent operator", "Tensor.tolist() with non-integer tensor")
_ITEM_BREAK = "Unsupported Tensor.item() call"
_VALUE_OPS = ("item", "tolist", "int", "float", "bool")
_BACKEND_EXCEPTION = "Backend compiler exception"


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
def graph_break_records() -> Iterator[_Records]:
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


def graph_breaks(
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
    traced = traced_frames(error)
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
        explanation=_data_dependent_op(kind, explanation, location) or _one_line(kind, explanation),
        location=location,
        source=location.source,
        path=path,
        decision=decided.get(location),
        fallback=fallback,
        hint=hint,
        rewrite=None,
    )
    return graph_break, cause


def raised_graph_break(
    error: BaseException,
    above: tuple[tuple[str, int], ...],
    decisions: Sequence[control_flow.Decision],
) -> GraphBreak | None:
    """The graph break torch's strict mode raised as ``error`` (no record is written for
    it), reached from the frames ``above``; ``None`` when ``error`` is no graph break."""
    if not isinstance(getattr(error, "gb_type", None), str):
        return None
    decided = {d.location: d.op for d in decisions}
    read = _graph_break(_BreakRecord("", error, above), decided)
    return None if read is None else _with_rewrite(*read)


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


def _data_dependent_op(kind: str, text: str, where: control_flow.Location) -> str | None:
    """Which op of the user's line makes a value or a size from a tensor's data, in
    words (``x.nonzero()`` makes a size that depends on the data), for a break on such an
    op; ``None`` for another break. torch names the aten op it met
    (``aten.nonzero.default``, also for ``x[mask]``), which is not the user's."""
    if kind in _SIZE_BREAKS:
        op = _ATEN_OP.search(text)
        names = _SIZE_OPS.get(op["op"] if op else "", ())
        found = _expression(where, names, mask=True)
        makes = "makes a size that depends on the data"
        if found is None:
            return f"an op of this line {makes}"
        expression, how = found
        if how == "mask":
            return (
                f"the boolean-mask indexing `{expression}` {makes} (as many elements as the "
                "mask holds)"
            )
        return f"`{expression}` {makes}"
    if kind in _VALUE_BREAKS or kind.startswith(_ITEM_BREAK):
        found = _expression(where, _VALUE_OPS, mask=False)
        reads = "reads a tensor's value into Python"
        if found is None:
            return f"this line {reads}"
        expression, how = found
        if how == "loop":
            return f"the loop over `{expression}` reads a tensor's values into Python"
        return f"`{expression}` {reads}"
    return None


def _expression(
    where: control_flow.Location, names: Sequence[str], *, mask: bool
) -> tuple[str, str] | None:
    """The first expression of ``where``'s line calling one of ``names`` (a method,
    ``torch.<name>`` or a builtin ``int``/``float``/``bool``), or a boolean-mask index
    when ``mask``; with how it was found (``call``, ``mask``, ``loop``: a ``for`` over it)."""
    source = parsed(where.filename)
    if source is None:
        return None
    nodes = sorted(
        (
            node
            for node in ast.walk(source.tree)
            if getattr(node, "lineno", None) == where.line and isinstance(node, ast.expr)
        ),
        key=lambda node: node.col_offset,
    )
    for node in nodes:
        called = (
            node.func.attr
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            else node.func.id
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            else None
        )
        if called in names:
            loop = source.parents.get(node)
            how = "loop" if isinstance(loop, ast.For) and loop.iter is node else "call"
            return ast.unparse(node), how
        if mask and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Compare):
            return ast.unparse(node), "mask"
    return None


def traced_frames(error: BaseException | None) -> list[tuple[str, int]]:
    """The frames dynamo was tracing when it raised ``error`` (its ``real_stack``), outermost
    first; none when it does not say."""
    return [
        (frame.filename, frame.lineno or 0) for frame in getattr(error, "real_stack", None) or ()
    ]


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
