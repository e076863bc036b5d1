"""Check that a model exports with ``torch.export``, and say how to make it export when not.

:func:`export_check` exports a model (or function), runs the ``ExportedProgram``
against eager PyTorch on the inputs, and returns the program. When export fails on
data-dependent control flow, the error names the line that made the decision and
the user's way there (:mod:`.frames`: the user's line, then the library lines under
it), the decision made there in one eager run (:mod:`.control_flow`), the rewrite
that makes the code exportable where that line is the user's (:mod:`.rewrites`),
and what ``torch.export.draft_export`` met on the same inputs: each data-dependent
guard with its line. torch's symbolic-shape text, FX dump and log records stay out
of the report (:mod:`.torch_logs`). A program that refuses another input set names
the guard that failed in the user's terms (the input, the dimension, both sizes)
and the ``dynamic_shapes`` that accept it.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import control_flow, data_dependence, options, torch_logs
from .calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from .comparison import close_mismatch
from .failures import CheckFailure
from .frames import CallPath, Origin, call_path, origin, stack_frames, traceback_frames
from .naming import describe_callable
from .rewrites import Rewrite, function_rewrites, rewrite
from .subject import FunctionModule, Subject
from .torch_text import in_words
from .trees import named_leaves
from .verified_rewrites import (
    LibrarySetting,
    Varied,
    Verdict,
    Verification,
    Watch,
    library_settings,
    verification_inputs,
    verify,
)

__all__ = [
    "DraftGuard",
    "DraftReport",
    "ExportBlocked",
    "ExportCheckFailure",
    "ExportMismatch",
    "ProgramRefused",
    "ShapeGuard",
    "export_check",
    "summary",
]

# "Guard failed: edge_index.size()[1] == 12", as an exported program words a refusal.
_SIZE_GUARD = re.compile(r"(?P<input>[\w.\[\]'\"]+)\.size\(\)\[(?P<dim>\d+)\] == (?P<size>\d+)")
# Guards of draft_export's report listed in a failure; the rest are counted.
_DRAFT_LISTED = 5


class ExportCheckFailure(CheckFailure):
    """``export_check`` failed; ``torch_error`` is torch's own exception, if it raised one."""

    check = "export_check"

    def __init__(self, message: str, torch_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.torch_error = torch_error


class ExportBlocked(ExportCheckFailure):
    """``torch.export`` refused the model: ``location`` is the cause, the line whose op
    made the data-dependent size (``source``) or, when no size is involved, the line of
    the decision; ``used_at`` is the line torch stopped at, which used it.

    ``path`` is the user's way there (the user's line, then the library lines under
    it), ``decision`` what the eager run decided there, ``verifications`` each rewrite
    the check built, exported and compared with eager, ``draft`` what
    ``torch.export.draft_export`` met on the same inputs.
    """

    def __init__(
        self,
        message: str,
        *,
        location: control_flow.Location | None,
        used_at: control_flow.Location | None,
        source: data_dependence.Source | None,
        path: CallPath,
        decision: control_flow.Decision | None,
        verifications: tuple[Verification, ...],
        draft: DraftReport,
        torch_error: BaseException,
    ) -> None:
        super().__init__(message, torch_error)
        self.location, self.used_at, self.source = location, used_at, source
        self.path, self.decision, self.draft = path, decision, draft
        self.verifications = verifications

    @property
    def rewrite(self) -> Verification | None:
        """The rewrite the check built, exported and found equal to eager, if any."""
        return next(
            (v for v in self.verifications if v.verdict in (Verdict.VERIFIED, Verdict.ONE_SIDE)),
            None,
        )


class ExportMismatch(ExportCheckFailure):
    """The exported program's output ``name`` differs from eager's for input set ``input_set``."""

    def __init__(self, message: str, *, name: str, input_set: int) -> None:
        super().__init__(message)
        self.name, self.input_set = name, input_set


class ProgramRefused(ExportCheckFailure):
    """The exported program refused input set ``input_set``; ``guard`` is the size it was
    specialized on (``None`` when torch's refusal names none), ``dynamic_shapes`` the
    argument that accepts every input set's sizes."""

    def __init__(
        self,
        message: str,
        *,
        input_set: int,
        guard: ShapeGuard | None,
        dynamic_shapes: Any,
        torch_error: BaseException,
    ) -> None:
        super().__init__(message, torch_error)
        self.input_set, self.guard, self.dynamic_shapes = input_set, guard, dynamic_shapes


@dataclass(frozen=True)
class ShapeGuard:
    """A size the program was exported with: ``input``'s dimension ``dim`` was ``exported``."""

    input: str
    dim: int
    exported: int
    actual: int | None  # the refused input's size there, when known

    def __str__(self) -> str:
        now = f"has {self.actual}" if self.actual is not None else "has another size"
        return (
            f"input {self.input} {now} in dimension {self.dim}; the program was exported "
            f"with {self.exported} there"
        )


@dataclass(frozen=True)
class DraftGuard:
    """A data-dependent guard ``torch.export.draft_export`` met: torch's ``expression``
    (kept for programs, not shown: it is in torch's symbols), how often, and where."""

    path: CallPath
    expression: str
    occurrences: int

    def __str__(self) -> str:
        where = self.path.innermost
        line = f"{where}: `{where.source}`: " if where else ""
        times = f" ({self.occurrences} times)" if self.occurrences > 1 else ""
        return f"{line}decided on these inputs' values{times}"


@dataclass(frozen=True)
class DraftReport:
    """What ``torch.export.draft_export`` met: data-dependent ``guards``, ``other`` problems
    (a missing or mismatched fake kernel), or the ``error`` it stopped on."""

    guards: tuple[DraftGuard, ...] = ()
    other: tuple[str, ...] = ()
    error: str | None = None

    def lines(self) -> list[str]:
        if self.error:
            return [f"torch.export.draft_export stopped too: {self.error}"]
        if not self.guards and not self.other:
            return []
        count = len(self.guards)
        lines = [
            "torch.export.draft_export, which traces on where export stops (deciding with these "
            f"inputs' values), met {count} data-dependent guard(s)"
            + (f" and {len(self.other)} other problem(s)" if self.other else "")
            + ":"
        ]
        lines += [f"  {guard}" for guard in self.guards[:_DRAFT_LISTED]]
        if count > _DRAFT_LISTED:
            lines.append(f"  and {count - _DRAFT_LISTED} more")
        lines += [f"  {problem}" for problem in self.other]
        return lines


@control_flow.without_torch_function_modes()
def export_check(
    model_or_fn: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    inputs_list: list[tuple] | None = None,
    dynamic_shapes: Any = None,
    strict: bool = False,
    **unknown: Any,
) -> torch.export.ExportedProgram:
    """Export ``model_or_fn`` with the first input set; its program must match eager.

    The program is exported from ``inputs`` (or the first tuple of ``inputs_list``)
    and ``forward_kwargs``, with ``dynamic_shapes`` and ``strict`` passed to
    ``torch.export.export``, then run on every input set and compared with the eager
    forward (tolerances of :data:`.comparison.DEFAULT_TOLERANCES`). Parameters,
    buffers and RNG states are put back after each run.

    Raises :class:`ExportBlocked` when torch refuses to export, naming the line of
    the data-dependent decision and the user's way there, with the rewrite that
    exports and draft_export's guards; :class:`ExportMismatch` naming the output and
    element that differ; :class:`ProgramRefused` when the program refuses an input
    set, with the guard that failed and the ``dynamic_shapes`` that accept it.
    """
    __tracebackhide__ = True
    reject_unknown_keywords(
        "export_check", unknown, ("forward_kwargs", "inputs_list", "dynamic_shapes", "strict")
    )
    options.function("export_check", "model_or_fn", model_or_fn, "an nn.Module or a callable")
    options.flag("export_check", "strict", strict)
    kwargs = forward_kwargs_of("export_check", forward_kwargs)
    sets = input_sets("export_check", inputs, inputs_list)
    module = model_or_fn if isinstance(model_or_fn, nn.Module) else FunctionModule(model_or_fn)
    name = describe_callable(model_or_fn)
    subject = Subject(module, sets[0], kwargs, failure=ExportCheckFailure)
    above = stack_frames(sys._getframe())  # the test's line, above the check
    torch_output = io.StringIO()
    with torch_logs.quiet():
        try:
            fresh = subject.fresh_inputs()
            # torch prints the partial FX graph of a failed export to stderr.
            with contextlib.redirect_stderr(torch_output):
                program = torch.export.export(
                    module, fresh.args, fresh.kwargs, dynamic_shapes=dynamic_shapes, strict=strict
                )
        except Exception as error:  # every refusal is explained the same way
            subject.reset()
            raise _blocked(name, subject, error, dynamic_shapes, strict, above) from None
        finally:
            subject.reset()
    if torch_output.getvalue():
        sys.stderr.write(torch_output.getvalue())
    exported = program.module()
    for number, arguments in enumerate(sets):
        _compare(
            name,
            Subject(module, arguments, kwargs, failure=ExportCheckFailure),
            exported,
            number,
            sets,
            dynamic_shapes,
        )
    return program


def summary(program: torch.export.ExportedProgram) -> str:
    """The line the ``export_check`` fixture reports for a passing check."""
    return f"export_check: exported {len(program.graph.nodes)} graph nodes"


def _compare(
    name: str,
    subject: Subject,
    exported: Any,
    number: int,
    sets: list[tuple],
    dynamic_shapes: Any,
) -> None:
    __tracebackhide__ = True
    try:
        with torch.no_grad():
            fresh = subject.fresh_inputs()
            eager = subject.target(*fresh.args, **fresh.kwargs)
            subject.reset()
            fresh = subject.fresh_inputs()
            try:
                program_output = exported(*fresh.args, **fresh.kwargs)
            except Exception as error:
                raise _refused(name, subject, number, sets, dynamic_shapes, error) from None
    finally:
        subject.reset()
    eager_values = dict(named_leaves(eager, "output"))
    program_values = dict(named_leaves(program_output, "output"))
    for output in [*eager_values, *(n for n in program_values if n not in eager_values)]:
        difference = close_mismatch(
            output,
            eager_values.get(output),
            program_values.get(output),
            None,
            None,
            ("eager", "exported"),
        )
        if difference:
            raise ExportMismatch(
                f"The program exported from {name} differs from eager for input set {number}:\n"
                f"  {difference.description}",
                name=output,
                input_set=number,
            )


# --- a program that refuses an input set ------------------------------------------------


def _refused(
    name: str,
    subject: Subject,
    number: int,
    sets: list[tuple],
    dynamic_shapes: Any,
    error: BaseException,
) -> ProgramRefused:
    text = str(error).strip()
    first = text.splitlines()[0] if text else repr(error)
    shapes = [_shapes(subject, arguments) for arguments in sets]
    guard = None
    matched = _SIZE_GUARD.search(first)
    if matched:
        refused = shapes[number].get(matched["input"])
        dim = int(matched["dim"])
        guard = ShapeGuard(
            matched["input"],
            dim,
            int(matched["size"]),
            refused[dim] if refused is not None and dim < len(refused) else None,
        )
    varying = _varying_dimensions(shapes, guard)
    suggestion = _dynamic_shapes(subject, varying) if dynamic_shapes is None else None
    lines = [
        f"The program exported from {name} refused input set {number}: "
        + (f"{guard} (torch: {first})" if guard else first)
    ]
    if suggestion is not None:
        lines.append(
            "An exported program takes inputs of the sizes it was exported with, unless it is "
            "told which sizes vary; to accept every input set's sizes, export with"
        )
        lines.append(f"    dynamic_shapes={_spelled(suggestion)}")
    elif varying:
        listed = ", ".join(f"{input} dimension {dim}" for input, dim in varying)
        lines.append(f"Mark as dynamic in dynamic_shapes: {listed}.")
    return ProgramRefused(
        "\n".join(lines),
        input_set=number,
        guard=guard,
        dynamic_shapes=suggestion,
        torch_error=error,
    )


def _shapes(subject: Subject, arguments: tuple) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of an input set, by the input's name."""
    return {
        input: tuple(leaf.shape)
        for input, leaf in subject.named_inputs(arguments, subject.kwargs)
        if isinstance(leaf, torch.Tensor)
    }


def _varying_dimensions(
    shapes: list[dict[str, tuple[int, ...]]], guard: ShapeGuard | None
) -> list[tuple[str, int]]:
    """The guard's dimension first, then each other dimension whose size differs between sets."""
    found = [(guard.input, guard.dim)] if guard else []
    first = shapes[0]
    for input, shape in first.items():
        for dim in range(len(shape)):
            if (input, dim) not in found and any(
                len(other.get(input, ())) == len(shape) and other[input][dim] != shape[dim]
                for other in shapes[1:]
            ):
                found.append((input, dim))
    return found


def _dynamic_shapes(subject: Subject, varying: list[tuple[str, int]]) -> Any:
    """``dynamic_shapes`` marking ``varying`` dynamic: by argument name, or positionally.

    ``None`` when a varying tensor is nested inside an argument (a list, a dict),
    whose ``dynamic_shapes`` entry has that argument's structure.
    """
    arguments = [*subject.input_names, *subject.kwargs]
    if not varying or any(input not in arguments for input, _ in varying):
        return None
    spec: dict[str, dict[int, Any] | None] = {argument: None for argument in arguments}
    for input, dim in varying:
        spec[input] = {**(spec[input] or {}), dim: torch.export.Dim.DYNAMIC}
    if any(argument.startswith("inputs[") for argument in subject.input_names):
        return tuple(spec[argument] for argument in subject.input_names)
    return spec


def _spelled(spec: Any) -> str:
    """``dynamic_shapes`` as the user writes it (``Dim.DYNAMIC``, not its repr)."""
    if isinstance(spec, dict) and all(isinstance(key, int) for key in spec):
        return "{" + ", ".join(f"{key}: torch.export.Dim.DYNAMIC" for key in spec) + "}"
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{key!r}: {_spelled(value)}" for key, value in spec.items()) + "}"
    if isinstance(spec, tuple):
        return (
            "("
            + ", ".join(_spelled(value) for value in spec)
            + ("," if len(spec) == 1 else "")
            + ")"
        )
    return repr(spec)


