"""``<project>-launch slurm`` without a cluster: the script it writes, and what it refuses.

The script is checked as text, with ``bash -n`` and shellcheck; the real SLURM cluster
in `test_slurm` runs it. Bad command lines are checked in-process through ``main()``:
one ``error:`` line naming the option, the value and what is allowed, exit status 2,
nothing written.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_PACKAGE

LAUNCH = f"{DEFAULT_PACKAGE}.launch"
PROG = f"python -m {LAUNCH} slurm"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"


CLUSTER = "tests"
GPU_COUNT = (
    "must be a number of GPUs, N or TYPE:N as the cluster names its GPUs (4, a100:4; 0 for none)"
)
SETUP_LINE = (
    "must be one non-empty shell line of printable text (no newline or other control character "
    "but tabs)"
)


@pytest.fixture
def launch(
    default_project: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
):
    """The launch module, imported from the default project, run from an empty folder,
    with an ``scontrol`` on PATH that answers ``show config`` as cluster `CLUSTER` does."""
    client = tmp_path_factory.mktemp("slurm-client")
    scontrol = client / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'ClusterName             = {CLUSTER}'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{client}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.syspath_prepend(str(default_project / "src"))
    monkeypatch.chdir(tmp_path)
    return importlib.import_module(LAUNCH)


def dry_run(launch, capsys, *argv: str) -> str:
    assert launch.main(["slurm", "--dry-run", *argv]) == 0
    return capsys.readouterr().out


def assert_valid_bash(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if SHELLCHECK.exists():
        # Warnings and errors: "expressions don't expand in single quotes" is what quoting
        # data is for.
        checked = subprocess.run(
            [str(SHELLCHECK), "--severity=warning", str(path)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout
    path.unlink()


def test_gpu_job_script(launch, capsys, tmp_path: Path) -> None:
    script = dry_run(
        launch, capsys,
        "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "32", "--time", "1-00:00:00",
        "--partition", "gpu", "--account", "proj", "--sbatch=--qos=high",
        "--", "--epochs", "100", "--checkpoint-every", "500",
    )  # fmt: skip
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        f"#SBATCH --job-name={DEFAULT_PACKAGE}",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        f"#SBATCH --output={tmp_path}/runs/slurm-{CLUSTER}-%j/slurm-%j.out",
        "#SBATCH --open-mode=append",
    ]
    assert f"cd {tmp_path}" in lines
    assert f'run_dir={tmp_path}/runs/slurm-{CLUSTER}-"$SLURM_JOB_ID"' in lines
    assert "export OMP_NUM_THREADS=8  # --cpus-per-task 32 shared by 4 process(es)" in lines
    command = script.split("\nsrun ", 1)[1].split(" &\n", 1)[0].replace("\\\n", " ").split()
    assert command == [
        "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--gpus-per-node=4", "--cpus-per-task=32",
        sys.executable, "-m", "torch.distributed.run",
        '--nnodes="$SLURM_JOB_NUM_NODES"', "--nproc-per-node=4",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$head_address:$port"', '--rdzv-id="$SLURM_JOB_ID"',
        "-m", f"{DEFAULT_PACKAGE}.train", "--device", "cuda", "--run-dir", '"$run_dir"',
        '${resume:+"$resume"}', "--epochs", "100", "--checkpoint-every", "500",
    ]  # fmt: skip
    assert "--nv" not in script  # no container asked for
    assert_valid_bash(script, tmp_path)
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_cpu_job_and_fixed_run_folder(launch, capsys, tmp_path: Path) -> None:
    script = dry_run(
        launch, capsys, "--gpus-per-node", "0", "--nproc-per-node", "3", "--run-dir", "runs/a"
    )
    assert "#SBATCH --gpus-per-node" not in script
    assert f"#SBATCH --output={tmp_path}/runs/a/slurm-%j.out" in script
    assert f"\nrun_dir={tmp_path}/runs/a\n" in script
    assert "--nproc-per-node=3" in script
    assert "--device cpu" in script
    # No --cpus-per-task: the task's CPUs, as SLURM tells them at run time (`test_omp_threads`).
    assert "threads=$((${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}} / 3))" in script
    assert "bash -c" not in script  # no --setup: torchrun is srun's command
    assert_valid_bash(script, tmp_path)


HOSTILE = "a b $(touch PWNED) `touch PWNED` 'q' \"d\" #c %j 100% ;x"


def test_hostile_values_are_quoted(launch, capsys, tmp_path: Path) -> None:
    """Shell and sbatch syntax in paths, an image name and an extra sbatch option stays
    text: quoted for bash, quoted and escaped for sbatch's ``#SBATCH`` parser (which
    takes a backslash as an escape, quotes as grouping and ``#`` as a comment)."""
    image = tmp_path / f"{HOSTILE}.sif"
    image.write_text("")
    script = dry_run(
        launch, capsys,
        "--gpus-per-node", "1", "--run-dir", HOSTILE, "--apptainer", str(image),
        f"--sbatch=--comment={HOSTILE}",
    )  # fmt: skip
    quoted = HOSTILE.replace('"', '\\"')
    assert f'#SBATCH --comment="{quoted}"' in script
    output = f"{tmp_path}/{HOSTILE}".replace("%", "%%").replace('"', '\\"')
    assert f'#SBATCH --output="{output}/slurm-%j.out"' in script
    assert "run_dir='" in script
    assert "exec --nv --bind" in script
    assert_valid_bash(script, tmp_path)
    # Run what bash makes of the script's quoted words: each is one argument, unchanged.
    quoted_run_dir = script.split("\nrun_dir=", 1)[1].split("\n", 1)[0]
    words = subprocess.run(
        ["bash", "-c", f'printf "%s\\n" {quoted_run_dir}'],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert words == f"{tmp_path}/{HOSTILE}\n"
    assert not list(tmp_path.rglob("PWNED"))


def test_containers(launch, capsys, tmp_path: Path) -> None:
    image = tmp_path / "dev.sif"
    image.write_text("")
    src = Path(launch.__file__).resolve().parent.parent
    apptainer = dry_run(launch, capsys, "--gpus-per-node", "2", "--apptainer", "dev.sif")
    assert f"export PYTHONPATH={src}" in apptainer
    assert f"binds={src},{tmp_path}" in apptainer
    assert f'"$runtime" exec --nv --bind "$binds" {image} python3 -m torch.distributed.run' in (
        apptainer
    )
    assert_valid_bash(apptainer, tmp_path)
    pyxis = dry_run(launch, capsys, "--gpus-per-node", "0", "--container-image", "nvcr.io#me/dev:1")
    assert "--container-image='nvcr.io#me/dev:1'" in pyxis
    assert f"--container-mounts={src}:{src},{tmp_path}:{tmp_path}" in pyxis
    assert "--no-container-entrypoint" in pyxis
    (tmp_path / "dev.sqsh").write_text("")  # a file: given to pyxis as a path
    squashfs = dry_run(launch, capsys, "--gpus-per-node", "0", "--container-image", "dev.sqsh")
    assert f"--container-image={tmp_path}/dev.sqsh " in squashfs
    assert "\n    python3 -m torch.distributed.run" in pyxis
    assert "--nv" not in pyxis
    assert_valid_bash(pyxis, tmp_path)


def usage_error(launch, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["slurm", *argv])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"usage: {PROG} ")
    assert lines[-1].startswith(f"{PROG}: error: ")
    return lines[-1].removeprefix(f"{PROG}: error: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "argument --nodes: must be a positive integer, got '0'"),
        (["--gpus-per-node", "-1"], f"argument --gpus-per-node: {GPU_COUNT}, got '-1'"),
        (["--gpus-per-node", "a100:0"], f"argument --gpus-per-node: {GPU_COUNT}, got 'a100:0'"),
        (["--gpus-per-node", "4:4"], f"argument --gpus-per-node: {GPU_COUNT}, got '4:4'"),
        (["--gpus", "a100"], f"argument --gpus: {GPU_COUNT}, got 'a100'"),
        (
            ["--gres", "a100:4"],
            "argument --gres: must be gpu:N or gpu:TYPE:N with N >= 1 (gpu:4, gpu:a100:4), got "
            "'a100:4'",
        ),
        (
            ["--gres", "gpu:0"],
            "argument --gres: must be gpu:N or gpu:TYPE:N with N >= 1 (gpu:4, gpu:a100:4), got "
            "'gpu:0'",
        ),
        (
            ["--gpus-per-node", "4", "--gpus", "8"],
            "argument --gpus: not allowed with argument --gpus-per-node",
        ),
        (
            ["--gres", "gpu:4", "--gpus-per-node", "0"],
            "argument --gpus-per-node: not allowed with argument --gres",
        ),
        (
            ["--nodes", "4", "--gpus", "a100:6"],
            "argument --gpus: a100:6 does not divide evenly among --nodes 4: torchrun starts as "
            "many processes, one per GPU, on each node; give --gpus-per-node",
        ),
        (
            ["--gres", "gpu:a100:2", "--nproc-per-node", "4"],
            "argument --nproc-per-node: with --gres gpu:a100:2 each node runs one process per GPU "
            "(2); --nproc-per-node is for CPU jobs (--gpus-per-node 0)",
        ),
        (
            ["--gpus-per-node", "0", "--sbatch=--gres=nvme:1,gpu:2"],
            "argument --sbatch: --gres=nvme:1,gpu:2 asks for GPUs: give them with "
            "--gpus-per-node, --gpus or --gres, from which the number of training processes per "
            "node follows",
        ),
        (
            ["--sbatch=--gpus-per-task=1"],
            "argument --sbatch: --gpus-per-task=1 asks for GPUs: give them with --gpus-per-node, "
            "--gpus or --gres, from which the number of training processes per node follows",
        ),
        (
            ["--sbatch=--cpus-per-task=8"],
            "argument --sbatch: --cpus-per-task=8: give it as --cpus-per-task, from which srun's "
            "CPUs and OMP_NUM_THREADS follow",
        ),
        (["--setup", " "], f"argument --setup: {SETUP_LINE}, got ' '"),
        (
            ["--setup", "module load a\nrm -rf x"],
            f"argument --setup: {SETUP_LINE}, got 'module load a\\nrm -rf x'",
        ),
        (["--setup", "a\x00b"], f"argument --setup: {SETUP_LINE}, got 'a\\x00b'"),
        (["--setup", "echo \u202eoops"], f"argument --setup: {SETUP_LINE}, got 'echo \\u202eoops'"),
        (
            ["--setup", "if true; then", "--setup", "echo"],
            "argument --setup: the setup lines are not complete bash: bash: -c: line 3: syntax "
            "error: unexpected end of file",
        ),
        (
            ["--setup-file", "missing.sh"],
            "argument --setup-file: cannot read missing.sh: No such file or directory",
        ),
        (
            ["--time", "25h"],
            "argument --time: must be a time limit as SLURM writes it (MINUTES, "
            "HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]]...) above 0, got '25h'",
        ),
        (
            ["--time", "0"],
            "argument --time: must be a time limit as SLURM writes it (MINUTES, "
            "HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]]...) above 0, got '0'",
        ),
        (
            ["--partition", "gpu;rm"],
            "argument --partition: must be a partition name or a comma-separated list of them, "
            "got 'gpu;rm'",
        ),
        (
            ["--account", "a b"],
            "argument --account: must be a SLURM name (letters, digits, and _ . + - after the "
            "first), got 'a b'",
        ),
        (
            ["--requeue-before", "0"],
            "argument --requeue-before: must be a number of seconds from 1 to 65535, got '0'",
        ),
        (
            ["--time", "5", "--requeue-before", "300"],
            "argument --requeue-before: 300 s is not less than --time 5 (300 s)",
        ),
        (
            ["--gpus-per-node", "2", "--nproc-per-node", "3"],
            "argument --nproc-per-node: with --gpus-per-node 2 each node runs one process per "
            "GPU (2); --nproc-per-node is for CPU jobs (--gpus-per-node 0)",
        ),
        (
            ["--sbatch=--qos=a\nsrun evil"],
            "argument --sbatch: must be one long sbatch option, as --name or --name=value on one "
            "line, got '--qos=a\\nsrun evil'",
        ),
        (
            ["--run-dir", "a\nb"],
            "argument --run-dir: must be a non-empty path without control characters or "
            "backslashes, got 'a\\nb'",
        ),
        (["--apptainer", "missing.sif"], "argument --apptainer: {cwd}/missing.sif does not exist"),
        (
            ["--apptainer", "docker://a", "--container-image", "b"],
            "argument --container-image: not allowed with argument --apptainer",
        ),
        (
            ["--epochs", "5"],
            f"unrecognized arguments: --epochs 5 (train's arguments go after --: {PROG} "
            "--nodes 2 -- --epochs 10)",
        ),
        (
            ["--", "--epochs", "0"],
            "train arguments (after --): argument --epochs: must be a positive integer, got '0'",
        ),
        (["--", "--bogus"], "train arguments (after --): unrecognized arguments: --bogus"),
        (
            ["--", "--run-dir", "x"],
            "train arguments (after --): --run-dir: the run folder is launch slurm's --run-dir "
            "(give it before --)",
        ),
        (
            ["--", "--res"],
            "train arguments (after --): --resume: the job script adds it when the run folder "
            "holds a checkpoint",
        ),
        (
            ["--", "--device", "auto"],
            "train arguments (after --): --device: the job script sets it: cuda with "
            "--gpus-per-node, cpu with 0",
        ),
    ],
)
def test_bad_values(launch, capsys, tmp_path: Path, argv, message) -> None:
    assert usage_error(launch, capsys, *argv) == message.format(cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_container_mounts_cannot_hold_separators(
    launch, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "a,b"
    folder.mkdir()
    monkeypatch.chdir(folder)
    (folder / "dev.sif").write_text("")
    assert usage_error(launch, capsys, "--dry-run", "--apptainer", "dev.sif") == (
        f"argument --apptainer: {folder} must be mounted into the container, and a path with "
        "',' or ':' cannot be (they separate mounts)"
    )


def test_without_sbatch(launch, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert launch.main(["slurm", "--gpus-per-node", "0"]) == 1
    assert capsys.readouterr().err == (
        f"{PROG}: error: sbatch is not on PATH: submit from a machine with the SLURM client (a "
        "login node), or add --dry-run to print the script\n"
    )
    assert list(tmp_path.iterdir()) == []
    assert launch.main(["slurm", "--gpus-per-node", "0", "--dry-run"]) == 0  # needs no SLURM
    # Without scontrol the cluster's name is unknown: the script says so where it goes.
    assert f'#SBATCH --output="{tmp_path}/runs/slurm-<cluster>-%j/slurm-%j.out"' in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 5400),
        ("1:30", 90),
        ("2:00:05", 7205),
        ("2-0", 172800),
        ("1-2:3", 93780),
        ("1-2:3:4", 93784),
    ],
)
def test_time_limits(launch, text: str, seconds: int) -> None:
    assert launch.time_seconds(text) == seconds


