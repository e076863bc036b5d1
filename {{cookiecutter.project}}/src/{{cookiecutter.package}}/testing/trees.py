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
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["map_tensors", "named_leaves"]


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
