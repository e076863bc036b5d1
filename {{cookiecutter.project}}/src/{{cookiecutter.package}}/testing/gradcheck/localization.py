"""Where a wrong first-order gradient enters: a gradient hook of the wrong parameter, a
custom autograd Function or the smallest submodule wrong on its own, each part checked
on its own (:mod:`..parts`) at the inputs it got, within the diagnosis budget."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..control_flow import UNKNOWN_LOCATION
from ..naming import element_name
from ..parts import FunctionCall, ModuleCall, Parts, record_parts
from ..trees import leaves
from .problem import Problem, hook_name
from .results import ErrorSource, SourceKind, WrongGradient
from .screen import DIAGNOSIS_FLOOR, Check

__all__ = ["LOCALIZATION_PARTS", "localized"]

# When a wrong first-order gradient is found, at most this many parts of the forward
# (custom autograd Functions, submodules) are checked on their own, each in fast mode.
LOCALIZATION_PARTS = 16
# A part's evaluation counts as at least this share of one of the whole model.
_SMALLEST_SHARE = 1 / 64


def localized(
    problem: Problem,
    check: Check,
    failure: WrongGradient,
    point: Sequence[torch.Tensor] | None = None,
) -> WrongGradient:
    """``failure`` told from where the error enters to what it reaches.

    Narrowed down within the diagnosis budget, cheapest first: a gradient hook of the
    wrong parameter (the check without it passes); else each custom autograd Function
    the forward applied, checked on its own at the inputs it got there; else the
    submodules, from the outermost down, to the smallest one wrong on its own. Each
    part is checked in fast mode, then diagnosed like the whole.
    """
    started = time.perf_counter()
    search = _Localization(problem, check)
    at_point = [checked.value for checked in problem.checked]
    if point is not None:  # the other side of a branch, where the failure was found
        for checked, value in zip(problem.checked, point, strict=True):
            checked.value = value
    try:
        source, part = search.run(failure)
    finally:
        for checked, value in zip(problem.checked, at_point, strict=True):
            checked.value = value
    if search.checked_parts == 0 and source is None:
        return failure
    lines = str(failure).splitlines()
    what = lines[0].split(" with respect to ")[0]
    diagnosis = round(
        problem.evaluations + search.part_evaluations - check.run_started - check.spent
    )
    narrowed = (
        f"  narrowed down in {time.perf_counter() - started:.2f} s by checking parts on their "
        f"own ({search.summary()}); the diagnosis made {diagnosis:,} "
        f"evaluations, {diagnosis / max(check.spent, 1):.1f}x the {check.spent:,} of the check"
    )
    if source is None:
        body = [lines[0], *lines[1:-1], narrowed + "; no part is wrong on its own", lines[-1]]
        message = "\n".join(body)
    else:
        element = lines[0].split(" with respect to ", 1)[1]
        head = [f"{what}: the error enters in {source}"]
        if part is not None:
            head.append(f"  on its own, at the inputs it got there: {part}")
        head.append(f"  it reaches {element}:")
        message = "\n".join([*head, *lines[1:-1], narrowed, lines[-1]])
    found = WrongGradient(
        message,
        tensor=failure.tensor,
        index=failure.index,
        order=failure.order,
        numerical=failure.numerical,
        analytical=failure.analytical,
        source=source,
    )
    found.output = failure.output
    return found


class _Localization:
    """Checks the parts of a failing model on their own, within the diagnosis budget."""

    def __init__(self, problem: Problem, check: Check) -> None:
        self.problem, self.check = problem, check
        remaining = check.diagnosis_budget() - problem.evaluations
        self.budget = max(remaining, check.spent + DIAGNOSIS_FLOOR)
        self.started = problem.evaluations
        # The parts' own evaluations, each counted as the share of a whole evaluation its
        # checked elements are of the model's (a part's forward is that much smaller).
        self.part_evaluations = 0.0
        self.elements = sum(c.numel for c in problem.checked) or 1
        self.functions = self.modules = self.hooks = 0
        self.checked_parts = 0

    def summary(self) -> str:
        """What was checked on its own: ``1 autograd Function call and 3 module calls``."""
        parts = ["the model without its gradient hooks"] if self.hooks else []
        for count, what in (
            (self.functions, "autograd Function call"),
            (self.modules, "module call"),
        ):
            if count:
                parts.append(f"{count} {what}" + ("s" if count > 1 else ""))
        return " and ".join(parts) or "no part"

    @property
    def evaluations(self) -> float:
        """What the narrowing has cost so far, in evaluations of the whole model."""
        return self.part_evaluations + self.problem.evaluations - self.started

    @property
    def exhausted(self) -> bool:
        return self.checked_parts >= LOCALIZATION_PARTS or self.evaluations >= self.budget

    def run(self, failure: WrongGradient) -> tuple[ErrorSource | None, str | None]:
        """Where the error enters, and the part's own wrong derivative (as text)."""
        hook = self._hook(failure)
        if hook is not None:
            return hook, None
        problem = self.problem
        point = [c.value.detach().requires_grad_() for c in problem.checked]
        with problem.installed(), record_parts(problem.module_names()) as parts:
            problem.evaluate(point)
        found = self._functions(parts) or self._modules(parts)
        return found or (None, None)

    def _part(self, function, args: tuple, kwargs: dict, params, hooks: bool = True):
        """The failure of ``function`` checked on its own; ``None`` when it passes or cannot
        be checked on its own (an exception, a boundary: inconclusive).

        Fast mode first; where it passes, slow mode too if it fits in the budget: one
        random direction misses an error orthogonal to it (two swapped elements of equal
        sign in it), every element does not.
        """
        self.checked_parts += 1
        part = None
        try:
            part = Problem(function, args, kwargs, params)
            part.hooks_enabled = hooks
            with part.installed():
                if not part.repeats_itself():
                    return None  # it keeps state between calls (a cache): no function to check
                for fast in (True, False):
                    slow_cost = 2 * sum(c.numel for c in part.checked) + 2
                    if not fast and slow_cost > self.budget - self.evaluations - part.evaluations:
                        break
                    self._check(part, fast=fast, reason="a part checked on its own", part=True)
        except WrongGradient as failure:
            return failure
        except Exception:  # the part cannot be checked on its own: no verdict
            return None
        finally:
            if part is not None:
                share = sum(c.numel for c in part.checked) / self.elements
                self.part_evaluations += part.evaluations * min(1.0, max(share, _SMALLEST_SHARE))
        return None

    def _check(self, problem: Problem, *, fast: bool, reason: str, part: bool = False) -> None:
        """First order of ``problem`` with the failing check's step and given tolerances."""
        # The failing check's step and given tolerances; the others from the part's own
        # outputs, in the arithmetic the part runs in.
        check = Check(problem, fast=fast, reason=reason, requested=self.check.requested)
        check.part = part
        check.run(1)

    def _hook(self, failure: WrongGradient) -> ErrorSource | None:
        """The wrong parameter's gradient hooks, when the check passes without them."""
        problem = self.problem
        checked = next((c for c in problem.checked if c.name == failure.tensor), None)
        if checked is None or not checked.hooks:
            return None
        self.hooks += 1
        self.checked_parts += 1
        problem.hooks_enabled = False
        try:
            with problem.installed():
                self._check(problem, fast=True, reason="the model without its gradient hooks")
        except Exception:  # still wrong without them (or not checkable): not the hooks
            return None
        finally:
            problem.hooks_enabled = True
        hooks = ", ".join(hook.description for hook in checked.hooks)
        return ErrorSource(SourceKind.HOOK, hooks, checked.hooks[0].location, tensor=checked.name)

    def _whole_model(self, call: ModuleCall, level: list[ModuleCall]) -> bool:
        """Whether ``call`` is the model the check ran: the callable itself, or the one
        module a function called at the top (``lambda x: model(x)``) holding every
        parameter checked. Checked on its own it would only repeat the check."""
        if call.module is self.problem.function:
            return True
        if call.parent is not None or any(other.module is not call.module for other in level):
            return False
        checked = {id(tensor) for tensor in self.problem.user_parameters()}
        return checked <= _parameter_ids(call.module)

    def _functions(self, parts: Parts) -> tuple[ErrorSource, str] | None:
        seen: set[tuple] = set()
        for call in parts.functions:
            key = (call.function, call.location, call.module.name if call.module else None)
            if key in seen or not _differentiable(call.args, call.kwargs):
                continue
            seen.add(key)
            if self.exhausted:
                return None
            self.functions += 1
            failure = self._part(_applier(call), call.args, call.kwargs, False)
            if failure is not None:
                source = ErrorSource(
                    SourceKind.FUNCTION,
                    call.function.__qualname__.replace(".<locals>", ""),
                    call.backward_location,
                    applied_at=call.location if call.location.line else None,
                    module=call.module.describe() if call.module else "",
                    tensor=failure.tensor,
                    index=failure.index,
                    numerical=failure.numerical,
                    analytical=failure.analytical,
                )
                return source, _derivative_text(failure)
        return None

    def _modules(self, parts: Parts) -> tuple[ErrorSource, str | None] | None:
        """The smallest module call wrong on its own, descending from the outermost."""
        checked_names = {c.name.removeprefix("parameter ") for c in self.problem.checked}
        found: tuple[ModuleCall, WrongGradient | None] | None = None
        level = parts.modules
        while level and not self.exhausted:
            wrong = None
            seen: set[int] = set()
            for call in level:
                if id(call.module) in seen:
                    continue
                seen.add(id(call.module))
                if self._whole_model(call, level):
                    wrong = (call, None)  # the whole model: known to be wrong
                    break
                if self.exhausted:
                    break
                prefix = f"{call.name}." if call.name else ""
                params = [
                    name.removeprefix(prefix)
                    for name, _ in call.module.named_parameters(prefix=call.name)
                    if name in checked_names
                ]
                if not params and not _differentiable(call.args, call.kwargs):
                    continue
                self.modules += 1
                failure = self._part(call.module, call.args, call.kwargs, params)
                if failure is not None:
                    wrong = (call, failure)
                    break
            if wrong is None:
                break
            found = wrong
            level = wrong[0].children
        if found is None:
            return None
        call, failure = found
        children = ", ".join(sorted({child.name for child in call.children}))
        if failure is None:  # the model itself
            if not self.modules:
                return None  # nothing smaller was checked: nothing to add
            name = (
                f"the forward of {call.describe()} itself: none of its submodules ({children}) "
                f"is wrong on its own, nor any autograd Function"
            )
        else:
            within = f" (none of its submodules {children} is, nor any autograd Function)"
            name = call.describe() + ": wrong on its own" + (within if children else "")
            hooks = [
                hook_name(hook)
                for hooks in (call.module._backward_hooks, call.module._backward_pre_hooks)
                for hook in hooks.values()
            ]
            if hooks:
                name += f", with its backward hook(s) {', '.join(hooks)}"
        source = ErrorSource(
            SourceKind.MODULE,
            name,
            UNKNOWN_LOCATION,
            module=call.name,
            tensor=failure.tensor if failure else "",
            index=failure.index if failure else (),
            numerical=failure.numerical if failure else 0.0,
            analytical=failure.analytical if failure else 0.0,
        )
        return source, _derivative_text(failure) if failure else None


def _parameter_ids(module: nn.Module) -> set[int]:
    return {id(parameter) for parameter in module.parameters()}


def _differentiable(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor that requires grad is among the arguments."""
    return any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves((args, kwargs))
    )


def _applier(call: FunctionCall) -> Callable[..., Any]:
    """``call.function.apply`` as a function named like it, its inputs named like the forward's."""
    function = call.function

    def apply(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)

    apply.__qualname__ = f"{function.__qualname__}.apply".replace(".<locals>", "")
    named = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in call.input_names()
    ]
    rest = [inspect.Parameter("inputs", inspect.Parameter.VAR_POSITIONAL)]
    apply.__signature__ = inspect.Signature(named + rest)  # type: ignore[attr-defined]
    return apply


def _derivative_text(failure: WrongGradient) -> str:
    """``d output[0, 1] / d input x[1, 2]: numerical 0.1, analytical 0.2``."""
    element = element_name(failure.tensor, failure.index)
    return (
        f"d {failure.output} / d {element}: numerical {failure.numerical:.6g}, analytical "
        f"{failure.analytical:.6g}"
    )