def test_shared_filesystem_check(launch) -> None:
    here = socket.gethostname()
    assert launch.filesystem_type(Path("/dev/shm/not/there")) == "tmpfs"
    assert launch.filesystem_type(Path("/proc/self")) == "proc"
    run = Path("/scratch/run")
    assert launch.unshared_run_folder(run, "nfs4", {"node1", "node2"}) is None
    assert launch.unshared_run_folder(run, "lustre", None) is None
    assert launch.unshared_run_folder(run, "ext4", {here}) is None  # the cluster is this machine
    assert launch.unshared_run_folder(run, "ext4", {here, "node2"}) == (
        f"{run} is on a filesystem local to this machine (ext4 on {here}), which nodes on node2 "
        "cannot reach; choose a folder on a shared filesystem (home, project or scratch space: "
        "NFS, Lustre, GPFS, BeeGFS...)"
    )
    assert "which the nodes cannot reach" in launch.unshared_run_folder(run, "tmpfs", None)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_requeue_trap_keeps_waiting_for_the_training(launch, capsys, tmp_path: Path) -> None:
    """The script's wait loop: a trapped signal interrupts ``wait``, which must not end the
    script while the training still runs (it is writing its checkpoint)."""
    script = dry_run(launch, capsys, "--gpus-per-node", "0")
    wait_loop = script.split("training=$!\n", 1)[1]
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "trap 'echo trapped' USR1\n"
        "(sleep 1; exit 7) &\n"
        "training=$!\n"
        "(sleep 0.2; kill -USR1 $$) &\n" + wait_loop
    )
    result = subprocess.run(["bash", str(probe)], capture_output=True, text=True, timeout=30)
    assert result.stdout == "trapped\n"
    assert result.returncode == 7  # the training's status, after the trap


