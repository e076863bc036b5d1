"""The rewrite that takes a data-dependent decision out of Python, built from the user's source.

``torch.export`` cannot record a decision made in Python on a tensor's data, and
``torch.compile`` breaks its graph there. :func:`rewrite` reads the line that made the
decision (and the code around it) and writes what records both outcomes instead:
``torch.cond`` for a branch, ``torch.where`` for an elementwise choice, a loop of
fixed length with a mask (or ``torch.while_loop``) for a loop whose length depends
on the data, ``torch._assert_async`` for an ``assert`` on a tensor; a Python number
read off a tensor gets :func:`scalar_advice`.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from .control_flow import Decision, Location
from .sources import ParsedSource, parsed

__all__ = ["rewrite", "scalar_advice"]


def _innermost(source: ParsedSource, line: int, kinds: tuple[type, ...]) -> ast.AST | None:
    """The innermost node of ``kinds`` whose condition (or loop header) spans ``line``."""
    nodes = [
        node
        for node in ast.walk(source.tree)
        if isinstance(node, kinds) and _test_lines(node)[0] <= line <= _test_lines(node)[1]
    ]
    return max(nodes, key=lambda node: len(source.ancestors(node)), default=None)


def _test_lines(node: ast.AST) -> tuple[int, int]:
    """The lines of a branch's or loop's condition (of the whole node otherwise)."""
    part = getattr(node, "test", None) or getattr(node, "iter", None) or node
    return part.lineno, part.end_lineno or part.lineno


def rewrite(where: Location, decision: Decision | None) -> str | None:
    """The rewrite for the decision at ``where``; ``decision`` is what the eager run decided."""
    source = parsed(where.filename)
    if source is None:
        return None
    node = _innermost(source, where.line, (ast.If, ast.IfExp, ast.While, ast.For, ast.Assert))
    if node is None:
        return scalar_advice(decision)
    if isinstance(node, ast.Assert):
        return _assert_rewrite(node)
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
    return scalar_advice(decision)


class _AsTensorOperators(ast.NodeTransformer):
    """``a and not b`` as ``a & ~b``: the same test on boolean tensors, without Python's bool."""

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        self.generic_visit(node)
        operator = ast.BitAnd() if isinstance(node.op, ast.And) else ast.BitOr()
        combined = node.values[0]
        for value in node.values[1:]:
            combined = ast.BinOp(combined, operator, value)
        return combined

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        self.generic_visit(node)
        return ast.UnaryOp(ast.Invert(), node.operand) if isinstance(node.op, ast.Not) else node


def _assert_rewrite(node: ast.Assert) -> str:
    test = _AsTensorOperators().visit(ast.parse(ast.unparse(node.test), mode="eval")).body
    message = f", {ast.unparse(node.msg)}" if node.msg is not None else ', "assertion failed"'
    return (
        "An assert on a tensor's value asks Python for the value; torch._assert_async checks "
        "it inside the graph instead (torch.export and torch.compile keep it):\n"
        f"    torch._assert_async({ast.unparse(test)}{message})"
    )


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


def _false_branch(node: ast.If, source: ParsedSource) -> list[ast.stmt]:
    if node.orelse:
        return node.orelse
    if node.body and isinstance(node.body[-1], ast.Return):
        parent = source.parents.get(node)
        body = getattr(parent, "body", [])
        if node in body:
            following = body[body.index(node) + 1 :]
            return following[:1]
    return []


def _cond_rewrite(node: ast.If, source: ParsedSource, function: ast.AST | None) -> str:
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


def _where_rewrite(node: ast.IfExp, source: ParsedSource) -> str:
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


def scalar_advice(decision: Decision | None) -> str:
    """What to do with a Python number read off a tensor."""
    made = f" ({decision.op} at {decision.location})" if decision else ""
    return (
        f"A Python number made from a tensor{made} is used as a size, a loop count or a "
        "branch. Keep it a tensor (masks, torch.where) where you can; when it is a size, "
        "bound it for export with torch._check(0 <= n) and torch._check(n <= <max>) right "
        "after it is made; a loop over it becomes a loop to a fixed maximum with a mask."
    )
