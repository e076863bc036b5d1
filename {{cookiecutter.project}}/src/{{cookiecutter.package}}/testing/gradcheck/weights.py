"""The check's random weights: of the outputs (one scalar to differentiate) and of the
checked tensors (directions to step along), shared by screening and diagnosis."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["EVALUATION_SEED", "random_direction", "random_weights", "weighted_sum"]

# The seed of the check's own random numbers (output weights, directions, moved points).
# Each evaluation of the function starts from the generator states the check started
# with, so dropout drops the same units in every evaluation.
EVALUATION_SEED = 1234


def random_weights(like: torch.Tensor, generator: torch.Generator, *, normalized: bool = True):
    """Random weights between 0.5 and 1.5 shaped like ``like``; summing to 1 if ``normalized``.

    Directions and output projections sum to 1, so that torch's tolerance ``atol`` means
    the same for a weighted sum as for one element. The output weights of a second-order
    check stand for a loss's gradient and are not scaled down, like ``gradgradcheck``'s.
    """
    weights = torch.rand(like.shape, generator=generator, dtype=torch.float64) + 0.5
    return (weights / weights.sum() if normalized else weights).to(like.device)


def weighted_sum(weights: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor]):
    """``Σ (w · output).sum()`` over the outputs that have weights (0 when none has)."""
    return sum((w * o).sum() for w, o in zip(weights, outputs, strict=True) if w is not None)


def random_direction(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A unit vector shaped like ``like``: random signs, random magnitudes in [1, 2).

    No element is much smaller than another (a wrong element shows undiluted by the
    others), and no two are equal (two swapped elements of the gradient do not cancel).
    """
    signs = torch.randint(0, 2, like.shape, generator=generator, dtype=torch.float64) * 2 - 1
    weights = signs * (1 + torch.rand(like.shape, generator=generator, dtype=torch.float64))
    return (weights / weights.norm().clamp_min(1e-300)).to(like.device)
