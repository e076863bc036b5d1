"""A few real optimizer steps on one repeated batch: does every parameter of the model learn?

``training_check(model, (inputs, targets), loss_fn)`` runs ``steps`` real training
steps (``zero_grad``, forward, ``loss_fn(output, targets)``, ``backward``,
``optimizer.step()``) on the same batch, from the same random number generator
states each step (dropout draws the same mask, so the loss changes only because the
weights do), then puts the model, its buffers, the ``.grad`` of its parameters, the
optimizer's state and the generators back as they were. It fails, naming
parameters, steps and the user's lines, on:

- parameters never given a gradient (:class:`ParametersWithoutGradient`), each with
  why, found by :mod:`.parameter_use`: the branch decision whose other outcome
  reaches it (``reached only when `if depth > 3:` at models.py:88 is True``), the
  ``.detach()`` or ``torch.no_grad()`` that cuts it off, or that nothing reaches it;
- trainable parameters the optimizer does not hold (:class:`ParametersNotInOptimizer`);
- parameters that got a gradient but did not change (:class:`ParametersNotUpdated`);
- NaN or inf in the loss, a gradient or a weight (:class:`NonFiniteValues`): the
  first step and tensor, and the op that made it at the user's line;
- a loss that does not decrease (:class:`LossNotDecreasing`), with the numbers;
- with ``accumulation_steps=k``: gradients accumulated over ``k`` micro-batches
  (each loss divided by ``k``) that are not the whole batch's gradient
  (:class:`AccumulationMismatch`), with the scale and the decisions that differ.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import calls, global_state, options
from .comparison import bitwise_equal, close_mismatch
from .control_flow import (
    Decision,
    Location,
    first_divergence,
    record_decisions,
    without_torch_function_modes,
)
from .failures import CheckFailure, most_fundamental
from .naming import describe_callable
from .nonfinite import Birth, find_origins, non_finite_text
from .parameter_use import (
    BRANCH_OPS,
    MAX_FLIPS,
    Reach,
    SiteOutcomes,
    UseRecorder,
    explain_unreached,
    located,
    site_outcomes,
)
from .subject import Inputs, Subject
from .trees import map_tensors, named_leaves

__all__ = [
    "AccumulationMismatch",
    "LossNotDecreasing",
    "NonFiniteValues",
    "ParametersNotInOptimizer",
    "ParametersNotUpdated",
    "ParametersWithoutGradient",
    "TrainingCheckFailure",
    "TrainingResult",
    "training_check",
]

# Five steps: enough for Adam's first steps to move every weight that has a gradient
# and lower the loss on one batch, few enough to cost little more than the bare steps.
DEFAULT_STEPS = 5
# Adam's own default learning rate: a step moves each weight by about lr whatever the
# gradient's scale, so a correct model's loss falls within DEFAULT_STEPS steps.
DEFAULT_LR = 1e-3
_OPTIONS = ("optimizer", "steps", "accumulation_steps", "forward_kwargs", "rtol", "atol")


class TrainingCheckFailure(CheckFailure):
    """Training on one batch went wrong; the subclasses say how."""

    check = "training_check"


class ParametersWithoutGradient(TrainingCheckFailure):
    """Parameters that no step gave a gradient; ``reasons`` says why, by parameter."""

    def __init__(self, message: str, reasons: Mapping[str, Reach]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)
        self.parameters = tuple(reasons)


class ParametersNotInOptimizer(TrainingCheckFailure):
    """Trainable parameters the optimizer does not hold (``parameters``), and tensors it
    holds that are not the model's (``foreign``: their shapes)."""

    def __init__(
        self, message: str, parameters: Sequence[str], foreign: Sequence[tuple[int, ...]]
    ) -> None:
        super().__init__(message)
        self.parameters = tuple(parameters)
        self.foreign = tuple(foreign)


class ParametersNotUpdated(TrainingCheckFailure):
    """Parameters that got a gradient but kept their value; ``reasons`` by parameter."""

    def __init__(self, message: str, reasons: Mapping[str, str]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)
        self.parameters = tuple(reasons)


