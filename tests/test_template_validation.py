"""Bad answers stop generation with one line naming the field, before any folder exists
anywhere; answers stay data, never code."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import TEMPLATE_DIR, bake_project
from cookiecutter.environment import StrictEnvironment
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter
from expected_files import resolve_answers

PYTHON_PAYLOAD = "'); import os; os.system('touch PWNED'); ('"
JINJA_PAYLOAD = "{{ 7*7 }}"
RESERVED = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())["_reserved_names"]

# Names of distributions the project installs, as pip compares them (PEP 503): pip takes
# a project so named for that distribution, finds the wrong version and goes looking
# for other versions of what needs it (torch: several GB each).
COLLIDING_PROJECTS = [
    "typing-extensions", "Typing.Extensions", "typing_extensions", "filelock", "sympy",
    "Jinja2", "networkx", "fsspec", "setuptools", "mpmath", "MarkupSafe", "triton",
    "nvidia-cublas-cu12", "nvidia-cudnn-cu13", "NVIDIA_NCCL_cu12", "nvidia-nvshmem-cu13",
    "cuda-toolkit", "cuda-bindings", "cuda.pathfinder",
    "packaging", "pytest-xdist", "pre-commit", "tensorboard-data-server", "attrs", "pyzmq",
]  # fmt: skip
# Import names of those distributions that differ from the distribution's name.
COLLIDING_PACKAGES = ["google", "dateutil", "fonttools", "nvidia", "cuda", "zmq", "isympy"]

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
    ("description", "Rocket \u202e ledom"),  # RIGHT-TO-LEFT OVERRIDE (Cf)
    ("description", "line\u2028separator"),  # Zl
    ("description", "para\u2029graph"),  # Zp
    ("description", "next\u0085line"),  # NEXT LINE (Cc)
    ("description", "del\x7f"),  # Cc
    ("description", "\u200b"),  # ZERO WIDTH SPACE only (Cf)
    ("description", "\u3000\u00a0 "),  # ideographic and no-break spaces: nothing visible
    ("description", "\u0301"),  # a combining accent with nothing to sit on
    ("description", "half \ud83d emoji"),  # a lone surrogate (Cs)
    ("description", "\u200dleading joiner"),  # ZWJ not inside a word
    ("description", "soft\u00adhyphen"),  # Cf
    ("author", "\ufeff张伟"),  # BYTE ORDER MARK (Cf)
    ("author", "张\u2066伟"),  # LEFT-TO-RIGHT ISOLATE (Cf)
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
    *[("project", name) for name in COLLIDING_PROJECTS],
    *[("package", name) for name in COLLIDING_PACKAGES],
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
    {"description": "Rocket 🚀 model, 𠮷野家 \U0001f9ea"},  # outside the BMP
    {"description": "动态图模型\u3000（中文）"},  # noqa: RUF001
    {"description": "family 👨\u200d👩\u200d👧, ❤️\u200d🔥, می\u200cخواهم"},  # noqa: RUF001 (joiners in words)
    {"author": "张三"},
    {"author": '𠮷田 "Q" \\ O\'Brien'},
    {"email": "first.last+tag@sub.example.co.uk"},
    {"ssh_port": "1024", "jupyter_port": "65535"},
    {"jupyter": False, "jupyter_port": "2222"},
    {"torch_version": "2.8.0", "cuda_version": "12.9"},
    # Near the names of what the project installs, without being one.
    {"project": "cuda-kernels"},
    {"project": "sympy-models"},
    {"project": "nvidia2"},
    {"project": "attrs-net", "package": "attrs_net"},
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


def refusal(output_dir: Path, **answers: object) -> list[str]:
    """The error lines with which generation of ``answers`` into ``output_dir`` stops."""
    with pytest.raises(FailedHookException) as refused:
        bake_project(output_dir, **answers)
    return str(refused.value).splitlines()


@pytest.mark.parametrize(("field", "value"), BAD_ANSWERS)
def test_bad_answer_stops_generation_naming_the_field(output_dir, field, value):
    before = entries(output_dir.parent)
    errors = refusal(output_dir, **{field: value})
    assert len(errors) == 1, f"one line per bad answer, got {errors}"
    assert errors[0].startswith(f"error: {field} = {value!r} is not allowed: expected ")
    assert errors[0].isprintable(), "the value is shown escaped where it holds invisible characters"
    assert entries(output_dir.parent) == before
    assert_no_pwned(output_dir.parent, TEMPLATE_DIR)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("Rocket \u202e ledom", "format character U+202E RIGHT-TO-LEFT OVERRIDE at position 8"),
        ("a\u2028b", "line separator character U+2028 LINE SEPARATOR at position 2"),
        ("x\ud800", "surrogate character U+D800 at position 2"),
        ("\x85", "text with at least one visible character"),
    ],
)
def test_refusal_names_the_invisible_character(output_dir, value, named):
    (error,) = refusal(output_dir, description=value)
    assert named in error


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


def test_every_bad_answer_gets_its_own_line(output_dir):
    errors = refusal(output_dir, project="2fast", email="x", ssh_port="1", cuda_version="12.8")
    assert [line.split()[1] for line in errors] == ["project", "email", "cuda_version", "ssh_port"]


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


@pytest.mark.parametrize(
    ("project", "clash"),
    [
        (
            "Typing.Extensions",
            "('typing-extensions', as pip reads the name, is one torch needs: pip would take the "
            "project for it and download other torch versions, several GB each, looking for one "
            "that fits)",
        ),
        (
            "packaging",
            "('packaging', as pip reads the name, is one the dev, train or notebook extra "
            "installs: pip would take the project for it and fail, or download older versions "
            "of what needs it)",
        ),
    ],
)
def test_project_named_like_what_it_installs_is_refused_saying_why(output_dir, project, clash):
    assert refusal(output_dir, project=project) == [
        f"error: project = {project!r} is not allowed: expected a project name other than those "
        f"of the distributions the project installs {clash}"
    ]
    assert entries(output_dir) == ["keep.txt"]


# Where the project may be installed: the images' Linux, and a user's own machine.
PLATFORMS = [
    ("linux", "Linux", "x86_64"),
    ("linux", "Linux", "aarch64"),
    ("darwin", "Darwin", "arm64"),
    ("win32", "Windows", "AMD64"),
]
MARKER_ENVIRONMENTS = [
    {
        "sys_platform": platform, "platform_system": system, "platform_machine": machine,
        "os_name": "nt" if platform == "win32" else "posix", "python_version": python,
        "python_full_version": f"{python}.0", "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    for platform, system, machine in PLATFORMS
    for python in ("3.10", "3.11", "3.12", "3.13")
]  # fmt: skip


def requirement_closure(roots: list[str]) -> set[str]:
    """Normalized names of ``roots`` and of everything they require, as installed here,
    with the requirements of every platform and Python above; a requirement that is not
    installed here (another platform's) is named, not followed."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names, seen, queue = set(), set(), [Requirement(root) for root in roots]
    while queue:
        requirement = queue.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            required = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in required:
            needed = Requirement(text)
            if needed.marker is None or any(
                needed.marker.evaluate({**environment, "extra": extra})
                for environment in MARKER_ENVIRONMENTS
                for extra in requirement.extras or {""}
            ):
                queue.append(needed)
    return names


def top_level_modules(distributions: set[str]) -> set[str]:
    from packaging.utils import canonicalize_name

    return {
        module.lower()
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(owner) in distributions for owner in owners)
    }


