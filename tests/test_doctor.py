"""The generated project's ``<package>-doctor``, run for real on this machine (no GPU).

Whole runs go through ``python -m dynamic_model.doctor`` in a subprocess, with planted
failures: ``PYTORCH_JIT=0``, a wrong derivative of ``**`` and gradient recording
switched off (both planted by a ``sitecustomize`` module, as a broken image would).
The checks are also called one by one, with facts this machine cannot produce (an
old driver, a GPU this build has no kernels for, a small ``/dev/shm``) and against
real servers on 127.0.0.1 for the dev container's sshd and Jupyter.
"""

from __future__ import annotations

import http.server
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_PACKAGE, module_environment, run_module

DOCTOR = f"{DEFAULT_PACKAGE}.doctor"
# Variables that change what the doctor reports; each test sets the ones it needs.
UNSET = {"PYTORCH_JIT": None, "PROJECT_SSH_PORT": None, "PROJECT_JUPYTER_PORT": None}
needs_no_usable_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a usable GPU"
)


def doctor(project: Path, *args: str, path: tuple[Path, ...] = (), **env: str | None):
    environ = module_environment(project, path=path, **{**UNSET, **env})
    return run_module(project, DOCTOR, *args, env=environ)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The table's rows: check -> (status, detail). Check names may contain spaces."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail"], stdout
    detail_at = lines[0].index("detail")
    status_at = lines[0].index("status")
    table = {}
    for line in lines[1:-1]:
        table[line[:status_at].strip()] = (line[status_at:detail_at].strip(), line[detail_at:])
    return table


@pytest.fixture
def checks(default_project: Path, monkeypatch: pytest.MonkeyPatch):
    """The default project's doctor module, for calling checks one by one."""
    monkeypatch.syspath_prepend(str(default_project / "src"))
    return importlib.import_module(DOCTOR)


@needs_no_usable_cuda
def test_cpu_only_machine_passes_with_a_gpu_warning(default_project: Path) -> None:
    result = doctor(default_project)
    assert result.returncode == 0, result.stdout + result.stderr
    table = rows(result.stdout)
    assert table["GPU"][0] == "warn"
    assert "CPU-only build" in table["GPU"][1]
    assert "--require-gpu" in table["GPU"][1]
    for check in ("python", "torch", "eager mode", "TorchScript", "autograd cpu"):
        assert table[check][0] == "ok", (check, table[check])
    assert table["deterministic mode"] == ("ok", "two runs bitwise equal on cpu")
    assert "[4, 6]" in table["autograd cpu"][1]
    assert "sshd" not in table  # not inside the dev container
    assert "jupyter" not in table
    assert result.stdout.splitlines()[-1].startswith("0 failed, ")


@needs_no_usable_cuda
def test_require_gpu_fails_with_the_reason(default_project: Path) -> None:
    result = doctor(default_project, "--require-gpu")
    assert result.returncode == 1
    status, detail = rows(result.stdout)["GPU"]
    assert status == "FAIL"
    assert "CPU-only build (torch.version.cuda is None)" in detail
    assert result.stdout.splitlines()[-1].startswith("1 failed, ")


@needs_no_usable_cuda
def test_json_parses_and_matches_the_exit_status(default_project: Path) -> None:
    passing = doctor(default_project, "--json")
    failing = doctor(default_project, "--json", "--require-gpu")
    report, failed = json.loads(passing.stdout), json.loads(failing.stdout)
    assert (passing.returncode, report["ok"], report["require_gpu"]) == (0, True, False)
    assert (failing.returncode, failed["ok"], failed["require_gpu"]) == (1, False, True)
    assert {check["status"] for check in report["checks"]} <= {"ok", "warn", "FAIL"}
    assert [check["check"] for check in report["checks"]][:4] == [
        "python",
        "torch",
        "NVIDIA driver",
        "GPU",
    ]
    assert [c["check"] for c in failed["checks"] if c["status"] == "FAIL"] == ["GPU"]


WRONG_POW = """
    import torch

    _pow = torch.Tensor.__pow__

    class WrongPow(torch.autograd.Function):
        # The planted bug: d/dx x**n computed as x**(n-1), without the factor n.
        @staticmethod
        def forward(ctx, x, exponent):
            ctx.save_for_backward(x)
            ctx.exponent = exponent
            return _pow(x, exponent)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * _pow(x, ctx.exponent - 1), None

    torch.Tensor.__pow__ = lambda self, exponent: WrongPow.apply(self, exponent)
"""
NO_GRAD = """
    import torch

    torch.set_grad_enabled(False)
"""


