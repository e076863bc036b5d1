"""The check's tolerances, from the arithmetic of its finite differences unless given.

A central difference ``(f(x + h) - f(x - h)) / 2h`` computed in a dtype of unit
roundoff ``u`` is off by about ``u · |f| / h`` from rounding (``|f|`` the size of the
outputs, and of what they were computed from) and by ``h² · f''' / 6`` from truncation.
In float64 with ``h = 1e-6`` that is about ``1e-10 · |f|``: a fixed ``atol=1e-5``, as
torch's default, lets a gradient of ``1e-4`` (a model initialised with std 0.02) be
wrong by 10% unseen. Unless the user gives them, ``atol`` is the rounding error of the
outputs at the point (:data:`ROUNDING_ULPS` units of roundoff, divided by the step) and
``rtol`` :data:`RELATIVE_FLOOR`; an element the plain central difference flags is
rechecked with half the step (:mod:`.diagnosis`), and the difference between the two
estimates, which bounds their truncation and rounding errors, is allowed on top: only
an element wrong beyond what its own finite differences can resolve fails.

The sensitivity that leaves is reported per tensor (:class:`.results.Sensitivity`):
the smallest relative error of its gradient the check catches, ``rtol + atol / |g|``
for its largest gradient element ``|g|``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .results import Sensitivity, TensorSensitivity, Tolerances

__all__ = [
    "CONFIRMATION_MARGIN",
    "FLOAT32_RTOL",
    "FLOAT32_STEP",
    "RELATIVE_FLOOR",
    "ROUNDING_ULPS",
    "SETTLED_FRACTION",
    "Requested",
    "beyond_own_error",
    "output_scale",
    "sensitivity",
    "times_allowed",
    "tolerances",
]

# Units of roundoff of the outputs' size allowed for the rounding error of a finite
# difference: the outputs carry the rounding of every op that made them, and of the
# larger values they were computed from (a sum that cancels, a normalization); 1000
# covers outputs computed from values 100x their size through dozens of ops, and still
# resolves 0.1% of a gradient 4,500 times smaller than the outputs (float64, eps=1e-6).
ROUNDING_ULPS = 1000.0
# The relative tolerance when none is given: well above the relative error of a float64
# backward (1e-13 and less for smooth ops; torch's special functions are accurate to
# 1e-12) and of the truncation at eps=1e-6 for inputs varying on scales above 1e-4,
# and ten times below the 0.1% error it must catch.
RELATIVE_FLOOR = 1e-4
# Where an op ran in float32 (no float64 kernel and no float64 equivalent): the step of
# a float32 gradient check, whose rounding (1e-7 of the outputs, divided by the step)
# and truncation (the step squared) both stay near 1e-4 of the gradient, and a relative
# tolerance ten times that.
FLOAT32_STEP = 1e-3
FLOAT32_RTOL = 1e-2
# An element (or direction) the plain central difference flags is estimated again with
# half the step; this many times the two estimates' difference is allowed on top of the
# tolerances. For a smooth function the difference is 3/4 of the first estimate's
# truncation error and the extrapolation (4·D(h/2) - D(h)) / 3 has almost none; a
# margin of 2 also covers rounding noise twice the size in the half-step estimate.
CONFIRMATION_MARGIN = 2.0
# The two estimates must agree to this fraction for their difference to count as their
# error: a smooth function's truncation error is far smaller; finite differences that
# cross a branch, a kink or a jump differ by the size of the derivative or more, and are
# left to the diagnosis to say what they are.
SETTLED_FRACTION = 0.1
# In float32 only the ops without a float64 kernel round to it: a few units of roundoff.
_FLOAT32_ULPS = 64.0


@dataclass(frozen=True)
class Requested:
    """The step and tolerances as the user gave them: ``None`` for "from the arithmetic"."""

    eps: float
    atol: float | None
    rtol: float | None


def tolerances(requested: Requested, output_scale: float, *, float32: bool) -> Tolerances:
    """The tolerances for outputs of size up to ``output_scale`` (their largest magnitude),
    in float64 or, where an op ran in float32, in float32."""
    dtype = torch.float32 if float32 else torch.float64
    eps = max(requested.eps, FLOAT32_STEP) if float32 else requested.eps
    ulps = _FLOAT32_ULPS if float32 else ROUNDING_ULPS
    rounding = ulps * torch.finfo(dtype).eps * output_scale / eps
    floor = FLOAT32_RTOL if float32 else RELATIVE_FLOOR
    return Tolerances(
        eps=eps,
        atol=rounding if requested.atol is None else requested.atol,
        rtol=floor if requested.rtol is None else requested.rtol,
        dtype=str(dtype).removeprefix("torch."),
        atol_given=requested.atol is not None,
        rtol_given=requested.rtol is not None,
        output_scale=output_scale,
    )


def beyond_own_error(
    analytical: torch.Tensor,
    numerical: torch.Tensor,
    half: torch.Tensor,
    tolerances: Tolerances,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many times ``analytical`` differs from the central differences with the step
    (``numerical``) and half of it (``half``) beyond what they resolve, and that allowance.

    The difference of the two estimates bounds their error and is allowed on top of the
    tolerances (times :data:`CONFIRMATION_MARGIN`), and the analytical value may match
    either estimate or their extrapolation ``(4·half - numerical) / 3``; where the two
    estimates are not settled (they differ by more than :data:`SETTLED_FRACTION`), no
    error is allowed for them: the comparison is the plain one.
    """
    error = (numerical - half).abs()
    settled = error <= SETTLED_FRACTION * half.abs() + tolerances.atol
    extrapolated = (4 * half - numerical) / 3
    off = torch.minimum((analytical - numerical).abs(), (analytical - extrapolated).abs())
    allowed = tolerances.atol + tolerances.rtol * numerical.abs()
    resolved = torch.where(
        settled,
        tolerances.atol + tolerances.rtol * extrapolated.abs() + CONFIRMATION_MARGIN * error,
        allowed,
    )
    off = torch.where(settled, off, (analytical - numerical).abs())
    return times_allowed(off, resolved), resolved


def times_allowed(difference: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``difference / allowed``, 0 where both are 0 (outputs that are 0 at the point and
    leave ``atol`` at 0, an element whose derivatives are both exactly 0)."""
    return torch.where(difference == 0, 0.0, difference / allowed)


def output_scale(outputs: Sequence[torch.Tensor]) -> float:
    """The largest magnitude among the outputs (0 when they are empty)."""
    scales = [float(o.detach().abs().max()) for o in outputs if o.numel()]
    finite = [s for s in scales if s == s and s != float("inf")]
    return max(finite, default=0.0)


def sensitivity(
    tolerances: Tolerances,
    names: Sequence[str],
    caught: Sequence[tuple[float, float]],
    settled: int = 0,
) -> Sensitivity:
    """Per tensor (``names``), ``(gradient scale, smallest relative error caught)``;
    ``settled`` elements (or directions) agreed only once their own error was allowed."""
    return Sensitivity(
        tolerances=tolerances,
        tensors=tuple(
            TensorSensitivity(name, scale, relative)
            for name, (scale, relative) in zip(names, caught, strict=True)
        ),
        settled=settled,
    )
