"""Decision coverage: which data-dependent decisions of the project's own code the tests made.

Line coverage marks ``if h.mean() > 0:`` covered after one outcome; a wrong gradient
in the branch no test takes still ships. While a test runs, :func:`recording` sees
every call that turns tensor data into a Python value (a
:class:`.control_flow.DecisionMode`) and, when the line that made it lies in one of
the source folders, counts its outcome at that site:

- a branch (``Tensor.__bool__``, ``torch.equal``, ...): how often its condition held
  and how often not, as the condition is written: ``if not torch.isfinite(dt):``
  counts True when its body ran (the ``not`` is read off the line's bytecode and
  source, see :func:`_negated`); each operand of ``and``/``or`` counts whether it
  held; ``assert c`` counts True when it passed; ``while c`` counts each pass
  (True) and the exit (False);
- a number read off a tensor (``.item()``, ``float()``, ``.tolist()``): count, min,
  max, distinct values;
- a loop count (``range(int(n))``, a tensor used as an index count): the same.

Evaluations a check makes at points of its own choosing (gradcheck's finite
differences and branch search: :func:`.control_flow.probing`) are counted apart, in
their own column, and only when the evaluation completed: a probe point where the
model raised counts nothing.

:class:`Coverage` holds the sites, merges what xdist workers recorded and turns into
the terminal report and the JSON file of ``pytest --decisions``.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import dis
import enum
import functools
import linecache
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from .control_flow import MODE_HANDLERS, TORCH_DIR, DecisionMode, current_probe
from .sources import ParsedSource, parsed

__all__ = ["Coverage", "DecisionKind", "Site", "recording"]

_BRANCH_OPS = frozenset({"Tensor.__bool__", "torch.is_nonzero", "torch.equal", "torch.allclose"})
# Distinct values kept per site; past this the count is shown as "more than".
_DISTINCT_LIMIT = 1000


class DecisionKind(enum.Enum):
    BRANCH = "branch"
    NUMBER = "number"
    LOOP_COUNT = "loop count"


@dataclass
class Site:
    """One line of the project's code that made data-dependent decisions."""

    path: str
    line: int
    kind: DecisionKind
    source: str
    ops: set[str] = field(default_factory=set)
    outcomes: dict[bool, int] = field(default_factory=dict)  # branches
    probe_outcomes: dict[bool, int] = field(default_factory=dict)  # branches, at check probes
    probes: int = 0  # decisions made at check probes (numbers and loop counts: not in the range)
    count: int = 0
    minimum: float = math.inf
    maximum: float = -math.inf
    distinct: set[float] = field(default_factory=set)
    distinct_overflow: bool = False
    tests: set[str] = field(default_factory=set)

    @property
    def missing_outcomes(self) -> list[bool]:
        """The branch outcomes never seen (empty for numbers and loop counts)."""
        if self.kind is not DecisionKind.BRANCH:
            return []
        return [outcome for outcome in (True, False) if not self.outcomes.get(outcome)]

    def add(self, op: str, value: Any, test: str, probe: bool = False) -> None:
        self.ops.add(op)
        self.tests.add(test)
        if probe:
            self.probes += 1
            if self.kind is DecisionKind.BRANCH:
                self.probe_outcomes[bool(value)] = self.probe_outcomes.get(bool(value), 0) + 1
            return
        if self.kind is DecisionKind.BRANCH:
            outcome = bool(value)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            return
        for number in _numbers(value):
            self.count += 1
            self.minimum = min(self.minimum, number)
            self.maximum = max(self.maximum, number)
            if len(self.distinct) < _DISTINCT_LIMIT:
                self.distinct.add(number)
            elif number not in self.distinct:
                self.distinct_overflow = True

    def merge(self, other: Site) -> None:
        self.ops |= other.ops
        self.tests |= other.tests
        for outcome, seen in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + seen
        for outcome, seen in other.probe_outcomes.items():
            self.probe_outcomes[outcome] = self.probe_outcomes.get(outcome, 0) + seen
        self.probes += other.probes
        self.count += other.count
        self.minimum = min(self.minimum, other.minimum)
        self.maximum = max(self.maximum, other.maximum)
        room = _DISTINCT_LIMIT - len(self.distinct)
        extra = other.distinct - self.distinct
        self.distinct |= set(sorted(extra)[:room])
        self.distinct_overflow |= other.distinct_overflow or len(extra) > room

    def outcome_text(self) -> str:
        if self.kind is DecisionKind.BRANCH:
            seen = ", ".join(
                f"{outcome} x{self.outcomes.get(outcome, 0)}" for outcome in (True, False)
            )
            missing = self.missing_outcomes
            text = seen + (f" (never {missing[0]})" if len(missing) == 1 else "")
            if self.probes:
                probed = ", ".join(
                    f"{outcome} x{self.probe_outcomes.get(outcome, 0)}" for outcome in (True, False)
                )
                text += f"; at check probes: {probed}"
            return text
        probed = f"; {self.probes} more at check probes" if self.probes else ""
        if not self.count:
            return "no numbers" + probed
        distinct = (
            f"more than {len(self.distinct)}" if self.distinct_overflow else len(self.distinct)
        )
        return (
            f"{self.count} values, min {_number_text(self.minimum)}, "
            f"max {_number_text(self.maximum)}, {distinct} distinct{probed}"
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "path": self.path,
            "line": self.line,
            "source": self.source,
            "kind": self.kind.value,
            "ops": sorted(self.ops),
            "tests": sorted(self.tests),
            "probes": self.probes,
        }
        if self.kind is DecisionKind.BRANCH:
            data["outcomes"] = {str(o): self.outcomes.get(o, 0) for o in (True, False)}
            data["probe_outcomes"] = {str(o): self.probe_outcomes.get(o, 0) for o in (True, False)}
            data["missing_outcomes"] = [str(outcome) for outcome in self.missing_outcomes]
        else:
            data["outcomes"] = {
                "count": self.count,
                "min": _json_number(self.minimum) if self.count else None,
                "max": _json_number(self.maximum) if self.count else None,
                "distinct": len(self.distinct),
                "distinct_values": (
                    [_json_number(value) for value in sorted(self.distinct)]
                    if not self.distinct_overflow
                    else None
                ),
            }
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Site:
        site = cls(data["path"], data["line"], DecisionKind(data["kind"]), data["source"])
        site.ops = set(data["ops"])
        site.tests = set(data["tests"])
        site.probes = data["probes"]
        outcomes = data["outcomes"]
        if site.kind is DecisionKind.BRANCH:
            site.outcomes = {outcome: outcomes[str(outcome)] for outcome in (True, False)}
            probed = data["probe_outcomes"]
            site.probe_outcomes = {outcome: probed[str(outcome)] for outcome in (True, False)}
        else:
            site.count = outcomes["count"]
            if site.count:
                site.minimum, site.maximum = float(outcomes["min"]), float(outcomes["max"])
            values = outcomes["distinct_values"]
            site.distinct = {float(value) for value in values} if values is not None else set()
            site.distinct_overflow = values is None
        return site


