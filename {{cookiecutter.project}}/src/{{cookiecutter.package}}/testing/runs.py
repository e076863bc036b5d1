"""One forward and backward of a :class:`.subject.Subject`, and its results by typed key.

:func:`run_once` starts from the subject's state (:meth:`.Subject.reset`), calls it on
fresh copies of the inputs, pulls a fixed random cotangent (:class:`Cotangents`) back
through every floating-point output that requires grad with ``torch.autograd.grad``
(``.grad`` attributes are not touched, post-accumulate hooks do not run), and returns
a :class:`Run`: the outputs (detached, in the structure the model returned) and every
value to compare, keyed by :class:`Key`: each output leaf, the gradient of each
trainable parameter and differentiated input, and each buffer the forward changed.
A :class:`RunProgress` passed in says which :class:`Phase` a run that raised was in.
"""

from __future__ import annotations

import contextlib
import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import calls
from .subject import Subject
from .trees import map_tensors, named_leaves

__all__ = ["Cotangents", "Key", "Kind", "Phase", "Run", "RunProgress", "run_once"]


class Kind(enum.Enum):
    """What a value of a run is."""

    OUTPUT = "output"
    PARAMETER_GRAD = "parameter gradient"
    INPUT_GRAD = "input gradient"
    BUFFER = "buffer"


@dataclass(frozen=True)
class Key:
    """One value of a run: its kind and name (``output[0]``, ``fc.weight``, ``x``).

    ``str()`` is how reports name it: ``output[0]``, ``grad of fc.weight``, ``grad of
    input x``, ``buffer bn.running_mean after the run``.
    """

    kind: Kind
    name: str

    def __str__(self) -> str:
        if self.kind is Kind.PARAMETER_GRAD:
            return f"grad of {self.name}"
        if self.kind is Kind.INPUT_GRAD:
            return f"grad of input {self.name}"
        if self.kind is Kind.BUFFER:
            return f"buffer {self.name} after the run"
        return self.name


class Phase(enum.Enum):
    """Which half of a run: the call of the model, or the gradients through it."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class RunProgress:
    """How far a run got: the :class:`Phase` it is in, updated as it goes."""

    phase: Phase = Phase.FORWARD


@dataclass
class Run:
    """The outputs of one run (detached) and its values to compare."""

    outputs: Any
    values: dict[Key, Any]

    def of_kind(self, kind: Kind) -> dict[str, Any]:
        """The values of one kind, by name."""
        return {key.name: value for key, value in self.values.items() if key.kind is kind}


class Cotangents:
    """One fixed random cotangent per differentiated output, the same in every run."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.samples: dict[tuple, torch.Tensor] = {}  # by (output name, shape, dtype, device)

    def __call__(self, name: str, output: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(output.shape), output.dtype, output.device)
        if key not in self.samples:
            generator = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))
            dtype = (
                output.dtype
                if output.dtype in (torch.float64, torch.complex128)
                else (torch.complex64 if output.is_complex() else torch.float32)
            )
            sample = torch.randn(output.shape, generator=generator, dtype=dtype)
            self.samples[key] = sample.to(device=output.device, dtype=output.dtype)
        return self.samples[key]


def _comparable(value: Any) -> bool:
    return value is None or isinstance(
        value, torch.Tensor | bool | int | float | complex | str | bytes
    )


def run_once(
    subject: Subject,
    cotangents: Cotangents,
    *,
    call: Callable[..., Any] | None = None,
    recording: contextlib.AbstractContextManager[Any] | None = None,
    progress: RunProgress | None = None,
) -> Run:
    """One forward and backward from the starting conditions.

    ``call`` runs in place of the subject's callable (its compiled version, say), with
    the subject's modules and inputs; ``recording`` is entered around forward and
    backward; ``progress`` follows the phase, so a caller knows where a run raised.
    """
    progress = progress or RunProgress()
    progress.phase = Phase.FORWARD
    subject.reset()
    inputs = subject.fresh_inputs()
    with recording or contextlib.nullcontext():
        target = subject.target if call is None else call
        outputs = target(*inputs.args, **inputs.kwargs)
        leaves = named_leaves(outputs, "output")
        if not subject.graph_checked:
            subject.graph_checked = True
            if calls.reentrant_checkpoint(t for _, t in leaves):
                raise ValueError(calls.REENTRANT_CHECKPOINT.format(check=subject.check))
        wrt = [
            *(Key(Kind.PARAMETER_GRAD, name) for name, _ in subject.parameters),
            *(Key(Kind.INPUT_GRAD, name) for name, _ in inputs.differentiated),
        ]
        tensors = [t for _, t in subject.parameters] + [t for _, t in inputs.differentiated]
        progress.phase = Phase.BACKWARD
        grads = _gradients(leaves, tensors, cotangents)
    values: dict[Key, Any] = {
        Key(Kind.OUTPUT, name): leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        for name, leaf in leaves
        if _comparable(leaf)
    }
    values.update(zip(wrt, grads, strict=True))
    values.update((Key(Kind.BUFFER, n), v) for n, v in subject.changed_buffers().items())
    return Run(map_tensors(torch.Tensor.detach, outputs), values)


def _gradients(
    leaves: list[tuple[str, Any]], wrt: list[torch.Tensor], cotangents: Cotangents
) -> tuple[torch.Tensor | None, ...]:
    """The cotangents pulled back to each tensor of ``wrt`` (None where none arrives)."""
    differentiable = [
        (name, t)
        for name, t in leaves
        if isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.is_floating_point() or t.is_complex())
    ]
    if not differentiable or not wrt:
        return (None,) * len(wrt)
    return torch.autograd.grad(
        [t for _, t in differentiable],
        wrt,
        [cotangents(name, t) for name, t in differentiable],
        allow_unused=True,
    )
