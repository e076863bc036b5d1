"""Diagnosis of a failed check: which element is wrong and why, found element by element.

A wrong gradient (numerical and analytical values, the output element, the other
tensors wrong too), a branch boundary (the finite differences took another branch
of a data-dependent decision than the point), a kink (one-sided differences disagree)
or a jump. It takes from the failed check only its :class:`Settings`.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..control_flow import (
    UNKNOWN_LOCATION,
    Decision,
    DecisionLog,
    first_divergence,
    record_decisions,
)
from ..naming import element_name
from .problem import JITTER_SCALE, Checked, Problem, unravel
from .results import (
    BranchBoundary,
    GradcheckFailure,
    NonDifferentiablePoint,
    OutputJump,
    Tolerances,
    WrongGradient,
    mode_text,
    percent,
    relative_error,
)
from .tolerances import beyond_own_error, times_allowed
from .weights import EVALUATION_SEED, random_direction, random_weights

__all__ = ["ELEMENTWISE_LIMIT", "OUTPUT_ELEMENTS_LIMIT", "Diagnosis", "Settings"]

# A failing tensor up to this size is rechecked element by element; a larger one is
# first narrowed down by bisection over random directions.
ELEMENTWISE_LIMIT = 1024
# The diagnosis compares each output element separately up to this many output
# elements (one backward pass each); above, one random weighting of the outputs.
OUTPUT_ELEMENTS_LIMIT = 1024
_BISECTION_BLOCK = 16
# One-sided differences that disagree by a gap which halves with the step are a smooth
# function's curvature (the gap is the step times the second derivative); at a kink it
# stays. Within this fraction of halving, it is curvature.
_CURVATURE_SPREAD = 0.1
_ANALYTICAL_ENTRIES_LIMIT = 1 << 23


@dataclass(frozen=True)
class Settings:
    """What a diagnosis takes from the check that failed: its step and tolerances (and
    whether they come from the arithmetic: then an element is wrong only beyond its own
    finite differences' error, see :mod:`.tolerances`), its mode (and the reason its
    report gives for it), whether it checks a part of the model on its own, and the
    evaluation count (``Problem.evaluations``) at which it stops."""

    tolerances: Tolerances
    fast: bool
    reason: str
    part: bool
    budget: int


_MISMATCH = re.compile(r"output (\d+) with respect to input (\d+)")
_CONTINUOUS = type("Continuous", (), {"__repr__": lambda self: "<number>"})()


def _is_discrete(value: Any) -> bool:
    if isinstance(value, (bool, int)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_discrete(item) for item in value)
    return False


def _branch_divergence(a: DecisionLog, b: DecisionLog):
    """Where two runs took different branches: ``(decision at the point, other)`` or None.

    Decisions that returned a float (``.item()`` of a float tensor) change with every
    perturbation; they count only by where they were made, not by their value.
    """

    def branches(log: DecisionLog) -> list[Decision]:
        return [
            d if _is_discrete(d.value) else Decision(d.index, d.op, _CONTINUOUS, d.location)
            for d in log
        ]

    found = first_divergence(branches(a), branches(b))
    if found is None:
        return None
    k = found[0]
    return (a[k - 1] if k <= len(a) else None, b[k - 1] if k <= len(b) else None, k)


def _short_value(decision: Decision | None) -> str:
    return "no decision" if decision is None else repr(decision.value)[:40]


def _moved_numbers(a: DecisionLog, b: DecisionLog) -> list[tuple[Decision, Decision]]:
    return [
        (x, y)
        for x, y in zip(a, b, strict=False)
        if not _is_discrete(x.value) and x.op == y.op and repr(x.value) != repr(y.value)
    ]


def _relative_text(numerical: float, analytical: float) -> str:
    if numerical == 0.0:
        return "the derivative is 0"
    return f"a relative error of {percent(relative_error(numerical, analytical))}"


class _FindingKind(enum.Enum):
    """What the finite differences of one element show."""

    WRONG = "wrong"  # a wrong gradient
    BOUNDARY = "boundary"  # the steps cross a branch boundary
    KINK = "kink"  # one-sided differences disagree
    JUMP = "jump"  # the outputs jump: a discontinuity


@dataclass
class _Finding:
    kind: _FindingKind
    checked: Checked
    element: int
    row: int
    numerical: float
    analytical: float
    allowed: float
    severity: float
    divergence: tuple | None = None
    side: str = ""
    moved_log: DecisionLog | Sequence[Decision] = ()
    one_sided: tuple[float, float] = (0.0, 0.0)
    moved: list = field(default_factory=list)
    jump: float = 0.0  # for a jump: how much the output changed over one step


class Diagnosis:
    """Finds, element by element, where and why a failed check's Jacobians disagree."""

    def __init__(
        self,
        problem: Problem,
        settings: Settings,
        order: int,
        torch_message: str,
        suspects: Sequence[int] = (),
    ) -> None:
        self.problem, self.settings, self.order = problem, settings, order
        self.torch_message = torch_message
        # Fast mode's screen names the tensors whose directional derivatives disagree:
        # only those are searched (each by bisection), and only those can be "also wrong".
        self.suspects = list(suspects)
        tolerances = settings.tolerances
        self.eps, self.atol, self.rtol = tolerances.eps, tolerances.atol, tolerances.rtol
        self.from_arithmetic = not tolerances.atol_given
        self.generator = torch.Generator().manual_seed(EVALUATION_SEED + 1)
        self.budget = settings.budget
        self.searched: set[int] = set()  # tensors whose every element was examined
        self.settled = 0  # elements that agree once their own finite-difference error is allowed
        self.point = [c.value for c in self.problem.checked]
        self.weights: list[torch.Tensor] = []
        values = [v.detach().requires_grad_() for v in self.point]
        with record_decisions() as self.base_log:
            outputs = self._target(values, graph=True)
        # Like torch: first order compares only the outputs autograd connects to the inputs.
        self.included = [o.requires_grad or order == 2 for o in outputs]
        self.names = self._output_names()
        flat = self._flat(outputs)
        self.base = flat.detach()
        self.rows = self._rows(flat.numel())
        self.analytical = self._analytical(flat, values)

    # the function whose Jacobian is diagnosed: the outputs, or (second order) the gradients
    def _target(self, values: list[torch.Tensor], graph: bool) -> tuple[torch.Tensor, ...]:
        # graph=True at the point; a finite-difference input otherwise.
        outputs = (self.problem.evaluate if graph else self.problem.probe)(values)
        if self.order == 1:
            return outputs
        if not self.weights:
            self.weights = [random_weights(o, self.generator, normalized=False) for o in outputs]
        total = sum(
            (w * o).sum() for w, o in zip(self.weights, outputs, strict=True) if o.requires_grad
        )
        if not isinstance(total, torch.Tensor) or not total.requires_grad:
            return tuple(torch.zeros_like(v) for v in values)
        grads = torch.autograd.grad(total, values, create_graph=graph, allow_unused=True)
        return tuple(
            torch.zeros_like(v) if g is None else g for g, v in zip(grads, values, strict=True)
        )

    def _output_names(self) -> list[str]:
        if self.order == 1:
            return list(self.problem.output_names or [])
        return [f"(gradient of {c.name}" for c in self.problem.checked]

    def _flat(self, outputs) -> torch.Tensor:
        parts = [
            o.reshape(-1).to(torch.float64)
            for o, keep in zip(outputs, self.included, strict=True)
            if keep
        ]
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=outputs[0].device)
        return torch.cat(parts)

    def _rows(self, size: int) -> torch.Tensor | None:
        """``None``: compare every output element; else one random weighting of them."""
        entries = size * sum(c.numel for c in self.problem.checked)
        if size <= OUTPUT_ELEMENTS_LIMIT and entries <= _ANALYTICAL_ENTRIES_LIMIT:
            return None
        # Weights of mean 1, not summing to 1: each element counts as much as in a sum.
        return random_weights(self.base, self.generator, normalized=False).reshape(1, -1)

    def _analytical(self, flat: torch.Tensor, values) -> list[torch.Tensor]:
        """Per checked tensor, the rows of the analytical Jacobian: (rows, elements)."""
        count = flat.numel() if self.rows is None else 1
        result = [
            torch.zeros(count, c.numel, dtype=torch.float64, device=c.value.device)
            for c in self.problem.checked
        ]
        if not flat.requires_grad:
            return result
        for row in range(count):
            target = flat[row] if self.rows is None else (flat * self.rows[0]).sum()
            grads = torch.autograd.grad(target, values, retain_graph=True, allow_unused=True)
            for tensor, grad in zip(result, grads, strict=True):
                if grad is not None:
                    tensor[row] = grad.reshape(-1)
        return result

    def _project(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.rows is None else self.rows @ flat

    def _evaluate(self, index: int, step: torch.Tensor) -> tuple[torch.Tensor, DecisionLog]:
        values = [v.detach().requires_grad_(self.order == 2) for v in self.point]
        values[index] = (self.point[index] + step).requires_grad_(self.order == 2)
        with record_decisions() as log:
            outputs = self._target(values, graph=False)
        return self._flat(outputs).detach(), log

    def failure(self) -> GradcheckFailure | None:
        """The failure, or ``None`` where the tolerances come from the arithmetic and every
        element agrees once its finite differences' own error is allowed."""
        if not any(self.included):
            return GradcheckFailure(self._detached())
        hint = _MISMATCH.search(self.torch_message)
        first = int(hint.group(2)) if hint else 0
        count = len(self.problem.checked)
        order = [first] + [i for i in range(count) if i != first] if first < count else range(count)
        if self.suspects:
            order = self.suspects
        explained: list[_Finding] = []
        for index in order:
            if explained and self.over_budget:
                break  # the point is on a boundary or kink: enough to say so
            findings = self._examine(index)
            wrong = [f for f in findings if f.kind is _FindingKind.WRONG]
            if wrong:
                also = self._also_wrong([i for i in order if i != index])
                return self._wrong(wrong, findings, index, also)
            explained.extend(findings)
        boundaries = [f for f in explained if f.kind is _FindingKind.BOUNDARY]
        if boundaries:
            return self._boundary(boundaries, explained)
        if explained:
            return self._kink(explained)
        if self.from_arithmetic and self.searched.issuperset(order):
            return None  # every element agrees within its finite differences' own error
        return GradcheckFailure(self._unexplained())

    def _also_wrong(self, indices: list[int]) -> list[str]:
        """``name (k of n elements)`` of the other tensors with wrong elements, within budget.

        In a mixture of experts a bug in one expert shows in the input's gradient first;
        the expert's own parameters are what the message must name. A part checked on
        its own needs one wrong element only.
        """
        if self.settings.part:
            return []
        found = []
        for index in indices:
            if self.over_budget:
                break
            wrong = [f for f in self._examine(index) if f.kind is _FindingKind.WRONG]
            if wrong:
                checked = self.problem.checked[index]
                counted = index in self.searched
                found.append(
                    f"{checked.name} ({len(wrong)} of {checked.numel} elements)"
                    if counted
                    else checked.element(wrong[0].element)
                )
        return found

    def wrong_in(self, indices: Iterable[int]) -> WrongGradient | None:
        """The wrong gradient of the first of these tensors that has one, else ``None``."""
        indices = list(indices)
        for position, index in enumerate(indices):
            findings = self._examine(index)
            wrong = [f for f in findings if f.kind is _FindingKind.WRONG]
            if wrong:
                also = self._also_wrong(indices[position + 1 :])
                return self._wrong(wrong, findings, index, also)
        return None

    @property
    def over_budget(self) -> bool:
        return self.problem.evaluations >= self.budget

    def _examine(self, index: int) -> list[_Finding]:
        checked = self.problem.checked[index]
        elements: Iterable[int] = range(checked.numel)
        # Slow mode examined every element already: its diagnosis may too. Fast mode's
        # cost is a few evaluations, so its diagnosis bisects down to a small block.
        limit = _BISECTION_BLOCK if self.settings.fast else ELEMENTWISE_LIMIT
        if checked.numel > limit:
            elements = self._bisect(index)
        else:
            self.searched.add(index)
        findings = []
        for element in elements:
            finding = self._element(index, int(element))
            if finding is not None:
                findings.append(finding)
        return findings

    def _bisect(self, index: int) -> torch.Tensor:
        """Narrow a large tensor down to a block where the directional derivatives disagree most."""
        checked = self.problem.checked[index]
        candidates = torch.arange(checked.numel)
        analytical = self.analytical[index]
        while candidates.numel() > _BISECTION_BLOCK:
            halves = candidates.chunk(2)
            scores = []
            for half in halves:
                # A wrong element shows undiluted by the others (see random_direction).
                direction = torch.zeros(checked.numel, dtype=torch.float64)
                direction[half] = random_direction(half, self.generator).cpu()
                direction = direction.to(checked.value.device)
                step = (self.eps * direction).reshape(checked.value.shape)
                plus, _ = self._evaluate(index, step)
                minus, _ = self._evaluate(index, -step)
                numerical = self._project(plus - minus) / (2 * self.eps)
                scores.append(float((analytical @ direction - numerical).abs().max()))
            candidates = halves[0] if scores[0] >= scores[1] else halves[1]
        return candidates

    def _element(self, index: int, element: int) -> _Finding | None:
        checked = self.problem.checked[index]
        step = torch.zeros(checked.numel, dtype=torch.float64, device=checked.value.device)
        step[element] = self.eps
        step = step.reshape(checked.value.shape)
        plus, plus_log = self._evaluate(index, step)
        minus, minus_log = self._evaluate(index, -step)
        difference = plus - minus
        numerical = self._project(difference) / (2 * self.eps)
        analytical = self.analytical[index][:, element]
        if self.rows is None:
            allowed = self.atol + self.rtol * numerical.abs()
        else:
            allowed = self.atol + self.rtol * (self.rows.abs() @ difference.abs()) / (2 * self.eps)
        ratio = times_allowed((analytical - numerical).abs(), allowed)
        row = int(ratio.argmax()) if ratio.numel() else 0
        if not ratio.numel() or float(ratio[row]) <= 1.0:
            return None
        finding = _Finding(
            _FindingKind.WRONG,
            checked,
            element,
            row,
            float(numerical[row]),
            float(analytical[row]),
            float(allowed[row]),
            float(ratio[row]),
        )
        for side, log in (("+", plus_log), ("-", minus_log)):
            divergence = _branch_divergence(self.base_log, log)
            if divergence is not None:
                finding.kind, finding.divergence = _FindingKind.BOUNDARY, divergence
                finding.side, finding.moved_log = side, log
                return finding
        half_plus, _ = self._evaluate(index, step / 2)
        half_minus, _ = self._evaluate(index, -step / 2)
        right = self._project(plus - self.base) / self.eps
        left = self._project(self.base - minus) / self.eps
        gap = (right - left).abs()
        half_gap = (self._project(half_plus + half_minus - 2 * self.base) / (self.eps / 2)).abs()
        curvature = (2 * half_gap - gap).abs() <= _CURVATURE_SPREAD * gap
        kink = (gap > self.atol + self.rtol * torch.maximum(right.abs(), left.abs())) & ~curvature
        if bool(kink.any()):
            kink_row = int((gap * kink).argmax())
            finding.kind, finding.row = _FindingKind.KINK, kink_row
            # A kink's one-sided changes halve with the step; a jump's stay as they are.
            for full, half in (
                (plus - self.base, half_plus - self.base),
                (self.base - minus, self.base - half_minus),
            ):
                full_change = float(self._project(full)[kink_row])
                half_change = float(self._project(half)[kink_row])
                jumped = abs(full_change) > max(
                    self.atol, 10 * self.eps * abs(analytical[kink_row])
                )
                if jumped and abs(half_change) > 0.75 * abs(full_change):
                    finding.kind, finding.jump = _FindingKind.JUMP, full_change
            finding.one_sided = (float(left[kink_row]), float(right[kink_row]))
            finding.numerical = float(numerical[kink_row])
            finding.analytical = float(analytical[kink_row])
            return finding
        if self.from_arithmetic:
            half = self._project(half_plus - half_minus) / self.eps
            beyond, resolved = beyond_own_error(
                analytical, numerical, half, self.settings.tolerances
            )
            if float(beyond.max()) <= 1.0:
                self.settled += 1
                return None  # within the finite differences' own error
            finding.row = int(beyond.argmax())
            finding.numerical = float(numerical[finding.row])
            finding.analytical = float(analytical[finding.row])
            finding.allowed = float(resolved[finding.row])
            finding.severity = float(beyond[finding.row])
        finding.moved = _moved_numbers(self.base_log, plus_log)
        return finding

    # --- messages

    def _output_element(self, row: int) -> str:
        if self.rows is not None:
            what = ("output", "gradient")[self.order - 1]
            return (
                f"(v · {what}s) for random weights v of the {self.base.numel():,} {what} elements"
            )
        outputs = [
            (name, shape)
            for name, shape, keep in zip(
                self.names, self._output_shapes(), self.included, strict=True
            )
            if keep
        ]
        for name, shape in outputs:
            size = math.prod(shape)
            if row < size:
                element = element_name(name, unravel(row, shape))
                return element + ")" if self.order == 2 else element
            row -= size
        return "output"

    def _output_shapes(self) -> list[tuple[int, ...]]:
        if self.order == 2:
            return [tuple(c.value.shape) for c in self.problem.checked]
        values = [v.detach() for v in self.point]
        return [tuple(o.shape) for o in self.problem.evaluate(values)]

    def _footer(self) -> str:
        c = self.settings
        lines = []
        if self.order == 2:
            lines.append(
                "second order: the gradients of (w · outputs) for random weights w, "
                "differentiated again (the first-order check passed)"
            )
        low = [
            f"{name} is {dtype}"
            for name, dtype in zip(
                self.problem.output_names or [], self.problem.output_dtypes, strict=True
            )
            if dtype not in (torch.float64, torch.complex128)
        ]
        if low:
            lines.append(
                f"note: {', '.join(low)}: the forward casts to a lower precision, "
                f"which finite differences with eps={c.eps:g} cannot resolve"
            )
        if self.problem.widened:
            lines.append(
                "computed in float64 where the forward asks for less: "
                + ", ".join(str(w) for w in self.problem.widened.values())
            )
        for ops, how in (
            (self.problem.substituted, "in float64 through an equivalent"),
            (self.problem.narrowed, "in float32"),
        ):
            if ops:
                lines.append(
                    f"computed {how} where no float64 kernel exists: "
                    + ", ".join(str(op) for op in ops.values())
                )
        mode = mode_text(c.fast, c.reason)
        if c.fast:
            mode += "; the failing tensor was then rechecked element by element"
        lines.append(f"checked {self.problem.description} ({c.tolerances}), {mode}")
        return "\n".join(lines)

    def _wrong(
        self, wrong: list[_Finding], findings: list[_Finding], index: int, also: Sequence[str] = ()
    ) -> WrongGradient:
        worst = max(wrong, key=lambda f: f.severity)
        checked = worst.checked
        what = ("first", "second")[self.order - 1]
        lines = [
            f"wrong {what}-order gradient of {self.problem.description} with respect to "
            f"{checked.element(worst.element)}",
            f"  d {self._output_element(worst.row)} / d {checked.element(worst.element)}: "
            f"numerical {worst.numerical:.6g}, analytical {worst.analytical:.6g} (difference "
            f"{abs(worst.numerical - worst.analytical):.3g}, allowed {worst.allowed:.3g}: "
            f"{_relative_text(worst.numerical, worst.analytical)}, {worst.severity:.3g} times "
            f"what the check resolves there)",
        ]
        if index in self.searched:
            lines.append(
                f"  {len(wrong)} of {checked.numel} elements of {checked.name} are wrong"
                + self._pattern(wrong)
            )
        for point, moved in worst.moved[:1]:
            lines.append(
                f"  note: {point.op} at {point.location} (decision #{point.index}) returned "
                f"{point.value!r} at the point and {moved.value!r} with this element moved: "
                f"autograd does not see through Python numbers, so this dependence is missing "
                f"from the analytical gradient"
            )
        others = len(findings) - len(wrong)
        if others:
            lines.append(f"  ({others} other elements sit at a branch boundary or a kink)")
        if also:
            lines.append(f"  also wrong: {', '.join(also)}")
        if checked.hooks:
            lines.append(
                f"  {checked.name} has gradient hook(s) "
                f"{', '.join(h.description for h in checked.hooks)}: the gradient training sees "
                f"goes through them, so they are part of the checked (analytical) gradient; a "
                f"hook that scales or changes the gradient makes it differ from the derivative"
            )
        module_hooks = self.problem.module_hooks()
        if module_hooks:
            lines.append(
                f"  module backward hooks are part of the checked gradient too: "
                f"{', '.join(module_hooks)}"
            )
        lines.append(self._footer())
        failure = WrongGradient(
            "\n".join(lines),
            tensor=checked.name,
            index=checked.index(worst.element),
            order=self.order,
            numerical=worst.numerical,
            analytical=worst.analytical,
            allowed=worst.allowed,
        )
        failure.output = self._output_element(worst.row)
        return failure

    def _pattern(self, wrong: list[_Finding]) -> str:
        numerical = torch.tensor([f.numerical for f in wrong], dtype=torch.float64)
        analytical = torch.tensor([f.analytical for f in wrong], dtype=torch.float64)
        if not bool(analytical.any()):
            return (
                "; the analytical gradient is 0 there: the backward misses this dependence "
                "(a missing term, a .detach() or a Python number in between)"
            )
        if not bool(numerical.any()):
            return ""
        factor = float((analytical * numerical).sum() / (numerical * numerical).sum())
        if bool(
            ((analytical - factor * numerical).abs() <= 1e-3 * numerical.abs() + self.atol).all()
        ):
            if abs(factor + 1) < 1e-3:
                return "; the analytical gradient has the wrong sign in all of them"
            return (
                f"; in all of them the analytical gradient is {factor:.4g} times the numerical one"
            )
        return ""

    def _boundary(self, boundaries: list[_Finding], explained: list[_Finding]) -> BranchBoundary:
        first = boundaries[0]
        at_point, moved, k = first.divergence
        decision = at_point or moved
        where = (
            f"decision #{decision.index} ({decision.location})" if decision else f"decision #{k}"
        )
        element = first.checked.element(first.element)
        ended = f"no decision #{k} (that run made only {k - 1})"
        tensors = sorted({f.checked.name for f in boundaries})
        moved_text = f"{element} {first.side} eps"
        location = decision.location if decision else UNKNOWN_LOCATION
        before = sum(d.location == location for d in self.base_log)
        after = sum(d.location == location for d in first.moved_log)
        if before != after:
            change = "changes how many times a loop runs"
            how = (
                f"  the decision at {location} was made {before} time(s) at the point and "
                f"{after} time(s) with {moved_text}: a loop over the data (a while condition, "
                f"routing to experts, a list built from tensor values) ran a different number of "
                f"times; no if went the other way"
            )
        else:
            change = "sends that decision the other way (an if, a comparison)"
            how = (
                f"  the same decision, with another outcome: {_short_value(at_point)} at the point"
            )
            how += f", {_short_value(moved)} with {moved_text}"
        lines = [
            f"cannot check the gradient of {self.problem.description} here: the point is within "
            f"eps of a branch boundary at {where}: moving {element} by {first.side}eps {change}",
            f"  at the point: {at_point or ended}",
            f"  with {moved_text} ({self.eps:g}): {moved or ended}",
            how,
            "  the finite differences compare two different branches, so they say nothing about "
            "the gradient: this is not a wrong gradient",
            f"  {len(boundaries)} examined elements cross a boundary (in {', '.join(tensors)})",
            "  move the point off the boundary: pass avoid_boundaries=True (retries at points "
            f"moved by {JITTER_SCALE:g} of each tensor's size), or check at other inputs",
            self._footer(),
        ]
        return BranchBoundary(
            "\n".join(lines),
            tensor=first.checked.name,
            index=first.checked.index(first.element),
            decision=decision,
        )

    def _kink(self, kinks: list[_Finding]) -> NonDifferentiablePoint:
        jumps = [f for f in kinks if f.kind is _FindingKind.JUMP]
        first = (jumps or kinks)[0]
        left, right = first.one_sided
        element = first.checked.element(first.element)
        lines = self._jump_lines(jumps, element) if jumps else self._kink_lines(kinks, element)
        lines.append(self._footer())
        found = dict(tensor=first.checked.name, index=first.checked.index(first.element))
        if jumps:
            return OutputJump("\n".join(lines), **found, left=left, right=right, change=first.jump)
        return NonDifferentiablePoint("\n".join(lines), **found, left=left, right=right)

    def _kink_lines(self, kinks: list[_Finding], element: str) -> list[str]:
        first = kinks[0]
        left, right = first.one_sided
        matches = (
            "the left-hand derivative"
            if abs(first.analytical - left) <= first.allowed
            else "the right-hand derivative"
            if abs(first.analytical - right) <= first.allowed
            else "neither one-sided derivative"
        )
        return [
            f"cannot check the gradient of {self.problem.description} at {element}: the function "
            f"is not differentiable there (one-sided differences disagree: a kink, such as relu, "
            f"abs, max or clamp exactly where it switches)",
            f"  d {self._output_element(first.row)} / d {element}: from the left {left:.6g}, "
            f"from the right {right:.6g}, central {first.numerical:.6g}; analytical "
            f"{first.analytical:.6g} ({matches})",
            f"  {len(kinks)} examined elements are at a kink; this is not a wrong gradient",
            "  move the point: pass avoid_boundaries=True, or check at inputs away from the kink",
        ]

    def _jump_lines(self, jumps: list[_Finding], element: str) -> list[str]:
        first = jumps[0]
        left, right = first.one_sided
        return [
            f"cannot check the gradient of {self.problem.description} at {element}: the outputs "
            f"jump there (a discontinuity, such as argmax or top-k routing at a tie, a "
            f"comparison, rounding or sorting: not a kink)",
            f"  {self._output_element(first.row)} changes by {first.jump:.6g} when {element} "
            f"moves by eps ({self.eps:g}), and by about as much when it moves by eps/2: the "
            f"change does not shrink with the step, so the one-sided differences ({left:.6g} "
            f"from the left, {right:.6g} from the right) grow without bound as eps shrinks",
            f"  {len(jumps)} examined elements are at a jump; this is not a wrong gradient",
            "  move the point: pass avoid_boundaries=True, or check at inputs away from the tie",
        ]

    def _detached(self) -> str:
        names = ", ".join(self.problem.output_names or [])
        return (
            f"wrong first-order gradient of {self.problem.description}: autograd connects none "
            f"of its floating-point outputs ({names}) to the checked tensors, so their analytical "
            f"gradient is 0, yet the outputs change when the checked tensors do: the forward "
            f"detaches them (.detach(), .data, torch.no_grad(), a Python number or NumPy in "
            f"between)\n{self._footer()}"
        )

    def _unexplained(self) -> str:
        names = {str(i): c.name for i, c in enumerate(self.problem.checked)}
        mapping = ", ".join(f"input {i} = {name}" for i, name in names.items())
        if self.settings.fast:
            mapping = "torch checked one scalar step per tensor: " + mapping
        return (
            f"gradient check of {self.problem.description} failed, but no single element was "
            f"found wrong when rechecked one by one\n"
            f"torch.autograd.gradcheck said: {self.torch_message.strip()[:2000]}\n"
            f"({mapping})\n{self._footer()}"
        )
