"""The generated project's tests/test_docs.py fails on each kind of drift a user makes: an
output shown under an example that the code no longer prints, a broken link, a docs page
the README does not link, a README past its length, a Python block that does not parse or
run; and passes on the project as generated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_module

QUICK = ("-m", "not slow")


def run_docs_tests(project: Path, *args: str):
    return run_module(
        project, "pytest", "tests/test_docs.py", "-p", "no:cacheprovider", "-q", *args
    )


def failures(result) -> str:
    return "\n".join(line for line in result.stdout.splitlines() if line.startswith("E "))


def test_the_generated_docs_pass_their_quick_tests(default_project: Path):
    result = run_docs_tests(default_project, *QUICK)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\d+ passed", result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_shown_report_line_the_code_no_longer_prints_fails(bake):
    project = bake()
    readme = project / "README.md"
    text = readme.read_text()
    # One word of autograd_determinism's report line changed, as a stale README would.
    stale = text.replace("3 runs agreed bit for bit", "3 runs agreed exactly", 1)
    assert stale != text
    readme.write_text(stale)
    result = run_docs_tests(project, "-m", "slow", "-k", "README.md")
    assert result.returncode == 1
    message = failures(result)
    assert "the output shown under the example is not what it prints now" in message
    assert "autograd_determinism DynamicNet: 3 runs agreed exactly" in message
    assert result.stdout.count("FAILED") == 1, result.stdout[-3000:]


@pytest.mark.slow
def test_an_example_that_no_longer_runs_fails(bake):
    project = bake()
    page = project / "docs" / "commands" / "train.md"
    text = page.read_text()
    broken = text.replace("import DynamicNet\n", "import DynamicNets\n", 1)
    assert broken != text
    page.write_text(broken)
    result = run_docs_tests(project, "-m", "slow", "-k", "train.md")
    assert result.returncode == 1
    assert "the example failed" in failures(result)
    assert "cannot import name 'DynamicNets'" in result.stdout


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        pytest.param(
            lambda project: (project / "docs" / "cluster.md").write_text(
                (project / "docs" / "cluster.md").read_text() + "\nSee [the GPUs](gpus.md).\n"
            ),
            "docs/cluster.md links to files that do not exist: ['gpus.md']",
            id="broken-link",
        ),
        pytest.param(
            lambda project: (project / "docs" / "faq.md").write_text("# FAQ\n"),
            "docs pages the README does not link to: ['docs/faq.md']",
            id="unlinked-page",
        ),
        pytest.param(
            lambda project: (project / "README.md").write_text(
                (project / "README.md").read_text() + "more\n" * 10
            ),
            "more than 250: move reference to docs/",
            id="long-readme",
        ),
        pytest.param(
            lambda project: (project / "docs" / "testing.md").write_text(
                (project / "docs" / "testing.md").read_text()
                + "\n```python\ndef test_x(:\n    pass\n```\n"
            ),
            "the Python block does not parse",
            id="syntax-error",
        ),
    ],
)
def test_a_planted_docs_error_fails_the_quick_tests(bake, plant, expected):
    project = bake()
    plant(project)
    result = run_docs_tests(project, *QUICK)
    assert result.returncode == 1
    assert expected in failures(result), result.stdout[-3000:]
