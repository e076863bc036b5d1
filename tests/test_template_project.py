"""A generated project installs, passes its own pre-commit hooks and its own tests, as generated."""

from __future__ import annotations

import subprocess

import pytest
from conftest import ProjectEnv

COMBINATIONS = {
    "defaults": {},
    "own-names-py310-no-jupyter": {
        "project": "Recursive.Nets",
        "package": "recnets",
        "description": '动态图模型 🚀 with "quotes" and a \\ backslash',
        "author": "张伟",
        "python_version": "3.10",
        "jupyter": False,
        "license": "Apache-2.0",
    },
}


def git(project, *args: str) -> None:
    subprocess.run(["git", *args], cwd=project, check=True, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("answers", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_fresh_project_passes_its_own_checks(bake, project_env: ProjectEnv, answers):
    project = bake(**answers)
    project_env.install(project)
    git(project, "init", "--quiet")
    git(project, "add", "--all")

    # Tests first: the hooks may rewrite files (ruff --fix, ruff format).
    # Every test, the slow ones too (a plain pytest leaves them out: -m "not slow"); the
    # docs' examples run once, in the defaults (in another they differ only by names).
    docs = [] if not answers else ["-k", "not test_python_blocks_run_and_print_what_they_show"]
    tests = project_env.run(
        "pytest", "-m", "slow or not slow", *docs, "-p", "no:cacheprovider", cwd=project,
        check=False,
    )  # fmt: skip
    hooks = project_env.run(
        "pre_commit", "run", "--all-files", "--show-diff-on-failure", cwd=project, check=False
    )

    problems = []
    if hooks.returncode != 0:
        problems.append(f"pre-commit failed on the fresh project:\n{hooks.stdout}")
    if tests.returncode != 0:
        problems.append(f"the project's tests failed:\n{tests.stdout}\n{tests.stderr}")
    assert not problems, "\n".join(problems)
    assert " passed" in tests.stdout.splitlines()[-1]
