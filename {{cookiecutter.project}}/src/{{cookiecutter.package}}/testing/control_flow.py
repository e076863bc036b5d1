"""Record the data-dependent decisions a forward makes, to compare two runs.

A dynamic model decides its graph in Python: ``if h.mean() > 0``, ``while
err.item() > tol``, ``range(int(n))``. Each such decision turns a tensor into a
Python value through one of a handful of ``Tensor`` methods. A
``TorchFunctionMode`` sees every one of them, so recording them costs one
dictionary lookup per torch call and a stack walk per decision.

    with record_decisions() as log:
        model(x)
    for decision in log:
        print(decision)   # decision #1: Tensor.__bool__ -> True at models.py:54

Two logs of the same computation on the same data must agree decision by
decision; ``first_divergence(a, b)`` says where they stop agreeing.

A check that evaluates the model at points of its own choosing (gradcheck's
finite-difference steps and branch search) marks those evaluations with
:func:`probing`; a decision mode that counts what the tests did asks
:func:`current_probe` and keeps a probe's decisions apart.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "DECISION_OPS",
    "MODE_HANDLERS",
    "TORCH_DIR",
    "UNKNOWN_LOCATION",
    "Decision",
    "DecisionLog",
    "DecisionMode",
    "Location",
    "Probe",
    "current_probe",
    "describe_divergence",
    "display_path",
    "first_divergence",
    "probing",
    "record_decisions",
    "user_location",
    "without_torch_function_modes",
]

# Each callable that turns tensor data into a Python value, by the name a report uses.
DECISION_OPS: dict[Any, str] = {
    torch.Tensor.__bool__: "Tensor.__bool__",
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.__int__: "Tensor.__int__",
    torch.Tensor.__float__: "Tensor.__float__",
    torch.Tensor.__index__: "Tensor.__index__",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.__complex__: "Tensor.__complex__",
    torch.is_nonzero: "torch.is_nonzero",
    torch.equal: "torch.equal",
    torch.allclose: "torch.allclose",
}

# A decision is located at the first frame outside torch: the user's line.
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The plugin's torch function and dispatch modes sit between the user's call and torch.
MODE_HANDLERS = frozenset({"__torch_function__", "__torch_dispatch__"})


class Location(str):
    """A line of the user's code: ``file:line`` as text, its parts as ``filename`` and ``line``.

    A ``str`` so that reports and users' assertions (``"models.py:54" in ...``) read it
    as the text it always was; the parts are kept, so nothing splits the text again.
    """

    filename: str
    line: int

    def __new__(cls, filename: str, line: int) -> Location:
        text = f"{display_path(filename)}:{line}" if line > 0 else filename
        location = super().__new__(cls, text)
        location.filename, location.line = filename, line
        return location

    def __getnewargs__(self) -> tuple[str, int]:  # type: ignore[override]
        return self.filename, self.line

    @property
    def source(self) -> str:
        """The line's code, stripped; empty when the file cannot be read."""
        return linecache.getline(self.filename, self.line).strip() if self.line > 0 else ""


UNKNOWN_LOCATION = Location("<unknown location>", 0)


@dataclass(frozen=True)
class Decision:
    """One data-dependent decision: the ``index``-th (from 1) of its run.

    ``op`` names the method (``Tensor.__bool__``), ``value`` is the Python value it
    returned, ``location`` is the line of the user's code that made it.
    """

    index: int
    op: str
    value: Any
    location: Location

    def same_as(self, other: Decision) -> bool:
        """Same op at the same place with the same value (NaN equal to NaN, -0.0 not 0.0)."""
        return (
            self.op == other.op
            and self.location == other.location
            and type(self.value) is type(other.value)
            and repr(self.value) == repr(other.value)
        )

    def __str__(self) -> str:
        return f"decision #{self.index}: {self.op} -> {_short(self.value)} at {self.location}"


class DecisionLog(Sequence[Decision]):
    """The decisions of one recorded run, in the order they were made."""

    def __init__(self) -> None:
        self._decisions: list[Decision] = []

    def __getitem__(self, index):  # type: ignore[override]
        return self._decisions[index]

    def __len__(self) -> int:
        return len(self._decisions)

    def __repr__(self) -> str:
        return f"DecisionLog({len(self)} decisions)"

    def _append(self, op: str, value: Any, location: Location) -> None:
        self._decisions.append(Decision(len(self._decisions) + 1, op, value, location))


