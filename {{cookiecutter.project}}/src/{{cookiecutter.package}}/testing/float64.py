"""Keep a forward in float64 end to end while the gradient check runs it.

Finite differences with ``eps=1e-6`` resolve nothing through float32, so the gradient
check computes in float64. Converting the model's parameters is not enough: forwards
make tensors (``torch.zeros(B, H)``, ``torch.arange(n, dtype=torch.float)``), cast
(softmax "in float32": ``.float()``, ``.to(torch.float32)``, ``.half()``) and use
float32 tensors held outside the model. :class:`Float64Mode`, a
``TorchFunctionMode`` active with a float64 default dtype, widens all of it:

- a ``dtype=`` argument or a cast to float32, float16 or bfloat16 becomes float64,
  one to complex64 (``torch.cfloat``) or complex32 becomes complex128;
- a float32/float16/bfloat16/complex64 tensor argument (one the forward did not
  make under the check: a constant in a closure, a NumPy array turned into a
  tensor) is widened before the op runs.

Where an op has no float64 kernel, it is computed in float64 through an equivalent
made of ops that have one (:data:`EQUIVALENTS`: ``torch._grouped_mm`` as a matmul per
group), so autograd differentiates the equivalent: the gradient checked is then the
one of the model's math, and a wrong backward of the op's own kernel is not what is
checked. A call no equivalent reproduces runs on float32 copies instead.

Each widening, equivalent and float32 op is recorded once, with the user's line, for
the check's report. A bit-level reinterpretation (``x.view(torch.int32)``) of a float
tensor cannot be kept wide: it raises :class:`CannotStayFloat64` naming the line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._device import DeviceContext, _device_constructors

from .control_flow import UNKNOWN_LOCATION, Location, user_location, without_torch_function_modes
from .naming import op_name

__all__ = [
    "EQUIVALENTS",
    "NARROW",
    "CannotStayFloat64",
    "Equivalent",
    "Float64Mode",
    "Narrowing",
    "Substitution",
    "Widening",
    "writes",
]

WIDE = {
    torch.float32: torch.float64,
    torch.float16: torch.float64,
    torch.bfloat16: torch.float64,
    torch.complex64: torch.complex128,
    torch.complex32: torch.complex128,
}
_CASTS = {
    torch.Tensor.float: ("Tensor.float()", torch.float32),
    torch.Tensor.half: ("Tensor.half()", torch.float16),
    torch.Tensor.bfloat16: ("Tensor.bfloat16()", torch.bfloat16),
    torch.Tensor.cfloat: ("Tensor.cfloat()", torch.complex64),
    torch.Tensor.chalf: ("Tensor.chalf()", torch.complex32),
}
_TYPE_NAMES = {
    f"torch.{device}{narrow}Tensor": f"torch.{device}DoubleTensor"
    for device in ("", "cuda.")
    for narrow in ("Float", "Half", "BFloat16")
}
# Where an op has no float64 kernel and no equivalent reproduces the call, it runs on
# float32 copies (see Float64Mode._in_float32).
NARROW = {torch.float64: torch.float32, torch.complex128: torch.complex64}
_WITH_DTYPE_ARGUMENT = (torch.Tensor.to, torch.Tensor.type)
# What reads a tensor's metadata, not its values: a narrow tensor passed to these is
# not widened (nor reported).
_METADATA_METHODS = (
    "dim",
    "ndimension",
    "size",
    "stride",
    "numel",
    "nelement",
    "__len__",
    "is_floating_point",
    "is_complex",
    "is_contiguous",
    "element_size",
    "data_ptr",
    "storage_offset",
    "get_device",
    "is_conj",
    "is_neg",
)
_METADATA_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "layout",
    "is_cuda",
    "is_sparse",
    "is_meta",
)
_METADATA = frozenset(
    {
        *(getattr(torch.Tensor, name) for name in _METADATA_METHODS),
        *(getattr(torch.Tensor, name).__get__ for name in _METADATA_PROPERTIES),
    }
)
_SPECIAL = frozenset({*_CASTS, *_WITH_DTYPE_ARGUMENT, torch.Tensor.view})
_CONTAINERS = (list, tuple)


class CannotStayFloat64(TypeError):
    """The forward does something with a float tensor that only its narrow dtype allows."""


@dataclass(frozen=True)
class Narrowing:
    """An op that has no float64 kernel here: it ran on ``dtype`` copies, widened back."""

    op: str
    dtype: torch.dtype
    location: Location
    reason: str  # what torch said in float64

    def __str__(self) -> str:
        return f"{self.op} at {self.location} ({self.reason})"


@dataclass(frozen=True)
class Substitution:
    """An op that has no float64 kernel here, computed in float64 through its equivalent."""

    op: str
    equivalent: str  # what it was computed as: "a float64 matmul per group"
    location: Location

    def __str__(self) -> str:
        return f"{self.op} as {self.equivalent} (at {self.location})"


@dataclass(frozen=True)
class Widening:
    """One place where the forward asked for a narrow dtype and got float64 instead."""

    what: str
    asked: torch.dtype
    location: Location

    def __str__(self) -> str:
        return f"{self.what} at {self.location}"


class Float64Mode(DeviceContext):
    """Widens dtype arguments, casts and narrow tensor arguments to float64/complex128.

    Use it together with ``torch.set_default_dtype(torch.float64)``; ``widened`` holds
    each widening once, in the order first seen, ``substituted`` each op computed
    through its float64 equivalent, ``narrowed`` each op run in float32.

    It is a ``DeviceContext`` (for the default device, so it places tensors where they
    would go anyway) because the autograd engine runs backward without the function
    modes of the forward, and non-reentrant ``torch.utils.checkpoint`` re-enters just
    the ``DeviceContext`` of its forward when it recomputes in backward: so the
    recomputation is widened like the forward.
    """

    def __init__(self) -> None:
        super().__init__(torch.get_default_device())
        self.widened: dict[Any, Widening] = {}
        self.substituted: dict[tuple[str, Location], Substitution] = {}
        self.narrowed: dict[tuple[str, Location], Narrowing] = {}
        # By id of a narrow tensor from outside the check: (it, its version, the float64
        # copy, the copy's version).
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor, int]] = {}
        # Factories need the device filled in only if a default device other than the
        # CPU was set (that DeviceContext is replaced by this one while it is active).
        self._constructors = (
            _device_constructors() if self.device != torch.device("cpu") else frozenset()
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs for every torch call of the forward: the common case (no dtype, no cast,
        # no narrow tensor) costs a few lookups.
        if kwargs:
            dtype = kwargs.get("dtype")
            if dtype in WIDE:
                self._note(f"{op_name(func)}(dtype={dtype})", dtype)
                kwargs = {**kwargs, "dtype": WIDE[dtype]}
            if func in self._constructors and kwargs.get("device") is None:
                kwargs = {**kwargs, "device": self.device}
        elif func in self._constructors:
            kwargs = {"device": self.device}
        else:
            kwargs = {}
        if func in _SPECIAL:
            cast = _CASTS.get(func)
            if cast is not None:
                what, asked = cast
                self._note(what, asked)
                return torch.Tensor.to(args[0], WIDE[asked], **kwargs)
            if func is torch.Tensor.view:
                if len(args) == 2 and isinstance(args[1], torch.dtype):
                    self._reject_reinterpretation(args[0], args[1])
            else:
                args = tuple(self._widen_dtype(func, a) if i else a for i, a in enumerate(args))
        if func not in _METADATA and _has_narrow(args):
            args = tuple(self._widen_tensor(func, a) for a in args)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            return self._without_float64_kernel(func, args, kwargs, error)

    def _without_float64_kernel(self, func, args: tuple, kwargs: dict, error: Exception) -> Any:
        """``func`` raised ``error`` on float64 arguments: computed through its float64
        equivalent where one reproduces the call, else on float32 copies.

        The equivalent runs with no torch function mode active, as a kernel would: the
        modes outside this one saw the op, not what computes it (reading ``offs`` is no
        decision of the forward's).
        """
        equivalent = EQUIVALENTS.get(func)
        if equivalent is not None:
            try:
                with without_torch_function_modes():
                    result = equivalent.function(*args, **kwargs)
            except Exception:  # left to float32, which re-raises ``error`` if it fails too
                result = None
            if result is not None:
                location = _location()
                key = (op_name(func), location)
                if key not in self.substituted:
                    self.substituted[key] = Substitution(key[0], equivalent.description, location)
                return result
        return self._in_float32(func, args, kwargs, error)

    def _in_float32(self, func, args: tuple, kwargs: dict, error: Exception) -> Any:
        """``func`` on float32 copies of its float64 arguments, its result widened back.

        For an op that has no float64 kernel on this device (``torch._grouped_mm`` on the
        CPU): ``error`` is what it raised in float64. An op that fails in float32 too, or
        that writes into a tensor (in place, ``out=``), gets ``error`` back unchanged.
        """
        if writes(func, kwargs) or not _holds(args, kwargs, NARROW):
            raise error
        try:
            result = func(*_cast(args, NARROW), **_cast(kwargs, NARROW))
        except Exception:
            raise error from None
        location = _location()
        key = (op_name(func), location)
        if key not in self.narrowed:
            reason = (
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            )
            self.narrowed[key] = Narrowing(op_name(func), torch.float32, location, reason)
        return _cast(result, WIDE)

    def _widen_dtype(self, func, argument: Any) -> Any:
        if isinstance(argument, torch.dtype) and argument in WIDE:
            self._note(f"{op_name(func)}({argument})", argument)
            return WIDE[argument]
        if isinstance(argument, type) and issubclass(argument, torch.Tensor):
            argument = f"{argument.__module__}.{argument.__name__}"
        if isinstance(argument, str) and argument in _TYPE_NAMES:
            self._note(f"{op_name(func)}({argument!r})", torch.float32)
            return _TYPE_NAMES[argument]
        return argument

    def _widen_tensor(self, func, argument: Any) -> Any:
        if type(argument) in (list, tuple):
            return type(argument)(self._widen_tensor(func, item) for item in argument)
        if not (isinstance(argument, torch.Tensor) and argument.dtype in WIDE):
            return argument
        # A tensor from outside (a closure's constant) is widened once per check and
        # reported once, where it was first widened: every later use gets the same copy
        # while neither tensor was changed in place.
        known = self._copies.get(id(argument))
        if known is not None:
            original, version, wide, wide_version = known
            if original._version == version and wide._version == wide_version:
                return wide
        self._note(
            f"a {argument.dtype} tensor made outside the check, first used by {op_name(func)}",
            argument.dtype,
            key=("tensor", id(argument)),
        )
        wide = argument.to(WIDE[argument.dtype])
        if not argument.requires_grad:  # a copy in a graph belongs to one evaluation only
            self._copies[id(argument)] = (argument, argument._version, wide, wide._version)
        return wide

    def _reject_reinterpretation(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        if (tensor.is_floating_point() or tensor.is_complex()) and dtype.itemsize != (
            tensor.dtype.itemsize
        ):
            location = _location()
            raise CannotStayFloat64(
                f"the forward reinterprets the bits of a floating-point tensor with "
                f"Tensor.view({dtype}) at {location}: the gradient check computes in float64, "
                f"where those bits mean something else. Check this part with another tool, "
                f"or move the bit manipulation out of the function under check"
            )

    def _note(self, what: str, asked: torch.dtype, key: Any = None) -> None:
        if key is not None and key in self.widened:
            return
        location = _location()
        key = key or (what, location)
        if key not in self.widened:
            self.widened[key] = Widening(what, asked, location)


@dataclass(frozen=True)
class Equivalent:
    """How an op without a float64 kernel is computed in float64: ``function`` takes the
    op's arguments and returns its result, or ``None`` for a call it does not reproduce.

    Autograd differentiates ``function``: a gradient check's analytical gradient comes
    from its backward, not from the op's own, so what is checked is the model's math.
    """

    description: str
    function: Callable[..., torch.Tensor | None]


def _grouped_mm_per_group(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)`` on float64 tensors, one matmul per group.

    As torch 2.13 defines it (``_meta_registrations.py``, the CPU fallback): ``offs`` holds
    the int32 end offsets of the groups along the sliced dimension, each group starting
    where the one before ends (an empty group is an expert that got no tokens):

    - 2D ``(M, K)`` x 3D ``(G, K, N)`` -> ``(M, N)``: rows of group g times ``mat_b[g]``;
    - 3D ``(G, M, K)`` x 2D ``(K, N)`` -> ``(M, N)``: ``mat_a[g]`` times columns of group g;
    - 2D ``(M, K)`` x 2D ``(K, N)`` -> ``(G, M, N)``: the groups split K; an empty one is 0;
    - 3D x 3D (no ``offs``): a batched matmul.

    Rows (columns, K) past the last offset are ignored; the kernel leaves those output
    rows unwritten, here they are 0. ``None`` for what the kernel refuses or does not
    define (a bias, decreasing offsets or offsets past the end) and for complex tensors,
    which it has no kernel for either. Its 16-byte stride alignment is not required.
    """
    a, b = mat_a, mat_b
    if (
        bias is not None
        or out_dtype not in (None, torch.float64, *WIDE)
        or not a.dtype == b.dtype == torch.float64
        or {a.dim(), b.dim()} - {2, 3}
    ):
        return None
    if a.dim() == b.dim() == 3:
        return torch.bmm(a, b) if offs is None else None
    if offs is None or offs.dim() != 1 or offs.dtype != torch.int32:
        return None
    ends = offs.tolist()
    groups = list(zip([0, *ends[:-1]], ends, strict=True))  # (start, end) of each
    if a.dim() == b.dim() == 2:
        count, length = len(ends), min(a.size(1), b.size(0))
    elif a.dim() == 2:
        count, length = b.size(0), a.size(0)
    else:
        count, length = a.size(0), b.size(1)
    if not 0 < len(ends) == count or ends[-1] > length or any(s > e for s, e in groups):
        return None
    if a.dim() == b.dim() == 2:
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in groups])
    if a.dim() == 2:
        rows = [a[s:e] @ b[g] for g, (s, e) in enumerate(groups)]
        return torch.cat([*rows, a.new_zeros(a.size(0) - ends[-1], b.size(2))])
    columns = [a[g] @ b[:, s:e] for g, (s, e) in enumerate(groups)]
    return torch.cat([*columns, a.new_zeros(a.size(1), b.size(1) - ends[-1])], dim=1)


