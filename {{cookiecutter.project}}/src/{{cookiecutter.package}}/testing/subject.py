"""The model or function a check runs, its inputs by name, and the state every run starts from.

A :class:`Subject` is built once per check from ``model_or_fn``, the positional
inputs and ``forward_kwargs``. It finds the modules the callable reaches
(:func:`.calls.reached_modules`), their trainable parameters (what gradients are
taken for) and their buffers, names the inputs as the forward does
(:func:`.naming.input_names` plus pytree paths), and puts everything back before each
run and after the check (:meth:`Subject.reset`): parameters, buffers and the global
random number generators as they were when the check started; each run gets fresh
copies of the inputs (:meth:`Subject.fresh_inputs`), so the user's tensors are never
touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import calls, global_state
from .comparison import bitwise_equal
from .failures import CheckFailure
from .naming import input_names
from .trees import map_tensors, named_leaves

__all__ = ["FunctionModule", "Inputs", "Slot", "Subject"]


class FunctionModule(nn.Module):
    """A plain function as the module a torch API wants (``torch.export.export``, DDP).

    ``modules``, the modules the function reaches (`.calls.reached_modules`), are
    registered, so their parameters are this module's; its inputs are named by the
    function's parameters (``__wrapped__``, which `inspect.signature` follows).
    """

    def __init__(self, function: Callable[..., Any], modules: tuple[nn.Module, ...] = ()) -> None:
        super().__init__()
        self.function = function
        self.reached = nn.ModuleList(modules)
        self.__wrapped__ = function

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


@dataclass(frozen=True)
class Slot:
    """Where a module keeps one parameter or buffer, the tensor and its starting value."""

    owner: dict[str, Any]
    key: str
    name: str
    tensor: torch.Tensor
    saved: torch.Tensor | None  # None for trainable parameters (see Subject)

    def put_back(self) -> None:
        if self.owner.get(self.key) is not self.tensor:
            self.owner[self.key] = self.tensor


@dataclass(frozen=True)
class Inputs:
    """Fresh copies of a subject's inputs for one run, and the ones to differentiate by name."""

    args: tuple
    kwargs: dict[str, Any]
    differentiated: list[tuple[str, torch.Tensor]]  # (input name, copy), e.g. ("x[0]", ...)


