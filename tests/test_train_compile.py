"""The generated ``train --compile``: the model through ``torch.compile``, run for real on the CPU.

`DynamicNet` breaks torch.compile's graph at its data-dependent ``if`` inside a loop,
so torch.compile runs its whole forward eagerly, compiles nothing, and says so: the
first step's report is checked for that, and the ``eager`` backend's run is bitwise
equal to the run without ``--compile``, which makes the resumes across ``--compile``
on and off checkable bit for bit. A ``sitecustomize`` replaces the forward with a
branch-free one (the block always 4 times) for the run that compiles a graph, with
``aot_eager``: it traces and differentiates like inductor without generating code.
Inductor itself takes about 60 s on 2 CPU cores for this one graph (forward and
backward), too slow for this suite; the checks of the compiled run are the same.
"""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import module_environment
from training import (
    AFTER_STEP,
    EPOCHS,
    SMALL,
    assert_bitwise_equal,
    checkpoint,
    metrics,
    plant,
    reproducible,
    train,
    usage_error,
)

EAGER = ("--compile", "--compile-backend", "eager")

BRANCH_FREE = """
    import torch

    from dynamic_model import models


    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        for _ in range(self.max_steps):
            h = h + 0.5 * self.block(h)
        return self.head(h)


    models.DynamicNet.forward = forward
"""


def compile_report(stderr: str) -> list[str]:
    """The lines of the first step's report under --compile, its timing left out."""
    lines = stderr.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith("torch.compile ")]
    head, took, rest = lines[start].partition(" the first step took ")
    assert took, lines[start]
    seconds, _, counts = rest.partition(" s, compiling included; ")
    assert float(seconds) > 0
    report = [f"{head} {counts}"]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        report.append(line)
    return report


def test_compiled_with_the_eager_backend_is_bitwise_the_uncompiled_run(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    run = tmp_path / "run"
    result = train(default_project, *SMALL, "--epochs", EPOCHS, *EAGER, "--run-dir", str(run))
    assert result.returncode == 0, result.stderr
    models = default_project / "src" / "dynamic_model" / "models.py"
    source = "if h.abs().mean() < self.tolerance:"
    line = next(
        number
        for number, text in enumerate(models.read_text().splitlines(), 1)
        if text.strip() == source
    )
    assert compile_report(result.stderr) == [
        "torch.compile (backend eager, mode default): 0 graph(s) compiled, 1 graph break(s)",
        f"  graph break at src/dynamic_model/models.py:{line}: `{source}`: Data-dependent "
        "branching",
        "  nothing was compiled: the model runs eagerly, as without --compile",
        "  (the compile_check fixture names each break's cause and a rewrite that removes it)",
    ]
    assert_bitwise_equal(checkpoint(run), checkpoint(reference))
    assert reproducible(metrics(run)) == reproducible(metrics(reference))


def stopped_at_40(project: Path, run: Path, plants: Path, *args: str) -> None:
    stopper = plant(plants, AFTER_STEP)
    environ = module_environment(project, path=(stopper,), AFTER_STEP_DO="SIGTERM", AFTER_STEP="40")
    stopped = train(project, *SMALL, "--epochs", EPOCHS, *args, "--run-dir", str(run), env=environ)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert checkpoint(run)["global_step"] == 40


def test_resume_across_compile_on_and_off_is_bitwise(
    default_project: Path, tmp_path: Path, reference: Path
) -> None:
    """A checkpoint holds the module's own weights (no ``_orig_mod.`` prefix from
    torch.compile's wrapper): a run stopped with --compile resumes without, and the
    other way round, and both end as the uninterrupted run without --compile."""
    for name, before, after in (("on-off", EAGER, ()), ("off-on", (), EAGER)):
        run = tmp_path / name
        stopped_at_40(default_project, run, tmp_path / f"plant-{name}", *before)
        assert list(checkpoint(run)["model"]) == list(checkpoint(reference)["model"])
        resumed = train(
            default_project, *SMALL, "--epochs", EPOCHS, *after, "--run-dir", str(run), "--resume"
        )
        assert resumed.returncode == 0, resumed.stderr
        assert ("torch.compile (backend eager" in resumed.stderr) == bool(after)
        assert_bitwise_equal(checkpoint(run), checkpoint(reference))


def test_a_branch_free_model_compiles_and_resumes_without_compile(
    default_project: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    branch_free = plant(tmp_path / "branch-free", BRANCH_FREE)
    stopper = plant(tmp_path / "branch-free-stop", BRANCH_FREE + AFTER_STEP)  # one sitecustomize
    args = (*SMALL, "--epochs", "2", "--run-dir", str(run))
    environ = module_environment(
        default_project, path=(stopper,), AFTER_STEP_DO="SIGTERM", AFTER_STEP="40"
    )
    backend = ("--compile", "--compile-backend", "aot_eager")
    stopped = train(default_project, *args, *backend, env=environ)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert compile_report(stopped.stderr) == [
        "torch.compile (backend aot_eager, mode default): 1 graph(s) compiled, 0 graph break(s)"
    ]
    names = list(checkpoint(run)["model"])
    assert names == [
        "encoder.weight", "encoder.bias", "block.0.weight", "block.0.bias",
        "head.weight", "head.bias",
    ]  # fmt: skip
    environ = module_environment(default_project, path=(branch_free,))
    resumed = train(default_project, *args, "--resume", env=environ)
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint(run)["global_step"] == 64


def test_bad_compile_flags(train_module, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for argv, message in (
        (["--compile-backend", "eager"], "argument --compile-backend: needs --compile"),
        (["--compile-mode", "max-autotune"], "argument --compile-mode: needs --compile"),
        (
            ["--compile", "--compile-backend", "eager", "--compile-mode", "max-autotune"],
            "argument --compile-mode: max-autotune is a mode of the inductor backend, and "
            "--compile-backend is eager",
        ),
        (
            ["--compile", "--compile-mode", "fast"],
            "argument --compile-mode: must be one of default, reduce-overhead, max-autotune, "
            "max-autotune-no-cudagraphs, got 'fast'",
        ),
    ):
        assert usage_error(train_module, capsys, *argv) == message
    refused = usage_error(train_module, capsys, "--compile", "--compile-backend", "inductr")
    assert refused.startswith("argument --compile-backend: must be a torch.compile backend (")
    assert refused.endswith(", got 'inductr'")
    assert ", inductor, " in refused
    assert list(tmp_path.iterdir()) == []
