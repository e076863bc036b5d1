"""Where a size or a Python value that depends on a tensor's data is made, and where it is used.

``torch.export`` records one graph for every input, and ``torch.compile`` breaks its
graph, where a size or a Python value depends on the data. torch stops at the line
that *uses* such a value (``if token.numel() == 0:``), while the user's question is
where it was *made* (``token = (ids == e).nonzero()``, a line earlier). One eager run
under :func:`tracing` answers both: each op whose output size depends on the data
(:data:`SIZE_OPS`: ``nonzero()``, boolean-mask indexing, one-argument ``torch.where``,
``unique()``, ...) tags its
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .control_flow import DECISION_OPS, UNKNOWN_LOCATION, Location, user_location
from .sources import parsed

__all__ = ["SIZE_OPS", "SizeOp", "Source", "Trace", "Use", "data_dependent_size", "tracing"]


@dataclass(frozen=True)
class SizeOp:
    """An op whose output's size depends on the data: ``name`` as a report keys it
    (``Tensor.nonzero``), ``words`` as a message says it (``nonzero()``), and ``measure``,
    the size of one call from its arguments and result (``None``: that call's size does
    not depend on the data, as ``torch.where``'s three-argument form)."""

    name: str
    words: str
    measure: Callable[[tuple, dict, Any], int | None]


def _rows(args: tuple, kwargs: dict, result: Any) -> int:
    """The length of dimension 0 of a result, or of its first tensor (``as_tuple=True``)."""
    first = result[0] if isinstance(result, tuple | list) else result
    return first.shape[0] if first.dim() else 1


def _length(result: Any, dim: int | None) -> int:
    """The length of dimension ``dim`` of the (first) result; all of it when ``dim`` is None
    (the op flattened its input)."""
    first = result[0] if isinstance(result, tuple | list) else result
    return first.numel() if dim is None else first.shape[dim]


def _where_size(args: tuple, kwargs: dict, result: Any) -> int | None:
    # torch.where(condition): the indices where it holds; the three-argument form selects
    # elementwise and keeps the shape.
    return _rows(args, kwargs, result) if len(args) == 1 and not kwargs else None


def _repeat_size(args: tuple, kwargs: dict, result: Any) -> int | None:
    # torch.repeat_interleave(x, repeats) with repeats a tensor (or repeat_interleave(repeats)
    # alone): as long as the repeats sum to; an int repeats fixes the size.
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    if not isinstance(repeats, torch.Tensor):
        return None
    return _length(result, args[2] if len(args) > 2 else kwargs.get("dim"))


def _unique_size(args: tuple, kwargs: dict, result: Any) -> int:
    return _length(result, kwargs.get("dim"))


def _selected_size(args: tuple, kwargs: dict, result: Any) -> int:
    return result.numel()


def _mask_size(args: tuple, kwargs: dict, result: Any) -> int | None:
    # x[mask] with one boolean tensor in the index: as many rows as the mask holds True
    # (counted with torch functions off: no mode, this one or another, sees the count).
    index = args[1] if len(args) > 1 else None
    entries = index if isinstance(index, tuple) else (index,)
    masks = [e for e in entries if isinstance(e, torch.Tensor) and e.dtype == torch.bool]
    if len(masks) != 1:
        return None
    with torch._C.DisableTorchFunction():
        return int(masks[0].count_nonzero())


# Each op whose output's size depends on the data. Not here: nonzero_static (its size is
# given), and bincount, whose length (the largest value + 1) is almost always fixed by
# its minlength.
SIZE_OPS: dict[Any, SizeOp] = {
    torch.nonzero: SizeOp("torch.nonzero", "torch.nonzero()", _rows),
    torch.Tensor.nonzero: SizeOp("Tensor.nonzero", "nonzero()", _rows),
    torch.argwhere: SizeOp("torch.argwhere", "torch.argwhere()", _rows),
    torch.Tensor.argwhere: SizeOp("Tensor.argwhere", "argwhere()", _rows),
    torch.where: SizeOp("torch.where", "torch.where(condition)", _where_size),
    torch.masked_select: SizeOp("torch.masked_select", "torch.masked_select()", _selected_size),
    torch.Tensor.masked_select: SizeOp("Tensor.masked_select", "masked_select()", _selected_size),
    torch.unique: SizeOp("torch.unique", "torch.unique()", _unique_size),
    torch.Tensor.unique: SizeOp("Tensor.unique", "unique()", _unique_size),
    torch.unique_consecutive: SizeOp(
        "torch.unique_consecutive", "torch.unique_consecutive()", _unique_size
    ),
    torch.Tensor.unique_consecutive: SizeOp(
        "Tensor.unique_consecutive", "unique_consecutive()", _unique_size
    ),
    torch.repeat_interleave: SizeOp(
        "torch.repeat_interleave", "torch.repeat_interleave()", _repeat_size
    ),
    torch.Tensor.repeat_interleave: SizeOp(
        "Tensor.repeat_interleave", "repeat_interleave()", _repeat_size
    ),
    torch.Tensor.__getitem__: SizeOp(
        "Tensor.__getitem__[mask]", "boolean-mask indexing", _mask_size
    ),
}


def data_dependent_size(
    func: Any, args: tuple, kwargs: dict, result: Any
) -> tuple[SizeOp, int] | None:
    """The op and the size of a call whose output's size depends on the data, else ``None``."""
    op = SIZE_OPS.get(func)
    if op is None:
        return None
    size = op.measure(args, kwargs, result)
    return None if size is None else (op, size)


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
        """``1 to 5 over 4 calls in the eager run, empty once``, as a message says it."""
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
        measured = data_dependent_size(func, args, kwargs, result)
        if measured is not None:
            op, size = measured
            location = user_location(frame) or UNKNOWN_LOCATION
            self.trace._ops.setdefault(location, op.words)
            self.trace._sizes.setdefault(location, []).append(size)
            tag = Source(op.words, location)
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


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Trace the sizes and values that depend on the data, made and used inside the block."""
    trace = Trace()
    with _Tracer(trace):
        yield trace
