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
import copy
from collections.abc import Sequence
from dataclasses import dataclass

from .control_flow import Decision, Location
from .sources import ParsedSource, parsed

__all__ = ["Rewrite", "function_rewrites", "rewrite", "scalar_advice"]


@dataclass(frozen=True)
class Rewrite:
    """A rewrite of the function around a decision, whole, so that a check can build it.

    ``explanation`` says what it does and ``code`` is what to write instead of lines
    ``replaced`` of ``filename`` (it parses); ``function`` is the whole function with
    the rewrite applied, whose ``def`` is at ``function_line`` of the file.
    """

    explanation: str
    code: str
    filename: str
    replaced: tuple[int, int]
    function: ast.FunctionDef
    function_line: int


def function_rewrites(where: Location, sized: Sequence[str] = ()) -> list[Rewrite]:
    """The rewrites of the decision at ``where`` that a check can build and export, best
    first; ``sized`` names the tensors whose data-dependent size the line reads."""
    source = parsed(where.filename)
    if source is None:
        return []
    node = _innermost(source, where.line, (ast.If, ast.While, ast.For, ast.Assert))
    if not isinstance(node, ast.If):
        return []
    function = next((a for a in source.ancestors(node) if isinstance(a, ast.FunctionDef)), None)
    if function is None:
        return []
    found = []
    loop = next((a for a in source.ancestors(node) if isinstance(a, ast.For | ast.While)), None)
    masked = masked_loop_statements(node, loop, function) if loop is not None else None
    if masked is not None:
        statements, replaced = masked
        found.append(_built(where.filename, function, replaced, statements, _MASKED_LOOP))
    if sized and not node.orelse:
        unguarded = (
            [] if all(isinstance(s, ast.Continue | ast.Pass) for s in node.body) else node.body
        )
        names = ", ".join(f"`{name}`" for name in sized)
        found.append(
            _built(
                where.filename,
                function,
                [node],
                unguarded,
                f"Take the `if` out: with an empty {names}, indexing and index_add_ do nothing, "
                "so the code under it computes the same for every size, 0 included, and the "
                "program keeps the size as a value instead of deciding on it. The code then reads:",
            )
        )
    leaves = any(
        isinstance(n, ast.Return | ast.Break | ast.Continue) for s in node.body for n in ast.walk(s)
    )
    if not sized and not node.orelse and not leaves:
        found.append(
            _built(
                where.filename,
                function,
                [node],
                node.body,
                "Take the `if` out: where its condition does not hold, the code under it "
                "changes nothing (a selection made from the condition, such as nonzero(), is "
                "empty, and indexing and index_add_ with it do nothing), so running it always "
                "computes the same and the program has no branch. The code then reads:",
            )
        )
    built = cond_statements(node, source, function)
    if built is not None:
        statements, replaced = built
        found.append(
            _built(
                where.filename,
                function,
                replaced,
                statements,
                "Rewrite the branch with torch.cond, which records both branches and picks one "
                "when the program runs (both take the same tensors and return tensors of the "
                "same shapes and dtypes):",
            )
        )
    return found


def _built(
    filename: str,
    function: ast.FunctionDef,
    replaced: list[ast.stmt],
    statements: list[ast.stmt],
    explanation: str,
) -> Rewrite:
    """``function`` with the statements ``replaced`` (consecutive, in one body) swapped for
    ``statements``; the code shown is the innermost loop around them, else the statements."""
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    copied = copy.deepcopy(function)
    position = {(n.lineno, n.col_offset) for n in replaced}
    shown: ast.AST | None = None
    for parent in ast.walk(copied):
        for field in ("body", "orelse"):
            body = getattr(parent, field, None)
            if not isinstance(body, list):
                continue
            indices = [
                i
                for i, n in enumerate(body)
                if (getattr(n, "lineno", None), getattr(n, "col_offset", None)) in position
            ]
            if indices:
                emptied = len(indices) == len(body) and not statements
                body[indices[0] : indices[-1] + 1] = (
                    [ast.Pass()] if emptied else copy.deepcopy(statements)
                )
                if isinstance(parent, ast.For | ast.While):
                    shown = parent
    ast.fix_missing_locations(copied)
    code = (
        ast.unparse(shown) if shown is not None else "\n".join(ast.unparse(s) for s in statements)
    )
    end = max(n.end_lineno or n.lineno for n in replaced)
    return Rewrite(
        explanation,
        "\n".join(f"    {line}" for line in code.splitlines()),
        filename,
        (replaced[0].lineno, end),
        copied,
        first,
    )


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
            return _masked_loop_rewrite(node, loop, function)
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
    built = cond_statements(node, source, function)
    if built is None:
        return (
            "Rewrite the branch with torch.cond, which records both branches and picks one when "
            "the program runs: move each side into a function of the tensors it reads that "
            "returns the tensors it assigns (both sides the same shapes and dtypes), and "
            "assign torch.cond(condition, true_fn, false_fn, operands) to them. This branch "
            "leaves its function (return, break or continue) on one side only, so it does not "
            "fit torch.cond as written."
        )
    statements, _ = built
    code = "\n".join(f"    {line}" for s in statements for line in ast.unparse(s).splitlines())
    return (
        "Rewrite the branch with torch.cond, which records both branches and picks one when "
        "the program runs (both take the same tensors and return tensors of the same shapes "
        "and dtypes):\n" + code
    )


