"""The generated ``train --accumulate N``: N micro-batches of ``--batch-size`` per optimizer step.

The sampler yields each optimizer step's whole batch (``--batch-size`` x N samples, the
samples and noise of a ``--batch-size`` x N run) and the trainer cuts it into
micro-batches, each loss weighted by its share of the samples, so a step's gradient is
the whole batch's up to float rounding, and positions, checkpoints and stops count
optimizer steps. Runs are real subprocesses (``torchrun`` with 2 gloo processes too);
a stop is a real SIGTERM sent between two micro-batches of a step.

`DynamicNet` decides from its whole batch how often to run its block (``if
h.abs().mean() < self.tolerance:``), so a micro-batch of 16 may loop another number
of times than the batch of 64 it is part of: on the default data (``--noise 0.05``)
34 of the 48 steps of ``test_accumulated_steps_equal_one_batch_of_all_their_samples``'s
run have a micro-batch that decides otherwise, and the weights end 0.02 apart. With
``--noise 3`` every sample's activations are large, every batch and micro-batch runs
the block 4 times, and the two runs agree up to rounding. ``train`` compares the
decisions of the first step's micro-batches with the whole batch's and warns when
they differ: that warning is checked on both data sets.
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import module_environment
from training import (
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
    usage_error,
)

BASE = ("--device", "cpu", "--samples", "1024", "--epochs", "3")
# Each sample's activations large enough that DynamicNet always runs its block 4 times.
AGREEING = ("--noise", "3")
ACCUMULATED = ("--batch-size", "16", "--accumulate", "4")
WHOLE = ("--batch-size", "64")
# The two runs' weights differ by float rounding only: the step's loss is a sum of four
# weighted means instead of one mean, about 1e-7 relative in each gradient, and Adam's
# update (lr x m / sqrt(v)) changes by about as much relative to its size, lr = 1e-3:
# measured, the 48 steps end at most 3e-8 apart. 1e-5, a hundredth of one step's size,
# leaves room for that, and is 2,000 times below the 0.02 that other branches make.
TOLERANCE = 1e-5

# A ``sitecustomize``: at this process's $MID_STEP-th forward of DynamicNet with
# gradients on (a micro-batch of training: the check of the first step's decisions
# runs without), SIGTERM to itself, in the middle of the step's accumulation.
MID_STEP = """
    import os
    import signal

    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    forwards = 0


    def before_forward(module, args):
        global forwards
        if type(module).__name__ == "DynamicNet" and torch.is_grad_enabled():
            forwards += 1
            if forwards == int(os.environ["MID_STEP"]):
                os.kill(os.getpid(), signal.SIGTERM)


    register_module_forward_pre_hook(before_forward)
