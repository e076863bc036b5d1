"""``train --detect-nonfinite``: the first step whose loss or gradients are not finite,
where its first NaN or inf was born, and the bundle that replays that step.

The look at a step is cheap enough to leave on (``benchmarks/train_nonfinite_cost.py``):
one fused pass over the loss, the weights and the gradients (the kernel `GradScaler`
finds overflows with, ``_amp_foreach_non_finite_check_and_unscale_``, with a scale of
1, which leaves every finite value's bits as they were) into one flag, and one read
of it: a device synchronisation per step, never one per op. Under ``torchrun`` the
flag is summed over the processes first (one all-reduce of one number), so every
process stops before the same step; which values were not finite, and on which rank,
is asked only then. The optimizer step waits for the look: a non-finite gradient never reaches
the weights or the optimizer's state, so the state at the stop is the state before
the step. An optimizer step can still make a weight non-finite from finite gradients
(an overflow in its update, a learning rate far too large): the next step's look
sees it in the parameters and names them and that step.

Only then does localization cost more: each process replays its own batch, from the
random number generators' state at the step's start, under
`testing.nonfinite.find_loss_origins`, which looks at every op forward and backward. The
replay runs the model itself, not its DistributedDataParallel wrapper: a NaN born
on one process is found on that process.

Under fp16, `GradScaler` skips a step whose scaled gradients overflowed and halves its
scale: that is how it finds its scale, not an error, so those steps are counted
(`OverflowSkips`). A non-finite loss (computed before any scaling) still stops the
run, and so do `SKIPS_IN_A_ROW` skips in a row: no scale explains them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _checkpoint
from ._checkpoint import TrainingState
from ._files import AtomicFile, write_atomically
from .testing.nonfinite import find_loss_origins, origin_lines

__all__ = [
    "BUNDLE_FORMAT",
    "CHECKPOINT",
    "RECORD",
    "SKIPS_IN_A_ROW",
    "FiniteSteps",
    "GeneratorsAtStep",
    "NotFiniteStep",
    "OverflowSkips",
    "RankRecord",
    "StepLook",
    "StepRecord",
    "bundle_folder",
    "locate",
    "write_bundle",
]

# GradScaler starts at a scale of 2**16 and halves it at each skip: after 24 skips in a
# row it is 2**-8, where a float16 gradient overflows only if the true one exceeds
# 65504 * 256 (1.7e7). That is no scale to find: the gradient itself is not finite.
SKIPS_IN_A_ROW = 24
BUNDLE_FORMAT = 1
CHECKPOINT = "checkpoint.pt"
RECORD = "step.json"  # written last: a folder without it is an incomplete bundle


@dataclass(frozen=True)
class GeneratorsAtStep:
    """torch's random number generators' states at a step's start (CPU and the device),
    taken every step (about 1 µs); `restore` puts them back. Python's ``random`` is not
    taken: its state is a 625-integer tuple, 12 µs a step (1% of the example model's
    step on the CPU), and torch's ops (dropout among them) draw from torch's generators.
    A bundle holds Python's state as it was at the stop."""

    torch: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def take(cls, device: torch.device) -> GeneratorsAtStep:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


@dataclass(frozen=True)
class StepLook:
    """What a step's look found: the ranks whose loss was not finite, whether the
    gradients (averaged over the processes) were not, and whether the parameters were
    not before the step (the optimizer step before it made them so)."""

    losses: tuple[int, ...]
    gradients: bool
    parameters: bool


class FiniteSteps:
    """The look at each step's loss, gradients and weights: one flag, computed on the
    device and read once. Which of them was not finite is asked only then (`what`)."""

    def __init__(
        self, parameters: Sequence[nn.Parameter], device: torch.device, world_size: int
    ) -> None:
        self.parameters, self.world_size = list(parameters), world_size
        self._found = torch.zeros(1, device=device)
        self._one = torch.ones((), device=device)
        # The weights stay the same tensors (the optimizer updates them in place): their
        # views are made once.
        with torch.no_grad():
            self._weights = [p.detach() for p in self.parameters]

    def finite(self, loss: torch.Tensor, *, gradients: bool) -> bool:
        """Whether the loss, the weights and (with ``gradients``; not under `GradScaler`,
        which looks at them itself) the gradients are finite, on every process."""
        found = self._found
        found.zero_()
        looked_at = [loss.detach().reshape(1), *self._weights]
        if gradients:
            looked_at += [p.grad for p in self.parameters if p.grad is not None]
        with torch.no_grad():
            for group in _by_dtype(looked_at):
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, self._one)
        if self.world_size > 1:
            dist.all_reduce(found)
        return not found.item()  # the step's one read of the device

    def what(self, losses: tuple[int, ...], *, gradients: bool) -> StepLook:
        """What was not finite, once `finite` said something was: ``losses``, the ranks
        whose loss was not; the gradients (with ``gradients``) and the weights, looked at
        one by one (they are the same on every process)."""
        with torch.no_grad():
            grads = gradients and any(
                not bool(torch.isfinite(p.grad).all())
                for p in self.parameters
                if p.grad is not None
            )
            weights = any(not bool(torch.isfinite(w).all()) for w in self._weights)
        return StepLook(losses, gradients=grads, parameters=weights)


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype: the fused kernel takes one dtype at a time."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