@pytest.mark.parametrize(
    ("answer", "job_id"),
    [
        ("1234\n", 1234),
        ("1234;tests\n", 1234),  # --parsable on a cluster of a federation
        ("Submitted batch job 77\n", 77),  # a site's sbatch without --parsable
        ("Submitted batch job 77 on cluster tests\n", 77),
        ("sbatch: jobs in partition gpu are billed per GPU hour\n1234\n", 1234),  # a wrapper
        ("1234\nsbatch: remember to cite the cluster\n", 1234),
        ("sbatch: accepted\n", None),
        ("1234 jobs queued\n", None),
        ("", None),
    ],
)
def test_job_id_in_sbatch_answers(launch, answer: str, job_id: int | None) -> None:
    assert launch.job_id_of(answer) == job_id


@pytest.mark.parametrize("character", ["\\", "\n", "\t"])
def test_paths_that_an_sbatch_line_cannot_hold(
    launch, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, character: str
) -> None:
    """The log's folder goes into ``#SBATCH --output``: a working directory with a
    backslash (sbatch would leave ``%j`` in the name, and the job fail after "submitted")
    or a control character (a newline ends the line) is refused, as a --run-dir is; a
    --run-dir elsewhere is taken from there."""
    folder = tmp_path / f"a{character}b"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert usage_error(launch, capsys, "--dry-run", "--gpus-per-node", "0") == (
        f"the working directory: {str(folder / 'runs')!r} holds {character!r} and goes into the "
        "script's #SBATCH --output line, which ends at a newline and loses its %j after a "
        "backslash; allowed: any character but backslashes and control characters"
    )
    assert usage_error(launch, capsys, "--dry-run", "--run-dir", "run") == (
        f"argument --run-dir: {str(folder / 'run')!r} holds {character!r} and goes into the "
        "script's #SBATCH --output line, which ends at a newline and loses its %j after a "
        "backslash; allowed: any character but backslashes and control characters"
    )
    elsewhere = tmp_path / "run"
    script = dry_run(launch, capsys, "--gpus-per-node", "0", "--run-dir", str(elsewhere))
    assert f"#SBATCH --output={elsewhere}/slurm-%j.out" in script
    assert sorted(path.name for path in tmp_path.iterdir()) == [folder.name]