def _numbers(value: Any) -> Iterator[float]:
    """The real numbers in what a decision op returned (``tolist`` gives nested lists)."""
    if isinstance(value, int | float):  # bool too
        yield float(value)
    elif isinstance(value, complex):
        yield abs(value)
    elif isinstance(value, list | tuple):
        for entry in value:
            yield from _numbers(entry)


def _json_number(number: float) -> float | str:
    """``number``, or "nan", "inf", "-inf" (which `float` reads back): JSON has no
    NaN or infinity, and strict parsers (jq, JavaScript) reject Python's ``NaN``."""
    return number if math.isfinite(number) else str(number)


def _number_text(number: float) -> str:
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else f"{number:.6g}"


def _kind(op: str, source: str) -> DecisionKind:
    if op in _BRANCH_OPS:
        return DecisionKind.BRANCH
    if op == "Tensor.__index__" or "range(" in source:
        return DecisionKind.LOOP_COUNT
    return DecisionKind.NUMBER


class Coverage:
    """The decision sites of one pytest session, keyed by (path, line)."""

    def __init__(self, sources: Sequence[Path], root: Path, excluded: Sequence[Path] = ()) -> None:
        resolved = [Path(source).resolve() for source in sources]
        self.source_files = {str(path) for path in resolved if path.is_file()}
        self.sources = tuple(f"{path}{os.sep}" for path in resolved if not path.is_file())
        self.excluded = tuple(f"{Path(path).resolve()}{os.sep}" for path in excluded)
        self.root = root
        self.sites: dict[tuple[str, int], Site] = {}
        self.test = ""
        self._in_source: dict[str, str | None] = {}

    def display_path(self, filename: str) -> str | None:
        """The path to show for a file in the source folders; None for any other file."""
        if filename not in self._in_source:
            resolved = str(Path(filename).resolve())
            shown = None
            if resolved in self.source_files or (
                resolved.startswith(self.sources) and not resolved.startswith(self.excluded)
            ):
                shown = os.path.relpath(resolved, self.root)
                if shown.startswith(os.pardir):
                    shown = resolved
            self._in_source[filename] = shown
        return self._in_source[filename]

    def record(self, op: str, value: Any, filename: str, line: int, probe: bool = False) -> None:
        """Count one decision at ``filename:line``: ``value`` is what the op returned, for a
        branch whether its condition held as written; ``probe``: made at a check's probe."""
        path = self.display_path(filename)
        if path is None:
            return
        site = self.sites.get((path, line))
        if site is None:
            source = linecache.getline(filename, line).strip()
            site = Site(path, line, _kind(op, source), source)
            self.sites[(path, line)] = site
        site.add(op, value, self.test, probe)

    def merge_json(self, sites: list[dict[str, Any]]) -> None:
        for data in sites:
            other = Site.from_json(data)
            site = self.sites.get((other.path, other.line))
            if site is None:
                self.sites[(other.path, other.line)] = other
            else:
                site.merge(other)

    def ordered(self) -> list[Site]:
        return sorted(self.sites.values(), key=lambda site: (site.path, site.line))

    def one_sided(self) -> list[Site]:
        """Branch sites that saw only one outcome."""
        return [site for site in self.ordered() if site.missing_outcomes]

    def to_json(self) -> dict[str, Any]:
        return {"sites": [site.to_json() for site in self.ordered()]}

    def report_lines(self, tests_shown: int = 3) -> list[str]:
        lines = [
            "Each row is a line of the project's code that turned tensor data into a Python "
            "value during the tests:",
            "branches count each outcome of the condition as written (True: `if not x:` ran its "
            "body; an outcome never seen is untested code); numbers and loop counts show their "
            "range; evaluations a check makes at points of its own (gradcheck's finite "
            "differences and branch search) are counted apart, at check probes.",
        ]
        if not self.sites:
            return [*lines, "(no data-dependent decisions in the source folders)"]
        for site in self.ordered():
            tests = sorted(site.tests)
            named = ", ".join(tests[:tests_shown])
            more = f" and {len(tests) - tests_shown} more" if len(tests) > tests_shown else ""
            lines.append(f"{site.path}:{site.line}: {site.source}")
            lines.append(f"    {site.kind.value}: {site.outcome_text()}")
            lines.append(f"    reached by {len(tests)} test(s): {named}{more}")
        return lines


