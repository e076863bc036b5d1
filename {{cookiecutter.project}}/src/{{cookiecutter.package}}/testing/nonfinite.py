"""Where the first NaN or infinity of a run was born: the op, forward or backward, and why.

By the time a loss is NaN every tensor downstream is NaN too; the question is which op
made the first one from values that were not. :func:`find_origins` runs a forward and
backward under a dispatch mode that looks at every aten op, in forward and backward
alike, and keeps two births:

- the first op whose output holds a NaN while no tensor input did (``log`` of a
  negative number, ``0/0``, ``inf - inf``, a softmax over a row that is all ``-inf``);
- the first op whose output holds an infinity while every tensor input was finite (an
  overflow, ``x/0``, the backward of ``sqrt`` at 0).

A NaN born from an infinity (``0 * inf``) names that infinity's birth too: the NaN is
its propagation. Each birth says where (:class:`.op_sites.OpSite`: the submodule, the
user's line, for a backward op the forward call it belongs to), the first element it
made, the input values at that element, the cause in words, and the data-dependent
decisions taken before it. Scalars passed to an op (``masked_fill(mask, -inf)``) are
not tensor inputs: a deliberate ``-inf`` mask is born there, and a NaN that a softmax
makes of it is the softmax's.

Looking at every op's output costs a device synchronisation per op: this is the
replay that runs once a cheap check found a non-finite value, never the check itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import control_flow
from .control_flow import Decision
from .op_sites import GraphTagger, ModuleStack, OpSite, op_site

__all__ = [
    "Birth",
    "Origins",
    "find_loss_origins",
    "find_origins",
    "non_finite_text",
    "origin_lines",
]

# Decisions listed before a birth: the last ones, which chose the path to it.
_DECISIONS_SHOWN = 3
# Ops whose NaN or infinity at an element comes from the input's value there, by the
# input values that make it (the words name the cause).
_DOMAINS: dict[str, Callable[[list[float]], str | None]] = {}


def _domain(*names: str) -> Callable[[Callable[[list[float]], str | None]], Any]:
    def register(explain: Callable[[list[float]], str | None]) -> Any:
        for name in names:
            _DOMAINS[name] = explain
        return explain

    return register


@_domain("log", "log2", "log10")
def _log(values: list[float]) -> str | None:
    (x, *_) = values
    return (
        "the logarithm of a negative number" if x < 0 else "the logarithm of 0" if x == 0 else None
    )


@_domain("log1p")
def _log1p(values: list[float]) -> str | None:
    (x, *_) = values
    return "log1p of a number below -1" if x < -1 else "log1p of -1" if x == -1 else None


@_domain("sqrt", "rsqrt")
def _sqrt(values: list[float]) -> str | None:
    (x, *_) = values
    return "the square root of a negative number" if x < 0 else "1/sqrt of 0" if x == 0 else None


@_domain("div", "true_divide", "reciprocal")
def _div(values: list[float]) -> str | None:
    if len(values) == 1:
        return "1/0" if values[0] == 0 else None
    a, b = values[:2]
    if a == 0 and b == 0:
        return "0/0"
    if b == 0:
        return "a division by 0"
    if math.isinf(a) and math.isinf(b):
        return "inf/inf"
    return None


@_domain("pow")
def _pow(values: list[float]) -> str | None:
    if len(values) < 2:
        return None
    base, exponent = values[:2]
    if base < 0 and not float(exponent).is_integer():
        return "a negative number to a fractional power"
    if base == 0 and exponent < 0:
        return "0 to a negative power"
    return None


@_domain("mul")
def _mul(values: list[float]) -> str | None:
    if len(values) >= 2 and {0.0, math.inf} <= {abs(v) for v in values[:2]}:
        return "0 * inf"
    return None


@_domain("sub", "add")
def _add(values: list[float]) -> str | None:
    if len(values) >= 2 and all(math.isinf(v) for v in values[:2]):
        return "inf - inf"
    return None


@_domain("acos", "asin")
def _arc(values: list[float]) -> str | None:
    return "an arc sine or cosine of a number outside [-1, 1]" if abs(values[0]) > 1 else None


@_domain("exp", "exp2", "expm1", "cosh", "sinh")
def _exp(values: list[float]) -> str | None:
    return "an exponential too large for the dtype" if values[0] > 0 else None


@dataclass(frozen=True)
class Birth:
    """One op that made a non-finite value from inputs that had none of its kind.

    ``op`` is the aten op (``log``), ``site`` where it ran, ``kind`` ``NaN``, ``inf`` or
    ``-inf`` (the first such element, at ``element`` of an output of ``dtype``),
    ``inputs`` the value of each tensor input at that element (broadcast; ``None`` for an
    input not elementwise with the output), ``cause`` the reason in words where the op
    and the values tell it, ``decisions`` the last data-dependent decisions before it.
    """

    op: str
    site: OpSite
    kind: str
    element: tuple[int, ...]
    dtype: torch.dtype
    inputs: tuple[float | None, ...]
    cause: str
    decisions: tuple[Decision, ...]
    deliberate: bool = False  # an infinity the code passed in (masked_fill(mask, -inf))
    from_infinity: bool = False  # a NaN made of an infinite input (0 * inf, inf - inf)

    @property
    def backward(self) -> bool:
        return self.site.forward is not None or self.site.what.startswith("backward")

    def __str__(self) -> str:
        values = ", ".join(_number(v) for v in self.inputs if v is not None)
        element = f" at element {list(self.element)}" if self.element else ""
        of = f" of {values}" if values else ""
        cause = f": {self.cause}" if self.cause else ""
        op = self.op.lstrip("_")
        return f"{self.kind} made by {op}{of}{element} ({self.dtype}){cause}, {self.site}"


@dataclass(frozen=True)
class Origins:
    """The births a run had (``None`` when none): the first NaN's, the first infinity's
    that no code passed in, and the first infinity the code passed in (a mask's)."""

    nan: Birth | None
    inf: Birth | None
    mask: Birth | None

    @property
    def origin(self) -> Birth | None:
        """Where it started: the infinity a NaN was made of, else the NaN, else the
        infinity; a mask's infinity is never an origin, the op that made NaN of it is."""
        if self.nan is not None and self.nan.from_infinity and self.inf is not None:
            return self.inf
        return self.nan or self.inf


class _Finder(TorchDispatchMode):
    def __init__(self, modules: ModuleStack, decisions: control_flow.DecisionLog) -> None:
        super().__init__()
        self.modules, self.decisions = modules, decisions
        self.nan: Birth | None = None
        self.inf: Birth | None = None
        self.mask: Birth | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.nan is not None and self.inf is not None and self.mask is not None:
            return result
        outputs = _floating(result)
        if not outputs:
            return result
        inputs = _floating((args, kwargs))
        out_nan = any(bool(t.isnan().any()) for t in outputs)
        out_inf = any(bool(t.isinf().any()) for t in outputs)
        if not (out_nan or out_inf):
            return result
        in_nan = any(bool(t.isnan().any()) for t in inputs)
        in_inf = any(bool(t.isinf().any()) for t in inputs)
        if self.nan is None and out_nan and not in_nan:
            self.nan = self._birth(func, args, outputs, torch.isnan, from_infinity=in_inf)
        if out_inf and not in_nan and not in_inf:
            deliberate = any(
                isinstance(a, float) and math.isinf(a) for a in pytree.tree_leaves((args, kwargs))
            )
            if deliberate and self.mask is None:
                self.mask = self._birth(func, args, outputs, torch.isinf, deliberate=True)
            elif not deliberate and self.inf is None:
                self.inf = self._birth(func, args, outputs, torch.isinf)
        return result

    def _birth(
        self,
        func: Any,
        args: tuple,
        outputs: list[torch.Tensor],
        test: Callable[[torch.Tensor], torch.Tensor],
        deliberate: bool = False,
        from_infinity: bool = False,
    ) -> Birth:
        output = next(t for t in outputs if bool(test(t).any()))
        flat = int(test(output).reshape(-1).to(torch.uint8).argmax())
        element = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), output.shape))
        value = float(output[element]) if output.dim() else float(output)
        kind = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        # The operands in order: a tensor's value at the element, a number as given.
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        # The operands in order: a tensor's value at the element, and for an elementwise
        # op of _DOMAINS a number as given (another op's numbers are options: a dim).
        operand_numbers = name.rstrip("_") in _DOMAINS
        values = tuple(
            _value_at(a, output.shape, element) if isinstance(a, torch.Tensor) else float(a)
            for a in args
            if isinstance(a, torch.Tensor)
            or (operand_numbers and isinstance(a, int | float) and not isinstance(a, bool))
        )
        cause = (
            "an infinity the code passes in (a mask's fill value)"
            if deliberate
            else _cause(name, values, output, kind)
        )
        decided = tuple(self.decisions[-_DECISIONS_SHOWN:])
        return Birth(
            name,
            op_site(self.modules, sys._getframe(2)),
            kind,
            element,
            output.dtype,
            values,
            cause,
            decided,
            deliberate,
            from_infinity,
        )


