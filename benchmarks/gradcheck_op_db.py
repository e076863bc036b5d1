"""The ``gradcheck`` fixture on every op torch has: verdicts and cost against torch's own check.

Two parts, over torch's operator database (``tests/op_db_sweep.py`` says which ops and
how each is called):

``--agreement`` (the whole sweep): every sample torch's gradient tests run on the CPU
(two per op, float64 and complex128, conjugated inputs included), each elementwise op on
an empty tensor in every input position, each in the default mode and forced into fast
mode; the fixture's verdict against ``torch.autograd.gradcheck``'s in the same mode.
Then planted bugs (one element off, a scale, the sign, two elements swapped, in a custom
autograd Function wrapping one sample of each op): both must fail, and the fixture must
name the Function, the input and (one element off) the element.

``--cost`` (the first sample of each of ``--ops`` ops, float64): CPU time of the
fixture's plain function against ``torch.autograd.gradcheck`` on the same function (of
the tensors that require grad, as torch's test builds it) in the same mode, per call
over blocks of calls of about 20 ms, best of ``--repeats`` interleaved blocks, one
torch thread. Targets: at most 1.10x where torch takes 5 ms or more, 1.3x below. The
per-evaluation overhead is timed directly (the fixture's evaluation of the function
against calling it), and the fixed cost per call is what remains: fixture - torch -
evaluations x overhead.

    python benchmarks/gradcheck_op_db.py [--agreement] [--cost] [--ops 300] [--repeats 5]
                                         [--src SRC]

Bakes the default project unless ``--src`` points at a generated project's ``src``.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import time
import timeit
from pathlib import Path

from baking import TEMPLATE_DIR, use_generated_src

TARGETS = ((0.0, 5e-3, 1.3), (5e-3, math.inf, 1.10))  # torch's time range, ratio target
FIXED_COST_TARGET = 1e-4  # seconds per call
EVALUATION_OVERHEAD_TARGET = 2e-6  # seconds per evaluation
# Each side is timed over calls adding up to about this long, as a test suite calls
# checks one after another (one call alone measures mostly the cold caches of the moment).
BLOCK_SECONDS = 0.02


def agreement(gradcheck, sweep) -> None:
    import torch

    rows: dict[str, collections.Counter] = {}
    disagreements: list[str] = []
    started = time.perf_counter()
    for label, dtype, source in (
        ("samples, float64", torch.float64, sweep.cases),
        ("samples, complex128", torch.complex128, sweep.cases),
        ("empty inputs, float64", torch.float64, sweep.empty_cases),
    ):
        for mode, fast in (("default", None), ("fast", True)):
            counts = rows.setdefault(f"{label}, {mode} mode", collections.Counter())
            for case in source(dtype):
                ours, theirs = sweep.ours(gradcheck, case, fast), sweep.theirs(case, fast)
                counts[(theirs.verdict.value, ours.verdict.value)] += 1
                if ours.verdict != theirs.verdict:
                    disagreements.append(f"{case.name} ({mode}): torch {theirs}; fixture {ours}")
    planted = collections.Counter()
    for case in sweep.cases(torch.float64, samples_per_op=1):
        if not sweep.plantable(case) or case.elements > 300:
            continue
        for plant in sweep.Plant:
            bug = sweep.planted_case(case, plant)
            ours, theirs = sweep.ours(gradcheck, bug), sweep.theirs(bug)
            named = sweep.names_the_plant(bug, plant, ours)
            planted[plant.value, theirs.verdict.value, ours.verdict.value, named] += 1
            if not named or theirs.verdict is not sweep.Verdict.FAIL:
                disagreements.append(f"{bug.name}: torch {theirs}; fixture {ours}")
    print(f"agreement with torch.autograd.gradcheck ({time.perf_counter() - started:.0f} s)")
    print(f"{'cases':<44}{'both pass':>10}{'both fail':>10}{'differ':>8}")
    for label, counts in rows.items():
        same_pass = counts["pass", "pass"]
        same_fail = counts["fail", "fail"] + counts["error", "error"]
        differ = sum(counts.values()) - same_pass - same_fail
        print(f"{label:<44}{same_pass:>10}{same_fail:>10}{differ:>8}")
    print(f"\n{'planted bug':<24}{'cases':>7}{'torch fails':>13}{'fixture fails':>15}{'named':>7}")
    for plant in sweep.Plant:
        entries = {key: n for key, n in planted.items() if key[0] == plant.value}
        total = sum(entries.values())
        torch_fails = sum(n for key, n in entries.items() if key[1] == "fail")
        ours_fails = sum(n for key, n in entries.items() if key[2] == "fail")
        named = sum(n for key, n in entries.items() if key[3])
        print(f"{plant.value:<24}{total:>7}{torch_fails:>13}{ours_fails:>15}{named:>7}")
    for line in disagreements:
        print("  " + line.replace("\n", " | ")[:400])


def _cpu_per_call(function, loops: int) -> float:
    started = time.process_time()
    for _ in range(loops):
        function()
    return (time.process_time() - started) / loops


def _evaluations(case) -> int:
    """How often torch's check calls the function on this case."""
    import torch

    count = 0
    function = case.torch_function()

    def counted(*tensors):
        nonlocal count
        count += 1
        return function(*tensors)

    fast = case.elements > 2048
    torch.autograd.gradcheck(counted, tuple(case.differentiable()), fast_mode=fast)
    return count


