"""The call every check makes: ``model_or_fn(*inputs, **forward_kwargs)``, checked.

The checks take ``(model_or_fn, /, *inputs, forward_kwargs=None, <options>)``;
``training_check`` takes ``(model_or_fn, batch, /, loss_fn, *, forward_kwargs=None,
<options>)``, its inputs in the batch. This module holds what they share about that call:

- :func:`reject_unknown_keywords`, :func:`forward_kwargs_of` and :func:`input_sets`:
  keyword arguments of the forward travel only in ``forward_kwargs``, so a forward
  parameter named like an option (``eps``, ``atol``, ``runs``) never gets the option's
  meaning; ``inputs_list`` adds input sets;
- :func:`reached_modules`: the modules a callable reaches (a module, a bound method,
  a ``functools.partial``, closures, default arguments and globals of a function that
  hold modules or containers of modules, attributes of an object with ``__call__``),
  so their parameters are checked as for a module passed directly;
- :func:`reject_data_less`: a ``ValueError`` for meta or fake tensors, which hold no
  values to check;
- :func:`reentrant_checkpoint`: whether a graph holds a reentrant
  ``torch.utils.checkpoint``, which ``torch.autograd.grad`` cannot differentiate;
  :func:`graph_nodes` walks a graph.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .naming import input_names

__all__ = [
    "REENTRANT_CHECKPOINT",
    "forward_kwargs_of",
    "graph_nodes",
    "input_sets",
    "reached_modules",
    "reentrant_checkpoint",
    "reject_data_less",
    "reject_unknown_keywords",
]

REENTRANT_CHECKPOINT = (
    "torch.utils.checkpoint with use_reentrant=True: torch's reentrant checkpoint "
    "supports only loss.backward() without inputs=, not torch.autograd.grad, which {check} "
    "needs to take gradients without touching .grad (torch says: 'Checkpointing is not "
    "compatible with .grad() or when an `inputs` parameter is passed to .backward()'). "
    "This is a limitation of torch, not of the model: use "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), which torch recommends "
    "and which {check} supports"
)
# How deep reached_modules looks into closures, defaults, partials and containers, and
# the largest list, tuple or dict it looks into (a module is not kept among data).
_REACH_DEPTH = 4
_REACH_ITEMS = 256


def forward_kwargs_of(check: str, forward_kwargs: Any) -> dict[str, Any]:
    """``forward_kwargs`` as a dict of keyword arguments; ``TypeError`` when it is not one."""
    __tracebackhide__ = True
    if forward_kwargs is None:
        return {}
    if not isinstance(forward_kwargs, Mapping) or not all(
        isinstance(key, str) for key in forward_kwargs
    ):
        raise TypeError(
            f"{check}: forward_kwargs must be a mapping from argument names (str) to the "
            f"values the forward gets as keyword arguments, got {forward_kwargs!r}"
        )
    return dict(forward_kwargs)


def input_sets(check: str, inputs: tuple, inputs_list: Any) -> list[tuple]:
    """The input tuples to run: ``inputs`` first (when given), then each of ``inputs_list``."""
    __tracebackhide__ = True
    if inputs_list is None:
        return [inputs]
    if not isinstance(inputs_list, list | tuple) or not inputs_list:
        raise TypeError(
            f"{check}: inputs_list must be a non-empty list of input tuples, "
            f"e.g. [(x1,), (x2,)], got {inputs_list!r}"
        )
    for position, entry in enumerate(inputs_list):
        if not isinstance(entry, tuple):
            raise TypeError(
                f"{check}: inputs_list[{position}] must be a tuple of positional inputs "
                f"(write (x,) for one input), got {type(entry).__name__}"
            )
    return ([inputs] if inputs else []) + list(inputs_list)


def reject_unknown_keywords(check: str, unknown: Mapping[str, Any], options: Iterable[str]) -> None:
    """``TypeError`` naming keywords that are no option: they belong in ``forward_kwargs``."""
    __tracebackhide__ = True
    if not unknown:
        return
    names = ", ".join(repr(name) for name in unknown)
    example = "{" + ", ".join(f"{name!r}: ..." for name in unknown) + "}"
    raise TypeError(
        f"{check}() got unknown keyword argument(s) {names}: its options are "
        f"{', '.join(options)}; keyword arguments of the forward go in "
        f"forward_kwargs={example}"
    )


def reached_modules(function: Callable[..., Any]) -> list[tuple[str, nn.Module]]:
    """``(prefix, module)`` for each module ``function`` reaches, outermost first.

    The prefix is what names its parameters: ``""`` for a module passed directly or the
    module of a bound method (``fc.weight``), else the variable that holds it
    (``model.fc.weight`` for ``lambda x: model(x)``, ``experts[1].weight`` for a list).
    """
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    _reach(function, "", found, seen, _REACH_DEPTH)
    return found


# What holds no module and no callable holding one: skipped without a closer look.
_ATOMS = frozenset({torch.Tensor, nn.Parameter, int, float, bool, complex, str, bytes, type(None)})
# Globals a function reads that are no container of modules (Python modules, classes,
# functions), told apart before the slower check for a Mapping.
_NEVER_HOLD = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)


def _reach(value: Any, prefix: str, found: list, seen: set[int], depth: int) -> None:
    if depth < 0 or type(value) in _ATOMS or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, nn.Module):
        found.append((prefix, value))
        return
    if isinstance(value, (list, tuple)):
        if len(value) <= _REACH_ITEMS:
            for index, item in enumerate(value):
                _reach(item, f"{prefix}[{index}]", found, seen, depth - 1)
        return
    # The abstract Mapping check is slow: asked only of what is not a callable.
    if isinstance(value, dict) or (not callable(value) and isinstance(value, Mapping)):
        if len(value) <= _REACH_ITEMS:
            for key, item in value.items():
                _reach(item, f"{prefix}[{key!r}]", found, seen, depth - 1)
        return
    for name, item in _held_by_callable(value):
        _reach(item, _join(prefix, name), found, seen, depth - 1)


def _held_by_callable(value: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of what a callable holds: its self, partial arguments, cells, defaults."""
    if inspect.ismethod(value):
        owner = value.__self__
        if isinstance(owner, nn.Module):
            yield "", owner
        elif not isinstance(owner, type):
            yield from _held_by_object(owner)
        yield "", value.__func__
    elif isinstance(value, functools.partial):
        names = input_names(value.func, len(value.args))
        yield from zip(names, value.args, strict=True)
        yield from value.keywords.items()
        yield "", value.func
    elif inspect.isfunction(value):
        code = value.__code__
        for name, cell in zip(code.co_freevars, value.__closure__ or (), strict=True):
            try:
                yield name, cell.cell_contents
            except ValueError:  # an empty cell: the variable is not assigned yet
                continue
        defaults = value.__defaults__ or ()
        positional = code.co_varnames[: code.co_argcount]
        yield from zip(positional[len(positional) - len(defaults) :], defaults, strict=True)
        yield from (value.__kwdefaults__ or {}).items()
        for name in _global_names(code):
            item = value.__globals__.get(name)
            if _may_hold(item):
                yield name, item
    elif callable(value) and not isinstance(value, type):
        yield from _held_by_object(value)  # an object with __call__ that keeps its model