def _floating(tree: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]


def _value_at(tensor: torch.Tensor, shape: torch.Size, element: tuple[int, ...]) -> float | None:
    """The tensor's value at ``element`` of an output of ``shape``, broadcast; ``None``
    when it is not elementwise with the output."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    try:
        expanded = tensor.expand(shape) if tensor.shape != shape else tensor
    except RuntimeError:
        return None
    return float(expanded[element]) if element else float(expanded.reshape(()))


def _cause(name: str, values: tuple[float | None, ...], output: torch.Tensor, kind: str) -> str:
    explain = _DOMAINS.get(name.rstrip("_"))
    known = [v for v in values if v is not None]
    if explain is not None and known:
        text = explain(known)
        if text:
            return text
    if name in ("_softmax", "_log_softmax", "softmax", "log_softmax"):
        return "a softmax over values that are all -inf (a fully masked row)"
    if kind != "NaN":  # from finite inputs, no domain above explains it
        largest = torch.finfo(output.dtype).max
        return f"a result beyond {output.dtype}'s largest value {largest:.6g}: an overflow"
    return ""


def _number(value: float) -> str:
    return f"{value:.6g}"


def find_origins(run: Callable[[], Any], roots: list[tuple[str, nn.Module]]) -> Origins:
    """The births of NaN and infinity in ``run()`` (a forward and backward), looking at
    every op's output: for a run that already showed a non-finite value."""
    with (
        control_flow.without_torch_function_modes(),
        ModuleStack(roots) as modules,
        control_flow.record_decisions() as log,
        GraphTagger(modules),
    ):
        finder = _Finder(modules, log)
        with finder:
            run()
    return Origins(finder.nan, finder.inf, finder.mask)


