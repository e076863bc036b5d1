"""Generated projects pull later template changes with cruft, from a local clone of the template;
no answer recorded in a project is ever run as code on the way."""

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

    updated = run(CRUFT, "update", "--skip-apply-ask", "--project-dir", project, cwd=project)
    # cruft renders the old and the new template into folders of its own: the hook's
    # next steps for a new project ("git init ...") are not true then, and not printed.
    assert "Next steps" not in updated

    assert readme.read_text().endswith("\nImproved by the template.\n")
    assert "\nOur notes: train on the cluster.\n" in readme.read_text()
    assert (project / "CHANGES.md").read_text() == f"# Changes of {project.name}\n"
    run(CRUFT, "check", "--project-dir", project, cwd=project)


def test_cruft_create_then_update(template_clone: Path, tmp_path: Path):
    out = tmp_path / "out"
    answers = json.dumps({"project": "graph-nets", "jupyter": "no"})
    created = run(CRUFT, "create", template_clone, "--no-input", "--output-dir", out,
                  "--extra-context", answers, cwd=tmp_path)  # fmt: skip
    assert created.count("Created graph-nets/. Next steps:") == 1
    project = out / "graph-nets"
    assert json.loads((project / ".cruft.json").read_text())["template"] == str(template_clone)
    run("git", "init", "--quiet", cwd=project)
    assert_update_arrives(project, template_clone)
    answers = json.loads((project / ".template-answers.json").read_text())
    assert (answers["project"], answers["jupyter"]) == ("graph-nets", False)


def link(project: Path, clone: Path) -> subprocess.CompletedProcess[str]:
    """The README's link command for a project generated from a plain folder (the clone)."""
    return subprocess.run(
        [sys.executable, clone / "cruft_link.py", project],
        cwd=project, env={**os.environ, **GIT_IDENTITY}, capture_output=True, text=True,
        check=False,
    )  # fmt: skip


def test_plain_project_links_with_its_recorded_answers(template_clone: Path, tmp_path: Path):
    project = bake_project(
        tmp_path / "out", project="graph-nets", license="BSD-3-Clause",
        description='动态图 🚀 "quoted" \\ model', author="张伟",
    )  # fmt: skip
    assert not (project / ".cruft.json").exists(), "a plain folder gives no URL to record"
    run("git", "init", "--quiet", cwd=project)
    linked = link(project, template_clone)
    assert linked.returncode == 0, linked.stdout + linked.stderr
    assert json.loads((project / ".cruft.json").read_text())["template"] == str(template_clone)
    # The recorded answers regenerate exactly this project: nothing differs, and the
    # hook's next steps do not land in the diff.
    assert run(CRUFT, "diff", "--exit-code", "--project-dir", project, cwd=project) == ""
    assert_update_arrives(project, template_clone)


def test_project_from_a_git_url_is_ready_for_cruft_update(template_clone: Path, tmp_path: Path):
    """cookiecutter cloned the template; the post-generation hook recorded what cruft needs."""
    config = tmp_path / "cookiecutter-config.yaml"
    config.write_text(f'cookiecutters_dir: "{tmp_path / "clones"}"\n'
                      f'replay_dir: "{tmp_path / "replay"}"\n')  # fmt: skip
    url = f"git+file://{template_clone}"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", url, "--no-input", "--output-dir", out,
         "project=graph-nets", "author=张伟 🚀"],
        env={**os.environ, "COOKIECUTTER_CONFIG": str(config)}, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    project = out / "graph-nets"
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    head = run("git", "rev-parse", "HEAD", cwd=template_clone).strip()
    answers = json.loads((project / ".template-answers.json").read_text(encoding="utf-8"))
    assert (state["template"], state["commit"], state["checkout"]) == (
        f"file://{template_clone}", head, None,
    )  # fmt: skip
    recorded = state["context"]["cookiecutter"]
    assert {name: value for name, value in recorded.items() if not name.startswith("_")} == answers
    assert answers["author"] == "张伟 🚀"
    run("git", "init", "--quiet", cwd=project)
    assert "diff --git" not in run(
        CRUFT, "diff", "--exit-code", "--project-dir", project, cwd=project
    )
    assert_update_arrives(project, template_clone)


def payload(marker: Path) -> str:
    """Jinja that runs a shell command when rendered: it creates ``marker``."""
    return f"{{{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}}}"


@pytest.mark.parametrize(
    "plant",
    [
        lambda answers, code: answers.update(description=code),
        lambda answers, code: answers.update(package=code),
        lambda answers, code: answers.update(author={"name": code}),
        lambda answers, code: answers.update({code: "x"}),
    ],
    ids=["description", "package", "nested-value", "key"],
)
def test_planted_template_syntax_in_the_answers_file_runs_nothing(
    template_clone: Path, tmp_path: Path, plant
):
    project = bake_project(tmp_path / "out")
    run("git", "init", "--quiet", cwd=project)
    answers_file = project / ".template-answers.json"
    answers = json.loads(answers_file.read_text())
    plant(answers, payload(tmp_path / "PWNED"))
    answers_file.write_text(json.dumps(answers))

    linked = link(project, template_clone)
    assert linked.returncode == 1
    assert "is not allowed: it holds template syntax, which cruft would run as code" in (
        linked.stderr
    )
    assert not (tmp_path / "PWNED").exists()
    assert not (project / ".cruft.json").exists()


def test_cruft_link_alone_runs_a_planted_answer(template_clone: Path, tmp_path: Path):
    """The reverse, and why the link command checks: cruft renders the answers it is given."""
    project = bake_project(tmp_path / "out")
    run("git", "init", "--quiet", cwd=project)
    answers = json.loads((project / ".template-answers.json").read_text())
    answers["description"] = payload(tmp_path / "PWNED")
    subprocess.run(
        [CRUFT, "link", template_clone, "--no-input", "--project-dir", project,
         "--extra-context", json.dumps(answers)],
        cwd=project, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (tmp_path / "PWNED").exists()


def test_link_command_refuses_answers_the_template_refuses(template_clone: Path, tmp_path: Path):
    project = bake_project(tmp_path / "out")
    answers_file = project / ".template-answers.json"
    answers_file.write_text(json.dumps({**json.loads(answers_file.read_text()), "email": "x"}))
    linked = link(project, template_clone)
    assert linked.returncode == 1
    assert linked.stderr.startswith("error: email = 'x' is not allowed: expected an email")
    assert not (project / ".cruft.json").exists()