def _held_by_object(owner: Any) -> Iterator[tuple[str, Any]]:
    """The attributes of an object that may hold modules."""
    attributes = getattr(owner, "__dict__", None) or {}
    return ((name, item) for name, item in attributes.items() if _may_hold(item))


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` and the functions defined in it (lambdas too) may read as globals."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _global_names(constant)


def _may_hold(value: Any) -> bool:
    """A module, or a list, tuple or dict that may hold modules; not a module of Python code."""
    if isinstance(value, (nn.Module, list, tuple, dict)):
        return True
    if type(value) in _ATOMS or isinstance(value, _NEVER_HOLD):
        return False
    return isinstance(value, Mapping)


def _join(prefix: str, name: str) -> str:
    if not name:
        return prefix
    if not prefix or name.startswith("["):
        return prefix + name
    return f"{prefix}.{name}"


def reject_data_less(check: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``ValueError`` naming the first tensor without data: on the meta device, or fake."""
    __tracebackhide__ = True
    # Fake tensors exist only once their module is imported; importing it costs 0.5 s.
    fake_tensor = sys.modules.get("torch._subclasses.fake_tensor")
    for name, tensor in named_tensors:
        if tensor.device.type == "meta":
            what = "is on the meta device"
        elif fake_tensor is not None and isinstance(tensor, fake_tensor.FakeTensor):
            what = f"is a FakeTensor (device {tensor.device})"
        else:
            continue
        raise ValueError(
            f"{check}: {name} {what}: it has a shape and a dtype but no values, so there is "
            f"nothing to compute with. Materialize it first (for a model built under "
            f"torch.device('meta'): model.to_empty(device='cpu'), then initialize or load its "
            f"weights; for a tensor: make it on a real device)"
        )


def graph_nodes(outputs: Iterable[Any]) -> Iterator[Any]:
    """Each node of the autograd graph behind the tensors of ``outputs``, once."""
    pending = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor)]
    visited: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        yield node
        pending.extend(next_node for next_node, _ in node.next_functions)


def reentrant_checkpoint(outputs: Iterable[Any]) -> bool:
    """Whether the autograd graph of ``outputs`` holds a reentrant checkpoint."""
    return any(
        node.name().startswith("CheckpointFunctionBackward") for node in graph_nodes(outputs)
    )
