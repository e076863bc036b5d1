"""``train --detect-nonfinite``: a finite run is unchanged bit for bit; the first step with a
NaN or inf stops the run with its origin, a bundle, and a replay command that reproduces it.

The NaNs are planted the way users make them: a ``sqrt`` of a value that goes negative
for a few samples of the data (so the first NaN comes at one step, in one batch, on one
rank), a backward-only NaN (``sqrt`` at 0), a learning rate so large that an optimizer
step makes the weights non-finite from finite gradients. Every command the stop prints
is run as printed.
"""

from __future__ import annotations

import io
import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, module_environment
from training import (
    EPOCHS,
    SMALL,
    SQRT_OF_A_NEGATIVE,
    assert_bitwise_equal,
    checkpoint,
    metrics,
    plant,
    replay_line,
    reproducible,
    run_printed,
    torchrun,
    train,
)

# Finite forward, NaN backward: the gradient of sqrt at 0 is inf, and times 0, NaN.
SQRT_AT_ZERO = f"""
    import torch
    from {DEFAULT_PACKAGE} import models

    _forward = models.DynamicNet.forward


    def forward_with_a_bug(self, x):
        out = _forward(self, x)
        return out + torch.sqrt(out[:, :1] * 0.0)
"""
SQRT_AT_ZERO += "\n    models.DynamicNet.forward = forward_with_a_bug\n"

STOP = f"python -m {DEFAULT_PACKAGE}.train: error: training stopped before "


def train_planted(project: Path, bug: Path, *args: str):
    """``train`` with the ``sitecustomize`` in ``bug`` loaded first."""
    return train(project, *args, env=module_environment(project, path=(bug,)))


def test_a_finite_run_is_unchanged_bit_for_bit(default_project: Path, reference: Path, tmp_path):
    run = tmp_path / "run"
    result = train(
        default_project, *SMALL, "--epochs", EPOCHS, "--run-dir", str(run), "--detect-nonfinite"
    )
    assert result.returncode == 0, result.stderr
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))
    assert not list(run.glob("nonfinite-step-*"))


def test_a_nan_in_one_batch_stops_before_its_step_with_the_origin(
    default_project: Path, tmp_path: Path
):
    bug = plant(tmp_path / "bug", SQRT_OF_A_NEGATIVE)
    run = tmp_path / "run"
    result = train_planted(
        default_project,
        bug,
        *SMALL,
        "--epochs",
        EPOCHS,
        "--run-dir",
        str(run),
        "--detect-nonfinite",
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(STOP))
    stopped = re.match(
        r".*before epoch 1, step (\d+)/32 \(step (\d+) of the run\): the loss was nan and the "
        r"gradients were not finite; the step was not applied, the weights are those before it$",
        lines[first],
    )
    assert stopped, lines[first]
    step = int(stopped[2])
    assert step > 1  # not the first batch: the NaN needs one of the rare samples
    assert re.fullmatch(
        r"Origin, in the forward: NaN made by sqrt of -\d\.\d+ at element \[\d+, 0\] "
        r"\(torch\.float32\): the square root of a negative number, forward in the model "
        r"\(DynamicNet\) at sitecustomize\.py:10",
        lines[first + 1],
    ), lines[first + 1]
    assert lines[first + 2] == (
        "    10: spread = torch.sqrt(12.0 - x.abs().amax(dim=1, keepdim=True))"
    )
    bundle = run / f"nonfinite-step-{step}"
    record = json.loads((bundle / "step.json").read_text())
    assert (record["epoch"], record["step"], record["global_step"]) == (0, step - 1, step - 1)
    (rank,) = record["ranks"]
    assert rank["loss"] == "nan"
    assert len(rank["indices"]) == 32
    assert rank["origin"][0] == lines[first + 1]
    shown = ", ".join(map(str, rank["indices"][:8]))
    assert f"The batch: samples [{shown}, ...] (32 samples; every process's are in step.json)" in (
        lines
    )
    # The checkpoint of the bundle is the state before the step: a run without the bug
    # stopped after step - 1 steps holds the same weights.
    state = torch.load(bundle / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["global_step"]) == (0, step - 1, step - 1)
    assert not (run / "latest.pt").exists()  # no checkpoint of a NaN state was written

    command = replay_line(result.stderr)
    assert command == f"python -m {DEFAULT_PACKAGE}.replay {bundle}"
    replayed = run_printed(default_project, command, PYTHONPATH=f"{bug}:{default_project / 'src'}")
    assert replayed.returncode == 1, replayed.stderr
    assert replayed.stderr.startswith(
        "NonFiniteRun: finite_check TrainingStep: the forward and backward of input set 0 "
        "made non-finite values: output has 1 NaN of 1 elements (first nan)"
    ), replayed.stderr
    assert lines[first + 1].replace("in the model", "in model") in replayed.stderr
    assert replayed.stderr.rstrip().endswith(
        f"reproduced: step {step} of the run (epoch 1), rank 0's 32 samples, on cpu is not finite"
    )