class NonFiniteValues(TrainingCheckFailure):
    """NaN or inf first seen at ``step`` in ``tensor`` (``loss``, ``grad of w``, ``w``);
    ``location`` is the user's line of the op that made it, where found."""

    def __init__(
        self, message: str, step: int, tensor: str, location: Location | None, op: str | None
    ) -> None:
        super().__init__(message)
        self.step = step
        self.tensor = tensor
        self.location = location
        self.op = op


class LossNotDecreasing(TrainingCheckFailure):
    """The loss after the steps is not below the first step's: ``losses`` then ``final``."""

    def __init__(self, message: str, losses: Sequence[float], final: float) -> None:
        super().__init__(message)
        self.losses = tuple(losses)
        self.final = final


class AccumulationMismatch(TrainingCheckFailure):
    """Accumulated micro-batch gradients that are not the whole batch's gradient.

    ``scale`` is the accumulated gradient over the whole batch's, fitted over every
    gradient (1.0 when they agree); ``differing`` names the gradients that differ;
    ``decisions`` the decisions a micro-batch made otherwise than the whole batch.
    """

    def __init__(
        self,
        message: str,
        scale: float,
        differing: Sequence[str],
        decisions: Sequence[tuple[int, Decision | None, Decision | None]],
    ) -> None:
        super().__init__(message)
        self.scale = scale
        self.differing = tuple(differing)
        self.decisions = tuple(decisions)


@dataclass(frozen=True)
class TrainingResult:
    """What ``training_check`` ran and saw; ``str()`` is its report."""

    subject: str
    optimizer: str
    steps: int
    losses: tuple[float, ...]  # each step's loss, before its update
    final_loss: float  # after the last update
    parameters: int
    decisions: tuple[SiteOutcomes, ...]
    accumulation_steps: int | None

    def __str__(self) -> str:
        first, final = self.losses[0], self.final_loss
        change = f" ({(final - first) / abs(first):+.1%})" if first else ""
        accumulation = (
            f"; {self.accumulation_steps} accumulated micro-batches give the whole batch's gradient"
            if self.accumulation_steps
            else ""
        )
        lines = [
            f"training_check {self.subject}: {self.steps} steps of {self.optimizer} on one "
            f"repeated batch: loss {first:.6g} -> {final:.6g}{change}; all {self.parameters} "
            f"parameters got a gradient and changed{accumulation}"
        ]
        lines.extend(f"  {site}" for site in self.decisions)
        return "\n".join(lines)