def _evaluation_overhead(problem_module, case) -> float:
    """Seconds the fixture adds to one evaluation of the function (best of many): its
    evaluation against the same call made directly on the same float64 tensors."""
    function = case.torch_function()
    problem = problem_module.Problem(function, tuple(case.differentiable()), {}, True)
    values = [c.value.detach() for c in problem.checked]
    tensors = [c.as_user(v) for c, v in zip(problem.checked, values, strict=True)]
    loops = 200
    with problem.installed():
        problem.evaluate(values)
        ours = min(timeit.repeat(lambda: problem.evaluate(values), number=loops, repeat=5))
        bare = min(timeit.repeat(lambda: function(*tensors), number=loops, repeat=5))
    return (ours - bare) / loops


def _theil_sen(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Slope and intercept of the line through ``points`` that outliers do not move: the
    median of the slopes between pairs, then the median of what is left."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 != x1
    ]
    slope = statistics.median(slopes) if slopes else 0.0
    return slope, statistics.median(y - slope * x for x, y in points)


def cost(gradcheck, problem_module, sweep, ops: int, repeats: int) -> bool:
    import torch

    rows = []
    seen = 0
    for case in sweep.cases(torch.float64, samples_per_op=1):
        if seen == ops:
            break
        if sweep.ours(gradcheck, case).verdict is not sweep.Verdict.PASS:
            continue
        if sweep.theirs(case).verdict is not sweep.Verdict.PASS:
            continue
        seen += 1
        loops = max(1, round(BLOCK_SECONDS / max(sweep.theirs(case).seconds, 1e-5)))
        fixture = direct = math.inf
        for _ in range(repeats):  # interleaved, so load on the machine hits both alike
            fixture = min(fixture, _cpu_per_call(lambda: sweep.ours_flat(gradcheck, case), loops))  # noqa: B023
            direct = min(direct, _cpu_per_call(lambda: sweep.theirs(case), loops))  # noqa: B023
        evaluations = _evaluations(case)
        overhead = _evaluation_overhead(problem_module, case)
        rows.append((case.name, direct, fixture, evaluations, overhead))
    print(f"\ncost against torch.autograd.gradcheck, {len(rows)} ops, CPU time, 1 thread")
    print(
        f"{'torch takes':<16}{'ops':>6}{'median x':>10}{'p90 x':>8}{'max x':>8}{'target':>8}"
        f"{'within':>8}"
    )
    ok = True
    for low, high, target in TARGETS:
        ratios = sorted(f / d for _, d, f, _, _ in rows if low <= d < high and d > 0)
        if not ratios:
            continue
        within = sum(r <= target for r in ratios)
        p90 = ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]
        label = f"< {high * 1e3:g} ms" if high < math.inf else f">= {low * 1e3:g} ms"
        ok = ok and statistics.median(ratios) <= target
        print(
            f"{label:<16}{len(ratios):>6}{statistics.median(ratios):>10.3f}{p90:>8.3f}"
            f"{ratios[-1]:>8.3f}{target:>8.2f}{within:>5}/{len(ratios)}"
        )
    overheads = [o for *_, o in rows if o is not None]
    per_evaluation = statistics.median(overheads)
    fixed = statistics.median(f - d - e * per_evaluation for _, d, f, e, _ in rows)
    slope, intercept = _theil_sen([(e, f - d) for _, d, f, e, _ in rows])
    print(
        f"per-evaluation overhead (median over ops): {per_evaluation * 1e6:.2f} us "
        f"(target < {EVALUATION_OVERHEAD_TARGET * 1e6:g} us)"
    )
    print(
        f"fixture - torch fitted over the ops as fixed + per evaluation (Theil-Sen): "
        f"{intercept * 1e6:.1f} us + {slope * 1e6:.2f} us per evaluation (in the calls, with "
        f"the caches as torch's own check leaves them)"
    )
    print(
        f"fixed cost per call (median): {fixed * 1e6:.1f} us "
        f"(target < {FIXED_COST_TARGET * 1e6:g} us)"
    )
    slowest = sorted(rows, key=lambda r: r[2] / max(r[1], 1e-9), reverse=True)[:8]
    print(
        "highest ratios: "
        + ", ".join(f"{n} {f / d:.2f}x ({d * 1e3:.2f} ms)" for n, d, f, _, _ in slowest)
    )
    return ok and per_evaluation < EVALUATION_OVERHEAD_TARGET and fixed < FIXED_COST_TARGET


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)
    sys.path.insert(0, str(Path(TEMPLATE_DIR, "tests")))
    import warnings

    import op_db_sweep as sweep
    import torch
    from dynamic_model.testing.gradcheck import gradcheck
    from dynamic_model.testing.gradcheck import problem as problem_module

    warnings.filterwarnings("ignore")  # deprecations of the ops' own samples
    torch.set_num_threads(1)
    ok = True
    if args.agreement or not args.cost:
        agreement(gradcheck, sweep)
    if args.cost or not args.agreement:
        ok = cost(gradcheck, problem_module, sweep, args.ops, args.repeats)
        print(f"\n{'within' if ok else 'OVER'} target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
