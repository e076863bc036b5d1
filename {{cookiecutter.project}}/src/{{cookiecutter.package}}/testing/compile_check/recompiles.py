"""Each recompilation of a compiled run, with the guard that failed in words and its line.

Private surface: ``torch._dynamo.utils.guard_failures`` (the guard failure behind each
recompilation, cleared by ``torch.compiler.reset()``), and the message of the error
``torch.compiler.set_stance("fail_on_recompile")`` raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .. import control_flow
from ..frames import call_path, frames_in_text
from .results import Recompile

__all__ = ["recompiles", "refused_recompile"]

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
_EQUALS = re.compile(r"^(?P<variable>\S+) == (?P<value>.+)$")
# "2 <= x.size()[0]": the range a dynamic size was compiled for.
_SIZE_RANGE = re.compile(r"(?P<name>[\w.\[\]'\"]+)\.size\(\)\[(?P<dim>\d+)\]")
_NONE = re.compile(r"^(?P<variable>\S+) is (?P<negation>not )?None$")
_EMPTY = re.compile(r"^(?P<negation>not )?(?P<variable>[\w.\[\]'\"]+)$")
_LOCAL = re.compile(r"^[LG]\['(?P<name>[^']+)'\]$")
_STACK = re.compile(r"^___stack\d+$")
_STANCE_FAILURE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_STANCE_WHERE = re.compile(
    r"filename: '(?P<file>[^']*)', function name: '(?P<function>[^']*)', line number: (?P<line>\d+)"
)


def recompiles(decisions: Sequence[control_flow.Decision]) -> list[Recompile]:
    """Each recompilation since the last reset, from the guard failures torch keeps.

    Private surface: ``torch._dynamo.utils.guard_failures`` maps each compiled code
    object to the failure reasons of its cached entries (``"<frame>/<entry>: <guard>"``);
    a recompilation lists every entry it tried, newest first, so each new entry number
    starts one recompilation.
    """
    from torch._dynamo.utils import guard_failures

    found = []
    for code, reasons in list(guard_failures.items()):
        seen: set[str] = set()
        for reason in reasons:
            matched = _GUARD_ID.match(str(reason).strip())
            if matched is None or matched["id"] in seen:
                continue
            seen.add(matched["id"])
            found.append(
                _recompile(
                    code.co_name, code.co_filename, code.co_firstlineno, matched["guard"], decisions
                )
            )
    return found


def _recompile(
    name: str,
    filename: str,
    first_line: int,
    text: str,
    decisions: Sequence[control_flow.Decision],
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
        guard=_guard_in_words(guard, made_at, decisions),
        location=location,
        source=location.source,
        torch_guard=guard,
    )


def _named(variable: str, made_at: control_flow.Location | None) -> str:
    """A guard's variable as the user wrote it (``L['x']`` is ``x``)."""
    local = _LOCAL.match(variable)
    if local:
        return local["name"]
    if _STACK.match(variable):
        after = f" the graph break at {made_at}" if made_at else " a graph break"
        return f"the value carried over{after}"
    if variable == ".0":
        return "the iterator the loop runs over"
    return variable


def _guard_in_words(
    guard: str, made_at: control_flow.Location | None, decisions: Sequence[control_flow.Decision]
) -> str:
    size = _SIZE.search(guard)
    if size:
        return (
            f"input {size['name']} has size {size['actual']} in dimension {size['dim']}, the "
            f"compiled code was specialized for {size['expected']} (pass dynamic=True, or "
            "torch._dynamo.mark_dynamic, to compile once for all sizes)"
        )
    mismatch = _MISMATCH.search(guard)
    if mismatch:
        return f"input {mismatch['name']}: its {mismatch['what']} changed ({mismatch['rest']})"
    expected = _EXPECTED_TENSOR.search(guard)
    if expected:
        return (
            f"{expected['name']} was a tensor when compiled and is a {expected['found'][8:-2]} "
            "now: the compiled code is specialized on the types of its inputs"
        )
    type_id = _TYPE_ID.match(guard)
    if type_id:
        was = f"was a {type_id['type']} when compiled and" if type_id["type"] else ""
        return (
            f"{_named(type_id['variable'], made_at)} {was} has another type now: the compiled "
            "code is specialized on the types of its inputs"
        ).replace("  ", " ")
    object_id = _OBJECT_ID.match(guard)
    if object_id:
        return (
            f"{_named(object_id['variable'], made_at)} is another object than when compiled: "
            "the compiled code is specialized on that object (a module, a function, a class)"
        )
    length = _LENGTH.match(guard)
    if length:
        return (
            f"the length of {_named(length['variable'], made_at)} was {length['value']} when "
            "compiled and is not now: torch.compile unrolls Python loops over a list, tuple "
            "or dict, so each new length compiles again"
        )
    loop = _RANGE.match(guard)
    if loop:
        return (
            f"a Python loop ran over range({loop['range']}) when compiled and over another "
            "range now: torch.compile unrolls Python loops, so each new length compiles again"
        )
    sized = _SIZE_RANGE.search(guard)
    if sized and any(op in guard for op in ("<", ">", "!=")):
        return (
            f"input {_named(sized['name'], made_at)} has a size in dimension {sized['dim']} "
            f"outside `{guard}`, which the compiled code was made for (the code is dynamic in "
            "that dimension; torch.compile specializes sizes 0 and 1)"
        )
    none = _NONE.match(guard)
    if none:
        was = "not None" if none["negation"] else "None"
        return (
            f"{_named(none['variable'], made_at)} was {was} when compiled and is not now: the "
            "compiled code is specialized on it"
        )
    equals = _EQUALS.match(guard)
    if equals:
        variable, value = equals["variable"], equals["value"]
        local = _LOCAL.match(variable)
        advice = "keep it a tensor"
        if local or (variable.isidentifier() and not variable.startswith("___")):
            subject = f"the Python value {local['name'] if local else variable}"
        elif _STACK.match(variable) and made_at:
            made = next((d for d in decisions if d.location == made_at), None)
            how = f" by {made.op}" if made else ""
            subject = f"the Python number made from a tensor{how} at {made_at}"
        else:
            subject, advice = variable, ""
        return (
            f"{subject} was {value} when compiled and is not now: the compiled code is "
            "specialized on that value, so each new value compiles again"
            + (f" ({advice})" if advice else "")
        )
    empty = _EMPTY.match(guard)
    if empty:
        was = "empty" if empty["negation"] else "not empty"
        return f"{_named(empty['variable'], made_at)} was {was} when compiled and is not now"
    return guard


def refused_recompile(
    error: BaseException, decisions: Sequence[control_flow.Decision]
) -> Recompile | None:
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
    return _recompile(function, filename, line, matched["guard"], decisions)
