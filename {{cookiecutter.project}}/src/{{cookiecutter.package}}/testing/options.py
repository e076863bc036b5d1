"""A check's options, checked one way, refused in one line.

Every refusal reads ``<check>: <option>=<value> is not allowed: expected <what is
allowed>``, e.g. ``compile_check: max_graph_breaks=-1 is not allowed: expected None or
an int >= 0``. A value of the wrong type raises ``TypeError``, one of the right type
out of bounds ``ValueError``. ``True`` and ``False`` are no whole numbers here (Python
makes ``bool`` an ``int``; ``steps=True`` is a mistake, not one step). Each function
returns the value, checked. No torch: the plugin may check with it while it loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, TypeVar

__all__ = ["choice", "flag", "function", "number", "refuse", "whole_number"]

T = TypeVar("T")

# A value whose repr is longer is shown by its type (a tensor's repr runs to lines).
_SHOWN_CHARACTERS = 60


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) > _SHOWN_CHARACTERS or "\n" in text:
        return f"{type(value).__name__}(...)"
    return text


def refuse(
    check: str, option: str, value: Any, expected: str, error: type[Exception] = ValueError
) -> Exception:
    """The error refusing ``option=value`` of ``check``, saying what is ``expected``."""
    return error(f"{check}: {option}={_shown(value)} is not allowed: expected {expected}")


def _optional(expected: str, optional: bool) -> str:
    return f"None or {expected}" if optional else expected


def whole_number(
    check: str,
    option: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
    why: str = "",
) -> Any:
    """``value``, an ``int`` within ``minimum``..``maximum`` (or ``None`` when ``optional``)."""
    __tracebackhide__ = True
    if optional and value is None:
        return value
    bounds = [f">= {minimum}"] if minimum is not None else []
    bounds += [f"<= {maximum}"] if maximum is not None else []
    expected = _optional(" ".join(["an int", " and ".join(bounds)]).strip(), optional)
    expected += f" ({why})" if why else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(check, option, value, expected, TypeError)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise refuse(check, option, value, expected)
    return value


def number(
    check: str,
    option: str,
    value: Any,
    *,
    zero: bool = False,
    optional: bool = False,
    why: str = "",
) -> Any:
    """``value``, a finite ``int`` or ``float`` above 0 (at least 0 when ``zero``)."""
    __tracebackhide__ = True
    if optional and value is None:
        return value
    expected = _optional(f"a number {'>=' if zero else '>'} 0", optional)
    expected += f" ({why})" if why else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise refuse(check, option, value, expected, TypeError)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise refuse(check, option, value, expected)
    return value


def choice(check: str, option: str, value: T, choices: Collection[Any]) -> T:
    """``value``, one of ``choices``."""
    __tracebackhide__ = True
    # By equality and type: True == 1, but True is no choice among 1, 2 and 3.
    if not any(value == known and type(value) is type(known) for known in choices):
        listed = ", ".join(repr(known) for known in choices)
        raise refuse(check, option, value, f"one of {listed}")
    return value


def flag(check: str, option: str, value: Any, *, optional: bool = False) -> Any:
    """``value``, ``True`` or ``False`` (or ``None`` when ``optional``)."""
    __tracebackhide__ = True
    if not isinstance(value, bool) and not (optional and value is None):
        raise refuse(check, option, value, _optional("True or False", optional), TypeError)
    return value


def function(
    check: str, option: str, value: Any, expected: str, *, optional: bool = False
) -> Callable[..., Any]:
    """``value``, a callable (``expected`` says which: ``a loss_fn(output, targets)``)."""
    __tracebackhide__ = True
    if not callable(value) and not (optional and value is None):
        raise refuse(check, option, value, _optional(expected, optional), TypeError)
    return value
