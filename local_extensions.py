"""The template's Jinja extension: answers written in each file's syntax, and checked early.

Cookiecutter loads it through ``_extensions`` in cookiecutter.json, with the template's
folder on ``sys.path`` (cruft does the same for its clone). The filters write an answer
as readable UTF-8 text, escaped only as the file's format requires:

- ``toml_string``: a TOML basic string (``\\``, ``"`` and control characters escaped);
- ``json_text``: JSON, non-ASCII characters kept as they are;
- ``markdown_text``: one Markdown paragraph that renders as the text itself.

``check_answers`` runs the pre-generation hook's checks while cookiecutter resolves the
answers (the ``__answers_checked`` entry of cookiecutter.json), before it creates the
project folder from the ``project`` answer: a refused answer leaves nothing anywhere.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

from cookiecutter.exceptions import FailedHookException
from jinja2 import Environment
from jinja2.ext import Extension

__all__ = ["AnswersExtension", "check_answers", "json_text", "markdown_text", "toml_string"]

CHECKS_FILE = Path(__file__).resolve().parent / "hooks" / "pre_gen_project.py"
_TOML_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
# Characters that start inline Markdown (or GitHub's) syntax anywhere in a line.
_MARKDOWN_INLINE = re.compile(r"([\\`*_\[\]<>&~|$])")
# What starts a heading, quote, list or setext underline at the beginning of a line.
_MARKDOWN_LINE_START = re.compile(r"^(?:[#>+=-]|\d{1,9}(?=[.)]))")


def toml_string(text: object) -> str:
    """``text`` as a TOML basic string."""

    def escape(char: str) -> str:
        if char in _TOML_ESCAPES:
            return _TOML_ESCAPES[char]
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"\\u{ord(char):04X}"
        return char

    return '"' + "".join(map(escape, str(text))) + '"'


def json_text(value: Any) -> str:
    """``value`` as JSON text with its non-ASCII characters as they are."""
    return json.dumps(value, ensure_ascii=False)


def markdown_text(text: object) -> str:
    """``text`` (one line) as a Markdown paragraph that shows exactly that text.

    Surrounding whitespace is dropped (Markdown drops it too, or makes four leading
    spaces a code block).
    """
    escaped = _MARKDOWN_INLINE.sub(r"\\\1", str(text).strip())
    start = _MARKDOWN_LINE_START.match(escaped)
    if start is None:
        return escaped
    if start.group().isdigit():  # "1. text" would start a numbered list
        end = start.end()
        return f"{escaped[:end]}\\{escaped[end:]}"
    return "\\" + escaped


def check_answers(answers: dict[str, Any]) -> str:
    """``"yes"`` if every answer is allowed; else stop with one line per bad answer."""
    # Read afresh at each check: cruft renders two commits of the template in one process.
    lines = runpy.run_path(str(CHECKS_FILE))["problems"](answers)
    if lines:
        raise FailedHookException("\n".join(lines))
    return "yes"


class AnswersExtension(Extension):
    """Registers this module's filters."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        for function in (toml_string, json_text, markdown_text, check_answers):
            environment.filters[function.__name__] = function