class _CoverageRecorder(DecisionMode):
    def __init__(self, coverage: Coverage) -> None:
        super().__init__()
        self.coverage = coverage

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        # The line that made the decision: past other torch function modes and
        # torch's Python dispatch to them.
        caller: FrameType | None = frame
        while caller is not None and (
            caller.f_code.co_name in MODE_HANDLERS
            or (
                caller.f_code.co_filename.startswith(TORCH_DIR)
                and caller.f_code.co_name in ("handle_torch_function", "_wrapped")
            )
        ):
            caller = caller.f_back
        if caller is None:
            return
        filename, line = caller.f_code.co_filename, caller.f_lineno
        if self.coverage.display_path(filename) is None:
            return  # not the project's code: nothing to count, nothing to read
        if op in _BRANCH_OPS:
            result = bool(result) != _negated(caller)
        probe = current_probe()
        if probe is None:
            self.coverage.record(op, result, filename, line)
        else:
            probe.defer(functools.partial(self.coverage.record, op, result, filename, line, True))


# --- a branch's outcome as its condition is written -----------------------------------------

# Instructions that call a function: the decision is the call's own result
# (``torch.equal(a, b)``, ``bool(t)``); any other instruction asks for the truth of the
# value the instruction before it produced (a jump, ``TO_BOOL``, ``UNARY_NOT``).
_CALLS = ("CALL", "PRECALL")


def _leading_negations(source: ParsedSource, line: int) -> int:
    """The ``not``s in front of the condition of the ``if``/``while``/``assert`` on ``line``."""
    test = next(
        (
            node.test
            for node in ast.walk(source.tree)
            if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert)
            and node.test.lineno == line
        ),
        None,
    )
    count = 0
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        count, test = count + 1, test.operand
    return count


def _negated(frame: FrameType) -> bool:
    """Whether the condition as written at the frame's current instruction negates the
    tensor's truth value: an odd number of ``not`` around it (``if not x.any():``)."""
    key = (frame.f_code, frame.f_lasti)
    negated = _NEGATED.get(key)
    if negated is None:
        count = _negations(frame.f_code, frame.f_lasti, frame.f_lineno)
        negated = _NEGATED[key] = count % 2 == 1
    return negated


_NEGATED: dict[tuple[CodeType, int], bool] = {}


@functools.lru_cache(maxsize=1024)
def _instructions(code: CodeType) -> tuple[list[int], list[dis.Instruction]]:
    instructions = list(dis.get_instructions(code))
    return [instruction.offset for instruction in instructions], instructions


def _negations(code: CodeType, offset: int, line: int) -> int:
    """How many ``not`` the source applies to the value decided at ``offset``.

    Python 3.11 and later give each instruction its columns: the instruction that
    produced the decided value spans the operand (``torch.isfinite(dt)``), whose
    ``not`` parents in the parsed source are counted. Python 3.10 gives lines only:
    then the leading ``not`` of the condition on that line count.
    """
    source = parsed(code.co_filename)
    if source is None:
        return 0
    offsets, instructions = _instructions(code)
    index = bisect.bisect_left(offsets, offset)
    if index >= len(instructions) or offsets[index] != offset:
        return 0
    current = instructions[index]
    producer = (
        current if current.opname.startswith(_CALLS) or not index else instructions[index - 1]
    )
    positions = getattr(producer, "positions", None)
    if positions is None or positions.col_offset is None:
        return _leading_negations(source, line)
    node = source.spans.get(
        (positions.lineno, positions.col_offset, positions.end_lineno, positions.end_col_offset)
    )
    count = 0
    while node is not None:
        parent = source.parents.get(node)
        if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
            count += 1
        elif not isinstance(parent, ast.BoolOp):
            break
        node = parent
    return count


@contextlib.contextmanager
def recording(coverage: Coverage, test: str) -> Iterator[None]:
    """Count the decisions ``test`` makes inside the block into ``coverage``."""
    coverage.test = test
    with _CoverageRecorder(coverage):
        yield
