"""What the tests of the generated ``train`` share: running it (alone or under torchrun),
reading what it wrote, and comparing two runs bit for bit."""

from __future__ import annotations

import csv
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, module_environment, run_module

TRAIN = f"{DEFAULT_PACKAGE}.train"
# Small enough for seconds per run, large enough for several steps per epoch (32).
SMALL = ("--device", "cpu", "--samples", "1024", "--batch-size", "32")
EPOCHS = "3"


# A ``sitecustomize`` (see `plant`): after this process's $AFTER_STEP-th optimizer step
# (in the process of rank $AFTER_STEP_RANK under torchrun, default 0), $AFTER_STEP_DO:
# a signal's name, sent to this process, or ``raise``, a RuntimeError from the step.
AFTER_STEP = """
    import os
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0


    def after_step(optimizer, args, kwargs):
        global steps
        steps += 1
        if steps == int(os.environ["AFTER_STEP"]) and os.environ.get(
            "RANK", "0"
        ) == os.environ.get("AFTER_STEP_RANK", "0"):
            if os.environ["AFTER_STEP_DO"] == "raise":
                raise RuntimeError("planted fault in the optimizer step")
            os.kill(os.getpid(), getattr(signal, os.environ["AFTER_STEP_DO"]))


    register_optimizer_step_post_hook(after_step)
"""


def train(project: Path, *args: str, env: dict[str, str] | None = None):
    return run_module(project, TRAIN, *args, env=env)


def train_in_background(project: Path, *args: str, path: tuple[Path, ...] = ()) -> subprocess.Popen:
    """``train`` started, its stderr to read (`wait_for_line`), ``path`` first on PYTHONPATH."""
    return subprocess.Popen(
        [sys.executable, "-m", TRAIN, *args],
        env=module_environment(project, path=path),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )


def uninterrupted(project: Path, directory: Path) -> Path:
    """``directory`` after an uninterrupted run of SMALL for EPOCHS epochs (no workers),
    the run that interrupted ones are compared with."""
    result = train(project, *SMALL, "--epochs", EPOCHS, "--run-dir", str(directory))
    assert result.returncode == 0, result.stderr
    return directory


def checkpoint(directory: Path) -> dict:
    return torch.load(directory / "latest.pt", weights_only=True)


def metrics(directory: Path) -> list[dict[str, str]]:
    with (directory / "metrics.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def reproducible(rows: list[dict[str, str]]) -> list[tuple[str, ...]]:
    """The columns of metrics.csv that do not depend on timing."""
    return [(row["epoch"], row["step"], row["loss"], row["lr"]) for row in rows]


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    """Same position, loss, weights and optimizer state, bit for bit."""
    assert (actual["epoch"], actual["step"], actual["global_step"], actual["loss"]) == (
        expected["epoch"],
        expected["step"],
        expected["global_step"],
        expected["loss"],
    )
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), f"weight {name} differs"
    for index, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"]["state"][index][key], tensor), (index, key)


def wait_for_line(process: subprocess.Popen, text: str) -> list[str]:
    """Read the process's stderr up to the line containing ``text``; the lines read."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(
        f"the run ended (exit {process.wait()}) before printing {text!r}:\n{''.join(lines)}"
    )


def plant(directory: Path, source: str) -> Path:
    """A folder with a ``sitecustomize.py`` holding ``source``, for PYTHONPATH."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(textwrap.dedent(source))
    return directory


def usage_error(train_module, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(list(argv))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"usage: python -m {DEFAULT_PACKAGE}.train ")
    assert "Traceback" not in "\n".join(lines)
    prefix = f"python -m {DEFAULT_PACKAGE}.train: error: "
    assert lines[-1].startswith(prefix)
    return lines[-1].removeprefix(prefix)


def gloo_environment(
    project: Path, path: tuple[Path, ...] = (), **variables: str
) -> dict[str, str]:
    """For gloo processes on the loopback device, one thread each; ``path`` first on
    PYTHONPATH (see `module_environment`)."""
    return module_environment(
        project, path=path, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **variables
    )


def torchrun(project: Path, *args: str, path: tuple[Path, ...] = (), **variables: str):
    """``torchrun --standalone`` with 2 CPU processes talking gloo over the loopback device."""
    environ = gloo_environment(project, path, **variables)
    command = ("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", TRAIN)
    return run_module(project, *command, *args, env=environ)


def run_printed(project: Path, command: str, **variables: str):
    """Run the command a stopped run printed, as printed (``python -m`` or ``torchrun``)."""
    words = shlex.split(command)
    launcher = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }
    return subprocess.run(
        [*launcher[words[0]], *words[1:]],
        env=module_environment(project, **variables),
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
    )


# Fixtures of the tests of train (registered in conftest.py with pytest_plugins).


@pytest.fixture
def train_module(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    """The default project's train module, imported in this process."""
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return importlib.import_module(TRAIN)


@pytest.fixture(scope="module")
def reference(default_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of SMALL for EPOCHS epochs that interrupted ones are
    compared with (no workers)."""
    return uninterrupted(default_project, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def one_epoch(default_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-epoch run with SMALL, made once."""
    directory = tmp_path_factory.mktemp("one-epoch") / "run"
    result = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(directory))
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture
def finished_run(tmp_path: Path, one_epoch: Path) -> Path:
    """This test's own copy of `one_epoch`."""
    return Path(shutil.copytree(one_epoch, tmp_path / "finished"))


def resume(directory: Path) -> tuple[str, ...]:
    """The arguments that resume a SMALL run in ``directory`` for a second epoch."""
    return (*SMALL, "--epochs", "2", "--resume", "--run-dir", str(directory))


# A process killed by PR_SET_PDEATHSIG disappears from /proc once its parent has reaped
# it, which for an orphan is init: allow it a moment.
GONE_WITHIN_S = 10


def processes_of(marker: str) -> list[str]:
    """The command lines of the processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        line = " ".join(word.decode(errors="replace") for word in words if word)
        if marker in line:
            found.append(f"{entry.name}: {line}")
    return found


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := processes_of(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "processes left behind:\n" + "\n".join(left)


# A model with a user's bug: the square root of a spread that is negative for the few
# samples whose largest input exceeds 12 (about one in 300 of the synthetic data).
SQRT_OF_A_NEGATIVE = f"""
    import torch
    from {DEFAULT_PACKAGE} import models

    _forward = models.DynamicNet.forward


    def forward_with_a_bug(self, x):
        out = _forward(self, x)
        spread = torch.sqrt(12.0 - x.abs().amax(dim=1, keepdim=True))
        return out * spread


    models.DynamicNet.forward = forward_with_a_bug
"""


def replay_line(stderr: str) -> str:
    (line,) = re.findall(r"^Replay it under finite_check with: (.*)$", stderr, re.M)
    return line
