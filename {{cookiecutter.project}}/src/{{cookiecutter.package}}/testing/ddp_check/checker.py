"""The phases of one check, run from the test's process, and what they found.

:class:`Checker` has the ranks train under DDP and the single process run alone on
the concatenated batch (:mod:`.launch`), takes in what they report step by step
(:mod:`.messages`), stops the ranks as soon as their collectives can no longer match
or DDP must fail, and compares: the ranks' decisions on the same samples, their
gradients with each other and with the single process's, the parameters each step
used. Every problem found is raised, the most fundamental first.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..comparison import bitwise_equal, close_mismatch, tolerances_for
from ..control_flow import Decision, Location, first_divergence
from ..failures import most_fundamental
from ..naming import describe_callable
from ..parameter_use import Reach, located, site_outcomes
from ..subject import Subject
from .launch import RankProcesses, RanksEnded
from .messages import (
    REFERENCE,
    Alone,
    AloneRuns,
    BackwardDone,
    CollectiveCalled,
    Event,
    Explain,
    Explained,
    ForwardDone,
    Go,
    Job,
    PhaseDone,
    Reference,
    ReferenceDone,
    ReferenceStep,
    SamplesDone,
    StepEvent,
    Time,
    Timed,
    Train,
)
from .results import (
    CollectiveMismatch,
    Cost,
    DdpCheckFailure,
    DdpResult,
    GradientMismatch,
    RankFailed,
    RanksDisagree,
    StaticGraphUnsafe,
    UnusedParameters,
    rank_steps,
)

__all__ = ["Checker"]

# Once the check knows DDP must fail (a parameter unused without
# find_unused_parameters), how long to wait for DDP's own error: it comes at the next
# step's forward, within milliseconds; the wait only bounds a rank stuck in the
# all-reduce the other ranks never join.
DOOMED_GRACE = 5.0
# How long to listen for the other ranks' errors once one rank raised in a step that had
# to fail: DDP raises on every rank that starts its next forward, within milliseconds.
DRAIN_WAIT = 1.0


@dataclass(frozen=True)
class _Collective:
    op: str
    location: Location


@dataclass
class _RankStep:
    """What one rank reported for one step."""

    decisions: list[Decision] = field(default_factory=list)
    reached: tuple[str, ...] | None = None
    grads: dict[str, torch.Tensor | None] | None = None


class Checker:
    """The phases of one check, run from the test's process, and what they found."""

    def __init__(
        self,
        job: Job,
        options: dict[str, Any],
        steps: int,
        method: str,
        tolerances: tuple[float | None, float | None],
    ) -> None:
        self.job = job
        self.options = options
        self.steps = steps
        self.method = method
        self.rtol, self.atol = tolerances
        self.subject = describe_callable(job.target)
        self.names = [
            name
            for name, _ in Subject(
                job.target, job.batches[0], job.kwargs, failure=DdpCheckFailure
            ).parameters
        ]
        self.ranks = list(range(job.world_size))
        self.record: dict[int, dict[int, _RankStep]] = {}
        self.collectives: dict[tuple[int, str], dict[int, list[_Collective]]] = {}
        self.samples: dict[int, SamplesDone] = {}
        self.reference: dict[int, ReferenceStep] = {}
        self.reference_info: ReferenceDone | None = None
        self.explained: dict[str, Reach] | None = None
        self.backlog: list[Event] = []
        self.alone: AloneRuns | None = None
        self.mismatch: tuple[int, str, dict[int, list[_Collective]], int] | None = None
        self.doomed = False
        self.step_seconds = math.nan

    def run(self) -> DdpResult:
        __tracebackhide__ = True
        cost = None
        with RankProcesses(self.job, self.method) as launch:
            try:
                startup = launch.start()
                launch.send(REFERENCE, Reference(self.steps))
                ddp_error = None
                try:
                    self._train(launch)
                except RanksEnded as stop:
                    if not self.doomed:
                        raise
                    # DDP raises at the next forward; a rank that waited for the others in the
                    # all-reduce may fail first, on the broken connection: DDP's error is the one
                    # raised in a forward.
                    raised = [stop.failure, *launch.drain(DRAIN_WAIT)]
                    ddp_error = next(
                        (f for f in raised if isinstance(f, RankFailed) and f.phase == "forward"),
                        stop.failure,
                    )
                if self.doomed:
                    launch.close()
                    raise RanksEnded(self._unused_failure(ddp_error))
                self._wait_reference(launch, lambda: self.reference_info is not None)
                failure = self._findings()
                if failure is not None:
                    raise RanksEnded(failure)
                if self.options.get("find_unused_parameters"):
                    cost = self._cost(launch)
            except RanksEnded as stop:
                if self.mismatch is not None:
                    raise self._collective_failure(
                        *self.mismatch, self._alone_runs(launch)
                    ) from None
                raise stop.failure from None
        return self._result(startup, cost)

    def _alone_runs(self, launch: RankProcesses) -> AloneRuns | None:
        """The collectives each rank's batch calls in a whole forward, from the single
        process (None when it cannot tell: it failed or hangs too)."""
        launch.send(REFERENCE, Alone())
        try:
            self._wait_reference(launch, lambda: self.alone is not None)
        except RanksEnded:
            return None
        return self.alone

    # --- the steps --------------------------------------------------------------------

    def _train(self, launch: RankProcesses) -> None:
        launch.to_ranks(Train(self.options, self.steps))
        deadline = time.monotonic() + self.job.timeout
        started = time.perf_counter()
        for step in range(1, self.steps + 1):
            steps = {rank: _RankStep() for rank in self.ranks}
            self.record[step] = steps

            def forward(event: PhaseDone, steps: dict[int, _RankStep] = steps) -> None:
                assert isinstance(event, ForwardDone)
                steps[event.rank].reached = tuple(event.reached)

            self._collect(launch, step, "forward", deadline, forward)
            self._check_unused(steps)
            launch.to_ranks(Go())
            if self.doomed:
                deadline = min(deadline, time.monotonic() + DOOMED_GRACE)

            def backward(event: PhaseDone, steps: dict[int, _RankStep] = steps) -> None:
                assert isinstance(event, BackwardDone)
                steps[event.rank].grads = event.grads

            self._collect(launch, step, "backward", deadline, backward)
        self.step_seconds = (time.perf_counter() - started) / self.steps

        def samples(event: PhaseDone) -> None:
            assert isinstance(event, SamplesDone)
            self.samples[event.rank] = event

        self._collect(launch, self.steps + 1, "same-sample forwards", deadline, samples)

    def _collect(
        self,
        launch: RankProcesses,
        step: int,
        phase: str,
        deadline: float,
        on_done: Callable[[PhaseDone], None],
    ) -> None:
        """Events until every rank has reported the end of ``phase``; the collectives they
        call meanwhile are checked against each other as they come."""
        calls = self.collectives.setdefault((step, phase), {rank: [] for rank in self.ranks})
        done: set[int] = set()
        doing = f"step {step}'s {phase}" if step <= self.steps else phase
        while len(done) < len(self.ranks):
            event = self._next_of(launch, step, phase, deadline, doing)
            if step in self.record and isinstance(event, StepEvent):
                self.record[step][event.rank].decisions.extend(event.decisions)
            if isinstance(event, CollectiveCalled):
                calls[event.rank].append(_Collective(event.op, event.location))
            elif isinstance(event, PhaseDone):
                on_done(event)
                done.add(event.rank)
            self._check_collectives(step, phase, calls, done)

    def _next_of(
        self, launch: RankProcesses, step: int, phase: str, deadline: float, doing: str
    ) -> Event:
        """The next event of a rank's ``phase`` of ``step``; a rank that is already further
        (its next step, while another rank finishes this one) has its events kept for
        later, and the single process's are taken in as they come."""
        for index, event in enumerate(self.backlog):
            if (event.step, event.phase) == (step, phase):
                return self.backlog.pop(index)
        while True:
            event = launch.next(deadline, doing)
            if event.rank == REFERENCE:
                self._absorb_reference(event)
            elif (event.step, event.phase) == (step, phase):
                return event
            else:
                self.backlog.append(event)

    def _absorb_reference(self, event: Event) -> None:
        match event:
            case ReferenceStep():
                self.reference[event.step] = event
            case ReferenceDone():
                self.reference_info = event
            case Explained():
                self.explained = dict(event.reasons)
            case AloneRuns():
                self.alone = event

    def _wait_reference(self, launch: RankProcesses, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.job.timeout
        while not ready():
            event = launch.next(deadline, "the single process's run")
            if event.rank == REFERENCE:
                self._absorb_reference(event)

    def _check_collectives(
        self, step: int, phase: str, calls: dict[int, list[_Collective]], done: set[int]
    ) -> None:
        """A CollectiveMismatch as soon as the ranks' collectives can no longer match: two
        ranks called different ones at the same position, or a rank finished the phase
        with fewer than another has called."""
        longest = max(len(sequence) for sequence in calls.values())
        for index in range(longest):
            called = {
                call
                for sequence in calls.values()
                if index < len(sequence)
                for call in [sequence[index]]
            }
            short = [rank for rank in done if index >= len(calls[rank])]
            if len(called) > 1 or short:
                self.mismatch = (step, phase, calls, index)
                raise RanksEnded(self._collective_failure(step, phase, calls, index))

    def _collective_failure(
        self,
        step: int,
        phase: str,
        calls: dict[int, list[_Collective]],
        index: int,
        alone: AloneRuns | None = None,
    ) -> CollectiveMismatch:
        first = next(sequence[index] for sequence in calls.values() if index < len(sequence))
        lines = [
            f"the ranks called collectives differently in step {step}'s {phase}: collective "
            f"#{index + 1} is {first.op} at {located(first.location)}"
        ]
        for rank, sequence in calls.items():
            call = sequence[index] if index < len(sequence) else None
            what = (
                f"called {call.op} at {call.location} as #{index + 1}"
                if call is not None
                else f"made no #{index + 1}: it finished with {len(sequence)}"
            )
            lines.append(f"  rank {rank} {what}")
        divergence = self._first_rank_divergence(step)
        counts = {
            rank: sum(1 for call in sequence if call == first) for rank, sequence in calls.items()
        }
        if alone is not None:
            counts = {
                rank: sum(
                    1 for op, at in alone.runs[rank][0] if (op, at) == (first.op, first.location)
                )
                for rank in self.ranks
            }
            lines.append(
                f"Each rank's batch alone (a process group of one, where a collective never "
                f"waits) calls {first.op} at {first.location} "
                + ", ".join(f"{counts[rank]} times on rank {rank}" for rank in self.ranks)
                + "."
            )
            logs = {rank: alone.runs[rank][1] for rank in self.ranks}
            divergence = next(
                (
                    ((0, rank), found)
                    for rank in self.ranks[1:]
                    if (found := first_divergence(logs[0], logs[rank])) is not None
                ),
                divergence,
            )
        if divergence is not None:
            (a, b), (_, left, right) = divergence
            decision = left or right
            assert decision is not None
            lines.append(
                f"The ranks part at {_decision_text(decision)}: rank {a} "
                f"{left.value if left else 'made none'}, rank {b} "
                f"{right.value if right else 'made none'}: a loop or branch decided by each "
                "rank's own data calls the collective a different number of times."
            )
        lines.append(
            "Under DDP this hangs until the process group's timeout (or gloo aborts on "
            "mismatched sizes): every rank must call the same collectives in the same order. "
            "Decide the loop on a value all ranks share (all_reduce the statistic, then loop "
            "on the result), or run the same number of iterations on every rank."
        )
        return CollectiveMismatch(
            "\n".join(lines),
            step,
            first.location,
            {rank: tuple((c.op, c.location) for c in sequence) for rank, sequence in calls.items()},
            counts,
            divergence[1] if divergence is not None else None,
        )

    def _first_rank_divergence(
        self, step: int
    ) -> tuple[tuple[int, int], tuple[int, Decision | None, Decision | None]] | None:
        if step not in self.record:
            return None
        logs = {rank: record.decisions for rank, record in self.record[step].items()}
        for a in self.ranks:
            for b in self.ranks[a + 1 :]:
                found = first_divergence(logs[a], logs[b])
                if found is not None:
                    return (a, b), found
        return None

    # --- unused parameters ----------------------------------------------------------

    def _check_unused(self, steps: dict[int, _RankStep]) -> None:
        if not self.options.get("find_unused_parameters") and any(
            set(record.reached or ()) != set(self.names) for record in steps.values()
        ):
            # DDP cannot finish this step's reduction: it says so at the next forward.
            self.doomed = True

    def _unused(self) -> dict[str, tuple[tuple[int, int], ...]]:
        unused: dict[str, list[tuple[int, int]]] = {}
        for step, steps in self.record.items():
            for rank, record in steps.items():
                if record.reached is None:
                    continue
                for name in self.names:
                    if name not in record.reached:
                        unused.setdefault(name, []).append((rank, step))
        return {name: tuple(pairs) for name, pairs in unused.items()}

    def _unused_reasons(
        self, unused: Mapping[str, tuple[tuple[int, int], ...]], launch: RankProcesses
    ) -> dict[str, str]:
        """For each unused parameter, the decision and each rank's outcome that left it out;
        for one no rank used, the decision that would (from the single process)."""
        reasons: dict[str, str] = {}
        for name, pairs in unused.items():
            for rank, step in pairs:
                users = [
                    other
                    for other, record in self.record[step].items()
                    if record.reached is not None and name in record.reached
                ]
                if users:
                    reasons[name] = self._divergence_text(step, rank, users[0])
                    break
        never_used = [name for name in unused if name not in reasons]
        if never_used:
            launch.send(REFERENCE, Explain(unused[never_used[0]][0][0], tuple(never_used)))
            self._wait_reference(launch, lambda: self.explained is not None)
            assert self.explained is not None
            for name in never_used:
                reach = self.explained[name]
                taken = ", which no rank's batch did here" if reach.decision is not None else ""
                reasons[name] = f"unused on every rank: {reach}{taken}"
        return reasons

    def _divergence_text(self, step: int, unused_on: int, used_on: int) -> str:
        logs = {rank: record.decisions for rank, record in self.record[step].items()}
        found = first_divergence(logs[used_on], logs[unused_on])
        if found is None:
            return f"used on rank {used_on}, not on rank {unused_on}, with the same decisions"
        k, used, not_used = found
        decision = used or not_used
        assert decision is not None
        outcomes = ", ".join(
            f"rank {rank} {logs[rank][k - 1].value if k <= len(logs[rank]) else 'no decision'}"
            for rank in self.ranks
        )
        return (
            f"{_decision_text(decision)} in step {step}: {outcomes} (used on rank {used_on}, not "
            f"on rank {unused_on})"
        )

    def _unused_failure(self, ddp_error: DdpCheckFailure | None) -> UnusedParameters:
        """This launch had to fail; a fresh one with find_unused_parameters=True measures
        the remedies and finds the decisions."""
        unused = self._unused()
        remedy = Checker(
            self.job,
            {**self.options, "find_unused_parameters": True},
            self.steps,
            self.method,
            (self.rtol, self.atol),
        )
        cost, checked, nested = None, "", ""
        # The same steps again: their decisions were counted by the launch that failed.
        with RankProcesses(self.job, self.method, counted=False) as launch:
            try:
                launch.start()
                launch.send(REFERENCE, Reference(self.steps))
                remedy._train(launch)
                remedy._wait_reference(launch, lambda: remedy.reference_info is not None)
                later = remedy._findings()
                if later is None:
                    checked = (
                        "checked here: the ranks then agree with one process on the "
                        "concatenated batch"
                    )
                else:
                    checked = "checked here, and then:"
                    nested = f"{type(later).__name__}: {later}"
                unused = remedy._unused() or unused
                cost = remedy._cost(launch)
                reasons = remedy._unused_reasons(unused, launch)
            except RanksEnded as stop:
                reasons = {}
                checked, nested = "checked here, and then:", str(stop.failure)
        lines = [
            f"under DistributedDataParallel(find_unused_parameters=False), {len(unused)} of "
            f"{len(self.names)} parameters of {self.subject} got no gradient on some ranks, so "
            "DDP's gradient reduction cannot finish:"
        ]
        groups: dict[str, list[str]] = {}
        for name, pairs in unused.items():
            why = reasons.get(name, "not reached by the graph of the loss")
            groups.setdefault(f"unused on {rank_steps(pairs)}: {why}", []).append(name)
        lines.extend(f"  {', '.join(names)}: {text}" for text, names in groups.items())
        error = ddp_error.error if isinstance(ddp_error, RankFailed) else None
        if isinstance(ddp_error, RankFailed) and error:
            lines.append(
                f"DDP's own error (rank {ddp_error.rank}, step {ddp_error.step}): "
                + _first_sentence(error)
            )
        lines.append("Either:")
        lines.append(
            "  - DistributedDataParallel(model, find_unused_parameters=True): DDP then searches "
            "the autograd graph for unused parameters at every step"
            + (f"; on this model: {cost}" if cost is not None else "")
            + (f"; {checked}" if checked else "")
        )
        # The failure the remedy runs into, whole: its cause and fix are the next step.
        lines += [f"      {line}" for line in nested.splitlines()]
        lines.append(
            "  - or touch every parameter in every step, so that none is ever unused: where the "
            "forward skips a module, add 0.0 * sum(p.sum() for p in module.parameters()) to "
            "its result (what the cost above is measured against)"
        )
        return UnusedParameters("\n".join(lines), unused, reasons, cost, error)

    # --- the comparisons --------------------------------------------------------------

    def _findings(self) -> DdpCheckFailure | None:
        """What is wrong in what the ranks and the single process reported, all of it, the
        most fundamental first: ranks that decide apart on the same samples train
        different models, gradients that differ between ranks make every comparison with
        the single process moot, and a gradient off the single process's is a wrong
        result where an unsafe static graph is a risk."""
        found = [
            self._disagreement(),
            self._rank_gradients(),
            self._reference_gradients(),
            self._static_graph(),
        ]
        return cast("DdpCheckFailure | None", most_fundamental([f for f in found if f]))

    def _disagreement(self) -> RanksDisagree | None:
        for batch in self.ranks:
            logs = {rank: self.samples[rank].logs[batch] for rank in self.ranks}
            for other in self.ranks[1:]:
                found = first_divergence(logs[0], logs[other])
                if found is None:
                    continue
                _, a, b = found
                decision = a or b
                assert decision is not None
                state = self._differing_state(0, other)
                cause = (
                    f"their state differs: {', '.join(state)} (with broadcast_buffers=False each "
                    "rank keeps its own buffers; with broadcast_buffers=True DDP gives every rank "
                    "rank 0's before each forward)"
                    if state
                    else "their parameters and buffers are equal, so their numerics differ "
                    "(another GPU model, nondeterministic kernels) and the decision sits close to "
                    "its boundary for these samples"
                )
                return RanksDisagree(
                    f"the ranks decide differently for the same samples: on rank {batch}'s batch, "
                    f"run by every rank after the {self.steps} steps, {_decision_text(decision)} "
                    f"is {a.value if a else 'not made'} on rank 0 and "
                    f"{b.value if b else 'not made'} on rank {other}: {cause}. Ranks that branch "
                    "differently on the same data train different models, and DDP averages their "
                    "gradients as if they did not.",
                    batch,
                    (0, other),
                    found,
                    state,
                )
        return None

    def _differing_state(self, a: int, b: int) -> list[str]:
        left, right = self.samples[a].state, self.samples[b].state
        return [name for name in left if not bitwise_equal(left[name], right[name])]

    def _rank_gradients(self) -> GradientMismatch | None:
        for step, steps in self.record.items():
            ours = steps[0].grads or {}
            for rank in self.ranks[1:]:
                theirs = steps[rank].grads or {}
                for name in self.names:
                    a, b = ours.get(name), theirs.get(name)
                    if (a is None) != (b is None) or (a is not None and not bitwise_equal(a, b)):
                        return GradientMismatch(
                            f"after the all-reduce of step {step}, the gradient of {name} differs "
                            f"between rank 0 and rank {rank}: an all-reduce gives every rank the "
                            "same bits, so something changed it on one rank afterwards (a hook, "
                            "or clipping by a rank-local norm)",
                            step,
                            name,
                            rank,
                            0.0,
                            0.0,
                        )
        return None

    def _reference_gradients(self) -> GradientMismatch | None:
        assert self.reference_info is not None
        if self.reference_info.random:
            return None
        for step in sorted(self.record):
            grads = self.record[step][0].grads or {}
            expected = self.reference[step].grads
            for name in self.names:
                grad, reference = grads.get(name), expected.get(name)
                if grad is None and reference is None:
                    continue
                if grad is None or reference is None:
                    present = reference if grad is None else grad
                    grad = torch.zeros_like(present) if grad is None else grad
                    reference = torch.zeros_like(present) if reference is None else reference
                mismatch = close_mismatch(
                    f"grad of {name}", reference, grad, self.rtol, self.atol, ("one process", "DDP")
                )
                if mismatch is None:
                    continue
                rtol, atol = self._tolerances(grad.dtype)
                return GradientMismatch(
                    f"after the all-reduce of step {step}, DDP's gradient differs from one process "
                    f"on the concatenated batch, which DDP stands for:\n  {mismatch.description}\n"
                    f"  {self._reference_cause(step)}",
                    step,
                    name,
                    "one process",
                    rtol,
                    atol,
                )
        return None

    def _reference_cause(self, step: int) -> str:
        single = self.reference[step].decisions
        logs = {rank: self.record[step][rank].decisions for rank in self.ranks}
        joined = [decision for rank in self.ranks for decision in logs[rank]]
        same = len(single) == len(joined) and all(
            a.op == b.op and a.location == b.location and repr(a.value) == repr(b.value)
            for a, b in zip(single, joined, strict=True)
        )
        if not same:
            for k, decision in enumerate(single, start=1):
                theirs = {rank: log[k - 1] for rank, log in logs.items() if k <= len(log)}
                if any(d.location != decision.location for d in theirs.values()):
                    break  # the ranks are elsewhere in the forward by now
                if any(not d.same_as(decision) for d in theirs.values()) or len(theirs) < len(logs):
                    values = ", ".join(
                        f"rank {rank} {theirs[rank].value if rank in theirs else 'none'}"
                        for rank in self.ranks
                    )
                    return (
                        f"cause: {_decision_text(decision)}: one process {decision.value}, "
                        f"{values}. The forward decides on the whole batch, and under DDP each "
                        "rank decides on its own part: make the decision per sample, or on a "
                        "statistic all_reduced over the ranks."
                    )
            return (
                f"cause: one process made {len(single)} decision(s) on the concatenated batch, "
                "the ranks "
                + ", ".join(f"{len(logs[rank])} on rank {rank}" for rank in self.ranks)
                + ", and they differ: the forward decides on the batch as a whole"
            )
        return (
            "cause: the decisions agree, sample for sample, so the forward mixes samples "
            "(BatchNorm in training mode normalizes over each rank's part: "
            "nn.SyncBatchNorm.convert_sync_batchnorm), or the loss is not a mean over samples"
        )

    def _static_graph(self) -> StaticGraphUnsafe | None:
        if not self.options.get("static_graph") or self._static_graph_safe():
            return None
        unused = self._unused()
        return StaticGraphUnsafe(
            "static_graph=True, but the parameters used change between ranks or steps: "
            + "; ".join(f"{name} unused on {rank_steps(pairs)}" for name, pairs in unused.items())
            + ". DDP's static graph assumes every step uses the parameters the first one did; "
            "use find_unused_parameters=True instead",
            list(unused),
        )

    def _static_graph_safe(self) -> bool:
        used = {
            frozenset(record.reached or ())
            for steps in self.record.values()
            for record in steps.values()
        }
        return len(used) <= 1

    def _tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        rtol, atol = tolerances_for(dtype)
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)

    # --- the cost, the result ---------------------------------------------------------

    def _cost(self, launch: RankProcesses) -> Cost:
        touched = bool(self._unused())
        configurations = [
            ({**self.options, "find_unused_parameters": True}, False),
            ({**self.options, "find_unused_parameters": False}, touched),
        ]
        launch.to_ranks(Time(tuple(configurations)))
        deadline = time.monotonic() + self.job.timeout
        per_rank: dict[int, Timed] = {}
        while len(per_rank) < len(self.ranks):
            event = self._next_of(launch, self.steps + 1, "timed steps", deadline, "timed steps")
            assert isinstance(event, Timed)
            per_rank[event.rank] = event
        medians = []
        for clock in ("wall", "cpu"):
            for index in range(len(configurations)):
                times = (getattr(timed, clock)[index] for timed in per_rank.values())
                medians.append(statistics.median(max(step) for step in zip(*times, strict=True)))
        steps = len(next(iter(per_rank.values())).wall[0])
        return Cost(*medians, touched=touched, steps=steps)

    def _result(self, startup: float, cost: Cost | None) -> DdpResult:
        assert self.reference_info is not None
        unused = self._unused()
        logs = {
            rank: [self.record[step][rank].decisions for step in sorted(self.record)]
            for rank in self.ranks
        }
        rtol, atol = self._tolerances(self.reference_info.dtype)
        compared = (
            "gradients after the all-reduce equal on every rank bit for bit (the forward draws "
            "random numbers, so one process on the concatenated batch is no reference)"
            if self.reference_info.random
            else "gradients after the all-reduce equal on every rank bit for bit and within "
            f"rtol={rtol:g}, atol={atol:g} of one process on the concatenated batch"
        )
        return DdpResult(
            subject=self.subject,
            world_size=self.job.world_size,
            backend=self.job.backend,
            device="cpu" if self.job.backend == "gloo" else "cuda",
            steps=self.steps,
            options=tuple(sorted(self.options.items())),
            outcomes=tuple((rank, site_outcomes(logs[rank])) for rank in self.ranks),
            unused=tuple(unused.items()),
            find_unused_needed=bool(unused),
            static_graph_safe=self._static_graph_safe(),
            at_risk=tuple(self.reference_info.at_risk),
            compared=compared,
            startup_seconds=startup,
            step_seconds=self.step_seconds,
            cost=cost,
        )


def _first_sentence(text: str) -> str:
    sentence, dot, rest = text.partition(". ")
    return sentence + dot.strip() + (" ..." if rest else "")


def _decision_text(decision: Decision) -> str:
    return f"decision #{decision.index} at {located(decision.location)}"
