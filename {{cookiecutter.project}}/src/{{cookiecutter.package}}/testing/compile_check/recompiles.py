"""Each recompilation of a compiled run, with the guard that failed in words and its line.

Private surface: ``torch._dynamo.utils.guard_failures`` (the guard failure behind each
recompilation, cleared by ``torch.compiler.reset()``), and the message of the error
``torch.compiler.set_stance("fail_on_recompile")`` raises.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .. import control_flow, python_attributes
from ..frames import call_path, frames_in_text
from ..sources import parsed
from .results import Recompile

__all__ = ["InputSet", "recompiles", "refused_recompile"]

_GUARD_ID = re.compile(r"^(?P<id>\d+/\d+): (?P<guard>.*)$", re.S)
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<function>.+)_at_(?P<line>\d+)$")
_SIZE = re.compile(
    r"tensor '(?P<name>.+)' size mismatch at index (?P<dim>\d+)\. "
    r"expected (?P<expected>\d+), actual (?P<actual>\d+)"
)
_MISMATCH = re.compile(r"tensor '(?P<name>.+)' (?P<what>[\w ]+?) mismatch\. (?P<rest>.*)")
_EXPECTED_TENSOR = re.compile(
    r"expected type of '(?P<name>[^']+)' to be a tensor type.*found (?P<found><class '[^']+'>)"
)
_TYPE_ID = re.compile(
    r"^___check_type_id\((?P<variable>.+), \d+\)(?:, type=<class '(?P<type>[^']+)'>)?$"
)
_OBJECT_ID = re.compile(r"^___check_obj_id\((?P<variable>.+), \d+\)")
_LENGTH = re.compile(r"^len\((?P<variable>.+)\) == (?P<value>\d+)$")
_RANGE = re.compile(r"^___normalize_range_iter\((?P<variable>.+)\) == \((?P<range>[-\d, ]+)\)$")
# "n == 3", "math.trunc(___stack1) == 3": a Python value the code was specialized on.
_EQUALS = re.compile(r"^(?:(?P<wrap>[\w.]+)\()?(?P<variable>[^\s()]+)\)? == (?P<value>[^\s()]+)$")
_TRUNCATING = ("math.trunc", "int", "math.floor", "math.ceil")
# "2 <= x.size()[0]": the range a dynamic size was compiled for.
_SIZE_RANGE = re.compile(r"(?P<name>[\w.\[\]'\"]+)\.size\(\)\[(?P<dim>\d+)\]")
_NONE = re.compile(r"^(?P<variable>\S+) is (?P<negation>not )?None$")
_EMPTY = re.compile(r"^(?P<negation>not )?(?P<variable>[\w.\[\]'\"]+)$")
_LOCAL_IN = re.compile(r"\b[LG]\['(?P<name>[^']+)'\]")
_MODULES = re.compile(r"\._modules\['(?P<name>[^']+)'\]")
_ATTRIBUTE = re.compile(r"^self\.(?P<path>[\w.]+)$")
_STACK = re.compile(r"^___stack\d+$")
_STACK_IN = re.compile(r"___stack\d+")
# A guard's variables inside a condition: a local, a carried stack value, an attribute.
_VARIABLE = re.compile(
    r"[LG]\['[^']+'\](?:\._modules\['[^']+'\]|\.\w+)*|___stack\d+|self(?:\.\w+)+"
)
_COMPARISON = re.compile(r"<=|>=|<|>|!=|==")
# torch's own symbols, which a message never shows: sizes and numbers it traces
# symbolically (s0, u0), sympy's relations, its guard helpers and tensor wrappers.
_INTERNAL = re.compile(r"\b[us]\d+\b|Eq\(|Ne\(|FakeTensor|___|\b[LG]\[")
_STANCE_FAILURE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_STANCE_WHERE = re.compile(
    r"filename: '(?P<file>[^']*)', function name: '(?P<function>[^']*)', line number: (?P<line>\d+)"
)


@dataclasses.dataclass(frozen=True)
class InputSet:
    """The input set whose compiled run recompiled, which a guard is read against:
    ``number``; ``decisions``, the eager runs' decisions so far (the op that made a
    Python number) and ``current`` this set's; ``inputs``, its leaves by name;
    ``attributes``, the modules' plain attributes when its compiled run started."""

    number: int
    decisions: Sequence[control_flow.Decision]
    current: Sequence[control_flow.Decision]
    inputs: Mapping[str, Any]
    attributes: python_attributes.Snapshot


