"""The commands CI runs: ``.ci/run`` (system packages) and ``tests/run`` (the test suite).

``.ci/run`` runs with the real apt-get while another process holds apt's locks. apt-get
runs on a copy of this machine's package state (``APT_CONFIG``: the package lists, the
dpkg status and the cache in a temporary folder, the system's sources), so the locks
it waits for are those copies' and the system's own apt is never blocked. The test
process holds them as apt and dpkg do: ``fcntl`` write locks on ``lists/lock``
(``apt-get update``) and on ``lock-frontend`` beside the dpkg status (``apt-get
install``). The package list names an installed package, so nothing is installed;
``tests/run`` is replaced by a line that says it ran.

``tests/run`` runs for real, with pip, in a copy of the template whose suite is one
test; see ``test_without_a_gpu_tests_run_takes_torch_from_the_cpu_index``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import TEMPLATE_DIR, copy_template

LISTS = Path("/var/lib/apt/lists")
STATUS = Path("/var/lib/dpkg/status")

needs_apt = pytest.mark.skipif(
    os.geteuid() != 0
    or not (shutil.which("apt-get") and any(LISTS.glob("*_Packages*")) and STATUS.exists()),
    reason=".ci/run installs packages as root only, with apt-get and its package lists",
)


@pytest.fixture
def ci(tmp_path: Path):
    """A copy of the template whose .ci/run uses apt state of its own; returns (folder, env)."""
    clone = copy_template(tmp_path / "template")
    (clone / "tests" / "run").write_text("echo tests/run ran\n")
    (clone / ".ci" / "apt-packages.txt").write_text("# installed already\ngit\n")
    state = tmp_path / "apt"
    (state / "lists" / "partial").mkdir(parents=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True)
    (state / "dpkg").mkdir()
    for listed in LISTS.iterdir():
        if listed.is_file() and listed.name != "lock":
            shutil.copy2(listed, state / "lists" / listed.name)
    shutil.copy2(STATUS, state / "dpkg" / "status")
    config = state / "apt.conf"
    config.write_text(
        f'Dir::State::Lists "{state / "lists"}/";\n'
        f'Dir::Cache "{state / "cache"}/";\n'
        f'Dir::State::status "{state / "dpkg" / "status"}";\n'
    )
    return clone, {**os.environ, "APT_CONFIG": str(config)}, state


@contextlib.contextmanager
def held(lock: Path, seconds: float):
    """Hold ``lock`` as apt does (an fcntl write lock) for ``seconds`` from now, or until
    the block ends, whichever comes first."""
    file = lock.open("a")
    fcntl.lockf(file, fcntl.LOCK_EX)
    release = threading.Timer(seconds, file.close)
    release.start()
    try:
        yield
    finally:
        release.cancel()
        file.close()


def run_ci(clone: Path, env: dict[str, str], **variables: str):
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(clone / ".ci" / "run")],
        env={**env, **variables},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return result, time.monotonic() - started


@needs_apt
def test_without_another_apt_it_goes_straight_on(ci):
    clone, env, _ = ci
    result, _ = run_ci(clone, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tests/run ran\n"
    assert ".ci/run:" not in result.stderr


# apt-get update takes the lock of the package lists; apt-get install dpkg's frontend lock.
APT_LOCKS = pytest.mark.parametrize(
    "lock", ["lists/lock", "dpkg/lock-frontend"], ids=["apt-get update", "apt-get install"]
)


@needs_apt
@APT_LOCKS
def test_it_waits_for_another_apt_then_goes_on(ci, lock):
    clone, env, state = ci
    with held(state / lock, 4):
        result, seconds = run_ci(clone, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tests/run ran\n"
    assert seconds >= 4
    if lock == "lists/lock":  # apt-get install says nothing while it waits, with -qq
        (waiting,) = [line for line in result.stderr.splitlines() if line.startswith(".ci/run")]
        assert waiting.startswith(
            ".ci/run: waiting for another apt or dpkg to finish (at most 600 s): "
            f"Could not get lock {state / lock}. It is held by process {os.getpid()}"
        )


@needs_apt
@APT_LOCKS
def test_it_waits_no_longer_than_its_bound(ci, lock):
    clone, env, state = ci
    with held(state / lock, 30):
        result, seconds = run_ci(clone, env, APT_LOCK_TIMEOUT="3")
    assert result.returncode == 1
    assert "tests/run ran" not in result.stdout
    assert 2 <= seconds < 20  # bash counts the bound in whole seconds
    # At most the notice that it waits (apt-get install waits silently), then the reason.
    *waiting, line = [line for line in result.stderr.splitlines() if line.startswith(".ci/run")]
    assert [notice.split(" (")[0] for notice in waiting] == [
        ".ci/run: waiting for another apt or dpkg to finish"
    ] * len(waiting)
    assert len(waiting) <= 1
    assert line.startswith(".ci/run: apt-get ")
    assert "another apt or dpkg still holds the lock after 3 s (" in line
    assert str(state / lock) in line
    assert line.endswith("run again once it is done, or set APT_LOCK_TIMEOUT")


TORCH_PIN = next(
    line.strip()
    for line in (TEMPLATE_DIR / "requirements-test.txt").read_text().splitlines()
    if line.startswith("torch==")
)


def cpu_torch_wheel() -> Path | None:
    """PyTorch's CPU wheel of the pinned torch for this Python, where pip's find-links has one."""
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    folders = re.findall(r"\.find-links='([^']+)'", configured)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    name = f"torch-{TORCH_PIN.split('==')[1]}+cpu-{tag}-{tag}-*linux*_{platform.machine()}.whl"
    return next((wheel for folder in folders for wheel in Path(folder).glob(name)), None)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PyPI's CUDA torch is the Linux one")
def test_without_a_gpu_tests_run_takes_torch_from_the_cpu_index(tmp_path: Path):
    """``tests/run`` and real pip in a copy of the template whose suite is one test.

    PyTorch's CPU index is stood in for by a local index in its format (a PEP 503 page
    per project) holding PyTorch's real CPU wheel of the pinned torch; the test points
    ``TORCH_CPU_INDEX_URL`` at it. No pip settings of this machine apply
    (``PIP_CONFIG_FILE`` is the null device, no ``PIP_*`` variable is passed), and a
    constraint allows only the CPU build, so PyPI's CUDA build is never downloaded,
    whatever tests/run does. PATH holds only what tests/run needs: no npm, and
    ``nvidia-smi`` only where a GPU stands in (the one fact used: ``nvidia-smi -L``
    prints a ``GPU <n>: ...`` line per GPU and exits 0).
    """
    wheel = cpu_torch_wheel()
    if wheel is None:
        pytest.skip(f"needs PyTorch's CPU wheel of {TORCH_PIN} on disk (in pip's find-links)")
    clone = copy_template(tmp_path / "template")
    pins = [TORCH_PIN, *(f"{name}=={version(name)}" for name in ("pytest", "pytest-xdist"))]
    (clone / "requirements-test.txt").write_text("\n".join(pins) + "\n")
    (clone / "requirements-libraries.txt").write_text("# none in this copy\n")
    for test in (clone / "tests").glob("*.py"):
        test.unlink()
    (clone / "tests" / "test_torch_build.py").write_text(
        "import torch\n\n\ndef test_cpu_build():\n    assert torch.version.cuda is None\n"
    )
    index = tmp_path / "cpu-index"
    (index / "torch").mkdir(parents=True)
    (index / "torch" / wheel.name).symlink_to(wheel)
    (index / "torch" / "index.html").write_text(
        f'<a href="{urllib.parse.quote(wheel.name)}">{wheel.name}</a>\n'
    )
    constraint = tmp_path / "cpu-only.txt"
    constraint.write_text(f"{TORCH_PIN}+cpu\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    python = Path(
        sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    (tools / "python3").symlink_to(python)
    for name in ("bash", "env", "dirname", "uname", "grep"):
        (tools / name).symlink_to(shutil.which(name))
    environ = {name: value for name, value in os.environ.items() if not name.startswith("PIP_")}
    environ |= {
        "PATH": str(tools), "PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": str(constraint),
        "TORCH_CPU_INDEX_URL": index.as_uri(), "PYTHONPATH": "",
    }  # fmt: skip
    chose_cpu = f"tests/run: no NVIDIA GPU: {TORCH_PIN} from PyTorch's CPU index ({index.as_uri()})"

    def tests_run(**variables: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["bash", str(clone / "tests" / "run"), "-n", "0", "-p", "no:cacheprovider"],
            env={**environ, **variables}, capture_output=True, text=True, timeout=900,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        return result

    first = tests_run()
    assert chose_cpu in first.stdout.splitlines()
    installed = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert installed.strip() == f"{TORCH_PIN.split('==')[1]}+cpu"

    # A GPU, or pip told where to look: pip is left alone (torch is installed by now).
    (tools / "nvidia-smi").write_text(
        "#!/bin/bash\necho 'GPU 0: NVIDIA H200 (UUID: GPU-5a3e6f5c-0c3b-4a3e-9e1d-000000000000)'\n"
    )
    (tools / "nvidia-smi").chmod(0o755)
    assert chose_cpu not in tests_run().stdout
    (tools / "nvidia-smi").unlink()
    pip_conf = tmp_path / "pip.conf"
    pip_conf.write_text(f"[global]\nfind-links = {tmp_path}\n")
    for told in (
        {"PIP_INDEX_URL": "https://pypi.org/simple"},
        {"PIP_EXTRA_INDEX_URL": index.as_uri()},
        {"PIP_FIND_LINKS": str(tmp_path)},
        {"PIP_NO_INDEX": "1"},
        {"PIP_CONFIG_FILE": str(pip_conf)},
    ):
        assert chose_cpu not in tests_run(**told).stdout, told
