"""The ddp_check fixture in real pytest sessions: real DistributedDataParallel, real gloo ranks.

Each planted bug has its fixed twin in the passing session: a parameter only one
rank's batch uses without and with ``find_unused_parameters=True``, a loop decided by
each rank's own data around an ``all_reduce`` against one decided by the all-reduced
value, buffers kept per rank (``broadcast_buffers=False``) against DDP's default. A
rank that kills itself in the middle of a step and one that hangs are reported, and
no process of the check outlives it (psutil lists this process's descendants), nor any
process a rank starts, in its process group or in a session of its own, whether the
check passes, a rank raises or hangs, or the test's process gets a Ctrl-C (found by
their argv[0] in /proc); the check's files are in pytest's temporary folder. Each
session runs in a fresh interpreter (``runpytest_subprocess``); the ranks are forked
from it, except in the one test that spawns them.
"""

from __future__ import annotations

from conftest import DEFAULT_PACKAGE
from sessions import SEEDED, assert_failures, assert_no_internals, run_session

HELPERS = f'''
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch import nn
from {DEFAULT_PACKAGE}.models import MeanGatedNet, PerSampleNet, RoutedRefineNet


def batch(scale=1.0, rows=4, seed=0):
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)) * scale


{SEEDED}


def descendants():
    return psutil.Process().children(recursive=True)


class LoopedAllReduce(nn.Module):
    """Halves h until it is small, all-reducing a statistic in each pass: each rank's
    own data decides how many passes, so how many all_reduce calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        while h.abs().mean() > 1.0:
            scale = h.detach().abs().mean()
            dist.all_reduce(scale)
            h = h / 2
        return h


class SharedLoop(LoopedAllReduce):
    """The same, with the loop decided by the all-reduced value every rank shares."""

    def forward(self, x):
        h = self.linear(x)
        while True:
            scale = h.detach().abs().mean()
            dist.all_reduce(scale)
            if scale / dist.get_world_size() <= 1.0:
                return h
            h = h / 2


class RunningGate(nn.Module):
    """relu or tanh by the sign of a running mean of the inputs kept in a buffer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("running", torch.zeros(()))

    def forward(self, x):
        out = torch.relu(self.linear(x)) if self.running > 0 else torch.tanh(self.linear(x))
        if self.training:
            self.running.mul_(0.5).add_(0.5 * x.detach().mean())
        return out


class DiesOnRankOne(nn.Module):
    """Rank 1 kills its own process in the forward of the second step."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if dist.get_world_size() > 1 and dist.get_rank() == 1 and self.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.linear(x)


class HangsOnRankOne(DiesOnRankOne):
    def forward(self, x):
        self.calls += 1
        if dist.get_world_size() > 1 and dist.get_rank() == 1 and self.calls == 2:
            time.sleep(600)
        return self.linear(x)


class RaisesOnNegativeBatches(DiesOnRankOne):
    def forward(self, x):
        if x.sum() < 0:
            raise ValueError("this batch sums to a negative number")
        return self.linear(x)


CHILD = f"ddp-check-child-{{uuid.uuid4().hex}}"  # argv[0] of the children the ranks start


def started_by_a_rank():
    """This process's check folder (its faulthandler file is open in it), after starting
    two sleeps with CHILD for argv[0]: one in this process's group, one in a session of
    its own (as a daemon starts)."""
    folder = next(
        Path(os.readlink(fd)).parent
        for fd in Path("/proc/self/fd").iterdir()
        if Path(os.readlink(fd)).name.startswith("stack")
    )
    for new_session in (False, True):
        subprocess.Popen([CHILD, "600"], executable=shutil.which("sleep"),
                         start_new_session=new_session)
    return folder


def children_left():
    """The live processes whose argv[0] is CHILD (a zombie's argv reads empty)."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "cmdline").read_bytes().split(b"\\0")[0] == CHILD.encode():
                left.append(int(entry.name))
        except OSError:
            continue
    return left


class StartsChildren(nn.Module):
    """Starts two sleeps in each process of the check, writing its folder to ``report``;
    then on rank 1, in the second step, raises, hangs, or hangs after a Ctrl-C to the
    test's process (its parent), as ``then`` says."""

    def __init__(self, report, then):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.report, self.then = report, then
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1 and dist.is_initialized():
            folder = started_by_a_rank()
            with open(self.report, "a") as report:
                report.write(f"{{dist.get_world_size()}}:{{dist.get_rank()}} {{folder}}\\n")
        if dist.get_world_size() > 1 and dist.get_rank() == 1 and self.calls == 2:
            if self.then == "raise":
                raise ValueError("rank 1 gives up")
            if self.then == "ctrl-c":
                os.kill(os.getppid(), signal.SIGINT)
            if self.then in ("hang", "ctrl-c"):
                time.sleep(600)
        return self.linear(x)


def both_sides(model):
    """A batch where h.mean() > 0 and one where it is < 0."""
    direction = model.linear.weight.sum(dim=0).sign().expand(4, -1)
    return 5.0 * direction, -5.0 * direction


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return seeded(lambda: GPT2LMHeadModel(config))
'''

