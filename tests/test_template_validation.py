"""Bad answers stop generation with one line naming the field; answers stay data, never code."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import TEMPLATE_DIR, bake_project
from cookiecutter.environment import StrictEnvironment
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter

PYTHON_PAYLOAD = "'); import os; os.system('touch PWNED'); ('"
JINJA_PAYLOAD = "{{ 7*7 }}"

BAD_ANSWERS = [
    ("project", "my model"),
    ("project", "2fast"),
    ("project", "class"),
    ("project", "modèle"),
    ("project", "torch"),
    ("project", "tests"),
    ("project", "Pytest"),
    ("project", "typing"),
    ("project", "-dash"),
    ("project", "x" * 65),
    ("project", PYTHON_PAYLOAD),
    ("package", "My-Pkg"),
    ("package", "numpy"),
    ("package", "import"),
    ("package", "_private"),
    ("description", "two\nlines"),
    ("description", "d" * 201),
    ("description", "tab\there"),
    ("author", ""),
    ("author", "   "),
    ("email", "not-an-email"),
    ("email", "you@localhost"),
    ("email", "two words@example.com"),
    ("ssh_port", "80"),
    ("ssh_port", "65536"),
    ("ssh_port", "02222"),
    ("ssh_port", "ssh"),
    ("jupyter_port", "0"),
    ("jupyter_port", "2222"),  # the default ssh_port, with Jupyter on
    ("cuda_version", "12.8"),  # torch 2.13.0 has no 12.8 build
    ("cuda_version", "12.9"),
]

GOOD_ANSWERS = [
    {"project": "a"},
    {"project": "My.Model-2_x"},
    {"project": "m" * 64},
    {"project": "torch-models"},
    {"package": "my_pkg2"},
    {"description": PYTHON_PAYLOAD},
    {"description": "Modèles dynamiques — 动态图 (50% {faster})"},
    {"description": r"C:\temp\new \u0041 \\ \" '''q'''"},
    {"author": "张三"},
    {"email": "first.last+tag@sub.example.co.uk"},
    {"ssh_port": "1024", "jupyter_port": "65535"},
    {"jupyter": False, "jupyter_port": "2222"},
    {"torch_version": "2.8.0", "cuda_version": "12.9"},
]


def entries(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def assert_no_pwned(*folders: Path) -> None:
    for folder in folders:
        assert not list(folder.rglob("PWNED")), f"the payload ran: PWNED in {folder}"


@pytest.fixture
def output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An output folder that already holds a user's file, with the test run from tmp_path."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's file\n")
    return folder


@pytest.mark.parametrize(("field", "value"), BAD_ANSWERS)
def test_bad_answer_stops_generation_naming_the_field(output_dir, capfd, field, value):
    with pytest.raises(FailedHookException):
        bake_project(output_dir, **{field: value})
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]], f"one line per bad answer, got {errors}"
    assert errors[0].startswith(f"error: {field} = {value!r} is not allowed: expected ")
    assert entries(output_dir) == ["keep.txt"]
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


@pytest.mark.parametrize(
    ("field", "value"),
    [("python_version", "3.9"), ("torch_version", "2.99.0"), ("license", "GPL-3.0")],
)
def test_value_outside_the_choices_is_refused_before_any_folder_exists(output_dir, field, value):
    with pytest.raises(ValueError, match=rf"{value} provided for choice variable {field}"):
        bake_project(output_dir, **{field: value})
    assert entries(output_dir) == ["keep.txt"]


@pytest.mark.parametrize("answers", GOOD_ANSWERS, ids=str)
def test_good_answers_generate(output_dir, answers):
    project = bake_project(output_dir, **answers)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if "description" in answers:
        assert meta["description"] == answers["description"]
    if "author" in answers:
        assert meta["authors"][0]["name"] == answers["author"]
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


def test_every_bad_answer_gets_its_own_line(output_dir, capfd):
    with pytest.raises(FailedHookException):
        bake_project(output_dir, project="2fast", email="x", ssh_port="1", cuda_version="12.8")
    fields = [line.split()[1] for line in capfd.readouterr().err.splitlines() if "error: " in line]
    assert fields == ["project", "email", "cuda_version", "ssh_port"]


def test_existing_project_folder_survives_a_bad_answer(output_dir):
    project = output_dir / "dynamic-model"
    project.mkdir()
    (project / "train_log.txt").write_text("three days of training\n")
    with pytest.raises(FailedHookException):
        cookiecutter(
            str(TEMPLATE_DIR), no_input=True, output_dir=str(output_dir),
            overwrite_if_exists=True, extra_context={"email": "bad"},
        )  # fmt: skip
    assert entries(output_dir) == ["dynamic-model", "dynamic-model/train_log.txt", "keep.txt"]
    assert (project / "train_log.txt").read_text() == "three days of training\n"


def run_interactive(output_dir: Path, answers: list[str]) -> subprocess.CompletedProcess[str]:
    """The cookiecutter command line, typing ``answers`` then Enter (defaults) at the prompts."""
    return subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(TEMPLATE_DIR), "--output-dir", str(output_dir)],
        input="\n".join([*answers, *[""] * 20]),
        capture_output=True,
        text=True,
        cwd=output_dir.parent,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("typed", "field", "value"),
    [
        ([PYTHON_PAYLOAD], "project", PYTHON_PAYLOAD),
        ([JINJA_PAYLOAD], "project", JINJA_PAYLOAD),
        (["", "", JINJA_PAYLOAD], "description", JINJA_PAYLOAD),
        (["", "", "", "{% if true %}x{% endif %}"], "author", "{% if true %}x{% endif %}"),
    ],
    ids=["python-in-project", "jinja-in-project", "jinja-in-description", "jinja-in-author"],
)
def test_typed_payloads_are_refused_not_run(output_dir, typed, field, value):
    result = run_interactive(output_dir, typed)
    assert result.returncode != 0
    assert f"error: {field} = {value!r} is not allowed" in result.stderr
    assert entries(output_dir) == ["keep.txt"]
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


def test_typed_python_payload_in_description_is_kept_as_text(output_dir):
    result = run_interactive(output_dir, ["", "", PYTHON_PAYLOAD])
    assert result.returncode == 0, result.stderr
    pyproject = tomllib.loads((output_dir / "dynamic-model" / "pyproject.toml").read_text())
    assert pyproject["project"]["description"] == PYTHON_PAYLOAD
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


def test_extra_context_python_payload_is_data(output_dir):
    project = bake_project(output_dir, description=PYTHON_PAYLOAD, author=PYTHON_PAYLOAD)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == meta["authors"][0]["name"] == PYTHON_PAYLOAD
    assert PYTHON_PAYLOAD in (project / "LICENSE").read_text()
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


def test_python_version_is_checked_against_the_table(output_dir, capfd):
    """No prompt offers an unsupported Python today; the hook still reads the table as data."""
    table = {"_compatibility": {"torch_python": {"2.13.0": ["3.12", "3.13"]}}}
    with pytest.raises(FailedHookException):
        bake_project(output_dir, python_version="3.11", **table)
    assert (
        "error: python_version = '3.11' is not allowed: "
        "expected a Python version torch 2.13.0 supports: 3.12, 3.13"
    ) in capfd.readouterr().err
    assert entries(output_dir) == ["keep.txt"]
    assert bake_project(output_dir, python_version="3.12", **table).is_dir()


@pytest.mark.parametrize(("given", "seen"), [(2, "'2'"), ("maybe", None)])
def test_jupyter_must_be_yes_or_no(output_dir, capfd, given, seen):
    if seen is None:  # cookiecutter converts yes/no words itself and refuses others
        with pytest.raises(ValueError, match="maybe provided for variable jupyter"):
            bake_project(output_dir, jupyter=given)
    else:
        with pytest.raises(FailedHookException):
            bake_project(output_dir, jupyter=given)
        assert (
            f"error: jupyter = {seen} is not allowed: expected yes or no" in capfd.readouterr().err
        )
    assert entries(output_dir) == ["keep.txt"]


def test_project_name_cannot_place_files_outside_the_output_folder(output_dir, capfd):
    before = entries(output_dir.parent)
    with pytest.raises(FailedHookException):
        bake_project(output_dir, project="../escape")
    assert "error: project = '../escape' is not allowed" in capfd.readouterr().err
    assert entries(output_dir.parent) == before


@pytest.mark.parametrize("hook", ["pre_gen_project.py", "post_gen_project.py"])
def test_answers_line_turns_any_text_into_the_same_string(hook):
    """The hooks' one Jinja line, rendered as cookiecutter does, gives back each answer exactly."""
    source = (TEMPLATE_DIR / "hooks" / hook).read_text()
    line = next(text for text in source.splitlines() if text.startswith("ANSWERS = "))
    template = StrictEnvironment(context={"cookiecutter": {}}).from_string(line)
    for text in ["'", "\\", "\\'", "'''", '"""', "\n", "\u2028", "é 张", "</script>", "\\u0027",
                 "{{ 1 }}", "\x00", PYTHON_PAYLOAD, "\\" * 3]:  # fmt: skip
        namespace: dict[str, object] = {"json": json}
        exec(template.render(cookiecutter={"value": text}), namespace)
        assert namespace["ANSWERS"] == {"value": text}
