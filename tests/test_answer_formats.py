"""local_extensions.py's filters write any answer so that each format's parser reads it back."""

from __future__ import annotations

import json
import runpy
import tomllib

import pytest
from conftest import TEMPLATE_DIR
from markdown_it import MarkdownIt

FILTERS = runpy.run_path(str(TEMPLATE_DIR / "local_extensions.py"))
toml_string, json_text, markdown_text = (
    FILTERS[name] for name in ("toml_string", "json_text", "markdown_text")
)

READABLE = ["张伟", "动态图模型", "Rocket 🚀", "𠮷野家", "Ünïcödé — «quotes»", "\u3000全角"]
QUOTING = ['"', "\\", '\\"', "'''", '"""', "\\u0041", "\\U0001F680", "# not a comment", "a = b"]
CONTROLS = [chr(code) for code in [*range(0x20), 0x7F]]
# Markdown that a description could hold by accident: each would render as something else.
MARKDOWN = [
    "*not bold*", "_not em_", "**x**", "`code`", "<b>tag</b>", "&amp; &#35;", "[link](x)",
    "![img](x)", "~~struck~~", "a | b", "$x$", "\\*", "1. not a list", "2) nor this",
    "- nor this", "+ nor", "# not a heading", "> not a quote", "---", "===", "back\\slash",
]  # fmt: skip
MARKDOWN_PARSER = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def toml_value(text: str) -> str:
    return tomllib.loads(f"value = {toml_string(text)}\n")["value"]


@pytest.mark.parametrize("text", READABLE + QUOTING + CONTROLS + ["".join(CONTROLS)])
def test_toml_string_reads_back(text):
    assert toml_value(text) == text


@pytest.mark.parametrize("text", READABLE)
def test_toml_string_keeps_non_ascii_readable(text):
    assert toml_string(text) == f'"{text}"'


@pytest.mark.parametrize("text", ["🚀", "𠮷"])
def test_json_escapes_are_no_toml_for_characters_outside_the_bmp(text):
    """What ``tojson`` wrote before: a surrogate pair, which TOML refuses."""
    with pytest.raises(tomllib.TOMLDecodeError, match="Unicode scalar value"):
        tomllib.loads(f"value = {json.dumps(text)}\n")
    assert toml_value(text) == text


@pytest.mark.parametrize("value", [*READABLE, *QUOTING, *CONTROLS, True, 2222, None])
def test_json_text_reads_back_and_stays_readable(value):
    text = json_text(value)
    assert json.loads(text) == value
    if isinstance(value, str) and not value.isascii():
        assert text == f'"{value}"'


def markdown_paragraph(source: str) -> list[tuple[str, str]]:
    """(type, content) of the inline parts of the paragraph after a heading."""
    tokens = MARKDOWN_PARSER.parse(f"# Title\n\n{source}\n\nNext paragraph.\n")
    assert [token.type for token in tokens[3:6]] == ["paragraph_open", "inline", "paragraph_close"]
    return [(child.type, child.content) for child in tokens[4].children or []]


@pytest.mark.parametrize("text", READABLE + QUOTING + MARKDOWN)
def test_markdown_text_renders_as_the_text_itself(text):
    assert markdown_paragraph(markdown_text(text)) == [("text", text.strip())]


# A table row, math (GitHub's) and a setext underline need context this test does not give
# them, and a backslash escapes only punctuation: these render as they are here.
CONTEXT_DEPENDENT = ("a | b", "$x$", "===", "back\\slash")


@pytest.mark.parametrize("text", [text for text in MARKDOWN if text not in CONTEXT_DEPENDENT])
def test_unescaped_markdown_renders_as_something_else(text):
    """The reverse: the same text pasted as it is does not come back as plain text."""
    source = f"# Title\n\n{text}\n\nNext paragraph.\n"
    tokens = MARKDOWN_PARSER.parse(source)
    inline = tokens[4] if tokens[3].type == "paragraph_open" else None
    assert inline is None or [(c.type, c.content) for c in inline.children or []] != [
        ("text", text)
    ]


@pytest.mark.parametrize("text", ["  leading", "trailing   ", "    four spaces"])
def test_markdown_text_drops_surrounding_whitespace(text):
    assert markdown_paragraph(markdown_text(text)) == [("text", text.strip())]


def test_markdown_text_keeps_non_ascii_readable():
    for text in READABLE:
        assert markdown_text(text) == text.strip()