def find_loss_origins(
    loss_of: Callable[[], torch.Tensor], roots: list[tuple[str, nn.Module]], wrt: list[torch.Tensor]
) -> Origins:
    """:func:`find_origins` of a loss's forward and its backward to ``wrt``. The backward
    is called from here, the plugin's code, so each backward op is named by the forward
    call that made its node rather than by the line that asked for the gradients."""

    def run() -> None:
        loss = loss_of()
        if loss.requires_grad:
            torch.autograd.grad(loss, wrt, allow_unused=True)

    return find_origins(run, roots)


def non_finite_text(tensor: torch.Tensor) -> str:
    """``2 NaN of 12 elements (first at [0, 3]: nan)``."""
    tensor = tensor.detach()
    nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
    kinds = [f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "inf")) if count]
    bad = ~torch.isfinite(tensor)
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tensor.shape))
    first = f"at {list(index)}: " if index else ""
    return (
        f"{' and '.join(kinds)} of {tensor.numel()} elements (first {first}{tensor[index].item()})"
    )


def origin_lines(origins: Origins) -> list[str]:
    """The report of a run's births: the origin with its line of source, the NaN it made
    when that is another op's, the mask an infinity came from, the decisions on the way."""
    origin = origins.origin
    assert origin is not None, "a run with no birth has no origin to report"
    lines = [f"Origin, in the {_phase(origin)}: {origin}", *_source(origin)]
    nan = origins.nan
    if nan is not None and nan is not origin:
        lines += [f"Then, in the {_phase(nan)}: {nan}", *_source(nan)]
    if origin is nan and nan.from_infinity and origins.mask is not None:
        lines.append(f"Its infinite input was put there by the code: {origins.mask}")
    if origin.decisions:
        lines.append("Decisions on the way there:")
        lines += [f"  {decision}" for decision in origin.decisions]
    return lines


def _phase(birth: Birth) -> str:
    return "backward" if birth.backward else "forward"


def _source(birth: Birth) -> list[str]:
    where = birth.site.user_line
    return [f"    {where.line}: {where.source}"] if where is not None and where.source else []
