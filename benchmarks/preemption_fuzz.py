"""Preemption fuzzing at length: the trial of ``tests/test_train_preemption_fuzz.py``
(``tests/preemption.py``: a small run of the generated ``train`` interrupted by random
real signals at random moments, resumed as printed until complete, compared bit for bit
with an uninterrupted run), ``--trials`` times from ``--seed``, every
``--torchrun-every``-th under torchrun with 2 CPU processes. Prints the trials, the
interruptions, the signals by kind, the moments, the processes resumed or restarted, and
whether every run ended equal; then each problem found.

    python benchmarks/preemption_fuzz.py --trials 40 --seed 1 [--project GENERATED]

Bakes the default project unless ``--project`` names a generated one.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from baking import TEMPLATE_DIR, bake_default


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interruptions", type=int, default=3, help="per trial (default: 3)")
    parser.add_argument("--torchrun-every", type=int, default=5, help="(default: 5)")
    parser.add_argument("--project", help="a generated project (default: bake one)")
    return parser.parse_args()


def main() -> int:
    options = arguments()
    project = Path(options.project) if options.project else bake_default()
    sys.path.insert(0, str(TEMPLATE_DIR / "tests"))  # after baking: cookiecutter resets it
    import preemption

    trials = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="preemption-fuzz-") as scratch:
        made: dict[preemption.Settings, Path] = {}

        def reference(settings: preemption.Settings) -> Path:
            if settings not in made:
                folder = Path(scratch, f"reference-{len(made)}")
                made[settings] = preemption.uninterrupted(settings, project, folder)
            return made[settings]

        for number in range(options.trials):
            rng = random.Random(f"{options.seed}-{number}")
            ranks = 2 if (number + 1) % options.torchrun_every == 0 else 1
            settings = preemption.draw_settings(rng, ranks=ranks)
            directory = Path(scratch, f"trial-{number}")
            directory.mkdir()
            trial = preemption.run_trial(
                rng, settings, project, directory, reference, options.interruptions
            )
            trials.append(trial)
            moments = ", ".join(f"{i.moment.value}/{i.signal.name}" for i in trial.interruptions)
            verdict = "equal" if trial.equal and not trial.problems else "PROBLEM"
            print(f"trial {number}: ranks {ranks}, {moments or 'none delivered'}: {verdict}",
                  flush=True)  # fmt: skip
    print(preemption.figures(trials))
    print(f"seconds: {time.monotonic() - started:.0f}")
    for number, trial in enumerate(trials):
        for problem in trial.problems:
            print(f"--- trial {number} ({trial.settings}): {problem}")
    return 0 if all(t.equal and not t.problems for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