class Subject:
    """The model or function under test, with the state every run starts from.

    ``failure`` is the check's own failure class: what the subject raises names the
    check that runs it. ``trains=True`` is for a check that changes the trainable
    parameters on purpose (optimizer steps): they are copied too, and :meth:`reset`
    puts their values back. ``restores=False`` is for a check that never runs the model
    on the user's own tensors (gradcheck installs float64 copies and puts the user's
    tensors back itself): no starting values are copied and no RNG states taken, so
    :meth:`reset` and :meth:`changed_buffers` are not for it.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        *,
        failure: type[CheckFailure],
        trains: bool = False,
        restores: bool = True,
    ) -> None:
        __tracebackhide__ = True
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.failure = failure
        self.check = failure.check
        self.roots = calls.reached_modules(target)
        self.input_names = input_names(target, len(args))
        # A slot for every place a module keeps a parameter (a buffer): a tensor held in
        # several places, or by a module reached under several names, has one for each.
        # Buffers and frozen parameters are copied: forwards update them (running
        # statistics, momentum encoders), not always with a bump of the version counter,
        # so they are compared by value. Trainable parameters are not copied, which
        # would cost as much as a backward's gradients: autograd refuses in-place
        # changes to them, and the ones made anyway (under no_grad) bump the counter.
        # A check that trains changes them on purpose, so it pays for the copies.
        self.parameter_slots: list[Slot] = []
        self.buffer_slots: list[Slot] = []
        self.parameters: list[tuple[str, torch.Tensor]] = []
        copies: dict[int, torch.Tensor | None] = {}
        for prefix, submodule in self.named_modules():
            for slots, tensors in (
                (self.parameter_slots, submodule._parameters),
                (self.buffer_slots, submodule._buffers),
            ):
                for key, tensor in tensors.items():
                    if tensor is None:
                        continue
                    name = f"{prefix}.{key}" if prefix else key
                    if id(tensor) not in copies:
                        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
                        copied = restores and (trains or not trainable)
                        copies[id(tensor)] = tensor.detach().clone() if copied else None
                        if trainable:
                            self.parameters.append((name, tensor))
                    slots.append(Slot(tensors, key, name, tensor, copies[id(tensor)]))
        calls.reject_data_less(
            self.check,
            [
                *(
                    (f"input {n}", t)
                    for n, t in self.named_inputs(args, kwargs)
                    if isinstance(t, torch.Tensor)
                ),
                *((f"parameter {slot.name}", slot.tensor) for slot in self.parameter_slots),
                *((f"buffer {slot.name}", slot.tensor) for slot in self.buffer_slots),
            ],
        )
        self.graph_checked = False
        self._versions = [slot.tensor._version for slot in self.parameter_slots]
        self._rngs = global_state.rng_states() if restores else ()
        self._ran = False  # whether a run may have changed the state since the last reset
        self._differentiate_all_inputs = not self.parameters and not any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for _, t in self.named_inputs(args, kwargs)
        )

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        """Every module reached, by its full name (a shared one under each of its names),
        walked now: a forward may have added submodules since the subject was made."""
        return [
            (f"{prefix}.{name}" if prefix and name else prefix or name, module)
            for prefix, root in self.roots
            for name, module in root.named_modules(remove_duplicate=False)
        ]

    def reset(self) -> None:
        """Parameters, buffers and RNG states as they were when the check started."""
        if not self._ran:
            return
        with torch.no_grad():
            for position, slot in enumerate(self.parameter_slots):
                slot.put_back()
                if slot.tensor._version == self._versions[position]:
                    continue
                if slot.saved is None:
                    self._versions[position] = slot.tensor._version  # reported once
                    raise self.failure(
                        f"The forward changed the trainable parameter {slot.name} in place "
                        "(under torch.no_grad() or through .data), so the next run cannot "
                        "start from the same value, and the model keeps the change. Change "
                        "it outside the forward, or keep the value in a buffer."
                    )
                slot.tensor.copy_(slot.saved)
                self._versions[position] = slot.tensor._version
            for slot in self.buffer_slots:
                slot.put_back()
                if not bitwise_equal(slot.tensor, slot.saved):
                    slot.tensor.copy_(slot.saved)
        for rng in self._rngs:
            rng.set_state(rng.raw)
        self._ran = False

    def fresh_inputs(self) -> Inputs:
        """Copies of the inputs (aliasing kept) and the ones to differentiate, by name."""
        self._ran = True
        copies: dict[int, torch.Tensor] = {}

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in copies:
                clone = tensor.detach().clone()
                if (tensor.requires_grad or self._differentiate_all_inputs) and (
                    clone.is_floating_point() or clone.is_complex()
                ):
                    clone.requires_grad_(True)
                copies[id(tensor)] = clone
            return copies[id(tensor)]

        args = map_tensors(copy, self.args)
        kwargs = map_tensors(copy, self.kwargs)
        differentiated: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for name, leaf in self.named_inputs(args, kwargs):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in seen:
                seen.add(id(leaf))
                differentiated.append((name, leaf))
        return Inputs(args, kwargs, differentiated)

    def named_inputs(self, args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """``("x[0]", leaf)`` for each leaf of the inputs, named by :func:`.naming.input_names`."""
        named = [*zip(self.input_names, args, strict=True), *kwargs.items()]
        for key, value in named:
            yield from named_leaves(value, key)

    def changed_buffers(self) -> dict[str, Any]:
        """Copies of the buffers the run changed (in place or by assignment), by name."""
        changed = {}
        for slot in self.buffer_slots:
            current = slot.owner.get(slot.key)
            if current is not slot.tensor or not bitwise_equal(current, slot.saved):
                changed[slot.name] = (
                    current.detach().clone() if isinstance(current, torch.Tensor) else current
                )
        return changed