# The ops without a float64 kernel (on the CPU, in torch 2.13) that an equivalent made of
# ops with one reproduces. None other of torch's operator database (op_db) raises in
# float64 where it runs in float32 on the CPU.
EQUIVALENTS: dict[Any, Equivalent] = {
    torch._grouped_mm: Equivalent("a float64 matmul per group", _grouped_mm_per_group),
}


def _holds(args: tuple, kwargs: dict, dtypes: dict) -> bool:
    """Whether a tensor of one of ``dtypes`` is among the arguments (or in a list there)."""
    return any(_holds_one(value, dtypes) for value in (*args, *kwargs.values()))


def _holds_one(value: Any, dtypes: dict) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in dtypes
    return type(value) in _CONTAINERS and any(_holds_one(item, dtypes) for item in value)


def _cast(value: Any, dtypes: dict) -> Any:
    """``value`` with each tensor of a dtype in ``dtypes`` cast to the dtype it maps to."""
    if isinstance(value, torch.Tensor):
        return value.to(dtypes[value.dtype]) if value.dtype in dtypes else value
    if type(value) in _CONTAINERS:
        return type(value)(_cast(item, dtypes) for item in value)
    if type(value) is dict:
        return {key: _cast(item, dtypes) for key, item in value.items()}
    return value


def writes(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` writes into a tensor it is given: in place or through ``out=``."""
    name = getattr(func, "__name__", "")
    return kwargs.get("out") is not None or (name.endswith("_") and not name.endswith("__"))


def _has_narrow(values: Any) -> bool:
    """Whether a tensor of a narrow dtype is among ``values`` (or in a list or tuple there)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype in WIDE:
                return True
        elif type(value) in _CONTAINERS and _has_narrow(value):
            return True
    return False


def _location() -> Location:
    """The user's line that called the op being handled: the first frame outside this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return user_location(frame) or UNKNOWN_LOCATION