def training_check(
    model_or_fn: Callable[..., Any],
    batch: Any,
    /,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    optimizer: Any = None,
    steps: int = DEFAULT_STEPS,
    accumulation_steps: int | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **unknown: Any,
) -> TrainingResult:
    """Train ``model_or_fn`` for ``steps`` steps on one repeated ``batch``: does it learn?

    ``batch`` is ``(inputs, targets)``, as a ``DataLoader`` gives it: ``inputs`` is a
    tensor (the forward's one input), a tuple (its positional inputs) or a dict (its
    keyword inputs); each step computes ``loss_fn(model_or_fn(inputs), targets)``.
    ``optimizer`` is an optimizer over the model's parameters (checked for the ones it
    misses), a callable that makes one from a list of them
    (``functools.partial(torch.optim.SGD, lr=0.1)``), or ``None`` for
    ``torch.optim.Adam(lr=1e-3)``. ``accumulation_steps=k`` says the gradient of the
    whole batch must equal the gradients of its ``k`` micro-batches (split along
    dimension 0), each loss divided by ``k``, accumulated in ``.grad``; they are
    compared within ``rtol``/``atol`` (by dtype, as ``compile_check``). Everything
    is put back afterwards. Returns a :class:`TrainingResult`; raises a
    :class:`TrainingCheckFailure` subclass: the most fundamental problem found (NaN
    first, then parameters the optimizer misses, parameters without a gradient,
    parameters not updated, a loss that does not fall, accumulation), with the others
    listed after ``also:`` in its message.
    """
    __tracebackhide__ = True
    calls.reject_unknown_keywords("training_check", unknown, _OPTIONS)
    extra_kwargs = calls.forward_kwargs_of("training_check", forward_kwargs)
    args, kwargs, targets = _split_batch(batch)
    kwargs = {**kwargs, **extra_kwargs}
    options.function("training_check", "model_or_fn", model_or_fn, "an nn.Module or a callable")
    options.whole_number("training_check", "steps", steps, minimum=1)
    options.whole_number(
        "training_check",
        "accumulation_steps",
        accumulation_steps,
        minimum=2,
        optional=True,
        why="micro-batches to accumulate",
    )
    options.function(
        "training_check",
        "loss_fn",
        loss_fn,
        "a callable loss_fn(output, targets) -> loss (e.g. torch.nn.CrossEntropyLoss())",
    )
    options.number("training_check", "rtol", rtol, zero=True, optional=True)
    options.number("training_check", "atol", atol, zero=True, optional=True)
    subject = Subject(model_or_fn, args, kwargs, failure=TrainingCheckFailure, trains=True)
    if not subject.parameters:
        raise ValueError(
            f"training_check: {describe_callable(model_or_fn)} reaches no trainable parameter "
            "(no module with parameters that require grad): there is nothing to train"
        )
    trainer = _OneBatchTraining(
        subject, targets, loss_fn, _optimizer(optimizer, subject.parameters)
    )
    with trainer.restoring():
        trainer.run(steps)
        accumulation = (
            trainer.accumulation(accumulation_steps, rtol, atol) if accumulation_steps else None
        )
        explained = trainer.explain_missing_gradients()
    failure = most_fundamental(trainer.findings(explained, accumulation))
    if failure is not None:
        raise failure
    return TrainingResult(
        subject=describe_callable(model_or_fn),
        optimizer=trainer.optimizer_text,
        steps=steps,
        losses=tuple(trainer.losses),
        final_loss=trainer.final_loss,
        parameters=len(subject.parameters),
        decisions=site_outcomes(trainer.logs),
        accumulation_steps=accumulation_steps,
    )


