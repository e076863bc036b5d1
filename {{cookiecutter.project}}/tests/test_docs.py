"""The README and docs/ tested as code: every page is linked, every Python block runs, and
the output shown under a block is what today's code prints.

A Python block that defines ``test_`` functions is a test module: it runs in its own pytest
session with the bundled plugin (``-v``, so each check's report line is printed). A block
whose first line is ``# examples/NAME.py`` (or any ``# NAME.py``) is written to that path
first, for the page's tests to import, and shows up in messages under that name. Any other
Python block runs as a script. A ``text`` block right under a Python block holds lines its
run must print, in order; durations (``0.19 s``, ``3.9 ms``) are not compared, and ``...``
in a shown line stands for any text. Without one, the run must succeed. ``pytest -m slow
tests/test_docs.py`` runs the blocks; the quick tests check links and syntax.
"""

from __future__ import annotations

import ast
import enum
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[\w-]*)\s*$")
NAMED = re.compile(r"^# (?P<path>[\w/.-]+\.py)$")
LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)\s]*)?\)")
DURATION = re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:s|ms|µs)\b")
# The examples run the checks on small models; a few take seconds, none a minute.
EXAMPLE_TIMEOUT_S = 600


class Kind(enum.Enum):
    TEST_MODULE = "test module"
    EXAMPLE_FILE = "example file"
    SCRIPT = "script"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    shown: str | None

    @property
    def name(self) -> str | None:
        first = self.code.split("\n", 1)[0]
        match = NAMED.match(first)
        return match["path"] if match else None

    @property
    def kind(self) -> Kind:
        if re.search(r"^def test_", self.code, re.M):
            return Kind.TEST_MODULE
        return Kind.EXAMPLE_FILE if self.name else Kind.SCRIPT

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[int, str, str, str | None]]:
    """(first line, info string, body, the text block under it) of each fenced block."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening["indent"])
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        blocks.append((i + 2, opening["info"], body, end))
        i = end + 1
    # A text block belongs to the Python block above it when only blank lines part them.
    result = []
    for k, (line, info, body, end) in enumerate(blocks):
        shown = None
        if k + 1 < len(blocks) and blocks[k + 1][1] == "text":
            between = lines[end + 1 : blocks[k + 1][0] - 2]
            if not any(text.strip() for text in between):
                shown = blocks[k + 1][2]
        result.append((line, info, body, shown))
    return result


def python_blocks(page: Path) -> list[Block]:
    return [
        Block(page, line, body, shown)
        for line, info, body, shown in fenced_blocks(page)
        if info == "python"
    ]


BLOCKS = [block for page in PAGES for block in python_blocks(page)]
RUNS = [block for block in BLOCKS if block.kind is not Kind.EXAMPLE_FILE]


def comparable(text: str) -> list[str]:
    lines = (re.sub(r"^E\s+", "", line.strip()) for line in text.splitlines())
    return [DURATION.sub("<duration>", line).strip() for line in lines if line.strip()]


def missing_lines(shown: str, printed: str) -> list[str]:
    """The shown lines that the printed output lacks, in order ('...' matches any text)."""
    printed_lines, position, missing = comparable(printed), 0, []
    for wanted in comparable(shown):
        pattern = re.compile(".*".join(re.escape(part) for part in wanted.split("...")))
        found = next(
            (i for i in range(position, len(printed_lines)) if pattern.search(printed_lines[i])),
            None,
        )
        if found is None:
            missing.append(wanted)
        else:
            position = found + 1
    return missing


def test_every_docs_page_is_linked_from_the_readme():
    readme = PAGES[0].read_text(encoding="utf-8")
    linked = {(ROOT / match["target"]).resolve() for match in LINK.finditer(readme)}
    unlinked = [str(page.relative_to(ROOT)) for page in PAGES[1:] if page not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_name_files_that_exist(page: Path):
    text = page.read_text(encoding="utf-8")
    broken = [
        match["target"]
        for match in LINK.finditer(text)
        if "://" not in match["target"]
        and not match["target"].startswith("mailto:")
        and not (page.parent / match["target"]).exists()
    ]
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_python_blocks_are_valid_python(block: Block):
    try:
        ast.parse(block.code, filename=str(block))
    except SyntaxError as error:
        pytest.fail(f"{block}: the Python block does not parse: {error}")


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNS, ids=str)
def test_python_blocks_run_and_print_what_they_show(block: Block, tmp_path: Path):
    for other in python_blocks(block.page):
        if other.kind is Kind.EXAMPLE_FILE:
            path = tmp_path / str(other.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(other.code + "\n", encoding="utf-8")
    target = tmp_path / (block.name or f"test_{block.page.stem}_{block.line}.py")
    if block.kind is Kind.SCRIPT and not block.name:
        target = tmp_path / f"{block.page.stem}_{block.line}.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.code + "\n", encoding="utf-8")
    if block.kind is Kind.TEST_MODULE:
        # Its own session, configured only by these options: not by this project's
        # pyproject.toml, whose -m "not slow" and -ra would change what is printed.
        command = [
            sys.executable, "-m", "pytest", str(target), "-v", "-p", "no:cacheprovider",
            "-p", "{{ cookiecutter.package }}.testing.plugin", "--rootdir", str(tmp_path),
        ]  # fmt: skip
    else:
        command = [sys.executable, str(target)]
    # The working folder is the project's, so its files show as src/... in messages.
    ran = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, check=False
    )
    printed = ran.stdout + ran.stderr
    if block.shown is None:
        assert ran.returncode == 0, f"{block}: the example failed:\n{printed[-4000:]}"
        return
    missing = missing_lines(block.shown, printed)
    absent = re.search(r"could not import '([\w.]+)'", printed)
    if missing and absent:
        pytest.skip(f"{block}: needs {absent[1]}, which is not installed")
    assert not missing, (
        f"{block}: the output shown under the example is not what it prints now; "
        f"missing lines: {missing}\n--- printed:\n{printed[-6000:]}"
    )
