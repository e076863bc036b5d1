"""The template's README and docs/ say what the template does: its commands, prompts and tables."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import TEMPLATE_DIR, copy_template
from cookiecutter.main import cookiecutter

README = (TEMPLATE_DIR / "README.md").read_text()
COMPATIBILITY = (TEMPLATE_DIR / "docs" / "compatibility.md").read_text()
CONTEXT = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())
TABLE = CONTEXT["_compatibility"]


def two_commands() -> list[str]:
    block = README.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def table_rows(header: str, text: str = README) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table


def test_test_command_is_what_ci_runs():
    generate, test = two_commands()
    assert generate.endswith("cookiecutter . --no-input")
    assert test == "bash .ci/run"
    ci = (TEMPLATE_DIR / ".ci" / "run").read_text()
    assert ci.rstrip().endswith("bash tests/run")


def test_every_answer_has_a_prompt_row_and_a_prompt():
    rows = table_rows("| answer |")
    documented = {name.strip("`") for row in rows for name in row[0].split(", ")}
    answers = {key for key in CONTEXT if not key.startswith("_")}
    assert documented == answers
    assert set(CONTEXT["__prompts__"]) == answers


def test_compatibility_tables_match_the_data():
    rows = table_rows("| torch | CUDA builds |", COMPATIBILITY)
    torch_rows = {row[0]: (row[1], row[2]) for row in rows}
    assert torch_rows == {
        torch: (", ".join(cudas), ", ".join(TABLE["torch_python"][torch]))
        for torch, cudas in TABLE["torch_cuda"].items()
    }
    drivers = {row[0]: row[1].split()[0] for row in table_rows("| CUDA major |", COMPATIBILITY)}
    assert drivers == TABLE["min_driver_by_cuda_major"]


def git_clone_of_the_template(folder):
    """A git repository of the template's files, all committed, as a user's clone is."""
    clone = copy_template(folder)
    identity = ["-c", "user.name=Template Tests", "-c", "user.email=tests@example.com"]
    for command in (["init", "--quiet"], ["add", "--all"], ["commit", "--quiet", "-m", "clone"]):
        subprocess.run(["git", *identity, *command], cwd=clone, check=True, capture_output=True)
    return clone


def git_status(clone):
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=clone, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def test_generating_with_the_defaults_leaves_the_clone_clean(tmp_path):
    """What the README's first command makes (./dynamic-model, ./.venv) is ignored by git."""
    clone = git_clone_of_the_template(tmp_path / "template")
    generate, _ = two_commands()
    assert generate.endswith("cookiecutter . --no-input")
    project = cookiecutter(str(clone), no_input=True, output_dir=str(clone))
    assert Path(project) == clone / "dynamic-model"
    (clone / ".venv" / "bin").mkdir(parents=True)
    assert git_status(clone) == ""


@pytest.mark.slow
def test_generate_command_works_in_a_fresh_clone(tmp_path):
    clone = git_clone_of_the_template(tmp_path / "template")
    generate, _ = two_commands()
    result = subprocess.run(
        ["bash", "-c", generate],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (clone / "dynamic-model" / "pyproject.toml").is_file()
    assert re.search(r"Created dynamic-model/", result.stdout)
    assert git_status(clone) == ""


def test_choice_labels_agree_with_the_table():
    prompts = CONTEXT["__prompts__"]
    for field in ("torch_version", "cuda_version", "license"):
        assert set(prompts[field]) - {"__prompt__"} == set(CONTEXT[field])
    for torch, cudas in TABLE["torch_cuda"].items():
        assert prompts["torch_version"][torch] == f"{torch} (CUDA builds: {', '.join(cudas)})"
    for cuda in CONTEXT["cuda_version"]:
        driver = TABLE["min_driver_by_cuda_major"][cuda.split(".")[0]]
        assert f"driver >= {driver}" in prompts["cuda_version"][cuda]