@pytest.mark.parametrize(
    ("argv", "option", "processes"),
    [
        ([], "--gpus-per-node=1", 1),
        (["--gpus-per-node", "4"], "--gpus-per-node=4", 4),
        (["--gpus-per-node", "a100:4"], "--gpus-per-node=a100:4", 4),
        (["--gpus-per-node", "1g.10gb:1"], "--gpus-per-node=1g.10gb:1", 1),  # a MIG slice
        (["--nodes", "2", "--gpus", "a100:8"], "--gpus-per-node=a100:4", 4),
        (["--gpus", "2"], "--gpus-per-node=2", 2),
        (["--gres", "gpu:a100:4"], "--gres=gpu:a100:4", 4),
        (["--gres", "gpu:2", "--nproc-per-node", "2"], "--gres=gpu:2", 2),
    ],
)
def test_gpu_forms(launch, capsys, argv: list[str], option: str, processes: int) -> None:
    """Each way of asking for GPUs: one sbatch line, the same option for srun's step, and
    one torchrun process per GPU of a node. ``--gpus`` (the whole job's) is written per
    node, with a comment saying so, as torchrun starts as many on each node."""
    script = dry_run(launch, capsys, *argv)
    assert [line for line in script.splitlines() if line.startswith("#SBATCH --g")] == [
        f"#SBATCH {option}"
    ]
    assert f"\nsrun --ntasks-per-node=1 --kill-on-bad-exit=1 {option} \\\n" in script
    assert f" --nproc-per-node={processes} \\\n" in script
    assert " --device cuda " in script
    converted = [line for line in script.splitlines() if line.startswith("# --gpus ")]
    if "--gpus" in argv:
        nodes = argv[1] if argv[0] == "--nodes" else "1"
        assert converted == [
            f"# --gpus {argv[-1]} on {nodes} node(s): {option}, as torchrun starts as many "
            "processes on each."
        ]
    else:
        assert converted == []