class OverflowSkips:
    """The steps fp16's `GradScaler` skipped for an overflow: in all, and in a row."""

    def __init__(self) -> None:
        self.total = self.in_a_row = 0

    def step(self, scale_before: float, scale_after: float) -> None:
        """After ``scaler.update()``: the scale falls only when the step was skipped."""
        if scale_after < scale_before:
            self.total += 1
            self.in_a_row += 1
        else:
            self.in_a_row = 0

    @property
    def endless(self) -> bool:
        """`SKIPS_IN_A_ROW` skips in a row: no scale makes these gradients finite."""
        return self.in_a_row >= SKIPS_IN_A_ROW

    def __str__(self) -> str:
        return (
            f"GradScaler skipped {self.total} step(s) for a float16 overflow (counted, not "
            "errors: it lowers its scale until the gradients fit)"
        )


def locate(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[str] | None:
    """The report of where the first NaN or inf of this batch's forward and backward was
    born, or ``None`` when a replay made none (or could not run)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    try:
        origins = find_loss_origins(
            lambda: loss_of(model, inputs, labels), [("", model)], parameters
        )
    except Exception:  # the replay is a help: without it the stop still says what it saw
        return None
    return origin_lines(origins) if origins.origin is not None else None


@dataclass(frozen=True)
class RankRecord:
    """One process's part of a non-finite step: its batch, its loss, its generators'
    states at the step's start (as a checkpoint holds them), its epoch loss so far, and
    where its first NaN or inf was born (``None`` when its replay made none)."""

    rank: int
    indices: list[int]
    loss: float
    origin: list[str] | None
    rng: dict[str, Any] = dataclasses.field(repr=False)
    running: dict[str, Any] = dataclasses.field(repr=False)


@dataclass(frozen=True)
class StepRecord:
    """``step.json``: the step (the position before it: epochs done, steps done in the
    epoch, steps done in the run) and what each process saw."""

    epoch: int
    step: int
    global_step: int
    precision: str
    gradients: bool  # the averaged gradients were not finite
    ranks: list[RankRecord]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": BUNDLE_FORMAT,
                "epoch": self.epoch,
                "step": self.step,
                "global_step": self.global_step,
                "precision": self.precision,
                "gradients_not_finite": self.gradients,
                "ranks": [
                    {
                        "rank": r.rank,
                        "loss": repr(r.loss),  # nan and inf are not JSON numbers
                        "origin": r.origin,
                        "indices": r.indices,
                    }
                    for r in self.ranks
                ],
            },
            indent=1,
        )


class NotFiniteStep(Exception):
    """Training stopped before a step whose loss or gradients were not finite; the text
    is the report (several lines), the exit status 1."""

    status = 1


def bundle_folder(run_dir: Path, global_step: int) -> Path:
    """The bundle of the step after ``global_step`` steps: named by that step's number."""
    return run_dir / f"nonfinite-step-{global_step + 1}"


def write_bundle(folder: Path, state: TrainingState, record: StepRecord) -> None:
    """``checkpoint.pt`` (the state before the step, as `_checkpoint.load` reads any) and
    then ``step.json``: each replaced whole, so a bundle is complete or has no record."""
    folder.mkdir(exist_ok=True)
    with AtomicFile(folder / CHECKPOINT, mode=_checkpoint.MODE) as target:
        _checkpoint.write(_checkpoint.entries(state), target)
        target.commit()
    write_atomically(folder / RECORD, record.to_json() + "\n", mode=_checkpoint.MODE)