@pytest.mark.parametrize(
    ("env", "sitecustomize", "failing", "message"),
    [
        pytest.param(
            {"PYTORCH_JIT": "0"},
            None,
            ["TorchScript"],
            "PYTORCH_JIT=0 turns TorchScript off",
            id="jit",
        ),
        pytest.param(
            {},
            WRONG_POW,
            ["autograd cpu"],
            "d/dx conditional_model([2, 3], flag=True) is [2.0, 3.0], expected [4.0, 6.0]",
            id="wrong-gradient",
        ),
        pytest.param(
            {},
            NO_GRAD,
            ["eager mode", "autograd cpu"],  # user code gets no gradients either
            "gradient recording is off",
            id="no-grad",
        ),
    ],
)
def test_planted_failure_exits_non_zero_naming_the_check(
    default_project: Path,
    tmp_path: Path,
    env: dict[str, str],
    sitecustomize: str | None,
    failing: list[str],
    message: str,
) -> None:
    if sitecustomize is not None:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(sitecustomize))
    result = doctor(default_project, path=(tmp_path,), **env)
    assert result.returncode == 1, result.stdout + result.stderr
    table = rows(result.stdout)
    assert message in table[failing[0]][1]
    assert [name for name, (status, _) in table.items() if status == "FAIL"] == failing


@pytest.mark.parametrize("value", ["1", "true"])
def test_pytorch_jit_on_is_fine(default_project: Path, value: str) -> None:
    """``PYTORCH_JIT=1`` leaves TorchScript (and eager mode) on, whatever some guides say."""
    result = doctor(default_project, PYTORCH_JIT=value)
    assert rows(result.stdout)["TorchScript"][0] == "ok"
    assert rows(result.stdout)["eager mode"][0] == "ok"


def test_driver_check(checks) -> None:
    old = checks.check_driver("12.6", "470.57.02")
    assert old.status == "FAIL"
    assert "470.57.02 is older than 525.60.13, the minimum for CUDA 12.6" in old.detail
    assert "update the host's driver to 525.60.13 or newer" in old.detail
    assert checks.check_driver("13.0", "575.51.03").status == "FAIL"
    assert checks.check_driver("13.0", "580.65.06").status == "ok"
    assert checks.check_driver("12.6", "580.95.05").detail == (
        "580.95.05 (CUDA 12.6 needs 525.60.13 or newer)"
    )
    assert checks.check_driver("12.6", None).status == "warn"
    assert checks.check_driver(None, None).status == "ok"
    assert checks.check_driver(None, "580.95.05").detail.startswith("580.95.05, unused")


@pytest.mark.parametrize(
    ("capability", "arch_list", "supported"),
    [
        ((9, 0), ["sm_80", "sm_90"], True),
        ((8, 6), ["sm_80"], True),  # same major, newer minor
        ((8, 0), ["sm_86"], False),  # older minor of the same major
        ((7, 5), ["sm_80", "sm_90", "sm_100", "sm_120"], False),
        ((12, 0), ["sm_90", "sm_100", "sm_120"], True),
        ((10, 0), ["sm_90", "sm_120"], False),  # no sm_100 kernels, no PTX
        ((9, 0), ["sm_90a"], True),  # architecture-specific: exactly 9.0
        ((10, 0), ["sm_90a"], False),
        ((12, 0), ["sm_90", "compute_90"], True),  # PTX is compiled for newer GPUs
        ((8, 9), ["compute_90"], False),
    ],
)
def test_arch_supported(checks, capability, arch_list, supported) -> None:
    assert checks.arch_supported(capability, arch_list) is supported


def test_no_gpu_is_a_warning_unless_required(checks) -> None:
    reason = "no NVIDIA driver found"
    (warning,) = checks.check_gpus(reason, require_gpu=False)
    (failure,) = checks.check_gpus(reason, require_gpu=True)
    assert (warning.status, failure.status) == ("warn", "FAIL")
    assert warning.detail.startswith(reason)
    assert failure.detail == reason


H200_UUID = "aaaaaaaa-1111-2222-3333-444444444444"
P100_UUID = "bbbbbbbb-1111-2222-3333-444444444444"