def test_a_cpu_build_of_torch_with_gpus(
    launch, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The torch the job runs is this interpreter's, and the test environment's is a CPU
    build: a GPU job is refused (the default of 1 GPU per node too), --dry-run says it as
    a warning, --force submits anyway (here it then stops at the missing sbatch). A CPU
    job, a container (the image's torch) and CUDA or ROCm builds are not refused."""
    import torch

    assert torch.version.cuda is None, "the test environment's torch is a CPU build"

    def message(option: str, value: str) -> str:
        return (
            f"argument {option}: {value} asks for GPUs, but the torch the job runs, "
            f"{torch.__version__} in {sys.executable}, is a CPU build (torch.version.cuda is "
            "None): train's --device cuda fails on every node; install a CUDA build of torch "
            "there, give --gpus-per-node 0 for a CPU job, or add --force to submit anyway"
        )

    assert usage_error(launch, capsys, "--gpus", "a100:2") == message("--gpus", "a100:2")
    assert usage_error(launch, capsys) == message("--gpus-per-node", "1 (the default)")
    assert launch.main(["slurm", "--dry-run", "--gres", "gpu:2"]) == 0
    shown = capsys.readouterr()
    assert shown.err == f"{PROG}: warning: {message('--gres', 'gpu:2')}\n"
    assert "#SBATCH --gres=gpu:2\n" in shown.out
    assert list(tmp_path.iterdir()) == []
    client = os.environ["PATH"].split(os.pathsep)[0]  # scontrol alone: no sbatch
    monkeypatch.setenv("PATH", client)
    assert launch.main(["slurm", "--gpus-per-node", "2", "--force"]) == 1
    assert capsys.readouterr().err.startswith(f"{PROG}: error: sbatch is not on PATH")

    def warned(*argv: str) -> str:
        assert launch.main(["slurm", "--dry-run", *argv]) == 0
        return capsys.readouterr().err

    assert warned("--gpus-per-node", "0") == ""
    (tmp_path / "dev.sif").write_text("")
    assert warned("--apptainer", "dev.sif") == ""
    assert warned("--container-image", "nvcr.io#me/dev:1") == ""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert warned() == ""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert warned() == ""


SITE_FILE = """\
# the site's own lines
END_OF_SETUP() { echo "a line that is the heredoc's end: $1" >> order.txt; }
END_OF_SETUP
\tprintf '%s\\n' "from the file, indented: $(echo ok)" >> order.txt
echo '$(touch PWNED)' "\\$HOME" >> order.txt
"""


def step_of(script: str) -> str:
    """The script's lines that define the step each node runs (``$step``)."""
    return script[script.index("IFS= read -r -d '' step") : script.index("\nsrun ")]


def test_setup_lines(launch, capsys, tmp_path: Path) -> None:
    """--setup and --setup-file lines, in their order, verbatim in a quoted heredoc: the
    step, run here in bash as srun runs it on each node, runs them in order (nothing in
    them expanded by the batch shell, a line equal to the heredoc's end included) and
    then the command after it (torchrun's, here printf)."""
    (tmp_path / "site.sh").write_text(SITE_FILE)
    first, last = 'echo "first: $0" > order.txt', "export MARK='$(touch PWNED)'"
    script = dry_run(
        launch, capsys, "--gpus-per-node", "0",
        "--setup", first, "--setup-file", "site.sh", "--setup", last,
    )  # fmt: skip
    lines = SITE_FILE.splitlines()
    assert step_of(script).splitlines() == [
        "IFS= read -r -d '' step <<'END_OF_SETUP_' || true",
        "set -e",
        first,
        *lines,
        last,
        'exec "$@"',
        "END_OF_SETUP_",
    ]
    assert '\nsrun --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n    bash -c "$step" setup \\\n' in (
        script
    )
    assert_valid_bash(script, tmp_path)
    probe = tmp_path / "probe.sh"
    probe.write_text(
        f'set -eu\n{step_of(script)}\nbash -c "$step" setup printf "%s|" torchrun "a b"\n'
    )
    ran = subprocess.run(["bash", str(probe)], capture_output=True, text=True, cwd=tmp_path)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "torchrun|a b|", "")
    assert (tmp_path / "order.txt").read_text() == (
        "first: setup\n"
        "a line that is the heredoc's end: \n"
        "from the file, indented: ok\n"
        "$(touch PWNED) $HOME\n"
    )
    assert not list(tmp_path.rglob("PWNED"))


def test_a_failing_setup_line_ends_the_step(launch, capsys, tmp_path: Path) -> None:
    """``set -e`` in the step: torchrun does not start after a setup line that failed
    (``module load`` of a module the node lacks), nor do the lines after it."""
    script = dry_run(
        launch, capsys, "--gpus-per-node", "0",
        "--setup", "touch before", "--setup", "false", "--setup", "touch after",
    )  # fmt: skip
    probe = tmp_path / "probe.sh"
    probe.write_text(f'{step_of(script)}\nbash -c "$step" setup touch torchrun\n')
    ran = subprocess.run(["bash", str(probe)], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["before", "probe.sh"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"module load a\r\nmodule load b\r\n",
            "site.sh, line 1: 'module load a\\r' holds a control character (Windows line ends: "
            "convert with dos2unix); each line must be printable text (tabs allowed)",
        ),
        (
            b"module load a\nmodule\x00load b\n",
            "site.sh, line 2: 'module\\x00load b' holds a control character; each line must be "
            "printable text (tabs allowed)",
        ),
        (b"module load \xe9\n", "site.sh is not UTF-8 text (invalid continuation byte)"),
        (None, "cannot read site.sh: Is a directory"),
    ],
)
def test_bad_setup_files(launch, capsys, tmp_path: Path, content: bytes | None, message) -> None:
    """One line naming the file (and the line); nothing written but the file."""
    site = tmp_path / "site.sh"
    site.mkdir() if content is None else site.write_bytes(content)
    assert usage_error(launch, capsys, "--dry-run", "--setup-file", "site.sh") == (
        f"argument --setup-file: {message}"
    )
    assert list(tmp_path.iterdir()) == [site]


