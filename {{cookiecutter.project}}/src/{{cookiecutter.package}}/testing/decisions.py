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
- a loop count (``range(int(n))``, a tensor used as an index count, ``for e in t:``
  over a tensor): the same;
- a data-dependent size: the length of the result of an op whose output shape
  depends on the data (``nonzero``, ``x[mask]``, ``unique``, ... :data:`.data_dependence.SIZE_OPS`):
  count, min, max, and how often it was 0. An empty result is where a routed model's
  code runs on nothing (a mixture-of-experts expert that no token chose), so the
  report says how often that happened.

Decisions made in the processes a check starts for the test (``ddp_check``'s ranks,
``autograd_determinism``'s fresh process) count for the test too: the check asks
:func:`for_child` for the settings to hand over, the child records into its own
:class:`Coverage` (:func:`child_coverage`) and writes it whole to the folder those
settings name (:func:`save_for_parent`), and the check merges what the children wrote
once they ended (:func:`merge_children`): a child killed before writing adds nothing.

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
import json
import linecache
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch

from .._files import write_atomically
from .control_flow import MODE_HANDLERS, TORCH_DIR, DecisionMode, current_probe
from .data_dependence import SIZE_OPS, data_dependent_size
from .sources import ParsedSource, parsed

__all__ = [
    "ChildRecording",
    "Coverage",
    "DecisionKind",
    "Site",
    "child_coverage",
    "for_child",
    "merge_children",
    "recording",
    "save_for_parent",
]

_BRANCH_OPS = frozenset({"Tensor.__bool__", "torch.is_nonzero", "torch.equal", "torch.allclose"})
# Distinct values kept per site; past this the count is shown as "more than".
_DISTINCT_LIMIT = 1000


class DecisionKind(enum.Enum):
    BRANCH = "branch"
    NUMBER = "number"
    LOOP_COUNT = "loop count"
    SIZE = "size"


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
    zeros: int = 0  # values that were 0 (a loop that ran no pass, an empty result)
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
            self.zeros += number == 0
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
        self.zeros += other.zeros
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
        if self.kind is DecisionKind.SIZE:
            return self._size_text() + probed
        if not self.count:
            return "no numbers" + probed
        distinct = (
            f"more than {len(self.distinct)}" if self.distinct_overflow else len(self.distinct)
        )
        zeros = (
            f", 0 in {self.zeros} of {self.count}"
            if self.kind is DecisionKind.LOOP_COUNT and self.zeros
            else ""
        )
        return (
            f"{self.count} values, min {_number_text(self.minimum)}, "
            f"max {_number_text(self.maximum)}, {distinct} distinct{zeros}{probed}"
        )

    def _size_text(self) -> str:
        if not self.count:
            return "no sizes"
        if self.zeros == self.count:
            return (
                f"0 in all {self.count} calls: the result was always empty, so the code "
                "that uses it never ran on data"
            )
        sizes = (
            f"{_number_text(self.minimum)} to {_number_text(self.maximum)} in {self.count} calls"
        )
        if not self.zeros:
            return f"{sizes}; never 0 (no test had it select nothing)"
        return (
            f"{sizes}; 0 in {self.zeros} of {self.count} calls (an empty result: the code "
            "that uses it ran on no rows there)"
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
                "zeros": self.zeros,
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
            site.zeros = outcomes["zeros"]
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
    if op in _SIZE_OP_NAMES:
        return DecisionKind.SIZE
    if op in ("Tensor.__index__", _TENSOR_LOOP) or "range(" in source:
        return DecisionKind.LOOP_COUNT
    return DecisionKind.NUMBER


@functools.lru_cache(maxsize=4096)
def _a_tests_assertion(filename: str, line: int) -> bool:
    """Whether ``line`` of a test module (``test_*.py``, ``*_test.py``, ``conftest.py``)
    lies in an ``assert``: a test's check of a result, not a decision of the code under
    test (in a passing run it holds every time, so it would read "never False")."""
    name = os.path.basename(filename)
    if not (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"):
        return False
    source = parsed(filename)
    return source is not None and any(
        isinstance(node, ast.Assert) and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in ast.walk(source.tree)
    )


class Coverage:
    """The decision sites of one pytest session, keyed by (path, line, kind).

    ``sources``: the folders and files whose decisions count; ``excluded``: folders and
    files inside them that do not (a file given in ``sources`` counts all the same).
    """

    def __init__(self, sources: Sequence[Path], root: Path, excluded: Sequence[Path] = ()) -> None:
        self.given = (tuple(map(str, sources)), str(root), tuple(map(str, excluded)))
        resolved = [Path(source).resolve() for source in sources]
        self.source_files = {str(path) for path in resolved if path.is_file()}
        self.sources = tuple(f"{path}{os.sep}" for path in resolved if not path.is_file())
        excluded_paths = [Path(path).resolve() for path in excluded]
        self.excluded_files = {str(path) for path in excluded_paths if path.is_file()}
        self.excluded = tuple(f"{path}{os.sep}" for path in excluded_paths if not path.is_file())
        self.root = root
        self.sites: dict[tuple[str, int, DecisionKind], Site] = {}
        self.test = ""
        self._in_source: dict[str, str | None] = {}

    def display_path(self, filename: str) -> str | None:
        """The path to show for a file in the source folders; None for any other file."""
        if filename not in self._in_source:
            resolved = str(Path(filename).resolve())
            shown = None
            if resolved in self.source_files or (
                resolved.startswith(self.sources)
                and not resolved.startswith(self.excluded)
                and resolved not in self.excluded_files
            ):
                shown = self._shown(resolved)
            self._in_source[filename] = shown
        return self._in_source[filename]

    def _shown(self, path: str) -> str:
        shown = os.path.relpath(path, self.root)
        return path if shown.startswith(os.pardir) else shown

    def record(self, op: str, value: Any, filename: str, line: int, probe: bool = False) -> None:
        """Count one decision at ``filename:line``: ``value`` is what the op returned, for a
        branch whether its condition held as written, for a size the size; ``probe``: made
        at a check's probe."""
        path = self.display_path(filename)
        if path is None or _a_tests_assertion(filename, line):
            return
        source = linecache.getline(filename, line).strip()
        kind = _kind(op, source)
        site = self.sites.get((path, line, kind))
        if site is None:
            site = Site(path, line, kind, source)
            self.sites[(path, line, kind)] = site
        site.add(op, value, self.test, probe)

    def merge_json(self, sites: list[dict[str, Any]]) -> None:
        for data in sites:
            other = Site.from_json(data)
            key = (other.path, other.line, other.kind)
            site = self.sites.get(key)
            if site is None:
                self.sites[key] = other
            else:
                site.merge(other)

    def ordered(self) -> list[Site]:
        kinds = list(DecisionKind)
        return sorted(
            self.sites.values(), key=lambda site: (site.path, site.line, kinds.index(site.kind))
        )

    def one_sided(self) -> list[Site]:
        """Branch sites that saw only one outcome."""
        return [site for site in self.ordered() if site.missing_outcomes]

    def to_json(self) -> dict[str, Any]:
        return {"sites": [site.to_json() for site in self.ordered()]}

    def looked_in(self) -> str:
        """The folders and files whose decisions count, each folder with what in it does not,
        as a phrase."""
        places = []
        for folder in self.sources:
            left_out = sorted(
                os.path.relpath(path, folder) + (os.sep if path in self.excluded else "")
                for path in (*self.excluded, *self.excluded_files)
                if path.startswith(folder)
            )
            less = f" (not {', '.join(left_out)})" if left_out else ""
            places.append(self._shown(folder.rstrip(os.sep)) + less)
        places.extend(self._shown(path) for path in sorted(self.source_files))
        return "looked in " + "; ".join(places)

    def report_lines(self, tests_shown: int = 3) -> list[str]:
        lines = [
            "Each row is a line of the project's code that turned tensor data into a Python "
            "value during the tests:",
            "branches count each outcome of the condition as written (True: `if not x:` ran its "
            "body; an outcome never seen is untested code); numbers and loop counts show their "
            "range; sizes are the lengths of results whose shape depends on the data "
            "(nonzero, x[mask], unique, ...), with how often one was 0 (empty: the code that "
            "uses it ran on nothing); evaluations a check makes at points of its own "
            "(gradcheck's finite differences and branch search) are counted apart, at check "
            "probes.",
        ]
        if not self.sites:
            return [
                *lines,
                f"(no data-dependent decisions found: {self.looked_in()}; add a folder or file "
                "with --decisions-source PATH)",
            ]
        for site in self.ordered():
            tests = sorted(site.tests)
            named = ", ".join(tests[:tests_shown])
            more = f" and {len(tests) - tests_shown} more" if len(tests) > tests_shown else ""
            lines.append(f"{site.path}:{site.line}: {site.source}")
            lines.append(f"    {site.kind.value}: {site.outcome_text()}")
            lines.append(f"    reached by {len(tests)} test(s): {named}{more}")
        return lines


_SIZE_OP_NAMES = frozenset(op.name for op in SIZE_OPS.values())
# ``for e in t:`` over a tensor: Tensor.__iter__ skips torch function dispatch and calls
# unbind(0), whose result's length is the loop's pass count.
_TENSOR_LOOP = "Tensor.__iter__"
_TENSOR_FILE = torch._tensor.__file__


class _CoverageRecorder(DecisionMode):
    def __init__(self, coverage: Coverage) -> None:
        super().__init__()
        self.coverage = coverage

    def decided(self, op: str, args: tuple, result: Any, frame: FrameType) -> None:
        caller = _user_frame(frame)
        if caller is None or self.coverage.display_path(caller.f_code.co_filename) is None:
            return  # not the project's code: nothing to count, nothing to read
        if op in _BRANCH_OPS:
            result = bool(result) != _negated(caller)
        self._record(op, result, caller)

    def computed(self, func: Any, args: tuple, kwargs: dict | None, result: Any) -> None:
        measured = data_dependent_size(func, args, kwargs or {}, result)
        if measured is None and func is not torch.Tensor.unbind:
            return
        # Called by DecisionMode.__torch_function__, itself called for the line.
        frame = sys._getframe(1)
        if measured is None:  # unbind: counted only as the passes of a loop over a tensor
            caller = _user_frame(frame)
            if (
                caller is not None
                and caller.f_code.co_filename == _TENSOR_FILE
                and caller.f_code.co_name == "__iter__"
            ):
                self._record(_TENSOR_LOOP, len(result), caller.f_back)
            return
        # Past torch's Python wrappers too (torch.unique is one): the user's line.
        caller = frame
        while caller is not None and (
            caller.f_code.co_name in MODE_HANDLERS
            or caller.f_code.co_filename.startswith(TORCH_DIR)
        ):
            caller = caller.f_back
        op, size = measured
        if caller is not None and self.coverage.display_path(caller.f_code.co_filename):
            self._record(op.name, size, caller)

    def _record(self, op: str, value: Any, caller: FrameType | None) -> None:
        if caller is None or self.coverage.display_path(caller.f_code.co_filename) is None:
            return
        filename, line = caller.f_code.co_filename, caller.f_lineno
        probe = current_probe()
        if probe is None:
            self.coverage.record(op, value, filename, line)
        else:
            probe.defer(functools.partial(self.coverage.record, op, value, filename, line, True))


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the line that made a decision: past other torch function modes and
    torch's Python dispatch to them."""
    while frame is not None and (
        frame.f_code.co_name in MODE_HANDLERS
        or (
            frame.f_code.co_filename.startswith(TORCH_DIR)
            and frame.f_code.co_name in ("handle_torch_function", "_wrapped")
        )
    ):
        frame = frame.f_back
    return frame


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
    """Count the decisions ``test`` makes inside the block into ``coverage``; the processes
    a check starts meanwhile count theirs into it too (:func:`for_child`)."""
    global _ACTIVE
    outer, _ACTIVE = _ACTIVE, coverage
    coverage.test = test
    try:
        with _CoverageRecorder(coverage):
            yield
    finally:
        _ACTIVE = outer


# The coverage recording the running test in this process, None when none does.
_ACTIVE: Coverage | None = None


# --- decisions of the processes a check starts ------------------------------------------


@dataclass(frozen=True)
class ChildRecording:
    """What a process a check starts needs to count its decisions for the running test: the
    coverage's settings, the test's id, and the folder its record goes to (plain values:
    it pickles into a spawned process)."""

    sources: tuple[str, ...]
    root: str
    excluded: tuple[str, ...]
    test: str
    folder: str

    def to_text(self) -> str:
        """As one line of JSON (for a command line); :meth:`from_text` reads it back."""
        return json.dumps(
            [list(self.sources), self.root, list(self.excluded), self.test, self.folder]
        )

    @classmethod
    def from_text(cls, text: str) -> ChildRecording:
        sources, root, excluded, test, folder = json.loads(text)
        return cls(tuple(sources), root, tuple(excluded), test, folder)


def for_child(folder: Path) -> ChildRecording | None:
    """In a check's process, before it starts a child: what to hand the child, with
    ``folder`` (made here) for its record; None when no test's decisions are recorded."""
    if _ACTIVE is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    sources, root, excluded = _ACTIVE.given
    return ChildRecording(sources, root, excluded, _ACTIVE.test, str(folder))


def child_coverage(settings: ChildRecording) -> Coverage:
    """In the child: an empty coverage of the same sources, counting for the same test
    (record into it with :func:`recording`)."""
    coverage = Coverage(
        [Path(source) for source in settings.sources],
        Path(settings.root),
        [Path(path) for path in settings.excluded],
    )
    coverage.test = settings.test
    return coverage


def save_for_parent(coverage: Coverage, settings: ChildRecording) -> None:
    """In the child, once its decisions are made: its record, written whole (a file of its
    own in the settings' folder) or not at all."""
    path = Path(settings.folder) / f"{os.getpid()}.json"
    write_atomically(path, json.dumps(coverage.to_json(), allow_nan=False), durable=False)


def merge_children(settings: ChildRecording | None) -> None:
    """In the check's process, once its children ended: what they wrote, into the test's
    coverage, each record once (all read before any is merged)."""
    if settings is None or _ACTIVE is None:
        return
    files = sorted(Path(settings.folder).glob("*.json"))
    records = [json.loads(path.read_text()) for path in files]
    for record in records:
        _ACTIVE.merge_json(record["sites"])
    for path in files:
        path.unlink()