# --- explaining a refusal to export ---------------------------------------------------------


def _error_path(error: BaseException, above: list[tuple[str, int]]) -> CallPath:
    """The user's way to where torch gave up, from the frames ``above`` the check: the
    stack torch traced, else the traceback."""
    stack = [
        (frame.filename, frame.lineno or 0) for frame in getattr(error, "real_stack", None) or []
    ]
    if not call_path(stack):
        stack = traceback_frames(error)
    return call_path([*above, *stack])


def _is_data_dependent(error: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    text = str(error)
    kind = str(getattr(error, "gb_type", ""))
    return (
        isinstance(error, GuardOnDataDependentSymNode)
        or "data-dependent" in kind.lower()
        or "item()" in kind
        or "data-dependent expression" in text
    )


def _blocked(
    name: str,
    subject: Subject,
    error: BaseException,
    dynamic_shapes: Any,
    strict: bool,
    above: list[tuple[str, int]],
) -> ExportCheckFailure:
    path = _error_path(error, above)
    where = path.innermost
    if not _is_data_dependent(error):
        at = f" at {where}: `{where.source}`" if where else ""
        return ExportCheckFailure(
            f"torch.export could not export {name}{at}:\n  {in_words(error)}", error
        )
    decision, uses = _eager_run(subject, where)
    sized = [use for use in uses if use.source is not None]
    source = sized[0].source if sized else None
    in_library = where is not None and origin(where.filename) is Origin.LIBRARY
    lines = _cause_lines(name, where, path, decision, source, sized[0] if sized else None)
    lines.append(
        "An exported program is one graph for every input, so a Python value computed from a "
        "tensor's data (a branch, a loop count, a size) cannot be recorded."
    )
    verifications = _verified(subject, where, source, dynamic_shapes, strict)
    working = [v for v in verifications if v.verdict in (Verdict.VERIFIED, Verdict.ONE_SIDE)]
    # A rewrite that was built and computes something else than eager is not advice.
    shown = working or [v for v in verifications if v.verdict is not Verdict.DIFFERS]
    for verification in shown:
        lines += verification.lines()
    if in_library and where and not working:
        lines.append(_library_advice(where))
    elif not shown and where:
        advice = rewrite(where, decision)
        if advice:
            lines.append("Not verified (the check could not build this rewrite): " + advice)
    draft = _draft(subject, dynamic_shapes)
    lines += draft.lines()
    return ExportBlocked(
        "\n".join(lines),
        location=source.location if source else where,
        used_at=where,
        source=source,
        path=path,
        decision=decision,
        verifications=tuple(verifications),
        draft=draft,
        torch_error=error,
    )


def _cause_lines(
    name: str,
    where: control_flow.Location | None,
    path: CallPath,
    decision: control_flow.Decision | None,
    source: data_dependence.Source | None,
    use: data_dependence.Use | None,
) -> list[str]:
    """The headline: where the value was made (the op, the line) and where it was used."""
    if source is None or where is None or use is None:
        lines = [f"torch.export cannot export {name}: its forward makes a data-dependent decision"]
        if where:
            lines[0] += f" at {where}:"
            lines.append(f"    {where.source}")
    else:
        used = [n for n in source.names if n in _loaded_names(where)] or list(source.names)
        tensor = f"`{used[0]}`" if used else "a tensor"
        sizes = source.describe_sizes()
        lines = [
            f"torch.export cannot export {name}: the size of {tensor}, made by {source.op} at "
            f"{source.location}, depends on the data"
            + (f" ({sizes})" if sizes else "")
            + f", and decides {_statement(where)} at {where}, read by {use.how}:",
            f"    {source.location.line}: {source.location.source}",
            f"    {where.line}: {where.source}",
        ]
    if path.library:
        lines.append("  reached from your code:")
        lines += path.lines(indent="    ")
    if decision and source is None:
        lines.append(
            f"  decision in the eager run: {decision.op} -> {decision.value!r} "
            f"at {decision.location}"
        )
    return lines


def _loaded_names(where: control_flow.Location) -> set[str]:
    try:
        tree = ast.parse(where.source.rstrip(":") or "pass")
    except SyntaxError:
        statement = where.source.split(" ", 1)[-1].rstrip(":")
        try:
            tree = ast.parse(statement)
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _statement(where: control_flow.Location) -> str:
    """``the `if` `` or ``the loop `for ...` ``: what the line is, as its first word says."""
    word = where.source.split(" ", 1)[0].rstrip(":")
    if word in ("if", "elif", "while", "assert"):
        return f"the `{word}`"
    if word == "for":
        return "the number of passes of the loop"
    return "a Python value"


def _verified(
    subject: Subject,
    where: control_flow.Location | None,
    source: data_dependence.Source | None,
    dynamic_shapes: Any,
    strict: bool,
) -> list[Verification]:
    """Each rewrite of the decision the check could build, built, exported and compared,
    until one works."""
    if where is None:
        return []
    names = [n for n in (source.names if source else ()) if n in _loaded_names(where)]
    candidates: list[Rewrite | LibrarySetting] = []
    if origin(where.filename) is Origin.LIBRARY:
        candidates += library_settings(subject.target)
    else:
        candidates += function_rewrites(where, names if source else ())
    if source is None:
        watch = Watch(where, Varied.BRANCH)
    else:
        loop = where.source.startswith("for ")
        watch = Watch(source.location, Varied.COUNT if loop else Varied.EMPTY)
    if not candidates:
        return []
    try:
        inputs = verification_inputs(
            subject.target, subject.args, subject.kwargs, watch, ExportCheckFailure
        )
    except Exception:  # the eager model fails on its own inputs: torch's refusal is the report
        return []
    found = []
    for candidate in candidates:
        verification = verify(
            candidate,
            subject.target,
            inputs,
            dynamic_shapes=dynamic_shapes,
            strict=strict,
            failure=ExportCheckFailure,
        )
        found.append(verification)
        if verification.verdict is Verdict.VERIFIED:
            break
    return found


def _library_advice(where: control_flow.Location) -> str:
    library = str(where).split("/", 1)[0]
    return (
        f"The decision is made inside {library}, not in your code, so there is no line of "
        "yours to rewrite: torch.export cannot trace a call into code that decides in Python "
        "on tensor values. Export the parts of the model around that call, or use "
        "torch.compile, which runs such code between its graphs."
    )


def _draft(subject: Subject, dynamic_shapes: Any) -> DraftReport:
    """What ``torch.export.draft_export`` meets on the same inputs (it traces on where
    export stops, deciding each data-dependent guard with the inputs' values; always
    non-strict, which traces through what strict export refuses)."""
    fresh = subject.fresh_inputs()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            program = torch.export.draft_export(
                subject.target,
                fresh.args,
                fresh.kwargs,
                dynamic_shapes=dynamic_shapes,
            )
    except Exception as error:  # draft_export is a hint here: say why it stopped
        where = call_path(traceback_frames(error)).innermost
        at = f" at {where}: `{where.source}`" if where else " inside torch"
        return DraftReport(error=f"{in_words(error)}{at}")
    finally:
        subject.reset()
    report = program._report  # draft_export's report has no public accessor
    # Frames name files by number: the numbers of this trace, and those torch gave out
    # earlier in the process (private: torch._logging.structured interns each name once).
    from torch._logging.structured import INTERN_TABLE

    filenames = {number: name for name, number in INTERN_TABLE.items()}
    filenames.update(report.str_to_filename)
    guards, other = [], []
    for failure in report.failures:
        data = failure.data
        kind = failure.failure_type.name
        if kind in ("DATA_DEPENDENT_ERROR", "GUARD_ADDED"):
            frames = _draft_frames(data.get("user_stack", []), filenames)
            guards.append(
                DraftGuard(
                    call_path(frames),
                    str(data.get("expr", "")),
                    int(data.get("occurrences", 1) or 1),
                )
            )
        else:
            detail = data.get("reason") or ""
            other.append(f"{kind.lower().replace('_', ' ')}: torch.ops.{data.get('op')} {detail}")
    return DraftReport(tuple(guards), tuple(other))


def _draft_frames(
    stack: Iterable[dict[str, Any]], filenames: dict[int, str]
) -> list[tuple[str, int]]:
    return [
        (filenames[frame["filename"]], int(frame["line"]))
        for frame in stack
        if frame.get("filename") in filenames
    ]


def _eager_run(
    subject: Subject, where: control_flow.Location | None
) -> tuple[control_flow.Decision | None, list[data_dependence.Use]]:
    """The decision the eager forward made at ``where`` (else the last one before it), and
    the data-dependent sizes and values the line read."""
    fresh = subject.fresh_inputs()
    try:
        with (
            torch.no_grad(),
            control_flow.record_decisions() as log,
            data_dependence.tracing() as trace,
        ):
            subject.target(*fresh.args, **fresh.kwargs)
    except Exception:  # the eager run is only a hint here
        pass
    finally:
        subject.reset()
    if where is None:
        return (log[0] if len(log) else None), []
    uses = trace.uses_at(where)
    same_line = [d for d in log if d.location == where]
    if same_line:
        return same_line[0], uses
    earlier = [
        d for d in log if d.location.filename == where.filename and d.location.line < where.line
    ]
    return (max(earlier, key=lambda d: d.location.line) if earlier else None), uses
