"""Where a size or a Python value that depends on a tensor's data is made, and where it is used.

``torch.export`` records one graph for every input, and ``torch.compile`` breaks its
graph, where a size or a Python value depends on the data. torch stops at the line
that *uses* such a value (``if token.numel() == 0:``), while the user's question is
where it was *made* (``token = (ids == e).nonzero()``, a line earlier). One eager run
under :func:`tracing` answers both: each op whose output size depends on the data
(:data:`SIZE_OPS`, boolean-mask indexing, one-argument ``torch.where``) tags its
outputs with a :class:`Source`; tensors computed from tagged ones carry the tag on;
each read of a tagged tensor's size into Python (``numel()``, ``size()``, ``.shape``,
``len()``, a loop over it) and each value read off any tensor (``.item()``,
``bool()``, ``.tolist()``) is recorded as a :class:`Use` at the user's line.

    with tracing() as trace:
        model(x)
    trace.uses_at(location)   # what the line used, and where each was made
"""

from __future__ import annotations

import ast
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .control_flow import DECISION_OPS, UNKNOWN_LOCATION, Location, user_location
from .sources import parsed

__all__ = ["SIZE_OPS", "Source", "Trace", "Use", "tracing"]

# Each op whose output's size depends on its input's values, by the name a user writes.
SIZE_OPS: dict[Any, str] = {
    torch.nonzero: "torch.nonzero()",
    torch.Tensor.nonzero: "nonzero()",
    torch.argwhere: "torch.argwhere()",
    torch.Tensor.argwhere: "argwhere()",
    torch.masked_select: "torch.masked_select()",
    torch.Tensor.masked_select: "masked_select()",
    torch.unique: "torch.unique()",
    torch.Tensor.unique: "unique()",
    torch.unique_consecutive: "torch.unique_consecutive()",
    torch.Tensor.unique_consecutive: "unique_consecutive()",
    torch.repeat_interleave: "torch.repeat_interleave()",
    torch.Tensor.repeat_interleave: "repeat_interleave()",
    torch.bincount: "torch.bincount()",
    torch.Tensor.bincount: "bincount()",
}
_SIZE_READS: dict[Any, str] = {
    torch.Tensor.numel: "numel()",
    torch.Tensor.size: "size()",
    torch.Tensor.__len__: "len()",
    torch.Tensor.unbind: "a loop over it",
}
_SHAPE = torch.Tensor.shape


@dataclass(frozen=True)
class Source:
    """Where a size that depends on the data is made: ``op`` (``nonzero()``) at ``location``.

    ``sizes`` are the sizes of its first output in each call the trace saw there (the
    number of elements ``nonzero()`` found, the rows a mask kept).
    """

    op: str
    location: Location
    sizes: tuple[int, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The variables the source line assigns (``token, slot = ...``)."""
        source = parsed(self.location.filename)
        if source is None:
            return ()
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.lineno == self.location.line:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                return tuple(
                    name.id
                    for target in targets
                    for name in ast.walk(target)
                    if isinstance(name, ast.Name)
                )
        return ()

    def describe_sizes(self) -> str:
        """``3, 0 and 5 in 3 calls, 0 once`` as a report says it."""
        if not self.sizes:
            return ""
        low, high = min(self.sizes), max(self.sizes)
        spread = f"{low}" if low == high else f"{low} to {high}"
        zeros = self.sizes.count(0)
        calls = len(self.sizes)
        text = f"{spread} over {calls} call{'s' if calls > 1 else ''} in the eager run"
        if zeros:
            text += f", empty {zeros} time{'s' if zeros > 1 else ''}"
        return text


@dataclass(frozen=True)
class Use:
    """A line that read a data-dependent size (``how``: ``numel()``, a loop over it) or a
    value (``Tensor.item``, ``Tensor.__bool__``) into Python; ``source`` made it (``None``
    for a value read straight off a tensor's data)."""

    location: Location
    how: str
    source: Source | None


@dataclass
class Trace:
    """What one traced run made and used."""

    uses: list[Use] = field(default_factory=list)
    _sizes: dict[Location, list[int]] = field(default_factory=dict)
    _ops: dict[Location, str] = field(default_factory=dict)

    def source_at(self, location: Location) -> Source | None:
        """The size source made at ``location``, with every size seen there."""
        if location not in self._ops:
            return None
        return Source(self._ops[location], location, tuple(self._sizes[location]))

    def uses_at(self, location: Location) -> list[Use]:
        """What the line at ``location`` read into Python, each source with all its sizes."""
        found: list[Use] = []
        for use in self.uses:
            if use.location == location and all(
                (u.how, u.source and u.source.location)
                != (use.how, use.source and use.source.location)
                for u in found
            ):
                source = use.source and self.source_at(use.source.location)
                found.append(Use(use.location, use.how, source))
        return found

    def sources(self) -> list[Source]:
        return [
            Source(op, location, tuple(self._sizes[location])) for location, op in self._ops.items()
        ]


class _Tracer(TorchFunctionMode):
    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        frame = sys._getframe(1)
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        tag = next((self.tags[t] for t in tensors if t in self.tags), None)
        op = SIZE_OPS.get(func) or _sized_by_data(func, args, kwargs)
        if op is not None:
            location = user_location(frame) or UNKNOWN_LOCATION
            outputs = [r for r in pytree.tree_leaves(result) if isinstance(r, torch.Tensor)]
            self.trace._ops.setdefault(location, op)
            if outputs:
                self.trace._sizes.setdefault(location, []).append(
                    int(outputs[0].shape[0]) if outputs[0].dim() else 1
                )
            tag = Source(op, location)
        elif tag is not None and (func in _SIZE_READS or _is_shape_read(func)):
            how = _SIZE_READS.get(func, ".shape")
            self.trace.uses.append(Use(user_location(frame) or UNKNOWN_LOCATION, how, tag))
            return result
        elif func in DECISION_OPS:
            self.trace.uses.append(
                Use(user_location(frame) or UNKNOWN_LOCATION, DECISION_OPS[func], tag)
            )
            return result
        if tag is not None:
            for output in pytree.tree_leaves(result):
                if isinstance(output, torch.Tensor) and output not in self.tags:
                    self.tags[output] = tag
        return result


def _is_shape_read(func: Any) -> bool:
    return getattr(func, "__self__", None) is _SHAPE


def _sized_by_data(func: Any, args: tuple, kwargs: dict) -> str | None:
    """``torch.where(condition)`` and indexing by a boolean mask: their sizes are the data's."""
    if func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1:
        return "torch.where(condition)"
    if func is torch.Tensor.__getitem__ and len(args) == 2:
        index = args[1]
        leaves = pytree.tree_leaves(index if isinstance(index, tuple) else (index,))
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in leaves):
            return "boolean-mask indexing"
    return None


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Trace the sizes and values that depend on the data, made and used inside the block."""
    trace = Trace()
    with _Tracer(trace):
        yield trace
