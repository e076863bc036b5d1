"""Stop signals at chosen moments of the generated ``train``, and the preemption fuzz trial
that ``test_train_preemption_fuzz.py`` and ``benchmarks/preemption_fuzz.py`` both run.

`plant` gives a ``sitecustomize`` for the training process's ``PYTHONPATH``: it prints
`MAIN_STARTED` when ``main`` parses its command line (stop signals are handled from
then on) and, at the `Moment` named by ``STOP_AT``, sends the process ``STOP_SIGNAL``
with ``os.kill`` (a real signal, from the kernel), once, and appends ``<moment>
<signal>`` to ``STOP_LOG`` so that the test knows it was sent. Under ``torchrun``
(``STOP_TORCHRUN`` set) only its rank ``STOP_RANK`` (default 0) acts, not torchrun
itself. `Moment.DELAY` is
the test's own: it sends the signal from outside.

A trial (`run_trial`) trains one small run through a seeded random schedule of
interruptions, each in a process of its own, every next process started as the last
one said (``resume with:``, ``start again with:``) or, after a SIGKILL, as the
documented resume command (`documented_command`), until the run is complete; then
compares it with an uninterrupted run of the same settings, bit for bit.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conftest import module_environment
from training import (
    TRAIN,
    assert_bitwise_equal,
    assert_nothing_left,
    checkpoint,
    gloo_environment,
    metrics,
    plant,
    reproducible,
)

MAIN_STARTED = "MAIN STARTED"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGKILL)
# Longer than any small run here takes on a busy CPU: a process still running then hangs.
ATTEMPT_TIMEOUT_S = 300


class Moment(enum.Enum):
    """When the signal comes (`SOURCE` places each)."""

    START = "start"  # main's first line: the command line being parsed
    LOAD = "load"  # the checkpoint being read, when resuming
    STEP = "step"  # after this process's optimizer step STOP_STEP
    WRITE = "write"  # while the STOP_STEP-th checkpoint of this process is being written
    LAST_STEP = "last step"  # after the run's last optimizer step
    FINISHED = "finished"  # the run complete, its "trained ..." line being printed
    EXIT = "exit"  # the interpreter's exit, after main returned (an atexit function)
    DELAY = "delay"  # from the test, a random time after main started


SOURCE = """
    import atexit
    import builtins
    import os
    import signal
    import sys

    # Under torchrun (STOP_TORCHRUN set) the training processes, not torchrun itself.
    _TRAINS = "STOP_TORCHRUN" not in os.environ or "RANK" in os.environ
    _AT = os.environ.get("STOP_AT")
    _RANK = os.environ.get("RANK", "0") == os.environ.get("STOP_RANK", "0")
    _ACTS = _AT is not None and _TRAINS and _RANK
    _sent = False


    def _send():
        global _sent
        if _sent:
            return
        _sent = True
        with open(os.environ["STOP_LOG"], "a") as log:
            log.write(f"{_AT} {os.environ['STOP_SIGNAL']}\\n")
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))


    import argparse

    _parse_args = argparse.ArgumentParser.parse_args


    def _parse(self, *args, **kwargs):
        if _TRAINS and not getattr(_parse, "seen", False):
            _parse.seen = True
            print("MAIN STARTED", file=sys.stderr, flush=True)
            if _ACTS and _AT == "start":
                _send()
        return _parse_args(self, *args, **kwargs)


    argparse.ArgumentParser.parse_args = _parse

    if _ACTS and _AT in ("load", "step", "write", "last step"):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _steps = 0
        _saves = 0
        _load = torch.load
        _save = torch.save

        def _loading(*args, **kwargs):
            if _AT == "load":
                _send()
            return _load(*args, **kwargs)

        def _saving(obj, file, *args, **kwargs):
            global _saves
            _saves += 1
            if _AT == "write" and _saves == int(os.environ["STOP_STEP"]):
                write = file.write

                def write_and_signal(data):
                    written = write(data)
                    _send()
                    return written

                file.write = write_and_signal
            return _save(obj, file, *args, **kwargs)

        def _after_step(optimizer, args, kwargs):
            global _steps
            _steps += 1
            if _AT in ("step", "last step") and _steps == int(os.environ["STOP_STEP"]):
                _send()

        torch.load, torch.save = _loading, _saving
        register_optimizer_step_post_hook(_after_step)

    if _ACTS and _AT == "finished":
        _print = builtins.print

        def _printing(*args, **kwargs):
            if args and str(args[0]).startswith("trained "):
                _send()
            return _print(*args, **kwargs)

        builtins.print = _printing

    if _ACTS and _AT == "exit":
        atexit.register(_send)
