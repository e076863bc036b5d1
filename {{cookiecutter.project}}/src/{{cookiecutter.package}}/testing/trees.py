"""Nested inputs and outputs, walked with ``torch.utils._pytree``, dataclasses included.

Models take and return tensors inside tuples, lists, dicts, named tuples, dataclasses
and the containers libraries register with pytree (transformers' ``ModelOutput``).
pytree walks all of them and names each leaf by its path (``output[0]``,
``output['logits']``, ``output.hidden`` for a named tuple's field). A dataclass that is
not registered with pytree is a leaf to it; its fields are walked here instead of
registering the user's class, because a registration is process-wide and permanent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "FlatArguments",
    "StructuresDiffer",
    "flatten_arguments",
    "leaves",
    "map_leaves",
    "map_tensors",
    "merge_leaves",
    "named_leaves",
]


def _unregistered_dataclass(value: Any) -> bool:
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and type(value) not in pytree.SUPPORTED_NODES
    )


def named_leaves(value: Any, name: str) -> list[tuple[str, Any]]:
    """``(name + path, leaf)`` for every leaf of ``value`` (tensors and anything else)."""
    if type(value) is torch.Tensor:  # the common case, without pytree's cost
        return [(name, value)]
    found: list[tuple[str, Any]] = []
    paths_and_leaves = pytree.tree_flatten_with_path(value, is_leaf=_unregistered_dataclass)[0]
    for path, leaf in paths_and_leaves:
        leaf_name = name + pytree.keystr(path)
        if _unregistered_dataclass(leaf):
            for field in dataclasses.fields(leaf):
                found.extend(named_leaves(getattr(leaf, field.name), f"{leaf_name}.{field.name}"))
        else:
            found.append((leaf_name, leaf))
    return found


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, torch.Tensor | bool | int | float | complex | str)


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor in it replaced by ``function(tensor)``, same structure."""
    if isinstance(value, torch.Tensor):
        return function(value)
    # Inputs are mostly a flat tuple and dict, mapped on every run of a check: without
    # pytree's flatten and unflatten, which cost more than a small model's forward.
    if type(value) is tuple and all(map(_plain, value)):
        return tuple(function(v) if isinstance(v, torch.Tensor) else v for v in value)
    if type(value) is dict and all(map(_plain, value.values())):
        return {k: function(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return function(item)
        if _unregistered_dataclass(item):
            changes = {
                field.name: map_tensors(function, getattr(item, field.name))
                for field in dataclasses.fields(item)
                if field.init
            }
            return dataclasses.replace(item, **changes)
        return item

    return pytree.tree_map(leaf, value, is_leaf=_unregistered_dataclass)


def map_leaves(function: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with every leaf as pytree flattens it replaced by ``function(leaf)``."""
    return pytree.tree_map(function, value)


def leaves(value: Any) -> list[Any]:
    """Every leaf of ``value`` as pytree flattens it (an unregistered dataclass is one leaf)."""
    return pytree.tree_leaves(value)


class StructuresDiffer(ValueError):
    """The values :func:`merge_leaves` was given are not nested alike."""


def merge_leaves(values: Sequence[Any], merge: Callable[[int, tuple[Any, ...]], Any]) -> Any:
    """One value of the structure all ``values`` share, its leaf at each position
    ``merge(position, the values' leaves there)``; :class:`StructuresDiffer` when they
    are not nested alike."""
    flat = [pytree.tree_flatten(value) for value in values]
    spec = flat[0][1]
    if any(other != spec for _, other in flat):
        raise StructuresDiffer("the values are not nested alike")
    columns = zip(*(leaves for leaves, _ in flat), strict=True)
    return pytree.tree_unflatten([merge(i, column) for i, column in enumerate(columns)], spec)


@dataclasses.dataclass(frozen=True)
class FlatArguments:
    """A call's ``(args, kwargs)`` as pytree flattens them: each leaf named as the forward
    names it (``x``, ``x[0]['mask']``, a keyword by its key), and how to rebuild them.

    ``top_level`` says that each leaf is one argument itself (no container among them),
    so the arguments can be rebuilt without pytree.
    """

    names: list[str]
    leaves: list[Any]
    spec: pytree.TreeSpec
    top_level: bool

    def rebuild(self, leaves: list[Any]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of the same structure, holding ``leaves``."""
        return pytree.tree_unflatten(leaves, self.spec)


def flatten_arguments(
    args: tuple, kwargs: dict[str, Any], positional_names: Sequence[str]
) -> FlatArguments:
    """``args`` and ``kwargs`` flattened; the positional ones named by ``positional_names``."""
    paths_and_leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _ in paths_and_leaves:
        # Paths into ((args...), {kwargs}): (0, position, ...) or (1, name, ...).
        group, key, rest = path[0], path[1], path[2:]
        head = positional_names[key.idx] if group.idx == 0 else str(key.key)
        names.append(head + pytree.keystr(rest))
    top_level = all(len(path) == 2 for path, _ in paths_and_leaves)
    top_level = top_level and len(paths_and_leaves) == len(args) + len(kwargs)
    return FlatArguments(names, [leaf for _, leaf in paths_and_leaves], spec, top_level)
