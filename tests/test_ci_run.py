"""``.ci/run`` with the real apt-get, while another process holds apt's locks.

apt-get runs on a copy of this machine's package state (``APT_CONFIG``: the package
lists, the dpkg status and the cache in a temporary folder, the system's sources), so
the locks it waits for are those copies' and the system's own apt is never blocked.
The test process holds them as apt and dpkg do: ``fcntl`` write locks on
``lists/lock`` (``apt-get update``) and on ``lock-frontend`` beside the dpkg status
(``apt-get install``). The package list names an installed package, so nothing is
installed; ``tests/run`` is replaced by a line that says it ran.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import copy_template

LISTS = Path("/var/lib/apt/lists")
STATUS = Path("/var/lib/dpkg/status")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason=".ci/run installs packages only as root"),
    pytest.mark.skipif(
        not (shutil.which("apt-get") and any(LISTS.glob("*_Packages*")) and STATUS.exists()),
        reason="needs apt-get with package lists (a Debian or Ubuntu machine after apt-get update)",
    ),
]


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


def hold(lock: Path, seconds: float) -> threading.Timer:
    """Hold ``lock`` as apt does (an fcntl write lock) for ``seconds``, from now."""
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.lockf(descriptor, fcntl.LOCK_EX)
    release = threading.Timer(seconds, os.close, (descriptor,))
    release.start()
    return release


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


def test_without_another_apt_it_goes_straight_on(ci):
    clone, env, _ = ci
    result, _ = run_ci(clone, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tests/run ran\n"
    assert ".ci/run:" not in result.stderr


@pytest.mark.parametrize(
    "lock", ["lists/lock", "dpkg/lock-frontend"], ids=["apt-get update", "apt-get install"]
)
def test_it_waits_for_another_apt_then_goes_on(ci, lock):
    clone, env, state = ci
    release = hold(state / lock, 4)
    try:
        result, seconds = run_ci(clone, env)
    finally:
        release.join()
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tests/run ran\n"
    assert seconds >= 4
    if lock == "lists/lock":  # apt-get install says nothing while it waits, with -qq
        (waiting,) = [line for line in result.stderr.splitlines() if line.startswith(".ci/run")]
        assert waiting.startswith(
            ".ci/run: waiting for another apt or dpkg to finish (at most 600 s): "
            f"Could not get lock {state / lock}. It is held by process {os.getpid()}"
        )


@pytest.mark.parametrize(
    "lock", ["lists/lock", "dpkg/lock-frontend"], ids=["apt-get update", "apt-get install"]
)
def test_it_waits_no_longer_than_its_bound(ci, lock):
    clone, env, state = ci
    release = hold(state / lock, 30)
    try:
        result, seconds = run_ci(clone, env, APT_LOCK_TIMEOUT="3")
    finally:
        release.cancel()
        release.function(*release.args)
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
