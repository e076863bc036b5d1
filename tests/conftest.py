"""Shared fixtures of the template's tests: baking projects and environments to run them in."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

# The fixtures of the tests of train, beside their helpers.
pytest_plugins = ("training",)

TEMPLATE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_PACKAGE = "dynamic_model"
PLUGIN_MODULE = f"{DEFAULT_PACKAGE}.testing.plugin"

# The tests match what the processes they start (pytest, sphinx, pre-commit) print by its
# text. A CI runner that forces colour would put escape codes in it; without these, a
# child process that writes to a pipe prints plain text, as on the generated project's CI.
for _forces_colour in ("FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE"):
    os.environ.pop(_forces_colour, None)


def bake_project(output_dir: Path, **answers: object) -> Path:
    """Generate a project from the template without prompts; return its folder."""
    return Path(
        cookiecutter(
            str(TEMPLATE_DIR),
            no_input=True,
            extra_context={key: value for key, value in answers.items()},
            output_dir=str(output_dir),
        )
    )


def copy_template(destination: Path) -> Path:
    """Copy the template's files as a commit would hold them (tracked and new, not ignored).

    Projects generated into the checkout (folders with ``.template-answers.json``,
    e.g. by the README's first command) are not part of the template and are left out.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=TEMPLATE_DIR, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for relative in filter(None, listed.split("\0")):
        source = TEMPLATE_DIR / relative
        top = relative.split("/", 1)[0]
        generated = "{{" not in top and (TEMPLATE_DIR / top / ".template-answers.json").is_file()
        if source.is_file() and not generated:
            (destination / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / relative)
    return destination


@pytest.fixture
def bake(tmp_path: Path):
    """``bake(**answers)`` generates a project into this test's temporary folder."""
    return lambda **answers: bake_project(tmp_path, **answers)


@pytest.fixture(scope="session")
def default_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project generated with every default answer, shared by the whole session."""
    return bake_project(tmp_path_factory.mktemp("default"))


class ProjectEnv:
    """A virtual environment that sees this test run's packages (torch included).

    A ``.pth`` file links the running interpreter's site-packages, so creating it
    costs no download, and whatever is installed into it stays out of the
    environment that runs the template's tests.
    """

    def __init__(self, root: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.root = root
        self.python = root / "bin" / "python"
        site_packages = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(site_packages, "_template_tests_parent.pth").write_text(
            sysconfig.get_path("purelib") + "\n"
        )

    def env(self) -> dict[str, str]:
        environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        path = [str(self.root / "bin"), os.path.dirname(sys.executable), environ.get("PATH", "")]
        environ["PATH"] = os.pathsep.join(path)
        environ["VIRTUAL_ENV"] = str(self.root)
        return environ

    def run(self, *args: str, cwd: Path, check: bool = True, timeout: float = 900):
        """Run ``python -m <args>`` in this environment; output is captured as text."""
        result = subprocess.run(
            [str(self.python), "-m", *args],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"python -m {' '.join(args)} exited {result.returncode} in {cwd}\n"
                f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
            )
        return result

    def install(self, project: Path, extras: str = "[dev]") -> None:
        self.run("pip", "install", "--quiet", "--editable", f"{project}{extras}", cwd=project)


@pytest.fixture
def project_env(tmp_path: Path) -> ProjectEnv:
    return ProjectEnv(tmp_path / "venv")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tool(name: str) -> str:
    """A linter installed with the test requirements (beside this interpreter) or on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: pip install -r requirements-test.txt")
    return found


def module_environment(
    project: Path, *, path: tuple[Path, ...] = (), **variables: str | None
) -> dict[str, str]:
    """This process's environment with ``path`` then ``project``'s ``src`` on PYTHONPATH,
    so ``python -m <package>.<module>`` runs the project uninstalled; ``variables`` are
    set, or removed where None."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(str(entry) for entry in (*path, project / "src"))
    for name, value in variables.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


def run_module(
    project: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m ARGS`` in ``env`` (default: `module_environment` of ``project``)."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        env=module_environment(project) if env is None else env,
        cwd=project if cwd is None else cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def plugin_pytester(pytester: pytest.Pytester, default_project: Path, monkeypatch):
    """A pytester whose runs can load the default project's plugin with ``-p PLUGIN_MODULE``.

    The project's ``src`` is put on ``sys.path`` for in-process runs and on
    ``PYTHONPATH`` for ``runpytest_subprocess`` and xdist workers.
    """
    src = str(default_project / "src")
    pytester.syspathinsert(src)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.getenv("PYTHONPATH")])))
    return pytester


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests: on a busy machine, threads contending for
    tiny float64 matmuls (gradient checks) make them 100x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