def test_gpu_rows(checks, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per visible GPU; one this build has no kernels for fails, naming the build."""
    # torch's device properties as the doctor reads them (uuid without the GPU- prefix).
    gpus = [
        types.SimpleNamespace(
            name="NVIDIA H200", total_memory=150_121_168_896, major=9, minor=0, uuid=H200_UUID
        ),
        types.SimpleNamespace(
            name="Tesla P100", total_memory=17_071_734_784, major=6, minor=0, uuid=P100_UUID
        ),
    ]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90"])
    h200, p100 = checks.check_gpus(None, require_gpu=True)
    assert (h200.check, h200.status) == ("GPU 0", "ok")
    assert h200.detail == (
        f"NVIDIA H200, 139.8 GiB, compute capability 9.0, GPU-{H200_UUID}, supported by this build"
    )
    assert (p100.check, p100.status) == ("GPU 1", "FAIL")
    assert p100.detail == (
        f"Tesla P100, 15.9 GiB, compute capability 6.0, GPU-{P100_UUID}: torch "
        f"{torch.__version__} has no "
        "kernels for it (built for sm_75 sm_80 sm_90); install a torch build that supports sm_60"
    )


def test_shm_size(checks, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_statvfs = os.statvfs
    assert checks.check_shm(tmp_path / "missing").status == "warn"

    def docker_default(path):  # 64 MiB, as `docker run` gives without --shm-size
        return os.statvfs_result((4096, 4096, 16384, 16384, 16384, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", docker_default)
    small = checks.check_shm(Path("/dev/shm"))
    assert small.status == "warn"
    assert small.detail.startswith("64 MiB")
    assert "--ipc=host" in small.detail
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    if os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize >= 1 << 30:
        assert checks.check_shm(Path("/dev/shm")).status == "ok"


def test_autograd_check_passes_on_the_cpu(checks) -> None:
    assert checks.gradient_mismatches("cpu") == []


def test_determinism_check_restores_global_state(checks) -> None:
    rng = torch.get_rng_state()
    result = checks.check_determinism(["cpu"])
    assert result.status == "ok"
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_check_that_raises_is_reported_as_its_failure(checks, monkeypatch) -> None:
    def broken_shm():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checks, "check_shm", broken_shm)
    results = {result.check: result for result in checks.run_checks(environ={})}
    assert results["/dev/shm"].status == "FAIL"
    assert results["/dev/shm"].detail == "the check raised OSError: [Errno 5] Input/output error"
    assert results["autograd cpu"].status == "ok"  # the others still ran


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def real_sshd(tmp_path: Path) -> Iterator[int]:
    """OpenSSH's sshd on 127.0.0.1, on a free port; its port."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.access(sshd, os.X_OK) or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH server not installed (apt-get install openssh-server)")
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    port = free_port()
    config = tmp_path / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {key}\nPasswordAuthentication no\n"
        f"PidFile {tmp_path / 'sshd.pid'}\nStrictModes no\n"
    )
    server = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"sshd did not start: {server.stderr.read().decode()}")
                threading.Event().wait(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def http_server() -> Iterator[callable]:
    """``serve(body, status)``: an HTTP server on 127.0.0.1 answering every GET; its port."""
    servers = []

    def serve(body: bytes, status: int = 200) -> int:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_sshd_check_against_real_sshd(checks, real_sshd: int) -> None:
    result = checks.check_sshd({"PROJECT_SSH_PORT": str(real_sshd)})
    assert result.status == "ok"
    assert result.detail.startswith("SSH-2.0-OpenSSH")
    assert result.detail.endswith(f"on port {real_sshd}")


def test_sshd_check_failures(checks, http_server) -> None:
    assert checks.check_sshd({}) is None
    closed = checks.check_sshd({"PROJECT_SSH_PORT": str(free_port())})
    assert closed.status == "FAIL"
    assert "nothing answers on 127.0.0.1:" in closed.detail
    web = checks.check_sshd({"PROJECT_SSH_PORT": str(http_server(b"{}"))})
    assert web.status == "FAIL"
    assert "not with an SSH banner" in web.detail
    bad = checks.check_sshd({"PROJECT_SSH_PORT": "22x"})
    assert (bad.status, bad.detail) == ("FAIL", "PROJECT_SSH_PORT='22x' is not a port number")


def test_jupyter_check(checks, http_server) -> None:
    assert checks.check_jupyter({}) is None
    jupyter = http_server(b'{"version": "2.17.0"}')
    result = checks.check_jupyter({"PROJECT_JUPYTER_PORT": str(jupyter)})
    assert (result.status, result.detail) == ("ok", f"Jupyter server 2.17.0 on port {jupyter}")
    other = checks.check_jupyter({"PROJECT_JUPYTER_PORT": str(http_server(b"<html>", 404))})
    assert other.status == "FAIL"
    assert "is not a Jupyter server (HTTP/1.0 404" in other.detail
    closed = checks.check_jupyter({"PROJECT_JUPYTER_PORT": str(free_port())})
    assert closed.status == "FAIL"
    assert "start JupyterLab" in closed.detail


def test_inside_the_dev_container(default_project: Path, real_sshd: int, http_server) -> None:
    """With the container's variables set, sshd and Jupyter are checked; one down fails the run."""
    jupyter = str(http_server(b'{"version": "2.17.0"}'))
    up = doctor(default_project, PROJECT_SSH_PORT=str(real_sshd), PROJECT_JUPYTER_PORT=jupyter)
    assert up.returncode == 0, up.stdout
    assert rows(up.stdout)["sshd"][0] == rows(up.stdout)["jupyter"][0] == "ok"
    down = doctor(default_project, PROJECT_SSH_PORT=str(free_port()), PROJECT_JUPYTER_PORT=jupyter)
    assert down.returncode == 1
    assert rows(down.stdout)["sshd"][0] == "FAIL"


def test_other_package_name(bake) -> None:
    """Nothing in the commands names the default package."""
    project = bake(project="Graph-Lab")
    for command in ("doctor", "train"):
        result = run_module(project, f"graph_lab.{command}", "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python -m graph_lab.{command}")


def test_gpu_access_names_the_case_it_sees(checks, tmp_path: Path) -> None:
    """Outside a container, GPUs passed into one, or none passed and the switch for it."""
    outside = checks.check_gpu_access(tmp_path, cuda_build=True)
    assert (outside.status, outside.detail) == (
        "ok",
        "not in a container: torch sees this machine's GPUs directly",
    )

    docker = tmp_path / "docker"
    (docker / "dev").mkdir(parents=True)
    (docker / ".dockerenv").touch()
    for device in ("nvidiactl", "nvidia-uvm", "nvidia1", "nvidia0"):
        (docker / "dev" / device).touch()
    passed = checks.check_gpu_access(docker, cuda_build=True)
    assert (passed.status, passed.detail) == (
        "ok",
        "2 GPU(s) passed into this Docker container: /dev/nvidia0, /dev/nvidia1",
    )

    for device in ("nvidia0", "nvidia1"):
        (docker / "dev" / device).unlink()
    missing = checks.check_gpu_access(docker, cuda_build=True)
    assert missing.status == "warn"
    assert missing.detail.startswith("no GPU passed into this Docker container")
    assert "dev.containers.gpuAvailability to all" in missing.detail
    assert "devcontainer up --gpu-availability all" in missing.detail
    # A CPU-only torch needs no GPU: the same case, said without a warning.
    assert checks.check_gpu_access(docker, cuda_build=False).status == "ok"

    podman = tmp_path / "podman"
    (podman / "run").mkdir(parents=True)
    (podman / "run" / ".containerenv").touch()
    on_podman = checks.check_gpu_access(podman, cuda_build=True)
    assert on_podman.status == "warn"
    assert on_podman.detail.startswith("no GPU passed into this Podman container")
    assert '"--device", "nvidia.com/gpu=all"' in on_podman.detail


def test_gpu_access_row_is_in_the_report(default_project: Path) -> None:
    result = doctor(default_project)
    assert "GPU access" in rows(result.stdout)


def test_json_into_a_pipe_whose_reader_left(default_project: Path) -> None:
    """``doctor --json | head``, once head has read its lines and exited: the doctor ends
    quietly with 141 (128 + SIGPIPE, what a program killed by that signal returns), not
    with a BrokenPipeError traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", DOCTOR, "--json"],
        env=module_environment(default_project, **UNSET),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # the reader is gone before the doctor writes (after its checks)
    errors = process.stderr.read().decode()
    assert process.wait() == 128 + signal.SIGPIPE, errors
    assert errors == ""


def test_ctrl_c_during_the_checks(checks, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Ctrl-C while the checks run: one line and 130 (128 + SIGINT), not a traceback."""

    def interrupted(*args: object, **kwargs: object) -> list:
        raise KeyboardInterrupt

    monkeypatch.setattr(checks, "run_checks", interrupted)
    assert checks.main([]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == f"python -m {DOCTOR}: interrupted\n"
