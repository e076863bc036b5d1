"""Compare two runs' results: bit for bit, or within tolerances chosen by dtype.

- :func:`bitwise_equal` and :func:`describe_tensor_difference`: the exact comparison
  of ``autograd_determinism`` (NaN equal to NaN, ``-0.0`` not ``0.0``);
- :func:`close_mismatch` with :data:`DEFAULT_TOLERANCES`: eager against compiled or
  exported code, which sums and fuses in other orders;
- :func:`differing`: which entries of two results (outputs, gradients, buffers, keyed
  alike) differ, in the first result's order.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = [
    "DEFAULT_TOLERANCES",
    "Mismatch",
    "as_bits",
    "bitwise_equal",
    "close_mismatch",
    "describe_tensor_difference",
    "differing",
    "same_value",
    "tolerances_for",
]

# (rtol, atol) by dtype: eager and compiled code sum and fuse in different orders, so
# they agree to a few units in the last places of the dtype, gradients a little less;
# torch.testing.assert_close's defaults (1.3e-6 for float32) are for one computation.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
_COMPONENT_DTYPE = {torch.complex128: torch.float64, torch.complex64: torch.float32}
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Key = TypeVar("Key", bound=Hashable)


def tolerances_for(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing eager and compiled tensors of ``dtype``; 0 for exact."""
    dtype = _COMPONENT_DTYPE.get(dtype, dtype)
    return DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))


def differing(
    reference: Mapping[Key, Any], other: Mapping[Key, Any], same: Callable[[Any, Any], bool]
) -> list[Key]:
    """The keys whose values differ or that only one side has, ``reference``'s order first."""
    keys = [*reference, *(key for key in other if key not in reference)]
    return [
        key
        for key in keys
        if key not in reference or key not in other or not same(reference[key], other[key])
    ]


def same_value(a: Any, b: Any) -> bool:
    """Bitwise for tensors; for other values the same type and ``repr`` (NaN equals NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bitwise_equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and repr(a) == repr(b)


# --- bit for bit ----------------------------------------------------------------------


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers with the same bits (NaN and -0.0 kept apart)."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.resolve_conj().resolve_neg()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_floating_point():
        return tensor.view(_INTEGER_OF_SIZE[tensor.element_size()])
    return tensor


@functools.cache
def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp``, which this process has loaded already; None without one."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return memcmp


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bits in every element."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    a_bits, b_bits = as_bits(a), as_bits(b)
    memcmp = _memcmp()
    if (
        memcmp is not None
        and a_bits.device.type == "cpu"
        and type(a_bits) is torch.Tensor
        and type(b_bits) is torch.Tensor
        and a_bits.is_contiguous()
        and b_bits.is_contiguous()
    ):
        # The comparison is what the check adds to the passes: memcmp reads the two
        # gradients several times faster than torch.equal does on one thread.
        size = a_bits.numel() * a_bits.element_size()
        return size == 0 or memcmp(a_bits.data_ptr(), b_bits.data_ptr(), size) == 0
    return torch.equal(a_bits, b_bits)


def _format_number(value: Any) -> str:
    return f"{value:.9g}" if isinstance(value, float) else repr(value)


def describe_tensor_difference(name: str, a: torch.Tensor, b: torch.Tensor, run: int) -> str:
    """One line: how many elements differ, the largest difference, the first differing one."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return (
            f"{name}: {a.dtype} {tuple(a.shape)} on {a.device} in run 1, "
            f"{b.dtype} {tuple(b.shape)} on {b.device} in run {run}"
        )
    a, b = a.detach(), b.detach()
    differs = as_bits(a) != as_bits(b)
    if differs.dim() > a.dim():  # complex: real and imaginary part
        differs = differs.any(dim=-1)
    parts = [f"{int(differs.sum())} of {a.numel()} elements differ"]
    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        x, y = a[differs].to(wide), b[differs].to(wide)
        nan_in_one = x.isnan() ^ y.isnan()
        numbers = ~(x.isnan() | y.isnan())
        if numbers.any():
            largest = float((x[numbers] - y[numbers]).abs().max())
            parts.append(
                f"largest absolute difference {largest:.3g}"
                if largest
                else "equal values with different bits (0.0 and -0.0)"
            )
        if nan_in_one.any():
            parts.append(f"{int(nan_in_one.sum())} NaN in one run only")
    else:
        gap = (a[differs].long() - b[differs].long()).abs().max()
        parts.append(f"largest absolute difference {int(gap)}")
    first = _first(differs)
    parts[-1] += (
        f" (first at {list(first)}: {_format_number(a[first].item())} in run 1, "
        f"{_format_number(b[first].item())} in run {run})"
    )
    return f"{name}: " + ", ".join(parts)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """The index of the first True element of ``mask`` (which has one)."""
    flat = int(mask.reshape(-1).to(torch.uint8).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


# --- within tolerances ----------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """How two values of the same name differ; ``index`` is the first differing element."""

    description: str
    index: tuple[int, ...] | None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "None (the backward pass did not reach it)" if value is None else repr(value)


def close_mismatch(
    name: str,
    expected: Any,
    actual: Any,
    rtol: float | None,
    atol: float | None,
    labels: tuple[str, str],
) -> Mismatch | None:
    """How ``actual`` differs from ``expected`` beyond ``rtol``/``atol``, or None.

    ``labels`` name the two sides in the text (``("eager", "compiled")``); ``None``
    tolerances take the dtype's :data:`DEFAULT_TOLERANCES`. Closeness is
    ``torch.isclose``'s, as in ``torch.testing.assert_close``, which reports only text:
    the count, the largest differences and the first element are needed as fields.
    """
    left, right = labels
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
        if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
            return Mismatch(f"{name}: {_kind(expected)} in {left}, {_kind(actual)} {right}", None)
        if type(expected) is type(actual) and repr(expected) == repr(actual):
            return None
        return Mismatch(f"{name}: {expected!r} in {left}, {actual!r} {right}", None)
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return Mismatch(
            f"{name}: {expected.dtype} {tuple(expected.shape)} in {left}, "
            f"{actual.dtype} {tuple(actual.shape)} {right}",
            None,
        )
    default_rtol, default_atol = tolerances_for(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, b = expected.detach(), actual.detach().to(expected.device)
    if a.is_floating_point() or a.is_complex():
        differs = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    else:
        differs = a != b
    if not differs.any():
        return None
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a[differs].to(wide), b[differs].to(wide)
    gap = (x - y).abs()
    largest = float(gap.nan_to_num(float("inf")).max())
    relative = float((gap / y.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())
    first = _first(differs)
    at = list(first) if first else "the only element"
    tolerance = f"rtol={rtol:g}, atol={atol:g} for {a.dtype}"
    return Mismatch(
        f"{name}: {int(differs.sum())} of {a.numel()} elements differ beyond {tolerance}; "
        f"largest absolute difference {largest:.3g}, largest relative {relative:.3g} (first at "
        f"{at}: {left} {a[first].item()!r}, {right} {b[first].item()!r})",
        first,
    )