"""


def plant_moments(directory: Path) -> Path:
    """A folder holding the ``sitecustomize`` of `SOURCE`, for ``PYTHONPATH``."""
    return plant(directory, SOURCE)


@dataclass(frozen=True)
class Settings:
    """One run's settings: non-default data settings, so that a resume from the folder
    alone must take them from the checkpoint."""

    seed: int = 7
    samples: int = 256
    batch_size: int = 16
    epochs: int = 2
    workers: int = 0
    precision: str = "32"
    ranks: int = 1  # 2: under torchrun (CPU, gloo)
    checkpoint_every: int | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps of the whole run, in each process."""
        return self.epochs * (self.samples // (self.batch_size * self.ranks))

    def flags(self) -> list[str]:
        flags = ["--device", "cpu", "--seed", str(self.seed), "--samples", str(self.samples)]
        flags += ["--batch-size", str(self.batch_size), "--epochs", str(self.epochs)]
        flags += ["--workers", str(self.workers), "--precision", self.precision]
        if self.checkpoint_every is not None:
            flags += ["--checkpoint-every", str(self.checkpoint_every)]
        return flags

    def reference(self) -> Settings:
        """The uninterrupted run these settings are compared with (workers change nothing)."""
        return dataclasses.replace(self, workers=0, checkpoint_every=None)


@dataclass(frozen=True)
class Interruption:
    moment: Moment
    signal: signal.Signals
    at: float = 0  # STOP_STEP for STEP and WRITE; seconds after main started for DELAY


@dataclass
class Attempt:
    """One process of a trial (torchrun, with its processes, under torchrun)."""

    command: list[str]
    interruption: Interruption | None
    delivered: bool = False  # the signal was sent before the process ended
    status: int | None = None
    stderr: str = ""


@dataclass
class Trial:
    settings: Settings
    attempts: list[Attempt] = field(default_factory=list)
    equal: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def interruptions(self) -> list[Interruption]:
        return [a.interruption for a in self.attempts if a.delivered and a.interruption]


def draw_settings(rng: random.Random, *, ranks: int) -> Settings:
    """Small runs, few enough kinds that their uninterrupted references are shared."""
    return Settings(
        workers=rng.choice((0, 2)),
        precision=rng.choice(("32", "bf16")),
        ranks=ranks,
        checkpoint_every=rng.choice((None, 3)),
    )


def draw_interruption(rng: random.Random, settings: Settings, done: int) -> Interruption:
    """A signal at a random moment of a process that starts at global step ``done``."""
    left = settings.steps - done
    moment = rng.choice(list(Moment))
    if settings.ranks > 1 and moment is Moment.DELAY:
        kind = rng.choice((signal.SIGTERM, signal.SIGINT, signal.SIGKILL))  # to torchrun
    else:
        kind = rng.choice(SIGNALS)
    if moment is Moment.STEP:
        return Interruption(moment, kind, rng.randint(1, max(1, left)))
    if moment is Moment.LAST_STEP:
        return Interruption(moment, kind, left)
    if moment is Moment.WRITE:
        per_epoch, every = settings.steps // settings.epochs, settings.checkpoint_every
        saves = sum(
            1
            for step in range(done + 1, settings.steps + 1)
            if step % per_epoch == 0 or (every is not None and step % every == 0)
        )
        return Interruption(moment, kind, rng.randint(1, max(1, saves)))
    if moment is Moment.DELAY:
        return Interruption(moment, kind, round(rng.uniform(0, 4), 2))
    return Interruption(moment, kind)


def train_command(settings: Settings) -> list[str]:
    if settings.ranks == 1:
        return [sys.executable, "-m", TRAIN]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc_per_node", str(settings.ranks), "-m", TRAIN]


def documented_command(settings: Settings, run_dir: Path) -> list[str]:
    """What the docstring says resumes a run after a kill: ``--run-dir DIR --resume``
    and the flags a checkpoint does not keep (--epochs, --workers, --device...); the
    first command again when no checkpoint was written."""
    if not (run_dir / "latest.pt").exists():
        return [*train_command(settings), *settings.flags(), "--run-dir", str(run_dir)]
    kept = ["--device", "cpu", "--epochs", str(settings.epochs), "--workers"]
    kept += [str(settings.workers)]
    if settings.checkpoint_every is not None:
        kept += ["--checkpoint-every", str(settings.checkpoint_every)]
    return [*train_command(settings), *kept, "--run-dir", str(run_dir), "--resume"]


def printed_command(stderr: str) -> list[str] | None:
    """The command a stopped run printed (``resume with:``, ``start again with:``)."""
    found = re.findall(r"^(?:resume|start again) with: (.*)$", stderr, re.MULTILINE)
    if not found:
        return None
    words = shlex.split(found[-1])
    launcher = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }
    return [*launcher[words[0]], *words[1:]]


