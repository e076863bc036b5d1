"""Check that a forward and backward stay finite, and say where the first NaN or inf came from.

:func:`finite_check` runs the model (or function) forward and backward, with the same
fixed random cotangents as the other checks (:func:`.runs.run_once`), and looks at
what came out: every output, every parameter's and differentiated input's gradient,
every buffer the forward changed. That look is one reduction per value, gathered on
the device and read once: the pass costs about what a bare forward and backward cost
(``benchmarks/finite_check_overhead.py``).

When something is not finite, a NaN or inf already in an input, a parameter or a
buffer is named as such (:class:`NonFiniteInput`). Otherwise the run is replayed under
:func:`.nonfinite.find_origins`, which looks at every op, and the failure
(:class:`NonFiniteRun`) names the origin, not the propagation: the op that made the
first NaN (or inf) from values that had none, forward or backward (and of which
forward call), the submodule, the user's line, the input values at the element, the
cause in words, and the decisions taken on the way. A passing check says what it
could not see: a non-finite value that no output, gradient or changed buffer carries
(one that ``torch.where``, ``nan_to_num`` or a mask cleaned away).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import control_flow, options
from .calls import forward_kwargs_of, input_sets, reject_unknown_keywords
from .failures import CheckFailure
from .naming import describe_callable
from .nonfinite import Birth, Origins, find_origins, non_finite_text, origin_lines
from .runs import Cotangents, Key, Run, run_once
from .subject import FunctionModule, Subject

__all__ = [
    "FiniteCheckFailure",
    "FiniteResult",
    "NonFiniteInput",
    "NonFiniteRun",
    "finite_check",
]

# The cotangents' seed, as every check that pulls gradients back uses one.
_COTANGENT_SEED = 0
# Non-finite values listed by name in a failure: the first ones show where it spread,
# the rest are counted (a NaN loss makes every gradient NaN).
_VALUES_LISTED = 3


class FiniteCheckFailure(CheckFailure):
    """``finite_check`` failed."""

    check = "finite_check"


class NonFiniteInput(FiniteCheckFailure):
    """A NaN or inf was already in ``name`` (an input, a parameter or a buffer) before
    the forward ran: no op made it."""

    def __init__(self, message: str, *, name: str, kind: str) -> None:
        super().__init__(message)
        self.name, self.kind = name, kind


class NonFiniteRun(FiniteCheckFailure):
    """A forward or backward made NaN or inf: ``seen`` are the values that carried it
    (``output``, ``grad of encoder.weight``), ``origin`` the op that made the first one
    (``None`` when the replay did not make it again), ``input_set`` which input set."""

    def __init__(
        self,
        message: str,
        *,
        seen: tuple[str, ...],
        origin: Birth | None,
        origins: Origins | None,
        input_set: int,
    ) -> None:
        super().__init__(message)
        self.seen, self.origin, self.origins, self.input_set = seen, origin, origins, input_set

    @property
    def location(self) -> control_flow.Location | None:
        """The user's line of the origin (for a backward op, of its forward call)."""
        return self.origin.site.user_line if self.origin else None


@dataclass(frozen=True)
class FiniteResult:
    """A passing check: what it looked at, what it cost, what it could not see."""

    name: str
    input_sets: int
    values: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"finite_check {self.name}: forward and backward finite on {self.input_sets} "
            f"input set(s), {self.values} values looked at (outputs, gradients, changed "
            f"buffers); {self.seconds:.2f} s. Not seen: a NaN or inf that no output or "
            "gradient carries (cleaned by torch.where, nan_to_num or a mask), and the sides "
            "of data-dependent branches these inputs did not take"
        )


def finite_check(
    model_or_fn: Callable[..., Any],
    /,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    inputs_list: list[tuple] | None = None,
    **unknown: Any,
) -> FiniteResult:
    """Run ``model_or_fn`` forward and backward on each input set; every value must be finite.

    Raises :class:`NonFiniteInput` for a NaN already in an input or a buffer, or a NaN or
    inf in a parameter (an input's or a buffer's ``-inf`` may be a mask), and
    :class:`NonFiniteRun` naming the op that made the first NaN or inf.
    A model wrapped by ``torch.compile`` is checked as compiled, and its origin is found
    by replaying the original module eagerly (the failure says so). Under
    ``pytest --decisions`` the check's run counts as the test's; the replay does not.
    """
    __tracebackhide__ = True
    reject_unknown_keywords("finite_check", unknown, ("forward_kwargs", "inputs_list"))
    options.function("finite_check", "model_or_fn", model_or_fn, "an nn.Module or a callable")
    kwargs = forward_kwargs_of("finite_check", forward_kwargs)
    sets = input_sets("finite_check", inputs, inputs_list)
    module = model_or_fn if isinstance(model_or_fn, nn.Module) else FunctionModule(model_or_fn)
    name = describe_callable(model_or_fn)
    started = time.perf_counter()
    looked_at = 0
    cotangents = Cotangents(_COTANGENT_SEED)
    for number, arguments in enumerate(sets):
        subject = Subject(module, arguments, kwargs, failure=FiniteCheckFailure)
        held = _held(subject, arguments)
        try:
            run = run_once(subject, cotangents)
        finally:
            subject.reset()
        tensors = _tensors(run)
        looked_at += len(tensors)
        # One read of the device for everything: the run's values must be finite, what
        # it started from free of NaN (and a parameter of inf too).
        if _finite(
            [t for _, t in tensors] + [t for _, t, strict in held if strict],
            [t for _, t, strict in held if not strict],
        ):
            continue
        _reject_non_finite_state(held, name)
        raise _non_finite(name, module, subject, run, number) from None
    return FiniteResult(name, len(sets), looked_at, time.perf_counter() - started)


