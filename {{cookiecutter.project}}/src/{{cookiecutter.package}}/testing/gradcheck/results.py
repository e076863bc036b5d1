"""What the gradient check reports: its failures, each with the tensor, element and
numbers as fields, and the result of a passing check, whose ``str()`` is its report line.

The bottom of the package: it imports nothing of it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..branches import BranchSide
from ..control_flow import Decision, Location
from ..failures import CheckFailure

__all__ = [
    "BranchBoundary",
    "ErrorSource",
    "GradcheckFailure",
    "GradcheckResult",
    "NonDifferentiablePoint",
    "OutputJump",
    "RefusedProbe",
    "Sensitivity",
    "SourceKind",
    "TensorSensitivity",
    "Tolerances",
    "WrongGradient",
    "mode_text",
    "percent",
    "relative_error",
]


class GradcheckFailure(CheckFailure):
    """The gradient check failed; the message says which element and why."""

    check = "gradcheck"


class SourceKind(enum.Enum):
    """The kind of place where a wrong gradient enters."""

    FUNCTION = "custom autograd Function"
    MODULE = "submodule"
    HOOK = "gradient hook"


@dataclass(frozen=True)
class ErrorSource:
    """Where a wrong gradient enters: the smallest part found wrong on its own.

    ``name`` is the Function's class, the module's name and class, or the hook;
    ``location`` the line of the Function's ``backward`` (of the hook); ``applied_at``
    the user's line that applied the Function and ``module`` the module it ran in;
    ``tensor``, ``index``, ``numerical`` and ``analytical`` the part's own wrong element
    (its input, named as its forward names it).
    """

    kind: SourceKind
    name: str
    location: Location
    applied_at: Location | None = None
    module: str = ""
    tensor: str = ""
    index: tuple[int, ...] = ()
    numerical: float = 0.0
    analytical: float = 0.0

    def __str__(self) -> str:
        if self.kind is SourceKind.FUNCTION:
            applied = f", applied at {self.applied_at}" if self.applied_at else ""
            where = f" in {self.module}" if self.module else ""
            backward = f"its backward at {self.location}"
            return f"the {self.kind.value} {self.name} ({backward}){applied}{where}"
        if self.kind is SourceKind.HOOK:
            return f"the {self.kind.value} {self.name} of {self.tensor}"
        return f"the {self.kind.value} {self.name}" if self.module else self.name


class WrongGradient(GradcheckFailure):
    """Autograd's gradient differs from the finite differences at ``tensor[index]``.

    ``source`` says where the error enters when the check narrowed it down to a
    custom autograd Function, a submodule or a gradient hook (``None`` otherwise);
    ``allowed`` is the difference the check allowed there, and :attr:`beyond` how many
    times it is exceeded.
    """

    def __init__(
        self,
        message: str,
        *,
        tensor: str,
        index: tuple[int, ...],
        order: int,
        numerical: float,
        analytical: float,
        allowed: float = 0.0,
        source: ErrorSource | None = None,
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.order = tensor, index, order
        self.numerical, self.analytical, self.allowed = numerical, analytical, allowed
        self.source = source
        self.output = "output"  # the output element it was compared on

    @property
    def relative_error(self) -> float:
        """``|analytical - numerical| / |numerical|`` (``inf`` where the derivative is 0)."""
        return relative_error(self.numerical, self.analytical)

    @property
    def beyond(self) -> float:
        """How many times the difference exceeds what the check allowed there."""
        difference = abs(self.analytical - self.numerical)
        return difference / self.allowed if self.allowed else float("inf")


class RefusedProbe(GradcheckFailure):
    """The model raised at every finite-difference input near the point, down to the
    smallest step: the gradient cannot be checked there (not a wrong gradient)."""

    def __init__(self, message: str, *, tensor: str, error: BaseException) -> None:
        super().__init__(message)
        self.tensor, self.error = tensor, error


class BranchBoundary(GradcheckFailure):
    """The point is within eps of a data-dependent decision: the gradient is not checkable there."""

    def __init__(
        self, message: str, *, tensor: str, index: tuple[int, ...], decision: Decision | None
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.decision = tensor, index, decision


class NonDifferentiablePoint(GradcheckFailure):
    """One-sided differences disagree at ``tensor[index]``: the function has a kink there."""

    def __init__(
        self, message: str, *, tensor: str, index: tuple[int, ...], left: float, right: float
    ) -> None:
        super().__init__(message)
        self.tensor, self.index, self.left, self.right = tensor, index, left, right


class OutputJump(NonDifferentiablePoint):
    """The outputs jump at ``tensor[index]`` (by ``change`` over one step): a discontinuity."""

    def __init__(
        self,
        message: str,
        *,
        tensor: str,
        index: tuple[int, ...],
        left: float,
        right: float,
        change: float,
    ) -> None:
        super().__init__(message, tensor=tensor, index=index, left=left, right=right)
        self.change = change


@dataclass(frozen=True)
class Tolerances:
    """The step and tolerances a check ran with, and where ``atol`` and ``rtol`` came from:
    given by the user, or from the arithmetic (``atol`` the rounding error of finite
    differences of outputs up to ``output_scale`` in ``dtype``, see :mod:`.tolerances`)."""

    eps: float
    atol: float
    rtol: float
    dtype: str = "float64"
    atol_given: bool = True
    rtol_given: bool = True
    output_scale: float = 0.0

    def caught(self, gradient_scale: float) -> float:
        """The smallest relative error caught in a gradient whose largest element is this."""
        if gradient_scale <= 0.0:
            return float("inf")
        return self.rtol + self.atol / gradient_scale

    def __str__(self) -> str:
        if self.atol_given:
            atol = f"atol={self.atol:.2g}"
        else:
            atol = (
                f"atol={self.atol:.2g} from the rounding of outputs up to {self.output_scale:.2g}"
            )
        rtol = f"rtol={self.rtol:g}"
        return f"{self.dtype}, eps={self.eps:g}, {atol}, {rtol}"


@dataclass(frozen=True)
class TensorSensitivity:
    """The smallest relative error of ``tensor``'s gradient the check catches (``relative``,
    ``inf`` where the gradient is 0), for its largest gradient element ``gradient_scale``."""

    tensor: str
    gradient_scale: float
    relative: float


# Tensors whose sensitivity is within this factor of the best are summarised together
# (by the worst of them); the others are named, with their gradient's size.
_SENSITIVITY_SPREAD = 10.0


@dataclass(frozen=True)
class Sensitivity:
    """What a check could have missed: per checked tensor, the smallest relative error of
    its gradient it catches, with the tolerances that leave it."""

    tolerances: Tolerances
    tensors: tuple[TensorSensitivity, ...] = ()
    # Elements (fast mode: directions) whose plain central difference disagreed and that
    # agreed once estimated with half the step too, their own error allowed.
    settled: int = 0

    @property
    def worst(self) -> TensorSensitivity | None:
        """The tensor with the largest error the check could miss."""
        return max(self.tensors, key=lambda t: t.relative, default=None)

    def __str__(self) -> str:
        tensors = [t for t in self.tensors if t.relative != float("inf")]
        zero = [t.tensor for t in self.tensors if t.relative == float("inf")]
        parts = []
        if tensors:
            best = min(t.relative for t in tensors)
            close = [t for t in tensors if t.relative <= _SENSITIVITY_SPREAD * best]
            far = sorted((t for t in tensors if t not in close), key=lambda t: -t.relative)
            where = (
                "every tensor"
                if len(close) == len(self.tensors)
                else f"{len(close)} of {len(self.tensors)} tensors"
            )
            worst = max(t.relative for t in close)
            parts.append(f"a relative error of {percent(worst)} caught in {where}")
            parts += [
                f"{percent(t.relative)} in {t.tensor} (gradient up to {t.gradient_scale:.2g})"
                for t in far[:3]
            ]
            if len(far) > 3:
                parts.append(f"{len(far) - 3} more tensors less")
        text = ", ".join(parts)
        if zero:
            names = ", ".join(zero[:3]) + (f" and {len(zero) - 3} more" if len(zero) > 3 else "")
            text += f"{'; ' if text else ''}gradient 0 at the point in {names}: an error above "
            text += "atol caught there"
        if self.settled:
            text += (
                f"; {self.settled} element(s) agreed only with half the step as well, their "
                f"finite differences' own error allowed (a function that curves within the step)"
            )
        return f"sensitivity: {text} ({self.tolerances})"


def relative_error(numerical: float, analytical: float) -> float:
    """``|analytical - numerical| / |numerical|`` (``inf`` where the derivative is 0)."""
    difference = abs(analytical - numerical)
    return difference / abs(numerical) if numerical else float("inf")


def percent(relative: float) -> str:
    """A relative error as a percentage: ``0.01%``, ``1.2%``."""
    return f"{100 * relative:.2g}%"


@dataclass(frozen=True)
class GradcheckResult:
    """What a passing check covered: ``str()`` of it is the line ``pytest -v`` shows."""

    function: str
    tensors: tuple[tuple[str, int], ...]
    orders: tuple[int, ...]
    fast: bool
    mode_reason: str
    moved: int
    seconds: float
    widened: tuple[str, ...] = ()
    branches: tuple[BranchSide, ...] = ()  # with branches="all": each decision's other side
    # Ops without a float64 kernel computed in float64 through an equivalent.
    substituted: tuple[str, ...] = ()
    # Ops without a float64 kernel, run in float32.
    narrowed: tuple[str, ...] = ()
    tolerances: tuple[float, float, float] = (1e-6, 1e-5, 1e-3)  # eps, atol, rtol
    # The smallest relative error of each tensor's gradient the first-order check catches.
    sensitivity: Sensitivity | None = None
    # Inputs the model raised at, and the smaller step checked with instead.
    refused: tuple[str, ...] = ()
    # Buffers the forward changes: restored before each evaluation, their writes held.
    held_buffers: tuple[str, ...] = ()

    @property
    def elements(self) -> int:
        return sum(numel for _, numel in self.tensors)

    def __str__(self) -> str:
        order = " and ".join(("first", "second")[o - 1] for o in self.orders)
        moved = f", at a point moved {self.moved}x off a boundary" if self.moved else ""
        return (
            f"gradcheck {self.function}: {order} order passed in {self.seconds:.2f} s, "
            f"{mode_text(self.fast, self.mode_reason)}, {len(self.tensors)} tensor(s) "
            f"({', '.join(name for name, _ in self.tensors)}){moved}{_widened_text(self.widened)}"
            f"{_substituted_text(self.substituted)}"
            f"{_narrowed_text(self.narrowed)}{_refused_text(self.refused)}"
            f"{_held_text(self.held_buffers)}{_branches_text(self.branches)}"
            f"{'; ' + str(self.sensitivity) if self.sensitivity else ''}"
        )


def _branches_text(branches: Sequence[BranchSide]) -> str:
    if not branches:
        return ""
    return "; branches: " + "; ".join(str(side) for side in branches)


def _narrowed_text(narrowed: Sequence[str]) -> str:
    if not narrowed:
        return ""
    return f"; computed in float32 where no float64 kernel exists: {', '.join(narrowed)}"


def _substituted_text(substituted: Sequence[str]) -> str:
    if not substituted:
        return ""
    return (
        "; computed in float64 through an equivalent where no float64 kernel exists: "
        + ", ".join(substituted)
    )


def _refused_text(refused: Sequence[str]) -> str:
    return "; " + "; ".join(refused) if refused else ""


def _held_text(held: Sequence[str]) -> str:
    if not held:
        return ""
    return (
        f"; buffers the forward changes ({', '.join(held)}): restored before each evaluation, "
        f"and what the forward writes into them outside autograd held at its value at the point"
    )


def _widened_text(widened: Sequence[str]) -> str:
    if not widened:
        return ""
    return f"; computed in float64 where the forward asks for less: {', '.join(widened)}"


def mode_text(fast: bool, reason: str) -> str:
    """How the check ran, as its report and its failures say it."""
    if fast:
        return (
            f"fast mode ({reason}: one random direction per tensor, screened for single wrong "
            "elements; fast=False checks every element)"
        )
    return f"slow mode ({reason}: every element)"
