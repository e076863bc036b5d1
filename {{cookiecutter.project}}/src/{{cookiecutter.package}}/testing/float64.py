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

Each widening is recorded once, with the user's line, for the check's report. A
bit-level reinterpretation (``x.view(torch.int32)``) of a float tensor cannot be
kept wide: it raises :class:`CannotStayFloat64` naming the line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._device import DeviceContext, _device_constructors

from .control_flow import UNKNOWN_LOCATION, Location, user_location

__all__ = ["CannotStayFloat64", "Float64Mode", "Widening"]

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
_WITH_DTYPE_ARGUMENT = (torch.Tensor.to, torch.Tensor.type)
_SPECIAL = frozenset({*_CASTS, *_WITH_DTYPE_ARGUMENT, torch.Tensor.view})
_CONTAINERS = (list, tuple)


class CannotStayFloat64(TypeError):
    """The forward does something with a float tensor that only its narrow dtype allows."""


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
    each widening once, in the order first seen.

    It is a ``DeviceContext`` (for the default device, so it places tensors where they
    would go anyway) because the autograd engine runs backward without the function
    modes of the forward, and non-reentrant ``torch.utils.checkpoint`` re-enters just
    the ``DeviceContext`` of its forward when it recomputes in backward: so the
    recomputation is widened like the forward.
    """

    def __init__(self) -> None:
        super().__init__(torch.get_default_device())
        self.widened: dict[tuple[str, str], Widening] = {}
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
                self._note(f"{_name(func)}(dtype={dtype})", dtype)
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
        if _has_narrow(args):
            args = tuple(self._widen_tensor(func, a) for a in args)
        return func(*args, **kwargs)

    def _widen_dtype(self, func, argument: Any) -> Any:
        if isinstance(argument, torch.dtype) and argument in WIDE:
            self._note(f"{_name(func)}({argument})", argument)
            return WIDE[argument]
        if isinstance(argument, type) and issubclass(argument, torch.Tensor):
            argument = f"{argument.__module__}.{argument.__name__}"
        if isinstance(argument, str) and argument in _TYPE_NAMES:
            self._note(f"{_name(func)}({argument!r})", torch.float32)
            return _TYPE_NAMES[argument]
        return argument

    def _widen_tensor(self, func, argument: Any) -> Any:
        if type(argument) in (list, tuple):
            return type(argument)(self._widen_tensor(func, item) for item in argument)
        if isinstance(argument, torch.Tensor) and argument.dtype in WIDE:
            what = f"a {argument.dtype} tensor made outside the check, passed to {_name(func)}"
            self._note(what, argument.dtype)
            return argument.to(WIDE[argument.dtype])
        return argument

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

    def _note(self, what: str, asked: torch.dtype) -> None:
        location = _location()
        key = (what, location)
        if key not in self.widened:
            self.widened[key] = Widening(what, asked, location)


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


def _name(func: Any) -> str:
    qualified = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    defined_by = getattr(func, "__objclass__", None)
    owner = (
        "Tensor." if isinstance(defined_by, type) and issubclass(torch.Tensor, defined_by) else ""
    )
    module = getattr(func, "__module__", None) or ""
    if not owner and module.startswith("torch"):
        owner = "torch.nn.functional." if module == "torch.nn.functional" else "torch."
    return owner + qualified.split(".")[-1]
