"""Preemption fuzzing: the generated ``train`` interrupted by a seeded random schedule of
real signals (SIGTERM, SIGINT, SIGUSR1, SIGKILL) at random moments, each process resumed
as the last one said until the run is complete, ends bit for bit as an uninterrupted run.

The moments (`preemption.Moment`): random delays after ``main`` started, random steps,
and the targeted ones: start-up, the resumed checkpoint being read, ``latest.pt`` being
written, the run's last step, its last line, the interpreter's exit. Without workers
and with 2, in float32 and bf16, alone and under ``torchrun`` with 2 CPU processes
(gloo). A few small trials here; ``benchmarks/preemption_fuzz.py`` runs the same trial
(`preemption.run_trial`) many times and prints the figures.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from preemption import (
    Attempt,
    Interruption,
    Moment,
    Settings,
    draw_settings,
    problems_of,
    run_trial,
    uninterrupted,
)

SEED = 33  # issue 33; any seed must pass
# Per trial: enough to reach a resumed process's start-up and a finished run's resume.
INTERRUPTIONS = 3


@pytest.fixture(scope="module")
def references(
    default_project: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Settings], Path]:
    """The uninterrupted run of some settings, made once per settings."""
    made: dict[Settings, Path] = {}

    def reference(settings: Settings) -> Path:
        if settings not in made:
            folder = tmp_path_factory.mktemp("reference") / "run"
            made[settings] = uninterrupted(settings, default_project, folder)
        return made[settings]

    return reference


@pytest.mark.parametrize(("trial", "ranks"), [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2)], ids=str)
def test_random_preemptions_end_bitwise_equal(
    default_project: Path,
    tmp_path: Path,
    references: Callable[[Settings], Path],
    trial: int,
    ranks: int,
) -> None:
    rng = random.Random(f"{SEED}-{trial}")
    settings = draw_settings(rng, ranks=ranks)
    result = run_trial(rng, settings, default_project, tmp_path, references, INTERRUPTIONS)
    schedule = [(a.interruption, a.delivered, a.status) for a in result.attempts]
    assert not result.problems, "\n".join([str(settings), str(schedule), *result.problems])
    assert result.equal, schedule


def test_a_trial_finds_what_goes_wrong() -> None:
    """The reverse case: a process killed by the default action of a stop signal, one that
    stopped without saying how to go on, one that exited 0 short of the end, and a
    signal at the run's end left unreported are each a problem; the good endings none."""
    settings = Settings()
    usr1 = Interruption(Moment.EXIT, signal.SIGUSR1)
    last = Interruption(Moment.LAST_STEP, signal.SIGTERM)
    said = "SIGTERM during the run's last step: nothing to stop\n"
    bad = [
        (Attempt([], usr1, delivered=True, status=-signal.SIGUSR1), True),
        (Attempt([], Interruption(Moment.STEP, signal.SIGINT, 3), True, 130), False),
        (Attempt([], None, status=0), False),
        (Attempt([], last, delivered=True, status=0), True),
    ]
    for attempt, complete in bad:
        assert problems_of(settings, attempt, complete), attempt
    good = [
        (Attempt([], usr1, delivered=True, status=0), True),
        (Attempt([], last, delivered=True, status=0, stderr=said), True),
        (Attempt([], Interruption(Moment.START, signal.SIGKILL), True, -signal.SIGKILL), False),
    ]
    for attempt, complete in good:
        assert not problems_of(settings, attempt, complete), attempt
