"""What ``compile_check`` reports: its failures, each graph break and recompilation with
its line, and the result of a passing check, whose ``str()`` is its report.

The bottom of the package: it imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ..control_flow import Location
from ..failures import CheckFailure
from ..frames import CallPath

__all__ = [
    "CompileCheckFailure",
    "CompileCheckResult",
    "CompileMismatch",
    "CompiledRunFailed",
    "EagerFallback",
    "FailedPhase",
    "GraphBreak",
    "Recompile",
    "TooManyGraphBreaks",
    "TooManyRecompiles",
    "indented",
]


class CompileCheckFailure(CheckFailure):
    """``compile_check`` failed; the message says what and where."""

    check = "compile_check"


class CompileMismatch(CompileCheckFailure):
    """The compiled run's ``name`` (an output, a gradient, a buffer) differs from eager's."""

    def __init__(
        self,
        message: str,
        *,
        name: str,
        index: tuple[int, ...] | None,
        eager: Any,
        compiled: Any,
        input_set: int,
    ) -> None:
        super().__init__(message)
        self.name, self.index, self.input_set = name, index, input_set
        self.eager, self.compiled = eager, compiled


class FailedPhase(enum.Enum):
    """Where a compiled run failed: compiling, or running the compiled forward or backward."""

    COMPILE = "compile"
    FORWARD = "forward"
    BACKWARD = "backward"


class CompiledRunFailed(CompileCheckFailure):
    """The model ran eagerly, and raised under ``torch.compile``.

    ``phase`` is a :class:`FailedPhase`: dynamo or the backend failed while compiling,
    or the compiled forward or backward failed while running; ``torch_error`` is
    torch's exception, ``path`` the user's line and the library lines under it where
    torch says which line it was running.
    """

    def __init__(
        self,
        message: str,
        *,
        backend: str,
        phase: FailedPhase,
        input_set: int,
        path: CallPath,
        torch_error: BaseException,
    ) -> None:
        super().__init__(message)
        self.backend, self.phase, self.input_set = backend, phase, input_set
        self.path, self.torch_error = path, torch_error


class TooManyGraphBreaks(CompileCheckFailure):
    """More graph breaks than ``max_graph_breaks``; ``graph_breaks`` lists them all."""

    def __init__(self, message: str, graph_breaks: tuple[GraphBreak, ...]) -> None:
        super().__init__(message)
        self.graph_breaks = graph_breaks


class TooManyRecompiles(CompileCheckFailure):
    """More recompilations than ``max_recompiles``; ``recompiles`` lists them all."""

    def __init__(self, message: str, recompiles: tuple[Recompile, ...]) -> None:
        super().__init__(message)
        self.recompiles = recompiles


class EagerFallback(enum.Enum):
    """What torch.compile runs eagerly because of a graph break, beyond the line itself."""

    NONE = ""
    REST_OF_FUNCTION = "torch.compile runs the rest of this function eagerly"
    WHOLE_FUNCTION = "torch.compile runs this whole function eagerly"


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where ``torch.compile`` split the graph, and why.

    ``kind`` is torch's graph break type (``Data-dependent branching``), ``gb_id`` its
    id in torch's registry (``GB0170``), ``explanation`` torch's one line about it
    and ``hint`` torch's first hint that is about the user's code. ``location`` is
    the line that caused the break, ``source`` its code; ``path`` is the user's way
    there: the innermost frame in the user's files, then the library frames under
    it, the last of them ``location`` when it is a library's. ``decision`` names the
    data-dependent decision the eager run made at that line (``Tensor.__bool__``,
    ``Tensor.item``), ``None`` when the break has another cause. ``rewrite`` is the
    code that removes the break, where there is one. ``fallback`` says what torch
    runs eagerly besides.
    """

    kind: str
    gb_id: str | None
    explanation: str
    location: Location
    source: str
    path: CallPath
    decision: str | None
    fallback: EagerFallback
    hint: str | None
    rewrite: str | None

    @property
    def reason(self) -> str:
        """``kind: explanation``, the break's reason in words."""
        return f"{self.kind}: {self.explanation}" if self.explanation else self.kind

    @property
    def whole_function_eager(self) -> bool:
        """torch.compile gave up on the function holding the line and runs all of it eagerly."""
        return self.fallback is EagerFallback.WHOLE_FUNCTION

    def __str__(self) -> str:
        kind = f"{self.kind} ({self.gb_id})" if self.gb_id else self.kind
        reason = f"{kind}: {self.explanation}" if self.explanation else kind
        decided = f" (decision {self.decision})" if self.decision else ""
        eager = f"; {self.fallback.value}" if self.fallback.value else ""
        lines = [f"graph break at {self.location}: `{self.source}`: {reason}{decided}{eager}"]
        if self.path.library:  # the line is a library's: the user's way there
            lines.append("    reached from your code:")
            lines += self.path.lines(indent="    ")
        if self.hint:
            lines.append(f"    torch's hint: {self.hint}")
        if self.rewrite:
            lines += [f"    {line}" for line in self.rewrite.splitlines()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A recompilation: the compiled code's guard ``guard`` failed on a later call.

    ``guard`` says in words what changed; ``location``/``source`` are the line the
    guard was made for (the function's first line when torch does not say), ``path``
    the lines that lead there; ``function`` is the compiled function, ``code after
    the graph break at <line>`` for the rest of a function after a graph break.
    ``torch_guard`` is torch's text.
    """

    function: str
    guard: str
    location: Location
    source: str
    torch_guard: str

    def __str__(self) -> str:
        return f"recompiled {self.function} at {self.location}: `{self.source}`: {self.guard}"


@dataclasses.dataclass(frozen=True)
class CompileCheckResult:
    """A passing check: what was compared, the graph breaks, the recompilations.

    ``str()`` of it is the report ``pytest -v`` shows.
    """

    function: str
    backend: str
    input_sets: int
    compared: tuple[str, ...]
    graph_breaks: tuple[GraphBreak, ...]
    recompiles: tuple[Recompile, ...]
    seconds: float

    def __str__(self) -> str:
        lines = [
            f"compile_check {self.function} (backend {self.backend}): {len(self.compared)} "
            f"outputs and gradients match eager on {self.input_sets} input set(s); "
            f"{len(self.graph_breaks)} graph break(s), {len(self.recompiles)} recompile(s); "
            f"{self.seconds:.2f} s"
        ]
        lines += [indented(entry) for entry in (*self.graph_breaks, *self.recompiles)]
        return "\n".join(lines)


def indented(entry: object) -> str:
    """``entry``'s report, each line indented by two: one entry of a list in a message."""
    return "\n".join(f"  {line}" for line in str(entry).splitlines())
