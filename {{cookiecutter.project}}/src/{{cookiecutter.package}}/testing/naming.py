"""How every check names what it reports: the callable, its inputs, one element of a tensor.

- :func:`describe_callable`: ``MeanGatedNet``, ``Router.forward``, ``test_gate.<lambda>``;
- :func:`input_names`: the forward's parameter name of each positional input where
  ``inspect.signature`` finds one, else ``inputs[i]`` (nested inputs then add their
  pytree path, ``x[0]['mask']``: see :mod:`.trees`);
- :func:`element_name`: ``x[2, 3]``, ``parameter encoder.weight[0, 1]``, or the name
  alone for a tensor of one element;
- :func:`op_name`: a torch function as the user calls it, ``Tensor.add``,
  ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["describe_callable", "element_name", "input_names", "op_name"]


def describe_callable(function: Any) -> str:
    """The class of a module, ``Owner.method`` of a bound method, else the qualified name."""
    if isinstance(function, nn.Module):
        return type(function).__name__
    if inspect.ismethod(function):
        owner = function.__self__
        owner_name = owner.__name__ if isinstance(owner, type) else type(owner).__name__
        return f"{owner_name}.{function.__name__}"
    if inspect.isfunction(function):
        return function.__qualname__.replace(".<locals>", "")
    return getattr(function, "__name__", None) or type(function).__name__


def element_name(name: str, index: Sequence[int]) -> str:
    """``name[i, j]``; ``name`` itself for a 0-dimensional tensor."""
    return f"{name}[{', '.join(map(str, index))}]" if len(index) else name


def op_name(func: Any) -> str:
    """A torch function as the user calls it: ``Tensor.add`` for a method, the module and
    name otherwise (``torch._C._nn``'s functions under ``torch.nn.functional``)."""
    owner = getattr(func, "__objclass__", None)
    name = getattr(func, "__name__", repr(func))
    if owner is not None and issubclass(torch.Tensor, owner):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"{module.replace('torch._C._nn', 'torch.nn.functional')}.{name}" if module else name


def input_names(function: Callable[..., Any], count: int) -> list[str]:
    """The name of each positional input: the forward's parameter name, else ``inputs[i]``.

    A wrapper that sets ``__wrapped__`` (``functools.wraps``, a module made around a
    function) names the inputs as the callable it wraps.
    """
    target = getattr(function, "__wrapped__", function)
    if isinstance(target, nn.Module):
        target = target.forward
    names = _from_code(target)
    if names is None:
        names = []
        try:
            parameters = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        for parameter in parameters:
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break
            names.append(parameter.name)
    names.extend(f"inputs[{position}]" for position in range(len(names), count))
    return names[:count]


def _from_code(target: Any) -> list[str] | None:
    """The positional parameter names of a plain function (or a bound method of one)
    read off its code object, as ``inspect.signature`` gives them at a tenth of its cost;
    ``None`` for anything else (a signature set by hand, a builtin, a partial)."""
    function, skip = target, 0
    if inspect.ismethod(target):
        function, skip = target.__func__, 1
    if type(function) is not types.FunctionType or "__signature__" in function.__dict__:
        return None
    code = function.__code__
    return list(code.co_varnames[skip : code.co_argcount])
