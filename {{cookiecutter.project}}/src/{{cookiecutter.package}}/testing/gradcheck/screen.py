"""One check of a problem's gradients at its point, in fast or slow mode (:class:`Check`).

Slow mode and second order run ``torch.autograd.gradcheck``/``gradgradcheck``; fast
mode's first order screens each checked tensor along one random direction. Each run
first measures the outputs and gradients at the point: the tolerances not given come
from them (:mod:`.tolerances`), and so does the sensitivity the result reports. A
failure goes to :mod:`.diagnosis` with the check's :class:`~.diagnosis.Settings`; a
refused finite-difference input shrinks the step, an op run in float32 takes float32's
tolerances.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.gradcheck import GradcheckError

from ..calls import REENTRANT_CHECKPOINT
from ..float64 import CannotStayFloat64
from .diagnosis import Diagnosis, Settings
from .problem import NoFloatingOutput, ProbeRefused, Probes, Problem
from .results import GradcheckFailure, RefusedProbe, Sensitivity, Tolerances, mode_text
from .tolerances import Requested, beyond_own_error, output_scale, sensitivity, tolerances
from .weights import EVALUATION_SEED, random_direction, random_weights, weighted_sum

__all__ = [
    "DIAGNOSIS_FLOOR",
    "DIAGNOSIS_MULTIPLE",
    "SCREENING_FRACTION",
    "SECOND_ORDER_FLOAT32_TOLERANCES",
    "SECOND_ORDER_TOLERANCES",
    "STEP_RETRIES",
    "STEP_SHRINK",
    "Check",
]

# Fast mode flags a tensor for an element-wise search when its directional derivatives
# disagree by this fraction of its largest gradient element (times the direction's
# smallest weight, see Check._screen): a single element wrong by 1% of that is found
# with a margin of 4x.
SCREENING_FRACTION = 0.0025
# A failing check's diagnosis (which element, why, where the error enters) makes at
# most this many times the evaluations the check made before it failed (a passing
# check's cost) plus DIAGNOSIS_FLOOR: the element search comes first; the other
# tensors' elements and the parts checked on their own get what is left.
DIAGNOSIS_MULTIPLE = 20
DIAGNOSIS_FLOOR = 64
# Second order, where the user gives no tolerances: torch's gradgradcheck defaults
# (atol, rtol). Its outputs are gradients weighted by torch's own random cotangents,
# whose size the check does not see, so no rounding error is estimated for them;
# where an op ran in float32, those of a float32 gradient check.
SECOND_ORDER_TOLERANCES = (1e-5, 1e-3)
SECOND_ORDER_FLOAT32_TOLERANCES = (1e-3, 1e-2)
# When the model raises at a finite-difference input (a solver's assertion), the step
# shrinks this many times by STEP_SHRINK before the point is reported as uncheckable.
STEP_RETRIES = 2
STEP_SHRINK = 10.0


class Check:
    """One check of a problem's gradients at its point, in fast or slow mode.

    The step starts as ``requested`` and shrinks where the model refuses a
    finite-difference input; the tolerances not requested are measured at the start of
    each run (:attr:`tolerances`), in float32's arithmetic once an op ran in float32.
    """

    def __init__(self, problem: Problem, *, fast: bool, reason: str, requested: Requested) -> None:
        self.problem, self.fast, self.reason = problem, fast, reason
        self.requested = requested
        self.tolerances = tolerances(requested, 0.0, float32=False)
        # The first order's sensitivity at the point, measured with its tolerances.
        self.sensitivity: Sensitivity | None = None
        self.refused: list[str] = []
        self.part = False  # a part of a model checked on its own, while narrowing down
        self._loosened = False
        self._refusals: list[ProbeRefused] = []
        # The evaluations the check itself made: the diagnosis is bounded by a multiple.
        self.spent = 0
        self.budget_end = 0

    @property
    def eps(self) -> float:
        """The step of the current run (the requested one, float32's where an op ran in it)."""
        return self.tolerances.eps

    def run(self, order: int) -> None:
        __tracebackhide__ = True
        while True:
            try:
                return self._run(order)
            except ProbeRefused as refused:
                self._shrink_step(refused)
            except GradcheckFailure:
                if not self._loosen():
                    raise

    def diagnosis_budget(self) -> int:
        """The evaluation count (``problem.evaluations``) at which a diagnosis stops."""
        if not self.budget_end:
            self.spent = self.problem.evaluations - self.run_started
            self.budget_end = (
                self.problem.evaluations + DIAGNOSIS_MULTIPLE * self.spent + DIAGNOSIS_FLOOR
            )
        return self.budget_end

    def _diagnosis(self, order: int, torch_message: str, suspects: Sequence[int] = ()) -> Diagnosis:
        """The diagnosis of this check's failure, with its step, tolerances and budget."""
        settings = Settings(
            tolerances=self.tolerances,
            fast=self.fast,
            reason=self.reason,
            part=self.part,
            budget=self.diagnosis_budget(),
        )
        return Diagnosis(self.problem, settings, order, torch_message, suspects)

    def _loosen(self) -> bool:
        """After a failure: whether an op ran in float32, so float32's tolerances apply."""
        if self._loosened or not self.problem.narrowed:
            return False
        self._loosened = True
        self.budget_end = 0
        return True

    def _measure(self, outputs: Sequence[torch.Tensor]) -> Tolerances:
        """First order: the tolerances for these outputs at the point (:mod:`.tolerances`)."""
        # An op that ran in float32 at the point (or at a probe of an earlier run) sets
        # the arithmetic of the whole check.
        self._loosened = self._loosened or bool(self.problem.narrowed)
        self.tolerances = tolerances(self.requested, output_scale(outputs), float32=self._loosened)
        return self.tolerances

    def _second_order_tolerances(self) -> None:
        """Second order: the given tolerances, else gradgradcheck's (float32's where an op
        ran in float32)."""
        self._loosened = self._loosened or bool(self.problem.narrowed)
        atol, rtol = SECOND_ORDER_FLOAT32_TOLERANCES if self._loosened else SECOND_ORDER_TOLERANCES
        given = self.requested
        requested = Requested(
            given.eps,
            atol if given.atol is None else given.atol,
            rtol if given.rtol is None else given.rtol,
        )
        self.tolerances = tolerances(requested, 0.0, float32=self._loosened)

    def _measure_point(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Slow mode, first order: the outputs at the point, evaluated once for torch's
        check as well; they give the tolerances."""
        outputs = self.problem.evaluate(inputs)
        self._measure([o for o in outputs if o.requires_grad] or list(outputs))
        return outputs

    def _rows_seen(self, inputs: Sequence[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list]:
        """Each input's gradients as torch's check computes them (its analytical Jacobian
        row by row, a unit cotangent each): kept by a hook, to read each tensor's largest
        Jacobian entry after the check, which its sensitivity is relative to."""
        rows: list[list[torch.Tensor]] = [[] for _ in inputs]
        handles = [t.register_hook(seen.append) for t, seen in zip(inputs, rows, strict=True)]
        return rows, handles

    def _slow_sensitivity(self, rows: list[list[torch.Tensor]], settled: int = 0) -> None:
        measured = self.tolerances
        defined = [[g for g in seen if g is not None] for seen in rows]
        scales = [
            float(torch.stack(seen).abs().max()) if seen and seen[0].numel() else 0.0
            for seen in defined
        ]
        self.sensitivity = sensitivity(
            measured,
            [c.name for c in self.problem.checked],
            [(scale, measured.caught(scale)) for scale in scales],
            settled,
        )

    def _shrink_step(self, refused: ProbeRefused) -> None:
        """The model raised at a finite-difference input: retry with a smaller step."""
        __tracebackhide__ = True
        self._refusals.append(refused)
        if len(self._refusals) > STEP_RETRIES:
            raise RefusedProbe(
                self._refused_message(), tensor=refused.tensor, error=refused.error
            ) from None
        self.requested = Requested(
            self.requested.eps / STEP_SHRINK, self.requested.atol, self.requested.rtol
        )
        self.budget_end = 0
        self.refused.append(
            f"the model raised at {refused.probe} ({refused.what}): checked with "
            f"eps={self.requested.eps:g} instead"
        )

    def _refused_message(self) -> str:
        first, last = self._refusals[0], self._refusals[-1]
        steps = ", ".join(f"{r.step:g}" for r in self._refusals[:-1])
        return "\n".join(
            [
                f"cannot check the gradient of {self.problem.description} here: the model "
                f"raises at the finite-difference inputs near the point, down to eps={self.eps:g}",
                f"  with {last.probe}: {last.what}",
                f"  it raised with eps={steps} too (first with {first.probe}); at the point itself "
                "it runs: this is not a wrong gradient",
                "  the point is within eps of inputs the model refuses (an assertion, a solver "
                "that gives up): check at inputs farther from them",
                self._footer(),
            ]
        )

    def _footer(self) -> str:
        return (
            f"checked {self.problem.description} ({self.tolerances}), "
            f"{mode_text(self.fast, self.reason)}"
        )

    def _run(self, order: int) -> None:
        __tracebackhide__ = True
        problem = self.problem
        self.run_started = problem.evaluations
        self.budget_end = 0
        generator = torch.Generator().manual_seed(EVALUATION_SEED) if self.fast else None
        if self.fast and order == 1:
            try:
                self._screen(generator)
            except RuntimeError:
                self._reject_reentrant_checkpoint()
                if not self._widen_from_now_on():
                    raise
                self._run(order)
            except NoFloatingOutput as error:
                raise TypeError(str(error)) from None
            return
        if self.fast:
            function, inputs = self._directional(order, generator)
        else:
            inputs = [c.value.clone().requires_grad_() for c in problem.checked]
        try:
            if order == 2:
                self._second_order_tolerances()
            else:
                function = Probes(problem, at_point=self._measure_point(inputs))
                rows, handles = self._rows_seen(inputs)
            measured = self.tolerances
            options = {"eps": measured.eps, "atol": measured.atol, "rtol": measured.rtol}
            if self.fast or order == 1:
                torch.autograd.gradcheck(function, inputs, **options)
            else:
                torch.autograd.gradgradcheck(Probes(problem), inputs, **options)
            if order == 1:
                for handle in handles:
                    handle.remove()
                self._slow_sensitivity(rows)
        except (GradcheckError, RuntimeError) as error:
            if not isinstance(error, GradcheckError):
                self._reject_reentrant_checkpoint()
            if self._widen_from_now_on():
                return self._run(order)
            if not isinstance(error, GradcheckError):
                raise
            diagnosis = self._diagnosis(order, str(error))
            failure = diagnosis.failure()
            if failure is not None:
                raise failure from None
            if order == 1:  # every element agrees within its own finite differences' error
                self._slow_sensitivity(rows, settled=diagnosis.settled)
        except NoFloatingOutput as error:
            raise TypeError(str(error)) from None
        except CannotStayFloat64 as error:
            raise CannotStayFloat64(str(error)) from None

    def _reject_reentrant_checkpoint(self) -> None:
        """After torch raised: a ``ValueError`` saying why, if the forward holds a reentrant
        checkpoint (torch's own message names no way out)."""
        __tracebackhide__ = True
        if self.problem.reentrant_checkpoint():
            raise ValueError(REENTRANT_CHECKPOINT.format(check="gradcheck")) from None

    def _widen_from_now_on(self) -> bool:
        """After a failure without Float64Mode: whether to check again with it.

        The first evaluation decides whether the forward needs the mode (it costs a
        Python call per torch call); a branch it did not take may still narrow a dtype,
        so a check that fails without the mode is run again with it.
        """
        if self.problem.widen is not False:
            return False
        self.problem.widen = True
        return True

    def _screen(self, generator: torch.Generator) -> None:
        """Fast mode, first order: one random direction per checked tensor.

        For ``s = w · outputs`` (random output weights ``w``) one backward pass gives
        ``∇s`` for every tensor; two forward passes per tensor give the derivative of
        ``s`` along ``u``, a direction of random signs and magnitudes between 1 and 2
        (normalized). Along such a direction a single wrong element of error ``δ`` shifts
        the derivative by at least ``δ·min|u|``, whatever the other elements, so besides
        torch's tolerance (``atol + rtol·|numerical|``) a tensor is flagged when the two
        differ by more than ``SCREENING_FRACTION`` of its largest gradient element times
        ``min|u|``, plus the rounding error of the differences. A flagged tensor is
        searched by bisection and its suspects rechecked element by element with
        ``atol``/``rtol``: only an element that fails there fails the check.
        """
        __tracebackhide__ = True
        problem = self.problem
        point = [c.value.detach().requires_grad_() for c in problem.checked]
        outputs = problem.evaluate(point)
        # Like torch's check: outputs autograd does not connect to the checked tensors (a
        # saved mean, a detached statistic) are left out; all of them when none is connected,
        # so that a detached forward still shows.
        kept = [o.requires_grad for o in outputs]
        if not any(kept):
            kept = [True] * len(outputs)
        weights = [
            random_weights(o, generator) if keep else None
            for o, keep in zip(outputs, kept, strict=True)
        ]
        total = weighted_sum(weights, outputs)
        measured = self._measure([o for o, keep in zip(outputs, kept, strict=True) if keep])
        analytical: Sequence[torch.Tensor | None] = [None] * len(point)
        if isinstance(total, torch.Tensor) and total.requires_grad:
            analytical = torch.autograd.grad(total, point, allow_unused=True)
        failed, flagged, caught, settled = [], [], [], 0
        for index, (checked, gradient) in enumerate(zip(problem.checked, analytical, strict=True)):
            largest = float(gradient.abs().max()) if gradient is not None and checked.numel else 0.0
            if not checked.numel:
                caught.append((0.0, measured.caught(0.0)))
                continue  # an empty tensor has no derivative to check
            direction = random_direction(checked.value, generator)
            plus, minus = self._sides(index, direction, weights, point, self.eps)
            numerical = (plus - minus) / (2 * self.eps)
            along = 0.0 if gradient is None else float((gradient * direction).sum())
            difference = abs(along - numerical)
            allowed = measured.atol + measured.rtol * abs(numerical)
            # The rounding error of the central difference, a few units in the last place.
            rounding = 2 * torch.finfo(torch.float64).eps * (abs(plus) + abs(minus)) / self.eps
            screened = SCREENING_FRACTION * largest * float(direction.abs().min()) + rounding
            threshold = min(allowed, screened) if gradient is not None else allowed
            caught.append((largest, threshold / abs(along) if along else float("inf")))
            if difference > allowed:
                if measured.atol_given or not self._within_half_step(
                    index, direction, weights, point, numerical, along
                ):
                    failed.append(index)
                else:
                    settled += 1
            elif gradient is not None and difference > screened:
                flagged.append(index)
        self.sensitivity = sensitivity(measured, [c.name for c in problem.checked], caught, settled)
        if (failed or flagged) and self._widen_from_now_on():
            return self._screen(torch.Generator().manual_seed(EVALUATION_SEED))
        if failed:
            message = f"Jacobian mismatch for output 0 with respect to input {failed[0]}"
            failure = self._diagnosis(1, message, suspects=failed + flagged).failure()
            if failure is not None:
                raise failure
            return  # every element of the failing tensors agrees within its own error
        if flagged:
            wrong = self._diagnosis(1, "", suspects=flagged).wrong_in(flagged)
            if wrong is not None:
                raise wrong

    def _sides(self, index, direction, weights, point, step) -> tuple[float, float]:
        """The weighted outputs with tensor ``index`` moved by ``±step`` along ``direction``."""
        sides = []
        for sign in (1, -1):
            values = [v.detach() for v in point]
            values[index] = torch.add(values[index], direction, alpha=sign * step)
            sides.append(float(weighted_sum(weights, self.problem.probe(values))))
        return sides[0], sides[1]

    def _within_half_step(self, index, direction, weights, point, numerical, along) -> bool:
        """Whether a directional derivative that fails agrees with the finite differences
        once their own error is allowed (:func:`.tolerances.beyond_own_error`)."""
        plus, minus = self._sides(index, direction, weights, point, self.eps / 2)
        beyond, _ = beyond_own_error(
            torch.tensor(along, dtype=torch.float64),
            torch.tensor(numerical, dtype=torch.float64),
            torch.tensor((plus - minus) / self.eps, dtype=torch.float64),
            self.tolerances,
        )
        return float(beyond) <= 1.0

    def _directional(self, order: int, generator: torch.Generator):
        """A function of one scalar per checked tensor: its derivatives are fast mode's checks."""
        checked = self.problem.checked
        directions = [random_weights(c.value, generator) for c in checked]
        if order == 2:
            projections = [random_weights(c.value, generator) for c in checked]
        weights: list[torch.Tensor] = []

        def evaluate(steps) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
            moved = [float(t.detach()) for t in steps]
            at_point = not any(moved)
            if at_point:
                # Where torch differentiates: x + t * u, with t in the graph.
                values = [
                    torch.addcmul(c.value, t, u)
                    for c, t, u in zip(checked, steps, directions, strict=True)
                ]
            else:
                # A finite difference: torch moves one step, and needs no graph back to it.
                values = [
                    c.value if m == 0.0 else torch.add(c.value, u, alpha=m)
                    for c, m, u in zip(checked, moved, directions, strict=True)
                ]
                if order == 2:
                    values = [v.detach().requires_grad_() for v in values]
            evaluate = self.problem.evaluate if at_point else self.problem.probe
            outputs = evaluate(values)
            if not weights:
                weights.extend(random_weights(o, generator, normalized=order == 1) for o in outputs)
            sums = [(w * o).sum() for w, o in zip(weights, outputs, strict=True)]
            return values, sums, at_point

        def first(*steps):
            return tuple(evaluate(steps)[1])

        def second(*steps):
            values, sums, at_point = evaluate(steps)
            differentiable = [s for s in sums if s.requires_grad]
            if not differentiable:
                return tuple(torch.zeros((), dtype=torch.float64, device=v.device) for v in values)
            grads = torch.autograd.grad(
                sum(differentiable), values, create_graph=at_point, allow_unused=True
            )
            return tuple(
                (g * p).sum() if g is not None else torch.zeros((), dtype=v.dtype, device=v.device)
                for g, p, v in zip(grads, projections, values, strict=True)
            )

        steps = [
            torch.zeros((), dtype=torch.float64, device=c.value.device, requires_grad=True)
            for c in checked
        ]
        return (first if order == 1 else second), steps
