"""The parts of one forward: each custom autograd Function it applies, each submodule it calls.

When a whole model's result is wrong, a check can narrow it down by checking the parts
on their own, at the inputs they got in that forward: :func:`record_parts` runs a
forward and returns every application of a custom ``torch.autograd.Function`` (its
class, the arguments of ``apply``, the user's line that applied it, the module it ran
in) and every module call (the module by its name, its arguments and keyword
arguments, the calls it made). Tensors among the arguments are kept as detached copies
of their values at the call, with ``requires_grad`` as it was: a part run again on them
gets the gradient for exactly the tensors that carried one.

The calls are seen through ``sys.setprofile`` while the forward runs (``Module.__call__``
and ``Function.apply`` are Python functions), on this thread only; the profile function
in place before is put back afterwards. Functions defined in torch itself are not
recorded: they are torch's to test.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
import linecache
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from .control_flow import TORCH_DIR, UNKNOWN_LOCATION, Location, user_location
from .trees import map_leaves, map_tensors

__all__ = ["FunctionCall", "ModuleCall", "Parts", "State", "definition", "record_parts"]

# At most this many calls of each kind are recorded: each keeps copies of its inputs.
MAX_CALLS = 256
# How far below a function's first line its def is looked for (decorators above it).
_DECORATOR_LINES = 8

_APPLY = torch.autograd.Function.apply.__func__.__code__
_MODULE_CALL = nn.Module._call_impl.__code__


def definition(function: Any) -> Location:
    """The line of the ``def`` of a Python function (below its decorators)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return UNKNOWN_LOCATION
    first = code.co_firstlineno  # the first decorator's line, where there are decorators
    for line in range(first, first + _DECORATOR_LINES):
        if linecache.getline(code.co_filename, line).lstrip().startswith(("def ", "async def ")):
            return Location(code.co_filename, line)
    return Location(code.co_filename, first)


@dataclass
class ModuleCall:
    """One call of a module in the forward, with copies of what it got."""

    name: str  # its name among the modules reached ("" for the model itself)
    module: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    parent: ModuleCall | None
    children: list[ModuleCall] = field(default_factory=list)

    def describe(self) -> str:
        """``experts.2 (Linear)``, or ``the model (Router)`` for the model itself."""
        kind = type(self.module).__name__
        return f"{self.name} ({kind})" if self.name else f"the model ({kind})"


@dataclass
class FunctionCall:
    """One application of a custom ``torch.autograd.Function``."""

    function: type[torch.autograd.Function]
    args: tuple
    kwargs: dict[str, Any]
    location: Location  # the user's line that called apply
    module: ModuleCall | None  # the module whose forward applied it

    @property
    def backward_location(self) -> Location:
        """The file and line where the class's ``backward`` is defined."""
        backward = getattr(self.function.backward, "__func__", None) or self.function.backward
        return definition(backward)

    def input_names(self) -> list[str]:
        """The names the forward gives its positional inputs, ``ctx`` left out."""
        try:
            parameters = list(inspect.signature(self.function.forward).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        # A Function with its own setup_context has a forward without ctx.
        if self.function.setup_context is torch.autograd.Function.setup_context:
            parameters = parameters[1:]
        return [
            p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]


@dataclass
class Parts:
    """What one recorded forward applied and called, in the order it happened."""

    functions: list[FunctionCall] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)  # the outermost calls


@dataclass(frozen=True)
class State:
    """An object a part got that it may change (a key-value cache it appends to), as it
    was at the call: a part run again gets a fresh copy of it each time (``fresh()``)."""

    value: Any

    def fresh(self) -> Any:
        return copy.deepcopy(self.value)


# Arguments that are no state a call can change.
_IMMUTABLE = (
    torch.Tensor,
    nn.Module,
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    enum.Enum,
    range,
    slice,
)


def _copy(value: Any) -> Any:
    """``value`` as it is at the call: a detached copy of each tensor (``requires_grad``
    as it was), and any other object a :class:`State` holding a copy of it."""

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        clone = tensor.detach().clone()
        if tensor.requires_grad and (clone.is_floating_point() or clone.is_complex()):
            clone.requires_grad_(True)
        return clone

    def state(leaf: Any) -> Any:
        if isinstance(leaf, _IMMUTABLE):
            return leaf
        try:
            return State(copy.deepcopy(leaf))
        except Exception:  # what cannot be copied is passed as it is
            return leaf

    return map_leaves(state, map_tensors(copy_tensor, value))


class _PartsRecorder:
    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.parts = Parts()
        self.stack: list[tuple[FrameType, ModuleCall]] = []
        self.calls = 0

    def __call__(self, frame: FrameType, event: str, argument: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code is _MODULE_CALL:
                self._module_called(frame)
            elif code is _APPLY:
                self._applied(frame)
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()

    def _module_called(self, frame: FrameType) -> None:
        local = frame.f_locals
        module = local.get("self")
        if not isinstance(module, nn.Module) or self.calls >= MAX_CALLS:
            return
        self.calls += 1
        parent = self.stack[-1][1] if self.stack else None
        name = self.names.get(id(module), type(module).__name__)
        call = ModuleCall(name, module, _copy(local["args"]), _copy(local["kwargs"]), parent)
        (parent.children if parent is not None else self.parts.modules).append(call)
        self.stack.append((frame, call))

    def _applied(self, frame: FrameType) -> None:
        local = frame.f_locals
        function = local.get("cls")
        if not isinstance(function, type) or len(self.parts.functions) >= MAX_CALLS:
            return
        defined_in = getattr(sys.modules.get(function.__module__), "__file__", None) or ""
        if defined_in.startswith(TORCH_DIR):
            return
        self.parts.functions.append(
            FunctionCall(
                function,
                _copy(local["args"]),
                _copy(local["kwargs"]),
                user_location(frame.f_back) or UNKNOWN_LOCATION,
                self.stack[-1][1] if self.stack else None,
            )
        )


@contextlib.contextmanager
def record_parts(names: dict[int, str]) -> Iterator[Parts]:
    """Record the Function applications and module calls of the forward run in the block.

    ``names`` maps ``id(module)`` to the name reports use (``experts.2``).
    """
    recorder = _PartsRecorder(names)
    previous: Callable[..., Any] | None = sys.getprofile()
    sys.setprofile(recorder)
    try:
        yield recorder.parts
    finally:
        sys.setprofile(previous)