PASSING = """
import os
from pathlib import Path

import pytest
import torch
from {package}.testing.ddp_check import DdpResult, RankFailed
from helpers import *


def test_per_sample_branches(ddp_check):
    result = ddp_check(seeded(PerSampleNet), batch(seed=0), batch(seed=1))
    assert isinstance(result, DdpResult)
    assert not result.find_unused_needed and result.static_graph_safe
    assert [rank for rank, _ in result.outcomes] == [0, 1]
    assert not torch.distributed.is_initialized()  # this process joined no process group


def test_a_branch_only_parameter_with_find_unused_parameters(ddp_check):
    result = ddp_check(seeded(RoutedRefineNet), batch(3.0), batch(0.1),
                       find_unused_parameters=True)
    assert result.find_unused_needed and not result.static_graph_safe
    assert dict(result.unused) == {{"refine.weight": ((1, 1), (1, 2), (1, 3)),
                                   "refine.bias": ((1, 1), (1, 2), (1, 3))}}
    assert result.cost is not None and result.cost.touched


def test_a_loop_on_the_all_reduced_value(ddp_check):
    ddp_check(seeded(SharedLoop), batch(10.0), batch(1.0))


def test_buffers_broadcast_from_rank_0(ddp_check):
    ddp_check(seeded(RunningGate), torch.full((4, 8), 2.0), torch.full((4, 8), -1.0))


def test_one_batch_split_and_a_function(ddp_check):
    model = seeded(PerSampleNet)
    result = ddp_check(lambda x: model(x).tanh(), batch(rows=8))
    assert result.world_size == 2
    assert result.subject == "test_one_batch_split_and_a_function.<lambda>"


def test_a_tiny_gpt2_that_returns_its_loss(ddp_check):
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    result = ddp_check(lambda ids: model(input_ids=ids, labels=ids).loss, ids[:2], ids[2:])
    assert "within rtol=0.0001, atol=1e-05 of one process" in result.compared


def test_spawned_ranks(ddp_check):
    ddp_check(seeded(PerSampleNet), batch(seed=0), batch(seed=1), start_method="spawn")


def test_find_unused_parameters_needed_in_one_process():
    from {package}.models import DynamicNet
    from {package}.testing.ddp_check import find_unused_parameters_needed

    model = seeded(lambda: DynamicNet(in_features=8))
    state = {{k: v.clone() for k, v in model.state_dict().items()}}
    rng = torch.get_rng_state()
    advice = find_unused_parameters_needed(model, batch(0.1))
    assert advice.needed and len(advice.reasons) == 1
    assert advice.reasons[0].startswith(
        "block.0.weight, block.0.bias reached only when `if h.abs().mean() < self.tolerance:` at "
    )
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not find_unused_parameters_needed(seeded(PerSampleNet), batch()).needed
    assert find_unused_parameters_needed(seeded(RoutedRefineNet), batch(3.0)).needed


def test_find_unused_parameters_kept_where_no_branch_can_show_it():
    from {package}.models import TopKMixture
    from {package}.testing.parameter_use import find_unused_parameters_needed

    # Experts are picked by the rows nonzero() finds: an expert no row picks goes unused,
    # with no branch decision the probe could turn.
    mixture = find_unused_parameters_needed(
        seeded(lambda: TopKMixture(8, experts=4, k=2)), batch(rows=16)
    )
    assert mixture.needed and not mixture.reasons
    assert "shapes decided by the data (Tensor.nonzero at " in str(mixture)
    assert str(mixture).startswith("find_unused_parameters=True kept: every parameter is used")

    class Steps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[: int(x.abs().mean().item() * 10) % 2 + 3]:
                x = layer(x)
            return x

    # Every layer runs on this batch, but how many run is a number read off the data.
    steps = find_unused_parameters_needed(seeded(Steps), batch())
    assert steps.needed and not steps.reasons
    assert "1 number(s) read off tensors (Tensor.item at " in str(steps)


def test_a_rank_killed_mid_step_leaves_no_process(ddp_check):
    with pytest.raises(RankFailed) as failure:
        ddp_check(seeded(DiesOnRankOne), batch(), batch())
    assert (failure.value.rank, failure.value.how, failure.value.step) == (1, "died", 1)
    assert "rank 1 died (killed by SIGKILL) during step 2's forward" in str(failure.value)
    assert not descendants()
    assert not any(os.path.exists(f"/proc/{{pid}}") for pid in failure.value.pids)


def test_a_hanging_rank_is_killed_at_the_timeout(ddp_check):
    with pytest.raises(RankFailed) as failure:
        ddp_check(seeded(HangsOnRankOne), batch(), batch(), timeout=3)
    assert failure.value.how == "timed out"
    assert failure.value.location.source == "time.sleep(600)"
    assert not descendants()


@pytest.mark.parametrize("then", ["passes", "raise", "hang", "ctrl-c"])
def test_processes_a_rank_starts_end_with_it(ddp_check, then, tmp_path, tmp_path_factory):
    report = tmp_path / "started.txt"
    model = seeded(lambda: StartsChildren(report, then))
    if then == "passes":
        ddp_check(model, batch(), batch())
    elif then == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            ddp_check(model, batch(), batch())
    else:
        with pytest.raises(RankFailed) as failure:
            ddp_check(model, batch(), batch(), timeout=3)
        assert failure.value.how == {{"raise": "raised", "hang": "timed out"}}[then]
    started = dict(line.split() for line in report.read_text().splitlines())
    # Both ranks started theirs (the single process too, unless a rank ended it first).
    assert {{"2:0", "2:1"}} <= set(started)
    assert not children_left()
    for folder in started.values():
        assert Path(folder).parent == tmp_path_factory.getbasetemp()
        assert not Path(folder).exists()


def test_a_rank_that_raises(ddp_check):
    with pytest.raises(RankFailed) as failure:
        ddp_check(seeded(RaisesOnNegativeBatches), batch().abs(), -batch().abs())
    assert (failure.value.rank, failure.value.how) == (1, "raised")
    assert failure.value.error == "ValueError: this batch sums to a negative number"
    assert not descendants()
"""