@pytest.mark.parametrize(
    ("environment", "processes", "threads"),
    [
        ({}, 1, 1),  # no CPUs told: SLURM's default of 1 per task
        ({"SLURM_CPUS_ON_NODE": "16"}, 4, 4),  # the step has the node's 16 CPUs of the job
        ({"SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "64"}, 4, 8),
        ({"SLURM_CPUS_ON_NODE": "2"}, 4, 1),  # fewer CPUs than processes: at least 1
    ],
)
def test_omp_threads_from_slurm(
    launch, capsys, environment: dict[str, str], processes: int, threads: int
) -> None:
    """Without --cpus-per-task, OMP_NUM_THREADS comes from what SLURM tells the batch
    shell, shared by the node's processes (run here in bash, with those variables)."""
    script = dry_run(launch, capsys, "--gpus-per-node", "0", "--nproc-per-node", str(processes))
    made = re.compile("threads=|export OMP_NUM_THREADS=")
    lines = [line for line in script.splitlines() if made.match(line)]
    assert len(lines) == 2, lines
    shell = "set -eu\n" + "\n".join(lines) + '\necho "$OMP_NUM_THREADS"'
    ran = subprocess.run(
        ["bash", "-c", shell], env={"PATH": os.environ["PATH"], **environment},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert ran.stdout == f"{threads}\n"


README_COMMAND = (
    "--nodes", "2", "--gpus-per-node", "a100:4", "--cpus-per-task", "32", "--time", "24:00:00",
    "--partition", "gpu", "--setup", "module load cuda/12.4",
    "--setup", "source .venv/bin/activate", "--", "--epochs", "100", "--checkpoint-every", "1000",
)  # fmt: skip


def test_readme_shows_the_script_launch_writes(
    launch, capsys, default_project: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The script on the generated docs' launch page is what --dry-run prints for its command, on a
    cluster named ``hpc``, run in /home/me/<project> with its .venv (the date and the
    token aside): a change to the script fails here until the page shows it."""
    section = (default_project / "docs" / "commands" / "launch.md").read_text()
    shown = section.split("\n```bash\n", 1)[1].split("\n```\n", 1)[0] + "\n"
    command = section.split("\n```console\n$ ", 1)[1].split("\n", 1)[0]
    assert command == f"{default_project.name}-launch slurm {shlex.join(README_COMMAND)}"
    hpc = tmp_path.parent / f"{tmp_path.name}-hpc"
    hpc.mkdir()
    (hpc / "scontrol").write_text("#!/bin/sh\necho 'ClusterName = hpc'\n")
    (hpc / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{hpc}{os.pathsep}{os.environ['PATH']}")
    home = f"/home/me/{default_project.name}"
    script = dry_run(launch, capsys, *README_COMMAND)
    script = script.replace(sys.executable, f"{home}/.venv/bin/python")
    script = script.replace(str(tmp_path), home)

    def normalized(text: str) -> str:
        text = re.sub(r"^# Written by .*$", "# Written by", text, count=1, flags=re.M)
        return re.sub(r"^token=[0-9a-f]{32}$", "token=", text, count=1, flags=re.M)

    assert normalized(shown) == normalized(script)