"""

WARNING = re.compile(
    r"warning: --accumulate 4: in the first step, micro-batch \d \(16 samples\) decided "
    r"(True|False) at decision #\d, \S*models\.py:\d+ "
    r"\(`if h\.abs\(\)\.mean\(\) < self\.tolerance:`\), where the whole batch \(64 samples\) "
    r"decided (True|False): the model decides per micro-batch, so a step's gradient is not "
    r"that of one batch of 64"
)


def run(project: Path, directory: Path, *args: str) -> str:
    result = train(project, *BASE, *args, "--run-dir", str(directory))
    assert result.returncode == 0, result.stderr
    return result.stderr


def largest_difference(a: dict, b: dict) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][name] - b["model"][name]).abs().max().item() for name in a["model"])


def test_accumulated_steps_equal_one_batch_of_all_their_samples(
    train_module, default_project: Path, tmp_path: Path
) -> None:
    config = train_module.Config
    launch = train_module.Launch()
    accumulated = train_module.epoch_batches(config(batch_size=16, accumulate=4), launch)
    whole = train_module.epoch_batches(config(batch_size=64), launch)
    assert len(accumulated) == len(whole) == 8192 // 64
    for epoch in (0, 1):
        for step in (0, 77, 127):
            assert torch.equal(accumulated.key(epoch, step).indices, whole.key(epoch, step).indices)

    stderr = run(default_project, tmp_path / "accumulated", *AGREEING, *ACCUMULATED)
    assert "warning" not in stderr
    run(default_project, tmp_path / "whole", *AGREEING, *WHOLE)
    a, b = checkpoint(tmp_path / "accumulated"), checkpoint(tmp_path / "whole")
    assert (a["global_step"], a["run"]["accumulate"], b["run"]["accumulate"]) == (48, 4, 1)
    assert a["global_step"] == b["global_step"] == 48  # optimizer steps: 1024 / 64 x 3
    assert largest_difference(a, b) <= TOLERANCE
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    rows_a, rows_b = metrics(tmp_path / "accumulated"), metrics(tmp_path / "whole")
    assert [row["step"] for row in rows_a] == [row["step"] for row in rows_b] == ["16", "32", "48"]

    # On the default data micro-batches loop otherwise than their batch: other weights.
    stderr = run(default_project, tmp_path / "deciding", *ACCUMULATED)
    assert WARNING.search(stderr), stderr
    run(default_project, tmp_path / "deciding-whole", *WHOLE)
    other = checkpoint(tmp_path / "deciding"), checkpoint(tmp_path / "deciding-whole")
    assert largest_difference(*other) > 100 * TOLERANCE


def test_stop_between_micro_batches_finishes_the_step_and_resumes_bitwise(
    default_project: Path, tmp_path: Path
) -> None:
    """SIGTERM at the first micro-batch of step 41 (of 96): the step's second micro-batch
    and its optimizer step still run, the checkpoint holds step 41, and the resumed run
    ends bitwise equal to the uninterrupted one."""
    args = ("--batch-size", "16", "--accumulate", "2")  # 32 samples a step, 32 steps an epoch
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(default_project, whole, *args)
    stopper = plant(tmp_path / "plant", MID_STEP)
    environ = module_environment(default_project, path=(stopper,), MID_STEP=str(2 * 40 + 1))
    stopped = train(default_project, *BASE, *args, "--run-dir", str(split), env=environ)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    saved = checkpoint(split)
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (1, 9, 41)
    message, command = stopped.stderr.splitlines()[-2:]
    assert message == (
        f"stopped by SIGTERM at epoch 2, step 9/32 (step 41 of the run); "
        f"checkpoint {split / 'latest.pt'}"
    )
    # --resume takes --batch-size and --accumulate from the checkpoint: not printed
    assert command == (
        f"resume with: python -m dynamic_model.train --device cpu --epochs 3 "
        f"--run-dir {split} --resume"
    )
    resumed = run_printed(default_project, command.removeprefix("resume with: "))
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(checkpoint(split), checkpoint(whole))
    assert reproducible(metrics(split)) == reproducible(metrics(whole))


def ddp_reference(train_module, config, world_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """The weights of ``config``'s run under torchrun with ``world_size`` processes,
    computed in this process: each optimizer step adds every process's micro-batches'
    gradients and divides by ``world_size`` (DDP's average), from the same data. And
    the steps where DynamicNet's block ran in some process's earlier micro-batches
    only, never in a last one (where DDP's all-reduce finds it unused)."""
    torch.manual_seed(config.seed)
    model = train_module.build_model()
    runs: list[int] = []  # the micro-batch (from 0) of each run of the block
    model.block.register_forward_hook(lambda *_: runs.append(micro_index))
    only_before_the_last = 0
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    inputs, labels = train_module.synthetic_data(config.samples, config.seed)
    data = train_module.SyntheticBatches(inputs, labels, noise=config.noise, seed=config.seed)
    shares = [
        train_module.epoch_batches(config, train_module.Launch(rank=rank, world_size=world_size))
        for rank in range(world_size)
    ]
    for epoch in range(config.epochs):
        for share in shares:
            share.set_position(epoch)
        for keys in zip(*shares, strict=True):
            optimizer.zero_grad(set_to_none=True)
            runs.clear()
            for key in keys:
                micros = train_module.micro_batches(*data[key], config.batch_size)
                for micro_index, micro in enumerate(micros):  # noqa: B007 (read by the hook)
                    train_module.micro_loss(model, micro, contextlib.nullcontext()).backward()
            last = config.accumulate - 1
            only_before_the_last += bool(runs) and last not in runs
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad /= world_size
            optimizer.step()
    return model.state_dict(), only_before_the_last


def test_torchrun_accumulates_every_process_s_micro_batches(
    train_module, default_project: Path, tmp_path: Path
) -> None:
    """2 processes, 2 micro-batches each: DDP all-reduces once a step (``no_sync`` before)
    and the weights are those of the same accumulation done in one process, to rounding.

    On this data the block is skipped by some micro-batches and not others: in some
    steps a process runs it only in its first micro-batch and neither process in its
    second, the one whose backward all-reduces, so the gradient kept from ``no_sync``
    must still reach the average (``find_unused_parameters``)."""
    args = ("--device", "cpu", "--samples", "512", "--batch-size", "16", "--epochs", "2")
    directory = tmp_path / "run"
    result = torchrun(default_project, *args, "--accumulate", "2", "--run-dir", str(directory))
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("epoch ")]
    assert "8/8" in progress[0]  # 512 samples in 2 shares of 256: 8 steps of 2 x 16
    saved = checkpoint(directory)
    assert saved["global_step"] == 16
    config = train_module.Config(samples=512, batch_size=16, epochs=2, accumulate=2, device="cpu")
    expected, only_before_the_last = ddp_reference(train_module, config, world_size=2)
    assert only_before_the_last > 0
    assert largest_difference(saved, {"model": expected}) <= TOLERANCE


def test_accumulate_zero_is_refused(train_module, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert usage_error(train_module, capsys, "--accumulate", "0") == (
        "argument --accumulate: must be a positive integer, got '0'"
    )
    assert list(tmp_path.iterdir()) == []


def test_resume_with_another_accumulate_warns(default_project: Path, finished_run: Path) -> None:
    args = ("--device", "cpu", "--samples", "1024", "--batch-size", "32", "--accumulate", "2")
    result = train(
        default_project, *args, "--epochs", "2", "--run-dir", str(finished_run), "--resume"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == (
        f"warning: {finished_run / 'latest.pt'} was trained with accumulate 1 and this run "
        "uses 2: training continues, but not bit for bit as an uninterrupted run would"
    )
    assert " 16/16 " in result.stderr  # 1024 samples, 2 x 32 a step
    assert checkpoint(finished_run)["run"]["accumulate"] == 2


def test_a_nan_in_a_micro_batch_stops_the_step_and_replays(
    default_project: Path, tmp_path: Path
) -> None:
    """``--detect-nonfinite`` looks at the whole step (its summed loss and gradients)
    once, before the optimizer's step; the bundle's replay cuts the batch into the same
    micro-batches, and reproduces the NaN."""
    bug = plant(tmp_path / "bug", SQRT_OF_A_NEGATIVE)
    run = tmp_path / "run"
    args = (*BASE, "--batch-size", "16", "--accumulate", "2", "--detect-nonfinite")
    environ = module_environment(default_project, path=(bug,))
    result = train(default_project, *args, "--run-dir", str(run), env=environ)
    assert result.returncode == 1, result.stderr
    stopped = re.search(
        r"error: training stopped before epoch 1, step (\d+)/32 \(step \d+ of the run\): the "
        r"loss was nan and the gradients were not finite; the step was not applied",
        result.stderr,
    )
    assert stopped, result.stderr
    assert "The batch: samples [" in result.stderr
    assert "(32 samples; every process's are in step.json)" in result.stderr  # 2 x 16
    replayed = run_printed(
        default_project, replay_line(result.stderr), PYTHONPATH=f"{bug}:{default_project / 'src'}"
    )
    assert replayed.returncode == 1, replayed.stderr
    assert replayed.stderr.rstrip().endswith(
        f"reproduced: step {stopped[1]} of the run (epoch 1), rank 0's 32 samples, on cpu is "
        "not finite"
    )


def test_fp16_scales_every_micro_batch_and_steps_the_scaler_once(
    train_module, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In this process, with ``torch.amp.GradScaler("cpu")`` standing in for CUDA's (the
    command refuses fp16 on the CPU; the scaler's code is the same): one scaler step
    per optimizer step, the same scale, and weights within float16's rounding of the
    whole batch's. Measured 1.6e-5 apart after 48 steps: autocast rounds activations to
    float16 (about 5e-4 relative), which reaches the gradients whatever the batch; 1e-4
    is a tenth of one Adam step, 200 times below what other branches make."""
    scaler_steps = []
    step = torch.amp.GradScaler.step

    def counted(self, *args, **kwargs):
        scaler_steps.append(self.get_scale())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "step", counted)

    def run(directory: Path, **settings) -> dict:
        directory.mkdir()  # what prepare_run_dir does before train
        config = train_module.Config(
            device="cpu", samples=1024, epochs=3, noise=3.0, precision="fp16",
            run_dir=directory, **settings,
        )  # fmt: skip
        with train_module.stop_signals() as stop:
            train_module.train(config, train_module.Launch(), torch.device("cpu"), stop=stop)
        return checkpoint(directory)

    accumulated = run(tmp_path / "accumulated", batch_size=16, accumulate=4)
    assert len(scaler_steps) == 48
    whole = run(tmp_path / "whole", batch_size=64)
    assert len(scaler_steps) == 96
    assert accumulated["scaler"] == whole["scaler"]
    assert largest_difference(accumulated, whole) <= 10 * TOLERANCE
