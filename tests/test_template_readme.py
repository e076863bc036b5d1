"""The template's README says what the template does: its commands, prompts and tables."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import TEMPLATE_DIR, copy_template

README = (TEMPLATE_DIR / "README.md").read_text()
CONTEXT = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())
TABLE = CONTEXT["_compatibility"]


def two_commands() -> list[str]:
    block = README.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def table_rows(header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with ``header``."""
    lines = README.splitlines()
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
    torch_rows = {row[0]: (row[1], row[2]) for row in table_rows("| torch | CUDA builds |")}
    assert torch_rows == {
        torch: (", ".join(cudas), ", ".join(TABLE["torch_python"][torch]))
        for torch, cudas in TABLE["torch_cuda"].items()
    }
    drivers = {row[0]: row[1].split()[0] for row in table_rows("| CUDA major |")}
    assert drivers == TABLE["min_driver_by_cuda_major"]


@pytest.mark.slow
def test_generate_command_works_in_a_fresh_clone(tmp_path):
    clone = copy_template(tmp_path / "template")
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


def test_choice_labels_agree_with_the_table():
    prompts = CONTEXT["__prompts__"]
    for field in ("torch_version", "cuda_version", "license"):
        assert set(prompts[field]) - {"__prompt__"} == set(CONTEXT[field])
    for torch, cudas in TABLE["torch_cuda"].items():
        assert prompts["torch_version"][torch] == f"{torch} (CUDA builds: {', '.join(cudas)})"
    for cuda in CONTEXT["cuda_version"]:
        driver = TABLE["min_driver_by_cuda_major"][cuda.split(".")[0]]
        assert f"driver >= {driver}" in prompts["cuda_version"][cuda]