def _finite(finite: list[torch.Tensor], without_nan: list[torch.Tensor]) -> bool:
    """Whether every tensor of ``finite`` is finite and none of ``without_nan`` holds NaN,
    read off each tensor's minimum and maximum (``aminmax`` reads it once and allocates
    nothing; a NaN anywhere makes both NaN), stacked, with one synchronisation."""
    extremes = [_extremes(t) for t in finite if t.numel()]
    nan_free = [_extremes(t) for t in without_nan if t.numel()]
    checks = []
    if extremes:
        checks.append(torch.isfinite(torch.cat(extremes)).all())
    if nan_free:
        checks.append(~torch.isnan(torch.cat(nan_free)).any())
    return bool(torch.stack(checks).all()) if checks else True


def _extremes(tensor: torch.Tensor) -> torch.Tensor:
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    low, high = torch.aminmax(values.detach())
    return torch.stack([low, high]).to(torch.float64)  # one dtype to stack, no overflow


def _tensors(run: Run) -> list[tuple[Key, torch.Tensor]]:
    return [
        (key, value)
        for key, value in run.values.items()
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
    ]


def _held(subject: Subject, arguments: tuple) -> list[tuple[str, torch.Tensor, bool]]:
    """Each floating-point tensor the run starts from, by what it is, and whether an
    infinity in it is an error: in a parameter it is; in an input or a buffer it may be
    a mask (an additive attention mask, a causal mask buffer of ``-inf``)."""
    held = [
        *((f"input {n}", t, False) for n, t in subject.named_inputs(arguments, subject.kwargs)),
        *((f"parameter {s.name}", s.tensor, True) for s in subject.parameter_slots),
        *((f"buffer {s.name}", s.tensor, False) for s in subject.buffer_slots),
    ]
    return [
        (what, tensor, infinity_is_error)
        for what, tensor, infinity_is_error in held
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    ]


def _reject_non_finite_state(held: list[tuple[str, torch.Tensor, bool]], name: str) -> None:
    """A NaN the run started from (or an infinity in a parameter) is no op's: name it."""
    __tracebackhide__ = True
    for what, tensor, infinity_is_error in held:
        bad = bool(tensor.isnan().any()) or (infinity_is_error and bool(tensor.isinf().any()))
        if bad:
            raise NonFiniteInput(
                f"finite_check {name}: {what} already holds {non_finite_text(tensor)} before "
                "the forward runs: no op of the model made it. Find where it was made (the "
                "data, an earlier optimizer step, a checkpoint) or clean it before the call.",
                name=what,
                kind="NaN" if bool(tensor.isnan().any()) else "inf",
            )


def _non_finite(
    name: str, module: nn.Module, subject: Subject, run: Run, number: int
) -> NonFiniteRun:
    bad = [(key, t) for key, t in _tensors(run) if not bool(torch.isfinite(t).all())]
    shown = ", ".join(f"{key} has {non_finite_text(t)}" for key, t in bad[:_VALUES_LISTED])
    if len(bad) > _VALUES_LISTED:
        shown += f", and {len(bad) - _VALUES_LISTED} more"
    eager = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    replayed = (
        Subject(eager, subject.args, subject.kwargs, failure=FiniteCheckFailure)
        if isinstance(eager, nn.Module)
        else subject
    )
    try:
        origins = find_origins(
            lambda: run_once(replayed, Cotangents(_COTANGENT_SEED)), replayed.roots
        )
    except Exception:  # the replay is a help: without it the values seen are the report
        origins = None
    finally:
        replayed.reset()
    lines = [
        f"finite_check {name}: the forward and backward of input set {number} made "
        f"non-finite values: {shown}."
    ]
    birth = origins.origin if origins else None
    if birth is None:
        lines.append(
            "Replaying it under an op recorder made no NaN or inf again: the run is not "
            "reproducible (a random op, a value from outside torch)."
        )
    else:
        lines += origin_lines(origins)
        if birth.from_infinity and origins.inf is None and origins.mask is None:
            given = [what for what, t, _ in _held(subject, subject.args) if bool(t.isinf().any())]
            if given:
                lines.append(
                    f"Its infinite input came from what the run was given: {', '.join(given)} "
                    "holds inf (a mask of -inf: a row masked everywhere leaves the softmax "
                    "nothing to normalize; use torch.finfo(dtype).min, as transformers does, "
                    "or keep one position unmasked)"
                )
    if replayed is not subject:
        lines.append(
            "The model is compiled (torch.compile): its origin was found by replaying the "
            "original module eagerly, op by op."
        )
    return NonFiniteRun(
        "\n".join(lines),
        seen=tuple(str(key) for key, _ in bad),
        origin=birth,
        origins=origins,
        input_set=number,
    )
