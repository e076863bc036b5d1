"""What a failing ``gradcheck`` costs next to a passing one: the diagnosis and the narrowing.

For each model, the same check with and without a planted bug: the passing check's
CPU time and evaluations, and the failing check's (the element search, the other
tensors, the parts checked on their own). Bound: the diagnosis makes at most
``DIAGNOSIS_MULTIPLE`` (20) times the evaluations of the check itself plus
``DIAGNOSIS_FLOOR`` (64); the table shows evaluations and time.

    python benchmarks/gradcheck_diagnosis.py [--repeats 3] [--src SRC]

Bakes the default project unless ``--src`` points at a generated project's ``src``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
import types

from baking import TEMPLATE_DIR, use_generated_src


def models():
    """(name, build(planted: bool) -> (model, x)) of each model compared: the planted bugs
    of the template's localization tests (``tests/test_plugin_gradcheck_localize.py``)."""
    import torch

    sys.path.insert(0, str(TEMPLATE_DIR / "tests"))
    import gradcheck_sessions
    import test_plugin_gradcheck_localize
    from conftest import DEFAULT_PACKAGE

    helpers = types.ModuleType("helpers")
    exec(gradcheck_sessions.HELPERS, helpers.__dict__)
    sys.modules["helpers"] = helpers  # what the planted models import
    planted = types.ModuleType("planted")
    exec(test_plugin_gradcheck_localize.PLANTED.format(package=DEFAULT_PACKAGE), planted.__dict__)

    def encoder(size, batch):
        def build(bug):
            torch.manual_seed(0)
            function = planted.SloppyTanhLinear if bug else planted.TanhLinear
            return planted.Encoder(size, function), torch.randn(batch, size, requires_grad=True)

        return build

    def mixture(bug):
        torch.manual_seed(0)
        model = helpers.TopOneMixture(expert=planted.Expert)
        if bug:
            model.experts[2] = planted.LeakyExpert()
        return model, torch.randn(8, 4, requires_grad=True)

    def hooked(bug):
        model = planted.hooked()
        model[2][0].weight.register_hook(planted.halved if bug else torch.clone)
        return model, torch.randn(3, 4, requires_grad=True)

    return [
        ("Function bug, slow mode", encoder(6, 3)),
        ("Function bug, fast mode", encoder(80, 8)),
        ("detached term in one expert, slow mode", mixture),
        ("parameter hook, slow mode", hooked),
    ]


def best_cpu(function, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.process_time()
        function()
        best = min(best, time.process_time() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)
    import torch
    from dynamic_model.testing import gradcheck as module
    from dynamic_model.testing.gradcheck.screen import DIAGNOSIS_FLOOR, DIAGNOSIS_MULTIPLE

    torch.set_num_threads(1)
    print(
        f"{'case':<44}{'pass s':>9}{'fail s':>9}{'x time':>8}{'check evals':>13}{'diagnosis':>11}"
    )
    within = True
    for name, build in models():
        model, x = build(False)
        passing = best_cpu(lambda: module.gradcheck(model, x), args.repeats)  # noqa: B023
        elements = x.numel() + sum(p.numel() for p in model.parameters())
        name = f"{name} ({elements:,} elements)"
        model, x = build(True)
        message = ""

        def failing():
            nonlocal message
            try:
                module.gradcheck(model, x)  # noqa: B023
            except module.WrongGradient as failure:
                message = str(failure)

        failed = best_cpu(failing, args.repeats)
        found = re.search(
            r"the diagnosis made ([\d,]+) evaluations, ([\d.]+)x the ([\d,]+)", message
        )
        diagnosis, _, check = (found.group(i).replace(",", "") for i in (1, 2, 3))
        bound = DIAGNOSIS_MULTIPLE * int(check) + DIAGNOSIS_FLOOR
        within = within and int(diagnosis) <= bound
        print(
            f"{name:<58}{passing:>9.3f}{failed:>9.3f}{failed / passing:>8.1f}{check:>13}"
            f"{diagnosis:>11}"
        )
    print(
        f"\ndiagnosis {'within' if within else 'OVER'} DIAGNOSIS_MULTIPLE x check + DIAGNOSIS_FLOOR"
    )
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