def recompiles(seen: set[tuple[object, str]], input_set: InputSet) -> list[Recompile]:
    """Each recompilation since the last reset that is not in ``seen`` (which gets it),
    from the guard failures torch keeps; called after each compiled run, so each one is
    read against the input set that made it.

    Private surface: ``torch._dynamo.utils.guard_failures`` maps each compiled code
    object to the failure reasons of its cached entries (``"<frame>/<entry>: <guard>"``);
    a recompilation lists every entry it tried, newest first, so each new entry number
    starts one recompilation.
    """
    from torch._dynamo.utils import guard_failures

    found = []
    for code, reasons in list(guard_failures.items()):
        for reason in reasons:
            matched = _GUARD_ID.match(str(reason).strip())
            if matched is None or (code, matched["id"]) in seen:
                continue
            seen.add((code, matched["id"]))
            found.append(
                _recompile(
                    code.co_name, code.co_filename, code.co_firstlineno, matched["guard"], input_set
                )
            )
    return found


def _recompile(
    name: str, filename: str, first_line: int, text: str, input_set: InputSet
) -> Recompile:
    """The recompilation of function ``name`` (defined at ``filename:first_line``) whose
    guard failed as torch's ``text`` says (the guard, then the user stack it was made for)."""
    guard, _, stack = text.partition("\nUser stack trace:")
    guard = guard.split("  #")[0].strip()
    path = call_path(frames_in_text(stack))
    location = path.innermost or control_flow.Location(filename, first_line)
    resumed = _RESUME.match(name)
    function = name
    made_at = None
    if resumed:
        made_at = control_flow.Location(filename, int(resumed["line"]))
        function = f"{resumed['function']} (the code after its graph break at {made_at})"
    return Recompile(
        function=function,
        guard=_Reader(made_at, input_set).in_words(guard),
        location=location,
        source=location.source,
        torch_guard=guard,
    )


_UNKNOWN = object()


@dataclasses.dataclass(frozen=True)
class _GuardedValue:
    """What a guard's variable is in the user's words, and its value now (``_UNKNOWN``
    when the check cannot tell); ``advice`` ends the sentence of a value guard."""

    words: str
    short: str
    now: Any = _UNKNOWN
    advice: str = ""