def test_without_detection_the_same_bug_only_shows_as_a_diverged_epoch(
    default_project: Path, tmp_path: Path
):
    bug = plant(tmp_path / "bug", SQRT_OF_A_NEGATIVE)
    run = tmp_path / "run"
    result = train_planted(
        default_project,
        bug,
        *SMALL,
        "--epochs",
        "1",
        "--run-dir",
        str(run),
    )
    assert result.returncode == 1
    assert "the loss of epoch 1 is nan" in result.stderr
    assert "Origin" not in result.stderr
    assert not list(run.glob("nonfinite-step-*"))


def test_a_nan_born_in_backward_is_named_there(default_project: Path, tmp_path: Path):
    bug = plant(tmp_path / "bug", SQRT_AT_ZERO)
    run = tmp_path / "run"
    result = train_planted(
        default_project,
        bug,
        *SMALL,
        "--run-dir",
        str(run),
        "--detect-nonfinite",
        "stop",
    )
    assert result.returncode == 1, result.stderr
    assert (
        "before epoch 1, step 1/32 (step 1 of the run): the gradients were not finite; the "
        "step was not applied" in result.stderr
    )
    origin = re.search(r"^Origin, in the backward: (.*)$", result.stderr, re.M)
    assert origin, result.stderr
    assert re.fullmatch(
        r"NaN made by div of 0, -?0 at element \[\d+, 0\] \(torch\.float32\): 0/0, backward "
        r"\(SqrtBackward0\) of sqrt in the model \(DynamicNet\) at sitecustomize\.py:10",
        origin[1],
    ), origin[1]


def test_weights_an_optimizer_step_made_non_finite_are_named(default_project: Path, tmp_path):
    run = tmp_path / "run"
    result = train(
        default_project, *SMALL, "--lr", "1e30", "--run-dir", str(run), "--detect-nonfinite"
    )
    assert result.returncode == 1, result.stderr
    first = next(line for line in result.stderr.splitlines() if line.startswith(STOP))
    assert re.search(
        r"\(step (\d+) of the run\): block\.0\.weight holds \d+ NaN of 1024 elements .*: the "
        r"optimizer step of step \d+ of the run made them so from finite gradients",
        first,
    ), first
    replayed = run_printed(default_project, replay_line(result.stderr))
    assert replayed.returncode == 1
    assert replayed.stderr.startswith(
        "NonFiniteInput: finite_check TrainingStep: parameter model.block.0.weight already holds"
    ), replayed.stderr


