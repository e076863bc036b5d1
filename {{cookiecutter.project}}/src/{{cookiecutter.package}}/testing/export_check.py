"""Check that a model exports with ``torch.export``, and say how to make it export when not.

:func:`export_check` exports a model (or function), runs the ``ExportedProgram``
against eager PyTorch on the inputs, and returns the program. When export fails on
data-dependent control flow, the error names the user's line and the decision made
there (recorded by :mod:`.control_flow` in one eager run), leaves out torch's
symbolic-shape text and FX dump, and shows the rewrite that makes the code
exportable, built from the source: ``torch.cond`` for a branch, ``torch.where`` for
an elementwise choice, a loop of fixed length with a mask (or ``torch.while_loop``)
for a loop whose length depends on the data.
"""

from __future__ import annotations

import ast
import contextlib
import io
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import control_flow
from .calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from .comparison import close_mismatch
from .failures import CheckFailure
from .naming import describe_callable
from .subject import Subject
from .trees import named_leaves

__all__ = ["ExportBlocked", "ExportCheckFailure", "ExportMismatch", "export_check", "summary"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class ExportCheckFailure(CheckFailure):
    """``export_check`` failed; ``torch_error`` is torch's own exception, if it raised one."""

    check = "export_check"

    def __init__(self, message: str, torch_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.torch_error = torch_error


class ExportBlocked(ExportCheckFailure):
    """``torch.export`` refused the model at ``location`` (the user's ``file:line``)."""

    def __init__(
        self,
        message: str,
        *,
        location: control_flow.Location | None,
        decision: control_flow.Decision | None,
        rewrite: str | None,
        torch_error: BaseException,
    ) -> None:
        super().__init__(message, torch_error)
        self.location, self.decision, self.rewrite = location, decision, rewrite


class ExportMismatch(ExportCheckFailure):
    """The exported program's output ``name`` differs from eager's for input set ``input_set``."""

    def __init__(self, message: str, *, name: str, input_set: int) -> None:
        super().__init__(message)
        self.name, self.input_set = name, input_set


class _FunctionModule(nn.Module):
    """A plain function as the module ``torch.export.export`` wants."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self.function = function
        self.__wrapped__ = function  # inputs are named by the function's parameters

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


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

    Raises :class:`ExportBlocked` when torch refuses to export, naming the user's line
    and the data-dependent decision there, with the rewrite that exports;
    :class:`ExportMismatch` naming the output and element that differ, or
    :class:`ExportCheckFailure` when the program refuses an input set.
    """
    __tracebackhide__ = True
    reject_unknown_keywords(
        "export_check", unknown, ("forward_kwargs", "inputs_list", "dynamic_shapes", "strict")
    )
    if not callable(model_or_fn):
        raise TypeError(
            f"export_check: model_or_fn must be an nn.Module or a callable, got "
            f"{type(model_or_fn).__name__}"
        )
    if not isinstance(strict, bool):
        raise TypeError(f"export_check: strict must be True or False, got {strict!r}")
    kwargs = forward_kwargs_of("export_check", forward_kwargs)
    sets = input_sets("export_check", inputs, inputs_list)
    module = model_or_fn if isinstance(model_or_fn, nn.Module) else _FunctionModule(model_or_fn)
    name = describe_callable(model_or_fn)
    subject = Subject(module, sets[0], kwargs, failure=ExportCheckFailure)
    fresh = subject.fresh_inputs()
    torch_output = io.StringIO()
    try:
        # torch prints the partial FX graph of a failed export to stderr.
        with contextlib.redirect_stderr(torch_output):
            program = torch.export.export(
                module, fresh.args, fresh.kwargs, dynamic_shapes=dynamic_shapes, strict=strict
            )
    except Exception as error:  # every refusal is explained the same way
        subject.reset()
        raise _blocked(name, subject, error) from None
    finally:
        subject.reset()
    if torch_output.getvalue():
        sys.stderr.write(torch_output.getvalue())
    exported = program.module()
    for number, arguments in enumerate(sets):
        _compare(
            name, Subject(module, arguments, kwargs, failure=ExportCheckFailure), exported, number
        )
    return program


def summary(program: torch.export.ExportedProgram) -> str:
    """The line the ``export_check`` fixture reports for a passing check."""
    return f"export_check: exported {len(program.graph.nodes)} graph nodes"


def _compare(name: str, subject: Subject, exported: Any, number: int) -> None:
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
                first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                raise ExportCheckFailure(
                    f"The program exported from {name} refused input set {number}: {first}. "
                    "An exported program takes inputs like the ones it was exported with; "
                    "for other sizes pass dynamic_shapes "
                    "(e.g. {'x': {0: torch.export.Dim('batch')}})",
                    error,
                ) from None
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


# --- explaining a refusal -----------------------------------------------------------------


def _is_user_file(filename: str) -> bool:
    return not filename.startswith((_TORCH_DIR, _PLUGIN_DIR, "<"))


def _user_line(error: BaseException) -> control_flow.Location | None:
    """The innermost line of user code torch was running when it gave up."""
    stack = getattr(error, "real_stack", None) or []
    frames = [(frame.filename, frame.lineno) for frame in stack]
    if not any(_is_user_file(f) for f, _ in frames):
        frames = [
            (f.f_code.co_filename, line) for f, line in traceback.walk_tb(error.__traceback__)
        ]
    user = [control_flow.Location(f, line) for f, line in frames if _is_user_file(f) and line]
    return user[-1] if user else None


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


def _blocked(name: str, subject: Subject, error: BaseException) -> ExportCheckFailure:
    where = _user_line(error)
    if not _is_data_dependent(error):
        first = str(error).strip().split("\n\n")[0]
        at = f" at {where}: `{where.source}`" if where else ""
        return ExportCheckFailure(
            f"torch.export could not export {name}{at}:\n  {type(error).__name__}: {first}",
            error,
        )
    decision = _decision_at(subject, where)
    rewrite = _rewrite(where, decision) if where else None
    lines = [f"torch.export cannot export {name}: its forward makes a data-dependent decision"]
    if where:
        lines[0] += f" at {where}:"
        lines.append(f"    {where.source}")
    if decision:
        lines.append(
            f"  decision in the eager run: {decision.op} -> {decision.value!r} "
            f"at {decision.location}"
        )
    lines.append(
        "An exported program is one graph for every input, so a Python value computed from a "
        "tensor's data (a branch, a loop count, a size) cannot be recorded."
    )
    if rewrite:
        lines.append(rewrite)
    return ExportBlocked(
        "\n".join(lines), location=where, decision=decision, rewrite=rewrite, torch_error=error
    )


def _decision_at(
    subject: Subject, where: control_flow.Location | None
) -> control_flow.Decision | None:
    """The decision the eager forward made at ``where`` (else the last one before it)."""
    fresh = subject.fresh_inputs()
    try:
        with torch.no_grad(), control_flow.record_decisions() as log:
            subject.target(*fresh.args, **fresh.kwargs)
    except Exception:  # the eager run is only a hint here
        pass
    finally:
        subject.reset()
    if where is None:
        return log[0] if len(log) else None
    same_line = [d for d in log if d.location == where]
    if same_line:
        return same_line[0]
    earlier = [
        d for d in log if d.location.filename == where.filename and d.location.line < where.line
    ]
    return max(earlier, key=lambda d: d.location.line) if earlier else None


class _Source:
    """The parsed file around the failing line: its nodes and their parents."""

    def __init__(self, filename: str) -> None:
        self.tree = ast.parse("".join(linecache.getlines(filename)))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    def ancestors(self, node: ast.AST) -> list[ast.AST]:
        found = []
        while node in self.parents:
            node = self.parents[node]
            found.append(node)
        return found

    def innermost(self, line: int, kinds: tuple[type, ...]) -> ast.AST | None:
        nodes = [
            node
            for node in ast.walk(self.tree)
            if isinstance(node, kinds) and _test_lines(node)[0] <= line <= _test_lines(node)[1]
        ]
        return max(nodes, key=lambda node: len(self.ancestors(node)), default=None)


def _test_lines(node: ast.AST) -> tuple[int, int]:
    """The lines of a branch's or loop's condition (of the whole node otherwise)."""
    part = getattr(node, "test", None) or getattr(node, "iter", None) or node
    return part.lineno, part.end_lineno or part.lineno


def _rewrite(where: control_flow.Location, decision: control_flow.Decision | None) -> str | None:
    try:
        source = _Source(where.filename)
    except (SyntaxError, ValueError):
        return None
    node = source.innermost(where.line, (ast.If, ast.IfExp, ast.While, ast.For))
    if node is None:
        return _scalar_advice(decision)
    function = next(
        (a for a in source.ancestors(node) if isinstance(a, ast.FunctionDef | ast.Lambda)),
        None,
    )
    if isinstance(node, ast.IfExp):
        return _where_rewrite(node, source)
    if isinstance(node, ast.If):
        loop = next((a for a in source.ancestors(node) if isinstance(a, ast.For | ast.While)), None)
        if loop is not None and any(isinstance(n, ast.Break) for n in node.body):
            return _masked_loop_rewrite(node, loop)
        return _cond_rewrite(node, source, function)
    if isinstance(node, ast.While):
        return _while_rewrite(node, function)
    return _scalar_advice(decision)


def _local_names(function: ast.AST | None) -> set[str]:
    if function is None:
        return set()
    names = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}  # type: ignore[attr-defined]
    names |= {
        n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    return names - {"self", "cls"}


def _operands(nodes: Sequence[ast.AST], function: ast.AST | None) -> list[str]:
    local = _local_names(function)
    found: list[str] = []
    for node in nodes:
        for name in ast.walk(node):
            loaded = isinstance(name, ast.Name) and isinstance(name.ctx, ast.Load)
            if loaded and name.id in local and name.id not in found:
                found.append(name.id)
    return found


def _branch(statements: list[ast.stmt]) -> tuple[str, ast.expr] | None:
    """``("return", expr)`` or ``(name, expr)`` for a branch that is one statement."""
    if len(statements) != 1:
        return None
    (statement,) = statements
    if isinstance(statement, ast.Return) and statement.value is not None:
        return "return", statement.value
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        return statement.targets[0].id, statement.value
    return None


def _false_branch(node: ast.If, source: _Source) -> list[ast.stmt]:
    if node.orelse:
        return node.orelse
    if node.body and isinstance(node.body[-1], ast.Return):
        parent = source.parents.get(node)
        body = getattr(parent, "body", [])
        if node in body:
            following = body[body.index(node) + 1 :]
            return following[:1]
    return []


def _cond_rewrite(node: ast.If, source: _Source, function: ast.AST | None) -> str:
    condition = ast.unparse(node.test)
    true_branch, false_branch = _branch(node.body), _branch(_false_branch(node, source))
    general = (
        "Rewrite the branch with torch.cond, which records both branches and picks one when "
        "the program runs (both take the same tensors and return tensors of the same shapes "
        "and dtypes):"
    )
    if true_branch and false_branch and true_branch[0] == false_branch[0]:
        operands = _operands([true_branch[1], false_branch[1]], function)
        parameters = ", ".join(operands)
        packed = f"({parameters},)" if len(operands) == 1 else f"({parameters})"
        target = "return" if true_branch[0] == "return" else f"{true_branch[0]} ="
        return (
            f"{general}\n"
            f"    {target} torch.cond({condition}, lambda {parameters}: "
            f"{ast.unparse(true_branch[1])}, lambda {parameters}: {ast.unparse(false_branch[1])}, "
            f"{packed})"
        )
    operands = _operands([*node.body, *_false_branch(node, source)], function)
    parameters = ", ".join(operands)
    return (
        f"{general}\n"
        f"    def true_branch({parameters}):  # line {node.body[0].lineno}: the `if` body\n"
        f"    def false_branch({parameters}):  # the `else` part\n"
        f"    ... = torch.cond({condition}, true_branch, false_branch, ({parameters},))"
    )


def _where_rewrite(node: ast.IfExp, source: _Source) -> str:
    condition, when_true, when_false = (ast.unparse(p) for p in (node.test, node.body, node.orelse))
    comprehension = next(
        (a for a in source.ancestors(node) if isinstance(a, ast.ListComp | ast.GeneratorExp)), None
    )
    lines = [
        "This is an elementwise choice: compute both sides and pick with torch.where, "
        "which exports (and gives the gradient of the side picked):",
        f"    torch.where({condition}, {when_true}, {when_false})",
    ]
    if comprehension is not None:
        loop = comprehension.generators[0]  # type: ignore[attr-defined]
        lines.append(
            f"Over `for {ast.unparse(loop.target)} in {ast.unparse(loop.iter)}`, do it for all "
            f"rows at once: compute the condition per row of {ast.unparse(loop.iter)} "
            "(a reduction with dim=-1, keepdim=True) and apply both sides to the whole tensor."
        )
    return "\n".join(lines)


def _masked_loop_rewrite(node: ast.If, loop: ast.For | ast.While) -> str:
    condition = ast.unparse(node.test)
    body = loop.body[loop.body.index(node) + 1 :] if node in loop.body else []
    updates = [
        (s.targets[0].id, ast.unparse(s.value))
        for s in body
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
    ]
    header = (
        f"for {ast.unparse(loop.target)} in {ast.unparse(loop.iter)}:"
        if isinstance(loop, ast.For)
        else "for _ in range(<an upper bound on the steps>):"
    )
    lines = [
        "The loop stops on a tensor's value. Run it a fixed number of times and stop "
        "updating with a mask (same outputs and gradients; every step is computed):",
        "    active = torch.ones((), dtype=torch.bool"
        + (f", device={updates[0][0]}.device)" if updates else ")"),
        f"    {header}",
        f"        active = active & ~({condition})",
    ]
    lines += [f"        {name} = torch.where(active, {value}, {name})" for name, value in updates]
    if not updates:
        lines.append("        <each update> = torch.where(active, <new value>, <old value>)")
    lines.append(
        "or torch.while_loop(cond_fn, body_fn, carried_inputs), which exports the loop itself "
        "(forward only)."
    )
    return "\n".join(lines)


def _while_rewrite(node: ast.While, function: ast.AST | None) -> str:
    carried = _operands([*node.body], function)
    names = ", ".join(carried)
    return (
        "The loop's length depends on a tensor's value. torch.while_loop exports it (forward "
        "only; the condition returns a boolean tensor):\n"
        f"    def cond_fn({names}): return {ast.unparse(node.test)}\n"
        f"    def body_fn({names}): ...  # the loop body, returning the new ({names})\n"
        f"    {names} = torch.while_loop(cond_fn, body_fn, ({names},))\n"
        "or, with an upper bound on the steps, a loop of fixed length that stops updating "
        "through a mask (torch.where), which also has gradients."
    )


def _scalar_advice(decision: control_flow.Decision | None) -> str:
    made = f" ({decision.op} at {decision.location})" if decision else ""
    return (
        f"A Python number made from a tensor{made} is used as a size, a loop count or a "
        "branch. Keep it a tensor (masks, torch.where) where you can; when it is a size, "
        "bound it for export with torch._check(0 <= n) and torch._check(n <= <max>) right "
        "after it is made; a loop over it becomes a loop to a fixed maximum with a mask."
    )
