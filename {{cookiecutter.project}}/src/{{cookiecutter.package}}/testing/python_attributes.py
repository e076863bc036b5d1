"""The plain Python attributes of a model's modules: snapshot, what a run changed, the
line that assigns each.

A forward that keeps a Python value on its module (``self.calls += 1``, a step count,
a mode string) starts every later run from another value; the checks restore
parameters, buffers and RNG states, not these, so runs part (``autograd_determinism``)
or eager and compiled runs differ and the compiled code recompiles (``compile_check``).
What a message needs to name the cause is here: which attribute changed, from what to
what, and where the code assigns it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from .control_flow import Location
from .sources import parsed

__all__ = ["AttributeChange", "Snapshot", "assigned_at", "changes", "described", "snapshot"]

# Values a forward keeps as plain Python state; a tuple longer than this is data, not a
# counter or a mode, and would make the messages that list it long.
_PLAIN = (bool, int, float, str, type(None))
_TUPLE_LIMIT = 8


@dataclasses.dataclass(frozen=True)
class AttributeChange:
    """``owner.attribute`` (``Counter.calls`` on the model, ``experts.0.steps`` on a
    submodule) went from
    ``before`` to ``after``; ``assigned_at`` is the line of the module's code that
    assigns it outside ``__init__`` (``None`` when none is found)."""

    owner: str
    attribute: str
    before: Any
    after: Any
    assigned_at: Location | None

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attribute}"

    def __str__(self) -> str:
        where = f" (`{self.assigned_at.source}` at {self.assigned_at})" if self.assigned_at else ""
        return f"{self.name}: {self.before!r} -> {self.after!r}{where}"


# (module's full name, attribute) -> (module, value)
Snapshot = dict[tuple[str, str], tuple[nn.Module, Any]]


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return len(value) <= _TUPLE_LIMIT and all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def snapshot(modules: Iterable[tuple[str, nn.Module]]) -> Snapshot:
    """The plain attributes (bools, ints, floats, strings, None, small tuples of them) of
    each module, by its full name; ``training`` and private names left out."""
    taken: Snapshot = {}
    for prefix, module in modules:
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or attribute == "training" or not _plain(value):
                continue
            taken.setdefault((prefix, attribute), (module, value))
    return taken


def changes(before: Snapshot, after: Snapshot) -> list[AttributeChange]:
    """Each attribute whose value differs between the two snapshots (or that one lacks)."""
    found = []
    for key in dict.fromkeys([*before, *after]):
        module, old = before.get(key, (None, "<unset>"))
        module, new = after.get(key, (module, "<unset>"))
        if type(old) is type(new) and old == new:
            continue
        prefix, attribute = key
        owner = prefix or type(module).__name__
        found.append(AttributeChange(owner, attribute, old, new, assigned_at(module, attribute)))
    return found


def described(changed: Sequence[AttributeChange], consequence: str) -> list[str]:
    """A message's lines naming the attributes a run changed and the way out; ``consequence``
    says what the change did (``so each run starts from other values``)."""
    if not changed:
        return []
    return [
        "The forward changes Python attributes of the model, which the check does not put "
        f"back between runs (it puts back parameters, buffers and RNG states), {consequence}:",
        *(f"  {change}" for change in changed),
        "Keep such state out of the forward, or in a buffer (register_buffer) if the forward "
        "needs it.",
    ]


def assigned_at(module: nn.Module | None, attribute: str) -> Location | None:
    """The first line of ``module``'s class (and its bases) outside ``__init__`` that
    assigns ``self.<attribute>`` (``=``, ``+=``, an annotated assignment)."""
    for cls in type(module).__mro__ if module is not None else ():
        if cls.__module__.startswith("torch."):
            break
        for function in vars(cls).values():
            code = getattr(inspect.unwrap(function), "__code__", None)
            if code is None or code.co_name == "__init__":
                continue
            found = _assignment(code.co_filename, code.co_firstlineno, attribute)
            if found is not None:
                return found
    return None


def _assignment(filename: str, first_line: int, attribute: str) -> Location | None:
    source = parsed(filename)
    if source is None:
        return None
    for node in ast.walk(source.tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        starts = [node.lineno, *(d.lineno for d in node.decorator_list)]
        if first_line not in starts:
            continue
        for inner in ast.walk(node):
            targets = (
                inner.targets
                if isinstance(inner, ast.Assign)
                else [inner.target]
                if isinstance(inner, ast.AugAssign | ast.AnnAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attribute
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    return Location(filename, inner.lineno)
    return None