def cond_statements(
    node: ast.If, source: ParsedSource, function: ast.AST | None
) -> tuple[list[ast.stmt], list[ast.stmt]] | None:
    """The statements that replace ``node`` (and what it returns into, when its body
    ends in ``return``): ``torch.cond`` over both sides, and the statements replaced;
    ``None`` when a side leaves the function or loop other than by a final ``return``."""
    false_side = _false_branch(node, source)
    true_branch, false_branch = _branch(node.body), _branch(false_side)
    replaced = [node, *(false_side if false_side is not node.orelse else [])]
    condition = node.test
    if true_branch and false_branch and true_branch[0] == false_branch[0]:
        operands = _operands([true_branch[1], false_branch[1]], function)
        parameters = ", ".join(operands)
        packed = f"({parameters},)" if len(operands) == 1 else f"({parameters})"
        target = "return" if true_branch[0] == "return" else f"{true_branch[0]} ="
        text = (
            f"{target} torch.cond({ast.unparse(condition)}, lambda {parameters}: "
            f"{ast.unparse(true_branch[1])}, lambda {parameters}: "
            f"{ast.unparse(false_branch[1])}, {packed})"
        )
        return ast.parse(text).body, replaced
    sides = [node.body, node.orelse]
    if any(
        isinstance(n, ast.Return | ast.Break | ast.Continue | ast.Yield)
        for side in sides
        for statement in side
        for n in ast.walk(statement)
    ):
        return None
    before, after = _names_around(function, node)
    assigned = [
        n.id
        for side in sides
        for statement in side
        for n in ast.walk(statement)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    ]
    outputs = [name for name in dict.fromkeys(assigned) if name in after]
    if not outputs:
        return None
    operands = [name for name in _operands([*node.body, *node.orelse], function) if name in before]
    operands += [name for name in outputs if name not in operands and name in before]
    parameters = ", ".join(operands)
    returned = ", ".join(outputs) + ("," if len(outputs) == 1 else "")
    lines = []
    for name, side in (("true_branch", node.body), ("false_branch", node.orelse)):
        lines.append(f"def {name}({parameters}):")
        lines += [
            f"    {line}" for statement in side for line in ast.unparse(statement).splitlines()
        ]
        # A branch may not return an operand itself: torch.cond refuses the alias.
        assigned_here = {
            n.id
            for statement in side
            for n in ast.walk(statement)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        values = [o if o in assigned_here else f"{o}.clone()" for o in outputs]
        lines.append(f"    return ({', '.join(values)}{',' if len(values) == 1 else ''})")
    lines.append(
        f"{returned} = torch.cond({ast.unparse(condition)}, true_branch, false_branch, "
        f"({parameters}{',' if len(operands) == 1 else ''}))"
    )
    return ast.parse("\n".join(lines)).body, replaced


def _names_around(function: ast.AST | None, node: ast.stmt) -> tuple[set[str], set[str]]:
    """The local names defined before ``node`` (parameters included), and those read after it."""
    if function is None:
        return set(), set()
    before = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}  # type: ignore[attr-defined]
    after = set()
    end = node.end_lineno or node.lineno
    for name in ast.walk(function):
        if not isinstance(name, ast.Name):
            continue
        if isinstance(name.ctx, ast.Store) and name.lineno < node.lineno:
            before.add(name.id)
        elif isinstance(name.ctx, ast.Load) and name.lineno > end:
            after.add(name.id)
    return before - {"self", "cls"}, after


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


_MASKED_LOOP = (
    "The loop stops on a tensor's value. Run it the full number of times and stop updating "
    "with a mask (same outputs and gradients; every step is computed):"
)