FAILING = """
import torch
from helpers import *


def test_a_branch_only_parameter(ddp_check):
    ddp_check(seeded(RoutedRefineNet), batch(3.0), batch(0.1))


def test_a_loop_decided_by_each_rank_around_an_all_reduce(ddp_check):
    ddp_check(seeded(LoopedAllReduce), batch(10.0), batch(1.0))


def test_buffers_kept_per_rank(ddp_check):
    ddp_check(seeded(RunningGate), torch.full((4, 8), 2.0), torch.full((4, 8), -1.0),
              broadcast_buffers=False)


def test_a_decision_on_the_whole_batch(ddp_check):
    model = seeded(MeanGatedNet)
    ddp_check(model, *both_sides(model))


def test_static_graph_with_a_branch_only_parameter(ddp_check):
    ddp_check(seeded(RoutedRefineNet), batch(3.0), batch(0.1), find_unused_parameters=True,
              static_graph=True)


def test_nccl_without_gpus(ddp_check):
    ddp_check(seeded(PerSampleNet), batch(), batch(), backend="nccl")


def test_one_step(ddp_check):
    ddp_check(seeded(PerSampleNet), batch(), batch(), steps=1)


def test_a_temp_root_that_is_no_folder(ddp_check):
    ddp_check(seeded(PerSampleNet), batch(), batch(), temp_root="no/such/folder")


def test_spawned_ranks_of_a_lambda(ddp_check):
    model = seeded(PerSampleNet)
    ddp_check(lambda x: model(x), batch(), batch(), start_method="spawn")
"""

