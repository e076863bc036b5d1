"""A source file parsed once: its syntax tree, each node's parent, each expression by its span.

What the plugin reads off the user's code to explain a decision (the rewrite of a
branch, the ``not`` around a condition) it reads from :func:`parsed`, which keeps the
last files it parsed: the few files of a model are read once per session.
"""

from __future__ import annotations

import ast
import functools
import linecache

__all__ = ["ParsedSource", "parsed"]

# Files kept parsed: a model's own files and the library files it decides in.
_KEPT = 64


class ParsedSource:
    """A parsed file: ``tree``, ``parents`` of each node, ``spans`` of each expression
    (``(line, column, end line, end column)``, the outermost of equal spans)."""

    def __init__(self, tree: ast.AST) -> None:
        self.tree = tree
        self.parents: dict[ast.AST, ast.AST] = {}
        self.spans: dict[tuple[int, int, int | None, int | None], ast.expr] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.expr):
                span = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)
                self.spans.setdefault(span, node)

    def ancestors(self, node: ast.AST) -> list[ast.AST]:
        """The nodes around ``node``, innermost first."""
        found = []
        while node in self.parents:
            node = self.parents[node]
            found.append(node)
        return found


@functools.lru_cache(maxsize=_KEPT)
def parsed(filename: str) -> ParsedSource | None:
    """``filename`` parsed, or ``None`` when it cannot be read or parsed."""
    try:
        return ParsedSource(ast.parse("".join(linecache.getlines(filename))))
    except (SyntaxError, ValueError):
        return None