def test_reserved_names_hold_what_the_project_installs(default_project: Path):
    """cookiecutter.json's ``_reserved_names`` against the metadata installed here: torch's
    requirements and the generated project's extras, followed to the end.

    torch's CUDA builds also need triton, cuda-toolkit, cuda-bindings, cuda-pathfinder and
    nvidia-* libraries: those names come from the metadata of PyPI's Linux wheels of each
    torch in the compatibility table; the CPU build installed here does not list them.
    """
    torch = requirement_closure(["torch"]) - {"torch"}
    extras = tomllib.loads((default_project / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras) == {"dev", "train", "notebook", "docs"}
    roots = [r for group in extras.values() for r in group if not r.startswith("dynamic-model[")]
    installed = requirement_closure(roots) | torch
    reserved = {
        "torch": sorted(torch - set(RESERVED["torch"])),
        "extras": sorted(installed - torch - set(RESERVED["torch"]) - set(RESERVED["extras"])),
        "modules": sorted(
            top_level_modules(installed | {"torch"}) - {m.lower() for m in RESERVED["modules"]}
        ),
    }
    assert reserved == {"torch": [], "extras": [], "modules": []}, (
        "add these names to cookiecutter.json's _reserved_names"
    )


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
    assert f"error: {field} = {value!r} is not allowed" in result.stdout + result.stderr
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


def test_python_version_is_checked_against_the_table(output_dir):
    """No prompt offers an unsupported Python today; the checks still read the table as data."""
    table = {"_compatibility": {"torch_python": {"2.13.0": ["3.12", "3.13"]}}}
    assert refusal(output_dir, python_version="3.11", **table) == [
        "error: python_version = '3.11' is not allowed: "
        "expected a Python version torch 2.13.0 supports: 3.12, 3.13"
    ]
    assert entries(output_dir) == ["keep.txt"]
    assert bake_project(output_dir, python_version="3.12", **table).is_dir()


@pytest.mark.parametrize(("given", "seen"), [(2, "'2'"), ("maybe", None)])
def test_jupyter_must_be_yes_or_no(output_dir, given, seen):
    if seen is None:  # cookiecutter converts yes/no words itself and refuses others
        with pytest.raises(ValueError, match="maybe provided for variable jupyter"):
            bake_project(output_dir, jupyter=given)
    else:
        assert refusal(output_dir, jupyter=given) == [
            f"error: jupyter = {seen} is not allowed: expected yes or no"
        ]
    assert entries(output_dir) == ["keep.txt"]


# Each escapes the output folder, its parent or both, as a path joined to the output folder.
ESCAPING_PROJECTS = ["a/b", "b/../../../x/y", "../escape", "{tmp}/abs", "..", "a\\b"]


@pytest.fixture
def deep_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An output folder three levels below tmp_path: '../../../x' still lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "home" / "user" / "out"
    folder.mkdir(parents=True)
    (folder / "keep.txt").write_text("the user's file\n")
    return folder


@pytest.mark.parametrize("project", ESCAPING_PROJECTS)
def test_refused_project_creates_nothing_anywhere(deep_output_dir, tmp_path, project):
    project = project.format(tmp=tmp_path)
    before = entries(tmp_path)
    with pytest.raises(FailedHookException, match=f"error: project = {re.escape(repr(project))}"):
        bake_project(deep_output_dir, project=project)
    assert entries(tmp_path) == before


@pytest.mark.parametrize("project", ["a/b", "b/../../../x/y"])
def test_typed_project_path_creates_nothing_anywhere(deep_output_dir, tmp_path, project):
    before = entries(tmp_path)
    result = run_interactive(deep_output_dir, [project])
    assert result.returncode != 0
    assert f"error: project = {project!r} is not allowed" in result.stdout + result.stderr
    assert entries(tmp_path) == before


def replay_file(folder: Path, **answers: object) -> Path:
    """A replay file as cookiecutter writes one after the prompts, holding ``answers``.

    Replayed answers are not asked or checked again: only the pre-generation hook sees them.
    """
    template = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())
    private = {name: value for name, value in template.items() if name.startswith("_")}
    context = {**resolve_answers(**answers), **private, "__answers_checked": "yes"}
    path = folder / "replay" / "template.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"cookiecutter": context}))
    return path