def _masked_loop_rewrite(node: ast.If, loop: ast.For | ast.While, function: ast.AST | None) -> str:
    built = masked_loop_statements(node, loop, function)
    if built is not None:
        statements, _ = built
        code = "\n".join(f"    {line}" for s in statements for line in ast.unparse(s).splitlines())
        return f"{_MASKED_LOOP}\n{code}"
    header = (
        f"for {ast.unparse(loop.target)} in {ast.unparse(loop.iter)}:"
        if isinstance(loop, ast.For)
        else "for _ in range(max_steps):  # max_steps: an upper bound on the passes"
    )
    return "\n".join(
        [
            _MASKED_LOOP,
            "    active = torch.ones((), dtype=torch.bool)",
            f"    {header}",
            f"        active = active & ~({ast.unparse(node.test)})",
            "        value = torch.where(active, new_value, value)  # each value the loop updates",
            "or torch.while_loop(cond_fn, body_fn, carried_inputs), which exports the loop "
            "itself (forward only).",
        ]
    )


def masked_loop_statements(
    node: ast.If, loop: ast.For | ast.While, function: ast.AST | None
) -> tuple[list[ast.stmt], list[ast.stmt]] | None:
    """The statements that replace ``loop``, which ``node`` (``if c: ...; break``) ends on
    a tensor's value: the loop run to its end, each assignment kept only while no ``break``
    has happened (``torch.where``), and the statements replaced; ``None`` unless the loop is
    a ``for`` whose body is assignments to names around that one ``if``."""
    if not isinstance(loop, ast.For) or node not in loop.body or node.orelse:
        return None
    if not node.body or not isinstance(node.body[-1], ast.Break):
        return None
    on_exit, others = node.body[:-1], [s for s in loop.body if s is not node]
    if not all(_assigns_a_name(s) for s in [*on_exit, *others]):
        return None
    before, after = _names_around(function, loop)
    index = loop.body.index(node)
    # Each statement of one pass in order, the `if` as its condition, then its body.
    passes = [*loop.body[:index], node.test, *on_exit, *loop.body[index + 1 :]]
    kept = {
        _assigned_name(s)
        for s in [*on_exit, *others]
        if _assigned_name(s) in after or _carried(_assigned_name(s), passes)
    }
    undefined = [
        name
        for name in dict.fromkeys(_assigned_name(s) for s in [*on_exit, *others])
        if name in kept and name not in before
    ]
    device = next((name for name in _operands(loop.body, function) if name in before), None)
    condition = ast.unparse(node.test)
    lines = [
        "active = torch.ones((), dtype=torch.bool"
        + (f", device={device}.device)" if device else ")"),
        *(f"{name} = None" for name in undefined),
        f"for {ast.unparse(loop.target)} in {ast.unparse(loop.iter)}:",
    ]
    lines += [_masked(s, "active", kept, undefined) for s in loop.body[:index]]
    if on_exit:
        lines.append(f"    stopping = active & ({condition})")
        lines += [_masked(s, "stopping", kept, undefined) for s in on_exit]
    lines.append(f"    active = active & ~({condition})")
    lines += [_masked(s, "active", kept, undefined) for s in loop.body[index + 1 :]]
    return ast.parse("\n".join(lines)).body, [loop]


def _assigns_a_name(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Assign):
        return len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name)
    return isinstance(statement, ast.AugAssign | ast.AnnAssign) and isinstance(
        statement.target, ast.Name
    )


def _assigned_name(statement: ast.stmt) -> str:
    target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target  # type: ignore[attr-defined]
    return target.id


def _carried(name: str, passes: list[ast.AST]) -> bool:
    """Whether a pass reads ``name`` before (or where) it first assigns it: its value comes
    from the pass before."""
    for part in passes:
        loaded = (n for n in ast.walk(part) if isinstance(n, ast.Name) and n.id == name)
        if any(isinstance(n.ctx, ast.Load) for n in loaded):
            return True
        if isinstance(part, ast.stmt) and _assigns_a_name(part) and _assigned_name(part) == name:
            return False
    return False


def _masked(statement: ast.stmt, mask: str, kept: set[str], undefined: list[str]) -> str:
    """``name = value`` as an update kept where ``mask`` holds (the new value on a first
    pass that defines the name); a value used only later in the same pass as it is."""
    name = _assigned_name(statement)
    if name not in kept:
        return "    " + ast.unparse(statement)
    if isinstance(statement, ast.AugAssign):
        value = ast.unparse(ast.BinOp(ast.Name(name), statement.op, statement.value))
    else:
        value = ast.unparse(statement.value)  # type: ignore[arg-type]
    kept = f"torch.where({mask}, {value}, {name})"
    if name in undefined:
        return f"    {name} = {value} if {name} is None else {kept}"
    return f"    {name} = {kept}"


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