class _Reader:
    """A guard of torch's read in the user's words, against the input set that failed it;
    ``made_at``: the graph break after which the guarded code resumes."""

    def __init__(self, made_at: control_flow.Location | None, input_set: InputSet) -> None:
        self.made_at, self.input_set = made_at, input_set

    def value(self, variable: str) -> _GuardedValue:
        """A guard's variable (``L['x']``, ``self.calls``, ``___stack0``) as the user knows it."""
        variable = _MODULES.sub(r".\g<name>", _LOCAL_IN.sub(r"\g<name>", variable))
        if _STACK.match(variable):
            return self._carried()
        attribute = _ATTRIBUTE.match(variable)
        if attribute:
            prefix, name = attribute["path"].rpartition(".")[::2]
            module, now = self.input_set.attributes.get((prefix, name), (None, _UNKNOWN))
            if module is None:
                return _GuardedValue(f"the attribute `{variable}`", f"`{variable}`")
            owner = prefix or type(module).__name__
            assigned = python_attributes.assigned_at(module, name)
            changes = (
                f"; the forward changes it: `{assigned.source}` at {assigned}" if assigned else ""
            )
            return _GuardedValue(
                f"the Python attribute `{owner}.{name}`",
                f"`{owner}.{name}`",
                now,
                f"keep it out of the forward, or in a tensor{changes}",
            )
        if variable == ".0":
            return _GuardedValue("the iterator the loop runs over", "the iterator")
        if variable in self.input_set.inputs:
            return _GuardedValue(
                f"the Python argument `{variable}`",
                f"`{variable}`",
                self.input_set.inputs[variable],
                "pass it as a tensor",
            )
        if variable.isidentifier():
            return _GuardedValue(
                f"the Python value `{variable}`", f"`{variable}`", advice="keep it a tensor"
            )
        return _GuardedValue(variable, variable)

    def _carried(self) -> _GuardedValue:
        """The Python value carried over the graph break at ``made_at``: the number the
        decision there made, named by the assignment that keeps it (``steps = ...``)."""
        made_at = self.made_at
        if made_at is None:
            return _GuardedValue("the Python value carried over a graph break", "that value")
        made = next((d for d in self.input_set.decisions if d.location == made_at), None)
        now = next((d.value for d in self.input_set.current if d.location == made_at), _UNKNOWN)
        target, expression = _assignment(made_at)
        by = f"`{expression}`" if expression else f"{made.op}" if made else "a tensor"
        number = "number" if isinstance(now, int | float) or made else "value"
        if target:
            words = f"the Python {number} `{target}` (from {by} at {made_at})"
        else:
            words = f"the Python {number} made from a tensor by {by} at {made_at}"
        return _GuardedValue(
            words, f"`{target}`" if target else "that number", now, "keep it a tensor"
        )

    def in_words(self, guard: str) -> str:
        words = self._known(guard)
        if words is None or _INTERNAL.search(words):
            return self._kind(guard)
        return words

    def _kind(self, guard: str) -> str:
        """What kind of guard failed, in words, where its text cannot be put in them."""
        if "size()" in guard or "stride()" in guard or "size mismatch" in guard:
            what = "the sizes or strides of a tensor input"
        elif _STACK_IN.search(guard):
            what = f"{self._carried().words}"
        else:
            what = "a value the compiled code was specialized on"
        return (
            f"a guard on {what} failed (torch's guard is in its own symbols, left out here; "
            "TORCH_LOGS=recompiles prints it)"
        )

    def _known(self, guard: str) -> str | None:
        size = _SIZE.search(guard)
        if size:
            return (
                f"input {self.value(size['name']).short.strip('`')} has size {size['actual']} in "
                f"dimension {size['dim']}, the compiled code was specialized for "
                f"{size['expected']} (pass dynamic=True, or torch._dynamo.mark_dynamic, to "
                "compile once for all sizes)"
            )
        mismatch = _MISMATCH.search(guard)
        if mismatch:
            name = self.value(mismatch["name"]).short.strip("`")
            return f"input {name}: its {mismatch['what']} changed ({mismatch['rest']})"
        expected = _EXPECTED_TENSOR.search(guard)
        if expected:
            return (
                f"{self.value(expected['name']).words} was a tensor when compiled and is a "
                f"{expected['found'][8:-2]} now: the compiled code is specialized on the types "
                "of its inputs"
            )
        type_id = _TYPE_ID.match(guard)
        if type_id:
            was = f" was a {type_id['type']} when compiled and" if type_id["type"] else ""
            return (
                f"{self.value(type_id['variable']).words}{was} has another type now: the "
                "compiled code is specialized on the types of its inputs"
            )
        object_id = _OBJECT_ID.match(guard)
        if object_id:
            return (
                f"{self.value(object_id['variable']).words} is another object than when "
                "compiled: the compiled code is specialized on that object (a module, a "
                "function, a class)"
            )
        length = _LENGTH.match(guard)
        if length:
            return (
                f"the length of {self.value(length['variable']).words} was {length['value']} "
                "when compiled and is not now: torch.compile unrolls Python loops over a list, "
                "tuple or dict, so each new length compiles again"
            )
        loop = _RANGE.match(guard)
        if loop:
            return (
                f"a Python loop ran over range({loop['range']}) when compiled and over another "
                "range now: torch.compile unrolls Python loops, so each new length compiles again"
            )
        sized = _SIZE_RANGE.search(guard)
        if sized and any(op in guard for op in ("<", ">", "!=")):
            name = self.value(sized["name"]).short.strip("`")
            now = self.input_set.inputs.get(name)
            dim = int(sized["dim"])
            shape = getattr(now, "shape", None)
            actual = f" ({name}.shape[{dim}] is {shape[dim]} now)" if shape else ""
            condition = _SIZE_RANGE.sub(
                lambda m: f"{self.value(m['name']).short.strip('`')}.shape[{m['dim']}]", guard
            )
            return (
                f"input {name} has a size in dimension {dim} outside `{condition}`{actual}, "
                "which the compiled code was made for (the code is dynamic in that dimension; "
                "torch.compile compiles sizes 0 and 1 apart from the others)"
            )
        none = _NONE.match(guard)
        if none:
            was = "not None" if none["negation"] else "None"
            return (
                f"{self.value(none['variable']).words} was {was} when compiled and is not now: "
                "the compiled code is specialized on it"
            )
        equals = _EQUALS.match(guard)
        if equals:
            value = self.value(equals["variable"])
            now = value.now
            if now is not _UNKNOWN and equals["wrap"] in _TRUNCATING:
                now = int(now)
            is_now = "is not now" if now is _UNKNOWN else f"is now {now!r}"
            advice = f" ({value.advice})" if value.advice else ""
            return (
                f"{value.words} was {equals['value']} when compiled and {is_now}: the compiled "
                f"code is specialized on that value, so each new value compiles again{advice}"
            )
        empty = _EMPTY.match(guard)
        if empty:
            was = "empty" if empty["negation"] else "not empty"
            return f"{self.value(empty['variable']).words} was {was} when compiled and is not now"
        if _COMPARISON.search(guard):
            return self._condition(guard)
        return None

    def _condition(self, guard: str) -> str:
        """A condition on Python numbers the compiled code holds for (``(1 + ___stack0) != 1``),
        its variables named as the user wrote them."""
        named: list[_GuardedValue] = []

        def name(match: re.Match[str]) -> str:
            value = self.value(match[0])
            named.append(value)
            return value.short.strip("`")

        condition = _VARIABLE.sub(name, guard)
        subjects = "; ".join(
            value.words + ("" if value.now is _UNKNOWN else f" is {value.now!r} now")
            for value in dict((v.words, v) for v in named).values()
        )
        return (
            f"the compiled code was made for values with `{condition}`, which does not hold "
            f"now" + (f" ({subjects})" if subjects else "")
        )