EXPECTED_FAILURES = {
    "test_a_branch_only_parameter": [
        "E*UnusedParameters: under DistributedDataParallel(find_unused_parameters=False), 2 of 6 "
        "parameters of RoutedRefineNet got no gradient on some ranks, so DDP's gradient "
        "reduction cannot finish:",
        "E*refine.weight, refine.bias: unused on rank 1 (steps 1, 2, 3): decision #1 at "
        "*models.py:* `if hard.any():` in step 1: rank 0 True, rank 1 False (used on rank 0, not "
        "on rank 1)",
        "E*DDP's own error (rank *, step 2): RuntimeError: Expected to have finished reduction in "
        "the prior iteration before starting a new one. ...",
        "E*- DistributedDataParallel(model, find_unused_parameters=True): DDP then searches the "
        "autograd graph for unused parameters at every step; on this model: * ms per step with it "
        "against * ms with the rewrite that touches every parameter (* ms; CPU time * against * "
        "ms, * ms; medians of 30 steps of the slowest rank); checked here: the ranks then agree "
        "with one process on the concatenated batch",
        "E*- or touch every parameter in every step*0.0 * sum(p.sum() for p in "
        "module.parameters())*",
    ],
    "test_a_loop_decided_by_each_rank_around_an_all_reduce": [
        "E*CollectiveMismatch: the ranks called collectives differently in step 1's forward: "
        "collective #1 is dist.all_reduce at helpers.py:* `dist.all_reduce(scale)`",
        "E*rank 0 called dist.all_reduce at helpers.py:* as #1",
        "E*rank 1 made no #1: it finished with 0",
        "E*Each rank's batch alone (a process group of one, where a collective never waits) calls "
        "dist.all_reduce at helpers.py:* 3 times on rank 0, 0 times on rank 1.",
        "E*The ranks part at decision #1 at helpers.py:* `while h.abs().mean() > 1.0:`: rank 0 "
        "True, rank 1 False*",
        "E*Under DDP this hangs until the process group's timeout*",
    ],
    "test_buffers_kept_per_rank": [
        "E*RanksDisagree: the ranks decide differently for the same samples: on rank 0's batch, "
        "run by every rank after the 3 steps, decision #1 at helpers.py:* `out = torch.relu(*` is "
        "True on rank 0 and False on rank 1: their state differs: buffer running (with "
        "broadcast_buffers=False each rank keeps its own buffers*",
    ],
    "test_a_decision_on_the_whole_batch": [
        "E*GradientMismatch: after the all-reduce of step 1, DDP's gradient differs from one "
        "process on the concatenated batch, which DDP stands for:",
        "E*grad of linear.weight: * of 64 elements differ beyond rtol=0.0001, atol=1e-05 for "
        "torch.float32*",
        "E*cause: decision #1 at *models.py:* `if h.mean() > 0:`: one process *, rank 0 True, "
        "rank 1 False. The forward decides on the whole batch*",
    ],
    "test_static_graph_with_a_branch_only_parameter": [
        "E*StaticGraphUnsafe: static_graph=True, but the parameters used change between ranks or "
        "steps: refine.weight unused on rank 1 (steps 1, 2, 3); refine.bias unused on rank 1 "
        "(steps 1, 2, 3)*use find_unused_parameters=True instead",
    ],
    "test_nccl_without_gpus": [
        "E*ValueError: ddp_check: backend='nccl' is not usable here: *",
    ],
    "test_one_step": [
        "E*ValueError: ddp_check: steps=1 is not allowed: expected an int >= 2 (DDP reports a "
        "reduction left unfinished at the next step)",
    ],
    "test_a_temp_root_that_is_no_folder": [
        "E*ValueError: ddp_check: temp_root='no/such/folder' is not allowed: expected None or an "
        "existing folder",
    ],
    "test_spawned_ranks_of_a_lambda": [
        "E*TypeError: ddp_check: start_method='spawn': the model, inputs, loss_fn and optimizer "
        "must then pickle, and they do not (*). Define the model's class and any function at "
        "module level*",
    ],
}