def test_under_torchrun_every_rank_stops_at_the_same_step_naming_the_one_that_saw_it(
    default_project: Path, tmp_path: Path
):
    bug = plant(tmp_path / "bug", SQRT_OF_A_NEGATIVE)
    run = tmp_path / "run"
    result = torchrun(
        default_project, *SMALL, "--epochs", EPOCHS, "--run-dir", str(run), "--detect-nonfinite",
        path=(bug,),
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("error: training stopped before") == 1  # rank 0 reports
    stopped = re.search(r"the loss was nan on rank (\d)", result.stderr)
    assert stopped, result.stderr
    rank = int(stopped[1])
    assert f"On rank {rank}:\nOrigin, in the forward: NaN made by sqrt" in result.stderr
    (bundle,) = run.glob("nonfinite-step-*")
    record = json.loads((bundle / "step.json").read_text())
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert record["ranks"][rank]["origin"] is not None
    assert record["ranks"][1 - rank]["origin"] is None
    assert record["ranks"][1 - rank]["loss"] != "nan"
    command = replay_line(result.stderr)
    assert command.endswith(f"--rank {rank}") if rank else command.endswith(bundle.name)
    replayed = run_printed(default_project, command, PYTHONPATH=f"{bug}:{default_project / 'src'}")
    assert replayed.returncode == 1, replayed.stderr
    assert f"rank {rank}'s 32 samples" in replayed.stderr
    other = [*shlex.split(command)[:4], "--rank", str(1 - rank)]
    replayed = run_printed(default_project, shlex.join(other))
    assert replayed.returncode == 0, replayed.stderr
    assert "not reproduced" in replayed.stdout


def test_a_bad_mode_is_refused(default_project: Path):
    result = train(default_project, *SMALL, "--detect-nonfinite", "warn")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"python -m {DEFAULT_PACKAGE}.train: error: argument --detect-nonfinite: must be stop "
        "or off, got 'warn'"
    )


@pytest.fixture
def fp16_on_the_cpu(train_module, monkeypatch: pytest.MonkeyPatch):
    """``train``'s fp16 on the CPU, where the command refuses it (no CUDA here).

    A stand-in for CUDA's fp16: ``torch.amp.GradScaler("cpu")`` runs the same code as
    on CUDA for what the overflow count depends on: a step whose scaled gradients hold
    an inf or NaN is skipped (the optimizer's ``step`` is not called) and the scale is
    halved (``backoff_factor``), doubled after ``growth_interval`` (2000) clean steps,
    and ``get_scale()`` reads it; autocast's float16 matmuls overflow at 65504 on both.
    """

    def run(forward, tmp_path: Path) -> tuple[float | None, str]:
        monkeypatch.setattr(train_module.DynamicNet, "forward", forward)
        config = train_module.Config(
            device="cpu", samples=2048, batch_size=64, epochs=1, precision="fp16",
            run_dir=tmp_path, detect_nonfinite="stop",
        )  # fmt: skip
        log = io.StringIO()
        device = torch.device("cpu")
        with train_module.stop_signals() as stop:
            try:
                loss = train_module.train(config, train_module.Launch(), device, log=log, stop=stop)
            except train_module.NotFiniteStep as stopped:
                return None, f"{log.getvalue()}{stopped}"
        return loss, log.getvalue()

    return run


def test_fp16_overflow_skips_are_counted_not_errors(train_module, fp16_on_the_cpu, tmp_path):
    forward = train_module.DynamicNet.forward

    def large_logits(self, x):  # scaled by 65536, their gradients overflow float16 at first
        return forward(self, x) * 1000.0

    loss, log = fp16_on_the_cpu(large_logits, tmp_path)
    assert loss is not None, log
    assert math.isfinite(loss), log
    skipped = re.search(r"GradScaler skipped (\d+) step\(s\) for a float16 overflow", log)
    assert skipped, log
    assert 1 <= int(skipped[1]) < 24
    assert not list(tmp_path.glob("nonfinite-step-*"))


def test_fp16_skips_without_end_stop_the_run(train_module, fp16_on_the_cpu, tmp_path):
    forward = train_module.DynamicNet.forward

    def nan_in_backward(self, x):
        out = forward(self, x)
        return out + torch.sqrt(out[:, :1] * 0.0)

    loss, report = fp16_on_the_cpu(nan_in_backward, tmp_path)
    assert loss is None
    lines = report.splitlines()
    assert lines[0] == (
        "training stopped before epoch 1, step 24/32 (step 24 of the run): GradScaler skipped "
        "24 steps in a row: no scale makes these gradients finite; the step was not applied, "
        "the weights are those before it"
    )
    assert lines[1].startswith("Origin, in the backward: NaN made by div of 0, ")
    assert "(SqrtBackward0) of sqrt in the model (DynamicNet) at " in lines[1]
    assert (tmp_path / "nonfinite-step-24" / "step.json").is_file()