@pytest.mark.parametrize(
    ("project", "left"), [("a/b", "home/user/out/a"), ("b/../../../x/y", "home/x")]
)
def test_checking_in_the_hook_alone_would_leave_folders(deep_output_dir, tmp_path, project, left):
    """Why the answers are checked before generation: cookiecutter 2.7 creates the project
    folder, then runs the pre-generation hook, and on failure removes only the last folder."""
    replay = replay_file(tmp_path, project=project)
    before = set(entries(tmp_path))
    with pytest.raises(FailedHookException):
        cookiecutter(str(TEMPLATE_DIR), replay=str(replay), output_dir=str(deep_output_dir))
    assert left in set(entries(tmp_path)) - before


@pytest.mark.parametrize("hook", ["pre_gen_project.py", "post_gen_project.py"])
def test_answers_line_turns_any_text_into_the_same_string(hook):
    """The hooks' one Jinja expression, rendered as cookiecutter does, gives back each answer."""
    source = (TEMPLATE_DIR / "hooks" / hook).read_text()
    (expression,) = re.findall(r"json\.loads\(r'\{\{ cookiecutter \| tojson \}\}'\)", source)
    template = StrictEnvironment(context={"cookiecutter": {}}).from_string(expression)
    for text in ["'", "\\", "\\'", "'''", '"""', "\n", "\u2028", "é 张", "</script>", "\\u0027",
                 "{{ 1 }}", "\x00", PYTHON_PAYLOAD, "\\" * 3, "🚀 𠮷"]:  # fmt: skip
        assert eval(template.render(cookiecutter={"value": text}), {"json": json}) == {
            "value": text
        }


def test_pre_generation_hook_still_checks_on_its_own(output_dir, tmp_path, capfd):
    """A replay skips the early check; the hook runs the same checks after cookiecutter
    created the folder, and cookiecutter removes that folder again."""
    replay = replay_file(tmp_path, email="x")
    with pytest.raises(FailedHookException):
        cookiecutter(str(TEMPLATE_DIR), replay=str(replay), output_dir=str(output_dir))
    assert "error: email = 'x' is not allowed" in capfd.readouterr().err
    assert entries(output_dir) == ["keep.txt"]
