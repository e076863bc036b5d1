"""Where an aten op runs, in the user's terms: the submodule, the user's line, and for a
backward op the forward call that made its autograd node.

A dispatch mode sees every aten op, forward and backward, but not who called it.
:class:`ModuleStack` (module hooks) says which submodule's forward is running;
:class:`GraphTagger` (a torch function mode) marks each new autograd node with the call
that made it; :func:`op_site` puts them together for the op being dispatched:

    with ModuleStack(subject.roots) as modules, GraphTagger(modules), recorder:
        ...  # in the recorder's __torch_dispatch__: op_site(modules, sys._getframe(1))

``forward in encoder.1 (Linear) at models.py:45``, ``backward (AddmmBackward0) of
linear in encoder.1 (Linear) at models.py:45``, ``backward (MyFnBackward) at
models.py:80`` (a custom Function's own backward).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import control_flow
from .control_flow import Location
from .subject import FunctionModule
from .trees import named_leaves

__all__ = ["GraphTagger", "ModuleStack", "OpSite", "op_site", "site_of"]

# The autograd node's metadata entry that holds the site of the forward call that made it.
_SITE_KEY = "plugin_forward_site"


class ModuleStack:
    """Which module's forward is running, by its name in the model, while active."""

    def __init__(self, roots: list[tuple[str, nn.Module]]) -> None:
        self._names: dict[int, str] = {}
        for prefix, root in reversed(roots):  # the outermost name wins
            for name, module in root.named_modules(remove_duplicate=False):
                self._names[id(module)] = f"{prefix}.{name}" if prefix and name else prefix or name
        self._stack: list[str | None] = []
        self._handles: list[Any] = []

    def current(self) -> str | None:
        return next((entry for entry in reversed(self._stack) if entry is not None), None)

    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        kind = type(module).__name__
        if isinstance(module, FunctionModule):  # a plain function, wrapped: no module of the user's
            self._stack.append(None)
            return
        self._stack.append(
            f"{name} ({kind})" if name else f"the model ({kind})" if name == "" else kind
        )

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> ModuleStack:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter),
            hooks.register_module_forward_hook(self._exit, always_call=True),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True)
class OpSite:
    """Where an op ran: ``what`` (``forward``, the torch call ``linear``, ``backward
    (AddmmBackward0)``), the submodule running, the user's line, and for a backward op
    the ``forward`` call that made its autograd node. ``str()`` is the report's phrase."""

    what: str
    module: str | None = None
    location: Location | None = None
    forward: OpSite | None = None

    @property
    def user_line(self) -> Location | None:
        """The user's line: the op's own, else the forward call's."""
        return self.location or (self.forward.location if self.forward else None)

    def __str__(self) -> str:
        if self.forward is not None and self.location is None:
            return f"{self.what} of {self.forward}"
        return " ".join(
            filter(
                None,
                [
                    self.what,
                    f"in {self.module}" if self.module else "",
                    f"at {self.location}" if self.location else "",
                ],
            )
        )


def site_of(modules: ModuleStack, frame: FrameType | None, what: str) -> OpSite:
    """The site of a call made from ``frame`` while ``modules`` is active."""
    return OpSite(what, modules.current(), control_flow.user_location(frame))


class GraphTagger(TorchFunctionMode):
    """Marks each new autograd node with the call that created it (module and user line)."""

    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        pending = [t.grad_fn for _, t in named_leaves(result, "") if isinstance(t, torch.Tensor)]
        site = None
        while pending:
            node = pending.pop()
            if node is None or _SITE_KEY in node.metadata:
                continue
            if site is None:
                site = site_of(self.modules, sys._getframe(1), getattr(func, "__name__", str(func)))
            node.metadata[_SITE_KEY] = site
            pending.extend(next_node for next_node, _ in node.next_functions)
        return result


def op_site(modules: ModuleStack, frame: FrameType | None) -> OpSite:
    """Where the op being dispatched from ``frame`` runs: forward, or backward and of what."""
    node = torch._C._current_autograd_node()
    if node is None:
        return site_of(modules, frame, "forward")
    location = control_flow.user_location(frame)  # a custom Function's backward
    return OpSite(f"backward ({node.name()})", None, location, node.metadata.get(_SITE_KEY))
