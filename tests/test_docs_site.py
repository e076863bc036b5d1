"""The generated project's docs/ builds into a site with Sphinx and MyST, strictly.

The build is CI's command (the generated ci.yml's docs job) on a copy of the project's
docs/ alone, outside the project and without it on the path: the site must need
neither the package nor torch. Every warning fails it; the plants below are the
mistakes a page split out of the README makes, and each must fail the build naming
the page.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sphinx") is None:
    # CI installs requirements-test.txt: a missing Sphinx there is a broken setup.
    if os.environ.get("CI"):
        pytest.fail("sphinx is missing: pip install -r requirements-test.txt", pytrace=False)
    pytest.skip(
        "sphinx is not installed here: pip install -r requirements-test.txt",
        allow_module_level=True,
    )

# As the generated ci.yml runs it, from the project's folder; --no-color: sphinx colours
# where CI=true, and the lines are matched by their start.
BUILD = (
    "-m", "sphinx", "-W", "--keep-going", "-n", "--no-color",
    "-b", "html", "docs", "docs/_build/html",
)  # fmt: skip


def copy_docs(project: Path, destination: Path) -> Path:
    """``project``'s docs/ alone, in ``destination``; returns ``destination``."""
    shutil.copytree(project / "docs", destination / "docs")
    return destination


def build(folder: Path) -> subprocess.CompletedProcess[str]:
    environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *BUILD], cwd=folder, env=environ, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def append(page: Path, text: str) -> None:
    page.parent.mkdir(parents=True, exist_ok=True)
    with page.open("a", encoding="utf-8") as file:
        file.write(text)


def pages(docs: Path) -> list[Path]:
    return sorted(
        page.relative_to(docs) for page in docs.rglob("*.md") if "_build" not in page.parts
    )


# Answers that change the pages: sections that are there only with JupyterLab, and
# names that are in headings (so in their anchors) and in links.
ANSWERS = {
    "defaults": {},
    "no-jupyter": {"jupyter": False},
    "own-names": {"project": "Recursive.Nets", "package": "recnets"},
}


@pytest.mark.parametrize("answers", ANSWERS.values(), ids=ANSWERS.keys())
def test_the_docs_build_strictly_into_a_page_each(answers, bake, default_project, tmp_path):
    folder = copy_docs(bake(**answers) if answers else default_project, tmp_path / "site")
    result = build(folder)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr
    site = folder / "docs" / "_build" / "html"
    sources = pages(folder / "docs")
    assert Path("index.md") in sources
    for page in sources:
        assert (site / page.with_suffix(".html")).is_file(), page


def test_a_link_to_a_heading_resolves_as_on_github(default_project: Path, tmp_path: Path):
    """``page.md#slug`` with GitHub's slug of the heading (lowercase, punctuation dropped,
    spaces as dashes), down to ### headings."""
    folder = copy_docs(default_project, tmp_path)
    append(
        folder / "docs" / "index.md",
        "\n## Options\n\n### The `--gpu` option, again\n\n[It](index.md#the---gpu-option-again).\n",
    )
    result = build(folder)
    assert result.returncode == 0, result.stdout + result.stderr
    index = (folder / "docs" / "_build" / "html" / "index.html").read_text(encoding="utf-8")
    # The link goes to the heading's own id; GitHub's slug is an id of it too, so an
    # address copied from the code host finds the heading in the site.
    assert 'id="the---gpu-option-again"' in index


# (planted file, what goes into it, the warning that must name it)
PLANTS = {
    "a link to a missing page": (
        "index.md",
        "\nSee [the missing page](missing.md).\n",
        "'myst' cross-reference target not found: 'missing.md'",
    ),
    "a link to a missing heading": (
        "index.md",
        "\nSee [a missing heading](index.md#nope).\n",
        "local id not found in doc 'index': 'nope'",
    ),
    "a page in no toctree": (
        "planted/orphan.md",
        "# A page no toctree lists\n",
        "document isn't included in any toctree",
    ),
}


@pytest.mark.parametrize("plant", PLANTS.values(), ids=PLANTS.keys())
def test_a_broken_page_fails_the_build_naming_it(default_project: Path, tmp_path: Path, plant):
    planted, text, warning = plant
    folder = copy_docs(default_project, tmp_path)
    page = folder / "docs" / planted
    append(page, text)
    result = build(folder)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if warning in line]
    assert line.startswith(f"{page}:"), line
    assert "WARNING" in line