def _split_batch(batch: Any) -> tuple[tuple, dict[str, Any], Any]:
    """``(args, kwargs, targets)`` of a batch ``(inputs, targets)``."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise TypeError(
            "training_check: batch must be a pair (inputs, targets), as a DataLoader gives "
            "it: inputs a tensor, a tuple of positional inputs or a dict of keyword inputs, "
            f"targets what loss_fn takes after the output (None if nothing); got {_kind(batch)}"
        )
    inputs, targets = batch
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}, targets
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}, targets
    if isinstance(inputs, Mapping) and all(isinstance(key, str) for key in inputs):
        return (), dict(inputs), targets
    raise TypeError(
        "training_check: the inputs of batch (its first item) must be a tensor, a tuple of "
        f"positional inputs or a dict of keyword inputs, got {_kind(inputs)}"
    )


def _kind(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return type(value).__name__


def _optimizer(optimizer: Any, parameters: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    tensors = [tensor for _, tensor in parameters]
    if optimizer is None:
        return torch.optim.Adam(tensors, lr=DEFAULT_LR)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        made = optimizer(tensors)
        if isinstance(made, torch.optim.Optimizer):
            return made
        raise TypeError(
            f"training_check: optimizer({len(tensors)} parameters) returned "
            f"{type(made).__name__}, not a torch.optim.Optimizer"
        )
    raise TypeError(
        "training_check: optimizer must be a torch.optim.Optimizer over the model's "
        "parameters, a callable that makes one from a list of parameters (e.g. "
        f"functools.partial(torch.optim.SGD, lr=0.1)) or None (Adam, lr={DEFAULT_LR}); "
        f"got {optimizer!r}"
    )


def _describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    rates = sorted({group.get("lr") for group in optimizer.param_groups}, key=str)
    lr = ", ".join(f"{rate:g}" if isinstance(rate, float | int) else str(rate) for rate in rates)
    return f"{type(optimizer).__name__} (lr={lr})"


@dataclass(frozen=True)
class _NonFinite:
    step: int
    tensor: str  # "loss", "grad of w", "w"
    description: str
    culprit: Birth | None = None  # the op that made it, at the user's line
    note: str = ""


class _OneBatchTraining:
    """The steps of one check, what they saw, and putting everything back."""

    def __init__(
        self,
        subject: Subject,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.subject = subject
        self.targets = targets
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.optimizer_text = _describe_optimizer(optimizer)
        self.parameters = subject.parameters
        self.losses: list[float] = []
        self.final_loss = math.nan
        self.logs: list[list[Decision]] = []
        self.with_gradient: set[str] = set()
        self.largest_gradient: dict[str, float] = {}
        self.non_finite: _NonFinite | None = None
        self.rngs = global_state.rng_states()

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Parameters, buffers, RNGs, ``.grad`` and the optimizer's state put back after."""
        grads = [tensor.grad for _, tensor in self.parameters]
        state = copy.deepcopy(self.optimizer.state_dict())
        try:
            for _, tensor in self.parameters:
                tensor.grad = None
            yield
        finally:
            self.subject.reset()
            self.optimizer.load_state_dict(state)
            for (_, tensor), grad in zip(self.parameters, grads, strict=True):
                tensor.grad = grad

    def _start_step(self) -> Any:
        """Fresh inputs and the RNGs of the first step: each step sees the same batch."""
        for rng in self.rngs:
            rng.set_state(rng.raw)
        return self.subject.fresh_inputs()

    def _loss(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        output = self.subject.target(*inputs.args, **inputs.kwargs)
        loss = self.loss_fn(output, self.targets if targets is None else targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else _kind(loss)
            )
            raise TypeError(
                "training_check: loss_fn must return a tensor of one element (a mean or sum "
                f"over the batch), got {got}"
            )
        return loss

    def run(self, steps: int) -> None:
        self.steps = steps
        held = {id(t) for group in self.optimizer.param_groups for t in group["params"]}
        self.held = held
        before = [tensor.detach().clone() for _, tensor in self.parameters]
        for step in range(1, steps + 1):
            inputs = self._start_step()
            self.optimizer.zero_grad(set_to_none=True)
            with record_decisions() as log:
                loss = self._loss(inputs)
            self.logs.append(list(log))
            self.losses.append(float(loss.detach()))
            if not torch.isfinite(loss.detach()).all():
                self.non_finite = _NonFinite(
                    step, "loss", f"the loss is {float(loss.detach())}", self._culprit(False)
                )
                break
            if loss.requires_grad:
                loss.backward()
            if self._check_gradients(step, loss):
                break
            self.optimizer.step()
            if self._check_weights(step):
                break
        with torch.no_grad():
            self.final_loss = float(self._loss(self._start_step()).detach())
        self.changed = {
            name
            for (name, tensor), start in zip(self.parameters, before, strict=True)
            if not bitwise_equal(tensor.detach(), start)
        }

    def _check_gradients(self, step: int, loss: torch.Tensor) -> bool:
        for name, tensor in self.parameters:
            grad = tensor.grad
            if grad is None:
                continue
            self.with_gradient.add(name)
            largest = _largest(grad)  # NaN or inf when an element is
            self.largest_gradient[name] = max(self.largest_gradient.get(name, 0.0), largest)
            if not math.isfinite(largest):
                self.non_finite = _NonFinite(
                    step,
                    f"grad of {name}",
                    f"the gradient of {name} has {non_finite_text(grad)}",
                    self._culprit(True),
                    note=f"the loss was finite ({float(loss.detach()):.6g})",
                )
                return True
        return False

    def _check_weights(self, step: int) -> bool:
        for name, tensor in self.parameters:
            if not math.isfinite(_largest(tensor)):
                self.non_finite = _NonFinite(
                    step,
                    name,
                    f"the weight {name} has {non_finite_text(tensor.detach())}",
                    note="after the optimizer step; every gradient was finite "
                    f"({self.optimizer_text})",
                )
                return True
        return False

    def _culprit(self, backward: bool) -> Birth | None:
        """The op that made the first NaN or inf of this step's forward (and backward):
        the step replayed under :func:`.nonfinite.find_origins`."""
        inputs = self._start_step()

        def step() -> None:
            loss = self._loss(inputs)
            if backward and loss.requires_grad:
                torch.autograd.grad(loss, [t for _, t in self.parameters], allow_unused=True)

        with torch.enable_grad() if backward else torch.no_grad():
            return find_origins(step, self.subject.roots).origin

    def accumulation(
        self, micro_batches: int, rtol: float | None, atol: float | None
    ) -> tuple[float, list[str], list[str], list[tuple[int, Decision | None, Decision | None]]]:
        """Accumulated micro-batch gradients against the whole batch's: scale, differing
        gradients (names and descriptions) and the first differing decision per micro-batch."""
        self.subject.reset()
        inputs = self._start_step()
        size = _batch_size(inputs, self.targets, micro_batches)
        with record_decisions() as whole_log:
            whole_loss = self._loss(inputs)
        whole = torch.autograd.grad(whole_loss, [t for _, t in self.parameters], allow_unused=True)
        for _, tensor in self.parameters:
            tensor.grad = None
        divergences = []
        for index in range(micro_batches):
            micro = self._start_step()
            part = slice(index * size, (index + 1) * size)
            args = map_tensors(lambda t, part=part: t[part], micro.args)
            kwargs = map_tensors(lambda t, part=part: t[part], micro.kwargs)
            targets = map_tensors(lambda t, part=part: t[part], self.targets)
            with record_decisions() as log:
                loss = self._loss(Inputs(args, kwargs, []), targets)
            (loss / micro_batches).backward()
            divergence = first_divergence(
                [d for d in whole_log if d.op in BRANCH_OPS], [d for d in log if d.op in BRANCH_OPS]
            )
            if divergence is not None:
                divergences.append((index + 1, *divergence[1:]))
        accumulated = [tensor.grad for _, tensor in self.parameters]
        for _, tensor in self.parameters:
            tensor.grad = None
        names, texts, dot, norm = [], [], 0.0, 0.0
        for (name, _), full, summed in zip(self.parameters, whole, accumulated, strict=True):
            if full is None and summed is None:
                continue
            full = torch.zeros_like(summed) if full is None else full
            summed = torch.zeros_like(full) if summed is None else summed
            dot += float((summed.double() * full.double()).sum())
            norm += float(full.double().square().sum())
            mismatch = close_mismatch(
                f"grad of {name}", full, summed, rtol, atol, ("the whole batch", "accumulated")
            )
            if mismatch is not None:
                names.append(name)
                texts.append(mismatch.description)
        scale = dot / norm if norm else math.nan
        return scale, names, texts, divergences

    def explain_missing_gradients(self) -> dict[str, Reach]:
        missing = [name for name, _ in self.parameters if name not in self.with_gradient]
        if not missing or self.non_finite is not None:
            return {}

        def run(recorder: UseRecorder) -> Any:
            self.subject.reset()
            inputs = self._start_step()
            with without_torch_function_modes(), recorder:
                return self._loss(inputs)

        return explain_unreached(run, self.parameters, missing, max_flips=MAX_FLIPS)

    # --- what went wrong, in words -------------------------------------------------

    def findings(
        self,
        explained: dict[str, Reach],
        accumulation: tuple[float, list[str], list[str], list] | None,
    ) -> list[TrainingCheckFailure]:
        subject = describe_callable(self.subject.target)
        found: list[TrainingCheckFailure] = []
        if self.non_finite is not None:
            found.append(self._non_finite_failure(subject))
            return found  # what comes after a NaN says nothing
        not_held = [name for name, tensor in self.parameters if id(tensor) not in self.held]
        if not_held:
            found.append(self._not_held_failure(subject, not_held))
        if explained:
            found.append(self._without_gradient_failure(subject, explained))
        stuck = {
            name: self._why_unchanged(name)
            for name, _ in self.parameters
            if name in self.with_gradient and name not in self.changed and name not in not_held
        }
        if stuck:
            found.append(
                ParametersNotUpdated(
                    f"{len(stuck)} of {len(self.parameters)} parameters of {subject} got a "
                    f"gradient but did not change in {len(self.losses)} steps of "
                    f"{self.optimizer_text}:\n" + _grouped(stuck),
                    stuck,
                )
            )
        if not self.final_loss < self.losses[0]:
            found.append(self._loss_failure(subject))
        if accumulation is not None and accumulation[1]:
            found.append(self._accumulation_failure(accumulation))
        return found

    def _non_finite_failure(self, subject: str) -> NonFiniteValues:
        bad = self.non_finite
        assert bad is not None
        where = ""
        op = location = None
        if bad.culprit is not None:
            op, location = bad.culprit.op, bad.culprit.site.user_line
            where = (
                f"\n  origin (the first operation that turned finite values into NaN or "
                f"inf): {bad.culprit}"
                + (f"\n    {location.source}" if location is not None and location.source else "")
            )
            if bad.tensor != "loss" and not bad.culprit.backward:
                where += (
                    "\n  The forward made it and the loss did not carry it (a value torch.where "
                    "or a mask discarded): its gradient is NaN all the same."
                )
        note = f"; {bad.note}" if bad.note else ""
        return NonFiniteValues(
            f"{subject}: {bad.description} at step {bad.step} of {self.steps}{note}{where}",
            bad.step,
            bad.tensor,
            location,
            op,
        )

    def _not_held_failure(self, subject: str, not_held: list[str]) -> ParametersNotInOptimizer:
        mine = {id(tensor) for _, tensor in self.parameters}
        foreign = [
            tuple(t.shape)
            for group in self.optimizer.param_groups
            for t in group["params"]
            if id(t) not in mine
        ]
        also = (
            f"\nThe optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {', '.join(str(shape) for shape in foreign)}): those of a submodule that "
            "was replaced after the optimizer was built."
            if foreign
            else ""
        )
        return ParametersNotInOptimizer(
            f"the optimizer ({self.optimizer_text}) does not hold {len(not_held)} of "
            f"{len(self.parameters)} trainable parameters of {subject}, so optimizer.step() "
            f"never changes them:\n  {_names_text(not_held)}\n"
            "Build the optimizer from model.parameters() once the model is complete: a "
            "submodule added or replaced after the optimizer was built, or an optimizer built "
            f"from a submodule's parameters(), leaves parameters out.{also}",
            not_held,
            foreign,
        )

    def _without_gradient_failure(
        self, subject: str, explained: dict[str, Reach]
    ) -> ParametersWithoutGradient:
        reasons = {name: self._reach_text(reach) for name, reach in explained.items()}
        return ParametersWithoutGradient(
            f"{len(explained)} of {len(self.parameters)} parameters of {subject} were never "
            f"given a gradient in {len(self.losses)} steps, so training never changes them:\n"
            + _grouped(reasons),
            explained,
        )

    def _reach_text(self, reach: Reach) -> str:
        text = str(reach)
        if reach.decision is not None:
            outcomes = [
                d.value
                for log in self.logs
                for d in log
                if d.location == reach.decision.location and d.op in BRANCH_OPS
            ]
            taken = outcomes.count(reach.outcome)
            text += (
                f", never the case here ({not reach.outcome} all {len(outcomes)} times in "
                f"{len(self.logs)} steps)"
                if not taken
                else f" (the case {taken} of {len(outcomes)} times here)"
            )
            text += ": train or test with batches that take that side too"
        elif reach.cut is not None:
            text += (
                ": nothing the loss depends on flows back to it. Remove the cut if it should "
                "learn, or freeze it (requires_grad_(False)) if it should not"
            )
        return text

    def _why_unchanged(self, name: str) -> str:
        largest = self.largest_gradient.get(name, 0.0)
        tensor = dict(self.parameters)[name]
        group = next(
            g for g in self.optimizer.param_groups if any(t is tensor for t in g["params"])
        )
        if largest == 0.0:
            return (
                "its gradient was zero in every step (reached by the graph, but the loss does "
                "not change with it here: a multiplication by zero, a mask or a dead unit)"
            )
        if group.get("lr") == 0:
            return "its param group has lr=0"
        return (
            f"its largest gradient element was {largest:.3g}: updates that small are below "
            f"{tensor.dtype}'s precision at its values with lr={group.get('lr')}"
        )

    def _loss_failure(self, subject: str) -> LossNotDecreasing:
        first, final = self.losses[0], self.final_loss
        steps = ", ".join(f"{loss:.6g}" for loss in self.losses)
        if final > first:
            why = (
                "The steps went uphill: a learning rate too large for this model, or gradients "
                "that point the wrong way (a custom autograd.Function: check it with gradcheck)."
            )
        elif not self.changed:
            why = "No parameter changed, so nothing could lower it."
        else:
            why = (
                "The parameters changed, but the loss did not: it does not depend on what the "
                "optimizer changes (a .detach() or a constant in the way), or the learning "
                "rate is too small for these steps."
            )
        return LossNotDecreasing(
            f"the loss of {subject} did not decrease in {len(self.losses)} steps of "
            f"{self.optimizer_text} on one repeated batch: {first:.6g} at step 1, {final:.6g} "
            f"after the last step (each step's loss: {steps}). {why}",
            self.losses,
            final,
        )

    def _accumulation_failure(self, accumulation: tuple) -> AccumulationMismatch:
        scale, names, texts, divergences = accumulation
        lines = [f"  {text}" for text in texts[:3]]
        if len(texts) > 3:
            lines.append(f"  also differ: {', '.join(f'grad of {n}' for n in names[3:])}")
        causes = []
        if math.isfinite(scale) and abs(scale - 1) > 0.05:
            causes.append(
                f"the accumulated gradient is {scale:.3g} times the whole batch's: with the "
                "loss summed over the batch (reduction='sum'), divide it by the batch size, not "
                "by the number of micro-batches; with a mean, divide each micro-batch's loss by "
                "the number of micro-batches"
            )
        for micro, whole, part in divergences:
            where = (whole or part).location  # type: ignore[union-attr]
            causes.append(
                f"micro-batch {micro} decided {part.value if part else 'nothing'} at "
                f"{located(where)} where the whole batch decided "
                f"{whole.value if whole else 'nothing'}: "
                "the forward decides on the whole batch at once, so a micro-batch computes "
                "something else"
            )
        if not causes:
            causes.append(
                "the forward treats samples together (batch statistics such as BatchNorm's "
                "in training mode, or a loss that is not a mean over samples)"
            )
        return AccumulationMismatch(
            "accumulating the gradients of micro-batches (each loss divided by their number) "
            "does not give the gradient of the whole batch:\n"
            + "\n".join(lines)
            + "\n"
            + "\n".join(f"  cause: {cause}" for cause in causes),
            scale,
            names,
            [(micro, whole, part) for micro, whole, part in divergences],
        )


def _names_text(names: Sequence[str]) -> str:
    return ", ".join(names)


def _grouped(reasons: Mapping[str, str]) -> str:
    """One line per reason: the parameters it holds for (a layer's weight and bias), then it."""
    groups: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        groups.setdefault(reason, []).append(name)
    return "\n".join(f"  {_names_text(names)}: {reason}" for reason, names in groups.items())


def _largest(tensor: torch.Tensor) -> float:
    """The largest absolute element; NaN or inf when an element is. ``aminmax`` reads the
    tensor once and allocates nothing: ``torch.isfinite(t).all()`` costs 15 times as much
    on the CPU, ``t.abs().max()`` three times."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    return max(abs(float(low)), abs(float(high)), key=lambda v: (math.isnan(v), v))


def _batch_size(inputs: Any, targets: Any, micro_batches: int) -> int:
    sizes = {
        tensor.shape[0]
        for _, tensor in named_leaves((inputs.args, inputs.kwargs, targets), "")
        if isinstance(tensor, torch.Tensor) and tensor.dim()
    }
    if len(sizes) != 1:
        raise ValueError(
            "training_check: accumulation_steps needs every tensor of the batch to have the "
            f"same size in dimension 0 (the samples), got sizes {sorted(sizes)}"
        )
    (size,) = sizes
    if size % micro_batches:
        raise ValueError(
            f"training_check: accumulation_steps={micro_batches} does not divide the batch of "
            f"{size} samples into equal micro-batches"
        )
    return size // micro_batches