class DecisionMode(TorchFunctionMode):
    """A torch function mode that calls :meth:`decided` for each data-dependent decision.

    Subclasses say what to do with a decision (log it, count it) and, through
    :meth:`computed`, with any other torch call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        op = DECISION_OPS.get(func)
        if op is None:
            self.computed(func, args, kwargs, result)
        else:
            self.decided(op, args, result, sys._getframe(1))
        return result

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        """``op`` (a name in :data:`DECISION_OPS`) returned ``result``; ``frame`` called it."""
        raise NotImplementedError

    def computed(self, func: Any, args: tuple, kwargs: dict | None, result: Any) -> None:
        """Any other torch call; nothing by default."""


class _DecisionRecorder(DecisionMode):
    def __init__(self, log: DecisionLog) -> None:
        super().__init__()
        self.log = log

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        self.log._append(op, result, user_location(frame) or UNKNOWN_LOCATION)


@contextlib.contextmanager
def record_decisions() -> Iterator[DecisionLog]:
    """Record every data-dependent decision made on this thread inside the block."""
    log = DecisionLog()
    with _DecisionRecorder(log):
        yield log


def without_torch_function_modes() -> _WithoutTorchFunctionModes:
    """Run the block with no torch function mode active, and put them back after it.

    ``torch.compile`` and ``torch.export`` trace the torch function modes that are
    active (a test's decision recorder under ``pytest --decisions``, say), so what
    they compile would be the mode's Python code, not the model's. Used as a
    decorator (``@without_torch_function_modes()``), its wrapper is hidden from
    pytest's tracebacks, so a failure's report ends at the check's caller.
    """
    return _WithoutTorchFunctionModes()


class _WithoutTorchFunctionModes(contextlib.AbstractContextManager):
    def __enter__(self) -> None:
        self._modes = []
        while torch._C._len_torch_function_stack():
            self._modes.append(torch._C._pop_torch_function_stack())

    def __exit__(self, *exc_info: object) -> None:
        for mode in reversed(self._modes):
            torch._C._push_on_torch_function_stack(mode)

    def __call__(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def without_modes(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            with _WithoutTorchFunctionModes():
                return function(*args, **kwargs)

        return without_modes


@dataclass(eq=False)
class Probe:
    """One evaluation a check makes at a point of its own choosing, not the test's.

    A decision mode that counts what the tests did hands each decision made during
    the probe to :meth:`defer`; the actions run when the probe completes, and are
    dropped when it raises, so a probe point where the model failed never counts.
    """

    _pending: list[Callable[[], None]] = field(default_factory=list)

    def defer(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the probe has completed without an exception."""
        self._pending.append(action)


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("probe", default=None)


def current_probe() -> Probe | None:
    """The probe being evaluated on this thread, or ``None`` in the test's own code."""
    return _PROBE.get()


@contextlib.contextmanager
def probing() -> Iterator[Probe]:
    """Mark the evaluations inside the block as a check's own probes (see :class:`Probe`)."""
    outer = _PROBE.get()
    probe = Probe()
    token = _PROBE.set(probe)
    try:
        yield probe
    finally:
        _PROBE.reset(token)
    # Reached only when the block completed: its decisions count now, or with the
    # probe around it.
    for action in probe._pending:
        if outer is None:
            action()
        else:
            outer.defer(action)


def first_divergence(
    a: Sequence[Decision], b: Sequence[Decision]
) -> tuple[int, Decision | None, Decision | None] | None:
    """The first decision number (from 1) where two logs differ, with both decisions.

    ``None`` when the logs agree. When one log is a prefix of the other, the
    shorter side's decision is ``None`` (that run made fewer decisions).
    """
    for position in range(max(len(a), len(b))):
        left = a[position] if position < len(a) else None
        right = b[position] if position < len(b) else None
        if left is None or right is None or not left.same_as(right):
            return position + 1, left, right
    return None


def describe_divergence(
    divergence: tuple[int, Decision | None, Decision | None], run: int = 2
) -> str:
    """``run 2 took a different branch at decision #k (file:line)`` plus both decisions."""
    k, reference, other = divergence
    where = (other or reference).location  # type: ignore[union-attr]
    ended = f"no decision #{k} (the run made only {k - 1})"
    return "\n".join(
        [
            f"run {run} took a different branch at decision #{k} ({where})",
            f"  run 1: {reference or ended}",
            f"  run {run}: {other or ended}",
        ]
    )


def user_location(frame: FrameType | None) -> Location | None:
    """The line of the user's code running ``frame``, or of its nearest user caller.

    Frames in torch and the plugin's own torch function and dispatch modes are
    skipped. ``None`` when the first other frame belongs to this plugin or the stack
    ends: then no user code is between the plugin and torch (an op torch's autograd
    engine runs on the plugin's behalf, or a module the plugin called directly).
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PLUGIN_DIR):
            if frame.f_code.co_name not in MODE_HANDLERS:
                return None
        elif not filename.startswith(TORCH_DIR):
            return Location(filename, frame.f_lineno)
        frame = frame.f_back
    return None


@functools.cache
def display_path(filename: str) -> str:
    """``filename`` relative to the working folder when it lies inside it; a library's
    file relative to the ``sys.path`` entry it was imported from
    (``transformers/models/mixtral/modeling_mixtral.py``); else as given."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    if not relative.startswith(os.pardir):
        return relative
    roots = [
        root
        for root in (os.path.abspath(entry) for entry in sys.path if entry)
        if filename.startswith(root + os.sep)
    ]
    return os.path.relpath(filename, max(roots, key=len)) if roots else filename


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