REMEDY_FAILS = """
import torch
from helpers import *


class RefinesTheWholeBatch(RoutedRefineNet):
    \"\"\"RoutedRefineNet that refines every row when one row needs it: the decision is
    the batch's, so each rank's half decides for itself, not as the whole batch would.\"\"\"

    def forward(self, x):
        h = self.encoder(x)
        if (h.norm(dim=-1) > self.threshold).any():
            h = h + torch.tanh(self.refine(h))
        return self.head(h)


def test_the_remedy_fails_too(ddp_check):
    ddp_check(seeded(RefinesTheWholeBatch), batch(3.0), batch(0.1))


def test_rows_routed_one_by_one(ddp_check):
    ddp_check(seeded(RoutedRefineNet), batch(3.0), batch(0.1), find_unused_parameters=True)
"""


def test_the_failure_a_remedy_runs_into_is_printed_whole(plugin_pytester):
    result = run_session(plugin_pytester, REMEDY_FAILS, helpers=HELPERS)
    result.assert_outcomes(passed=1, failed=1)
    expected = {
        "test_the_remedy_fails_too": [
            "E*UnusedParameters: under DistributedDataParallel(find_unused_parameters=False), "
            "2 of 6 parameters of RefinesTheWholeBatch got no gradient on some ranks*",
            "E*- DistributedDataParallel(model, find_unused_parameters=True): DDP then searches "
            "the autograd graph for unused parameters at every step; on this model: *; checked "
            "here, and then:",
            "E*      GradientMismatch: after the all-reduce of step 1, DDP's gradient differs from "
            "one process on the concatenated batch, which DDP stands for:",
            "E*        grad of *: * elements differ beyond rtol=*",
            "E*        cause: decision #1 at test_session.py:* `if (h.norm(dim=-1) > "
            "self.threshold).any():`: one process *, rank 0 True, rank 1 False*",
            "E*- or touch every parameter in every step*",
        ]
    }
    assert_failures(result, expected)
    assert_no_internals(result)


def test_models_that_scale_pass_and_failing_ranks_are_ended(plugin_pytester):
    result = run_session(plugin_pytester, PASSING, "-v", helpers=HELPERS)
    result.assert_outcomes(passed=16)
    result.stdout.fnmatch_lines(
        [
            "ddp_check RoutedRefineNet: 2 ranks (gloo, cpu), 3 steps, DDP options: "
            "find_unused_parameters=True: gradients after the all-reduce equal on every rank bit "
            "for bit and within rtol=0.0001, atol=1e-05 of one process on the concatenated batch; "
            "same decisions on every rank for the same samples; start-up * s, * ms per checked "
            "step",
            "  rank 0: *models.py:* `if hard.any():`: True x3",
            "  rank 1: *models.py:* `if hard.any():`: False x3",
            "  find_unused_parameters=True is needed: unused refine.weight, refine.bias on rank 1 "
            "(steps 1, 2, 3)",
            "  find_unused_parameters=True: * ms per step with it against * ms with the rewrite "
            "that touches every parameter *",
            "  static_graph=True would not be safe: *",
        ],
        consecutive=False,
    )


def test_each_planted_bug_fails_with_its_cause(plugin_pytester):
    result = run_session(plugin_pytester, FAILING, helpers=HELPERS)
    result.assert_outcomes(failed=len(EXPECTED_FAILURES))
    assert_failures(result, EXPECTED_FAILURES)
