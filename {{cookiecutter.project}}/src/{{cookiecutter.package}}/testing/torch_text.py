"""torch's error text in the user's words: no symbolic-shape internals in a report.

torch's tracers word their refusals in their own terms: unbacked symbols (``u0``),
sympy guards (``Eq(u0, 1)``), ``FakeTensor(...)`` reprs, dynamo's stack slots
(``___stack0``) and their exception class names. A user wrote none of these and
cannot act on them. :func:`in_words` gives the first paragraph of torch's message
with those translated where they say something the user can act on, and left out
where they do not.
"""

from __future__ import annotations

import re

__all__ = ["INTERNALS", "has_internals", "in_words"]

# What a report must never show: symbols, sympy relations, fake tensors, dynamo's slots.
INTERNALS = re.compile(
    r"\b[uszq](?:uf)?\d+\b|\b(?:Eq|Ne|Lt|Le|Gt|Ge|TruncToInt|Mod|FloorDiv)\(|FakeTensor\(|___stack|L\['"
)

# torch's refusals that mean something the user can act on, in the user's words.
_KNOWN = (
    (
        re.compile(r"Could not guard on data-dependent expression|data-dependent"),
        "a size or a Python value that depends on the data decides what the code does there",
    ),
    (
        re.compile(r"Pending unbacked symbols"),
        "a size that depends on the data (made by an op such as nonzero(), or read with "
        ".item()) is made and then decided on",
    ),
)


def has_internals(text: str) -> bool:
    return INTERNALS.search(text) is not None


def in_words(error: BaseException) -> str:
    """The first paragraph of ``error``'s message, in the user's words."""
    text = str(error).strip().split("\n\n")[0].strip()
    for pattern, words in _KNOWN:
        if pattern.search(text):
            return words
    if has_internals(text) or not text:
        return "torch stopped on a size or a value it could not know while tracing"
    return text