def _assignment(made_at: control_flow.Location) -> tuple[str | None, str | None]:
    """The name a line assigns and the expression it assigns (``steps``,
    ``int(x.sum().item())``), where the line is one assignment to a name."""
    source = parsed(made_at.filename)
    if source is None:
        return None, None
    for node in ast.walk(source.tree):
        if (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and node.lineno == made_at.line
            and node.value is not None
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                return targets[0].id, ast.unparse(node.value)
    return None, None


def refused_recompile(error: BaseException, input_set: InputSet) -> Recompile | None:
    """The recompilation ``set_stance("fail_on_recompile")`` refused by raising ``error``,
    from its message; ``None`` when ``error`` is another."""
    message = str(error)
    if not message.startswith(_STANCE_FAILURE):
        return None
    where = _STANCE_WHERE.search(message)
    filename, function, line = (
        (where["file"], where["function"], int(where["line"])) if where else ("<unknown>", "?", 0)
    )
    failures = [
        line.strip().removeprefix("- ")
        for line in message.partition("triggered by the following guard failure(s):")[
            2
        ].splitlines()
    ]
    text = "\n".join(failures).strip()
    matched = _GUARD_ID.match(text)
    if matched is None:  # no earlier entry failed: this code was never compiled before
        location = control_flow.Location(filename, line)
        return Recompile(
            function=function,
            guard="first compiled now: the earlier input sets did not reach this code",
            location=location,
            source=location.source,
            torch_guard="",
        )
    return _recompile(function, filename, line, matched["guard"], input_set)
