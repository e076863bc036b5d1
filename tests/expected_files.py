"""The exact set of files a generated project holds, for any combination of answers.

Paths are relative to the generated project folder; ``{package}`` stands for the
package folder's name. To add a generated file, add one line: to ``BASE_FILES`` if
every project has it, or to the set of the answer that brings it in
``FILES_BY_ANSWER``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

BASE_FILES = frozenset(
    {
        ".template-answers.json",
        ".devcontainer/.dockerignore",
        ".devcontainer/.gitignore",
        ".devcontainer/Dockerfile",
        ".devcontainer/collect-host-ssh-keys.sh",
        ".devcontainer/create-user.sh",
        ".devcontainer/devcontainer.json",
        ".devcontainer/post-create.sh",
        ".devcontainer/ssh-session-env.sh",
        ".devcontainer/sshd_config",
        ".devcontainer/start-services.sh",
        ".devcontainer/start-sshd.sh",
        ".github/workflows/ci.yml",
        ".gitignore",
        ".pre-commit-config.yaml",
        "ARCHITECTURE.md",
        "docs/benchmarks.md",
        "docs/checks/autograd_determinism.md",
        "docs/checks/compile_check.md",
        "docs/checks/ddp_check.md",
        "docs/checks/decisions.md",
        "docs/checks/export_check.md",
        "docs/checks/finite_check.md",
        "docs/checks/gradcheck.md",
        "docs/checks/training_check.md",
        "docs/cluster.md",
        "docs/commands/doctor.md",
        "docs/commands/launch.md",
        "docs/commands/train.md",
        "docs/conf.py",
        "docs/devcontainer.md",
        "docs/development.md",
        "docs/index.md",
        "docs/testing.md",
        "docs/troubleshooting.md",
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "src/{package}/__init__.py",
        "src/{package}/_checkpoint.py",
        "src/{package}/_command.py",
        "src/{package}/_digest.py",
        "src/{package}/_data.py",
        "src/{package}/_files.py",
        "src/{package}/_finite_steps.py",
        "src/{package}/_lifetime.py",
        "src/{package}/_metrics.py",
        "src/{package}/_preemption.py",
        "src/{package}/_progress.py",
        "src/{package}/doctor.py",
        "src/{package}/gpus.py",
        "src/{package}/launch.py",
        "src/{package}/models.py",
        "src/{package}/replay.py",
        "src/{package}/testing/__init__.py",
        "src/{package}/testing/branches.py",
        "src/{package}/testing/calls.py",
        "src/{package}/testing/comparison.py",
        "src/{package}/testing/compile_check/__init__.py",
        "src/{package}/testing/compile_check/graph_breaks.py",
        "src/{package}/testing/compile_check/recompiles.py",
        "src/{package}/testing/compile_check/results.py",
        "src/{package}/testing/control_flow.py",
        "src/{package}/testing/data_dependence.py",
        "src/{package}/testing/ddp_check/__init__.py",
        "src/{package}/testing/ddp_check/checker.py",
        "src/{package}/testing/ddp_check/launch.py",
        "src/{package}/testing/ddp_check/messages.py",
        "src/{package}/testing/ddp_check/process_tree.py",
        "src/{package}/testing/ddp_check/results.py",
        "src/{package}/testing/ddp_check/worker.py",
        "src/{package}/testing/decisions.py",
        "src/{package}/testing/determinism.py",
        "src/{package}/testing/export_check.py",
        "src/{package}/testing/failures.py",
        "src/{package}/testing/finite_check.py",
        "src/{package}/testing/float64.py",
        "src/{package}/testing/frames.py",
        "src/{package}/testing/global_state.py",
        "src/{package}/testing/gradcheck/__init__.py",
        "src/{package}/testing/gradcheck/diagnosis.py",
        "src/{package}/testing/gradcheck/localization.py",
        "src/{package}/testing/gradcheck/problem.py",
        "src/{package}/testing/gradcheck/results.py",
        "src/{package}/testing/gradcheck/screen.py",
        "src/{package}/testing/gradcheck/tolerances.py",
        "src/{package}/testing/gradcheck/weights.py",
        "src/{package}/testing/naming.py",
        "src/{package}/testing/nonfinite.py",
        "src/{package}/testing/op_sites.py",
        "src/{package}/testing/options.py",
        "src/{package}/testing/parameter_use.py",
        "src/{package}/testing/parts.py",
        "src/{package}/testing/plugin.py",
        "src/{package}/testing/processes.py",
        "src/{package}/testing/python_attributes.py",
        "src/{package}/testing/rewrites.py",
        "src/{package}/testing/sources.py",
        "src/{package}/testing/runs.py",
        "src/{package}/testing/subject.py",
        "src/{package}/testing/torch_logs.py",
        "src/{package}/testing/torch_text.py",
        "src/{package}/testing/trees.py",
        "src/{package}/testing/training_check.py",
        "src/{package}/testing/verified_rewrites.py",
        "src/{package}/train.py",
        "tests/test_architecture.py",
        "tests/test_commands.py",
        "tests/test_compile.py",
        "tests/test_ddp.py",
        "tests/test_determinism.py",
        "tests/test_docs.py",
        "tests/test_gpu.py",
        "tests/test_gradients.py",
        "tests/test_models.py",
        "tests/test_training.py",
    }
)

# (answer, value) -> files present only when that answer has that value.
FILES_BY_ANSWER: dict[tuple[str, object], frozenset[str]] = {
    ("jupyter", True): frozenset({".devcontainer/start-jupyter.sh", "notebooks/quickstart.ipynb"}),
}

_DEFAULTS = json.loads((Path(__file__).resolve().parent.parent / "cookiecutter.json").read_text())


def default_answers() -> dict[str, object]:
    """The answers ``cookiecutter --no-input`` uses: first choice of each list."""
    answers = {
        key: value[0] if isinstance(value, list) else value
        for key, value in _DEFAULTS.items()
        if not key.startswith("_")
    }
    answers["package"] = package_for(str(answers["project"]))
    return answers


def package_for(project: str) -> str:
    """The package name the template derives from a project name."""
    return project.lower().replace("-", "_").replace(".", "_")


def resolve_answers(**overrides: object) -> dict[str, object]:
    """Defaults with ``overrides`` applied; the package follows the project unless given."""
    answers = default_answers()
    answers.update(overrides)
    if "package" not in overrides:
        answers["package"] = package_for(str(answers["project"]))
    return answers


def expected_files(answers: Mapping[str, object]) -> set[str]:
    """Every file (relative POSIX path) of a project generated with ``answers``.

    ``answers`` may be partial: missing ones take their defaults.
    """
    full = resolve_answers(**answers)
    paths = set(BASE_FILES)
    for (name, value), files in FILES_BY_ANSWER.items():
        if full[name] == value:
            paths |= files
    return {path.format(package=full["package"]) for path in paths}
