"""Generated projects pull later template changes with cruft, from a local clone of the template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bake_project, copy_template

CRUFT = Path(sys.executable).with_name("cruft")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "Template Tests",
    "GIT_AUTHOR_EMAIL": "tests@example.com",
    "GIT_COMMITTER_NAME": "Template Tests",
    "GIT_COMMITTER_EMAIL": "tests@example.com",
}
TEMPLATE_README = "{{cookiecutter.project}}/README.md"


def run(*args: object, cwd: Path) -> str:
    result = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env={**os.environ, **GIT_IDENTITY},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def commit_all(repo: Path, message: str) -> None:
    run("git", "add", "--all", cwd=repo)
    run("git", "commit", "--quiet", "--message", message, cwd=repo)


@pytest.fixture
def template_clone(tmp_path: Path) -> Path:
    """A git repository of the template as it is on disk now, committed or not."""
    clone = copy_template(tmp_path / "template")
    run("git", "init", "--quiet", cwd=clone)
    commit_all(clone, "template as tested")
    return clone


def change_template(clone: Path) -> None:
    """A template improvement: a README line and a new file in every generated project."""
    readme = clone / TEMPLATE_README
    readme.write_text(readme.read_text() + "\nImproved by the template.\n")
    (clone / "{{cookiecutter.project}}" / "CHANGES.md").write_text(
        "# Changes of {{ cookiecutter.project }}\n"
    )
    commit_all(clone, "improve the template")


def assert_update_arrives(project: Path, clone: Path) -> None:
    """A template change reaches the project, and the user's own change stays."""
    commit_all(project, "project as generated")
    readme = project / "README.md"
    title, rest = readme.read_text().split("\n", 1)
    readme.write_text(f"{title}\n\nOur notes: train on the cluster.\n{rest}")
    commit_all(project, "the user's own change")
    change_template(clone)
    check = subprocess.run(
        [CRUFT, "check", "--project-dir", project], capture_output=True, text=True, check=False
    )
    assert check.returncode != 0, "cruft check should see the template moved on"

    run(CRUFT, "update", "--skip-apply-ask", "--project-dir", project, cwd=project)

    assert readme.read_text().endswith("\nImproved by the template.\n")
    assert "\nOur notes: train on the cluster.\n" in readme.read_text()
    assert (project / "CHANGES.md").read_text() == f"# Changes of {project.name}\n"
    run(CRUFT, "check", "--project-dir", project, cwd=project)


def test_cruft_create_then_update(template_clone: Path, tmp_path: Path):
    out = tmp_path / "out"
    answers = json.dumps({"project": "graph-nets", "jupyter": "no"})
    run(CRUFT, "create", template_clone, "--no-input", "--output-dir", out,
        "--extra-context", answers, cwd=tmp_path)  # fmt: skip
    project = out / "graph-nets"
    assert json.loads((project / ".cruft.json").read_text())["template"] == str(template_clone)
    run("git", "init", "--quiet", cwd=project)
    assert_update_arrives(project, template_clone)
    answers = json.loads((project / ".template-answers.json").read_text())
    assert (answers["project"], answers["jupyter"]) == ("graph-nets", False)


def test_plain_project_links_with_its_recorded_answers(template_clone: Path, tmp_path: Path):
    project = bake_project(tmp_path / "out", project="graph-nets", license="BSD-3-Clause")
    run("git", "init", "--quiet", cwd=project)
    answers = (project / ".template-answers.json").read_text()
    run(CRUFT, "link", template_clone, "--no-input", "--project-dir", project,
        "--extra-context", answers, cwd=project)  # fmt: skip
    # The recorded answers regenerate exactly this project: nothing differs.
    assert "diff --git" not in run(
        CRUFT, "diff", "--exit-code", "--project-dir", project, cwd=project
    )
    assert_update_arrives(project, template_clone)