def wait_for_main(process: subprocess.Popen, ranks: int, lines: list[str]) -> bool:
    """Read stderr until every process printed MAIN_STARTED; False if it ended first."""
    started = 0
    for line in process.stderr:
        lines.append(line)
        started += MAIN_STARTED in line
        if started == ranks:
            return True
    return False


def environment(settings: Settings, project: Path, path: tuple[Path, ...] = (),
                **variables: str | None) -> dict[str, str]:  # fmt: skip
    if settings.ranks > 1:
        return gloo_environment(project, path, **variables)
    return module_environment(project, path=path, **variables)


def uninterrupted(settings: Settings, project: Path, run_dir: Path) -> Path:
    """``run_dir`` after an uninterrupted run of ``settings``."""
    command = [*train_command(settings), *settings.flags(), "--run-dir", str(run_dir)]
    result = subprocess.run(
        command, env=environment(settings, project), cwd=project, capture_output=True,
        text=True, timeout=ATTEMPT_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return run_dir


def attempt(settings: Settings, project: Path, plants: Path, command: list[str], run_dir: Path,
            interruption: Interruption | None, log: Path) -> Attempt:  # fmt: skip
    """Run ``command`` once, interrupted as ``interruption`` says."""
    variables = {"STOP_LOG": str(log), "STOP_AT": None, "STOP_SIGNAL": None, "STOP_STEP": None}
    variables["STOP_TORCHRUN"] = "1" if settings.ranks > 1 else None
    if interruption is not None and interruption.moment is not Moment.DELAY:
        variables.update(STOP_AT=interruption.moment.value, STOP_SIGNAL=interruption.signal.name)
        variables["STOP_STEP"] = str(int(interruption.at))
    environ = environment(settings, project, (plants,), **variables)
    log.write_text("")
    result = Attempt(command, interruption)
    process = subprocess.Popen(
        command, env=environ, cwd=project, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        delayed = interruption is not None and interruption.moment is Moment.DELAY
        if delayed and wait_for_main(process, settings.ranks, lines):
            assert interruption is not None
            time.sleep(interruption.at)
            if process.poll() is None:
                process.send_signal(interruption.signal)
                result.delivered = True
        lines.append(process.stderr.read())
        result.status = process.wait(timeout=ATTEMPT_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    result.stderr = "".join(lines)
    result.delivered = result.delivered or bool(log.read_text())
    assert_nothing_left(str(run_dir))
    return result


def problems_of(settings: Settings, result: Attempt, complete: bool) -> list[str]:
    """What is wrong with how the attempt ended, given whether the run is now complete."""
    stopped = result.interruption.signal if result.delivered and result.interruption else None
    problems = []
    if "Traceback" in result.stderr and settings.ranks == 1:
        problems.append("a traceback")
    printed = printed_command(result.stderr)
    if stopped is signal.SIGKILL:
        if result.status not in (-signal.SIGKILL, 1, 0):  # torchrun: 1; a kill at exit: 0
            problems.append(f"exit status {result.status} after SIGKILL")
    elif settings.ranks == 1 and result.status not in (
        0,
        None if stopped is None else 128 + stopped,
    ):
        problems.append(f"exit status {result.status} after {stopped and stopped.name}")
    if result.status == 0 and not complete:
        problems.append("exit status 0, but the run is not complete")
    late = result.interruption is not None and result.interruption.moment in (
        Moment.LAST_STEP,
        Moment.FINISHED,
    )
    if stopped not in (None, signal.SIGKILL) and late and "nothing to stop" not in result.stderr:
        problems.append(f"{stopped.name} at the run's end, and no 'nothing to stop'")
    if stopped not in (None, signal.SIGKILL) and not complete and printed is None:
        problems.append(f"stopped by {stopped.name} without printing how to go on")
    return [f"{problem}:\n{result.stderr[-3000:]}" for problem in problems]


def is_complete(settings: Settings, run_dir: Path) -> bool:
    latest = run_dir / "latest.pt"
    return latest.exists() and checkpoint(run_dir)["epoch"] == settings.epochs


def run_trial(rng: random.Random, settings: Settings, project: Path, directory: Path,
              reference: Callable[[Settings], Path], interruptions: int) -> Trial:  # fmt: skip
    """Train ``settings`` in ``directory``/run through ``interruptions`` random ones (and
    as many more processes as it takes to finish), then compare it with the run that
    ``reference(settings.reference())`` returns the folder of."""
    run_dir, plants = directory / "run", plant_moments(directory / "plant")
    log = directory / "sent.log"
    trial = Trial(settings)
    command = [*train_command(settings), *settings.flags(), "--run-dir", str(run_dir)]
    # A run complete before the schedule is done is resumed again (nothing to do).
    for number in range(interruptions + 3):  # enough to finish once the schedule is done
        done = checkpoint(run_dir)["global_step"] if (run_dir / "latest.pt").exists() else 0
        chosen = draw_interruption(rng, settings, done) if number < interruptions else None
        result = attempt(settings, project, plants, command, run_dir, chosen, log)
        trial.attempts.append(result)
        complete = is_complete(settings, run_dir)
        trial.problems += problems_of(settings, result, complete)
        if complete and result.status == 0 and number + 1 >= interruptions:
            break
        command = printed_command(result.stderr) or documented_command(settings, run_dir)
    else:
        trial.problems.append(f"not complete after {len(trial.attempts)} processes")
        return trial
    try:
        expected = reference(settings.reference())
        assert_bitwise_equal(checkpoint(run_dir), checkpoint(expected))
        assert reproducible(metrics(run_dir)) == reproducible(metrics(expected)), "metrics"
        trial.equal = True
    except AssertionError as error:
        trial.problems.append("differs from the uninterrupted run: " + "".join(
            traceback.format_exception_only(error)).strip())  # fmt: skip
    return trial


def figures(trials: list[Trial]) -> str:
    """The fuzz's figures, one per line."""
    delivered = [i for trial in trials for i in trial.interruptions]
    kinds = Counter(i.signal.name for i in delivered)
    moments = Counter(i.moment.value for i in delivered)
    resumes = sum(len(trial.attempts) - 1 for trial in trials)
    equal = all(trial.equal for trial in trials) and not any(t.problems for t in trials)
    return "\n".join([
        f"trials: {len(trials)} ({sum(t.settings.ranks > 1 for t in trials)} under torchrun)",
        f"interruptions: {len(delivered)}",
        "signals: " + ", ".join(f"{name} {n}" for name, n in sorted(kinds.items())),
        "moments: " + ", ".join(f"{name} {n}" for name, n in sorted(moments.items())),
        f"processes resumed or restarted: {resumes}",
        f"all equal: {'yes' if equal else 'no'}",
    ])  # fmt: skip
