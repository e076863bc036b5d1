"""Check that this environment runs dynamic-graph PyTorch models correctly.

    <project>-doctor                 # a table: check, ok / warn / FAIL, detail
    <project>-doctor --require-gpu   # no usable GPU is a failure, with the reason
    <project>-doctor --json          # the same results for scripts

Exit status 0 when no check FAILs (warnings allowed), 1 when one does, 2 for a bad
command line. Every check is a plain function returning `Result` rows, so each
can be called on its own.

What is a failure and what a warning:

- FAIL: something that makes results wrong or a GPU that is there unusable: a
  wrong gradient, eager mode not in force, ``PYTORCH_JIT=0`` (TorchScript silently
  off), a driver older than torch's CUDA runtime needs, a GPU this torch build has
  no kernels for, a nondeterministic result in deterministic mode, and, inside the
  dev container, sshd or Jupyter not answering.
- warn: no GPU (a failure with ``--require-gpu``), a small ``/dev/shm``, anomaly
  detection left on, deterministic mode that needs ``CUBLAS_WORKSPACE_CONFIG``.

``PYTORCH_JIT`` does not switch eager mode off, whatever some guides say: eager
execution is always on. ``PYTORCH_JIT=0`` makes ``torch.jit.script`` and
``torch.jit.trace`` return the Python code unchanged, so an export to TorchScript
silently exports nothing and ``torch.jit.save`` fails later. It is meant for
debugging TorchScript; left set anywhere else it is a trap, hence a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import gpus
from ._command import command_name, reports_errors
from .models import DynamicNet, conditional_model, forward_with_condition
from .testing.global_state import restore, snapshot

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Result",
    "arch_supported",
    "check_autograd",
    "check_determinism",
    "check_driver",
    "check_eager_mode",
    "check_gpus",
    "check_jupyter",
    "check_python",
    "check_shm",
    "check_sshd",
    "check_torch",
    "check_torchscript",
    "format_table",
    "gradient_mismatches",
    "main",
    "run_checks",
]

PACKAGE = __package__
OK, WARN, FAIL = "ok", "warn", "FAIL"
# Docker's default /dev/shm is 64 MiB; DataLoader workers pass batches through it.
SHM_WARN_BELOW = 1 << 30
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Result:
    check: str
    status: str
    detail: str


def check_python() -> Result:
    return Result("python", OK, f"{platform.python_version()} at {sys.executable}")


def _cudnn_version() -> str | None:
    version = torch.backends.cudnn.version()
    if version is None:
        return None
    # 90100 -> 9.1.0 (cuDNN 9: major * 10000 + minor * 100 + patch; cuDNN 8: * 1000, * 100).
    major, rest = divmod(version, 10000 if version >= 90000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def check_torch() -> Result:
    if torch.version.cuda is None:
        return Result("torch", OK, f"{torch.__version__}, a CPU-only build (no CUDA, no cuDNN)")
    cudnn = _cudnn_version()
    if cudnn is None:
        return Result(
            "torch",
            WARN,
            f"{torch.__version__}, CUDA {torch.version.cuda} build, but cuDNN is missing: "
            "convolutions and RNNs on the GPU fail; reinstall torch with its nvidia-cudnn wheel",
        )
    return Result(
        "torch", OK, f"{torch.__version__}, CUDA {torch.version.cuda} build, cuDNN {cudnn}"
    )


def check_driver(cuda_runtime: str | None, driver: str | None) -> Result:
    """The NVIDIA driver against the minimum for torch's CUDA runtime ``cuda_runtime``."""
    name = "NVIDIA driver"
    found = gpus.check_driver(cuda_runtime, driver)
    if found.status is gpus.DriverStatus.NOT_NEEDED:
        described = f"{driver}, unused" if driver else "none found, none needed"
        return Result(name, OK, f"{described}: torch is a CPU-only build")
    if found.status is gpus.DriverStatus.MISSING:
        return Result(
            name,
            WARN,
            "none found (no nvidia-smi, no /proc/driver/nvidia/version): install the NVIDIA "
            "driver on the host; in a container, start it with --gpus all",
        )
    if found.status is gpus.DriverStatus.MINIMUM_UNKNOWN:
        return Result(name, WARN, f"{driver}; no known minimum for CUDA {cuda_runtime}")
    if found.status is gpus.DriverStatus.TOO_OLD:
        return Result(
            name,
            FAIL,
            f"{driver} is older than {found.minimum}, the minimum for CUDA {cuda_runtime} "
            f"(torch's runtime): update the host's driver to {found.minimum} or newer, or use "
            "a torch build (container image) for an older CUDA",
        )
    return Result(name, OK, f"{driver} (CUDA {cuda_runtime} needs {found.minimum} or newer)")


def arch_supported(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``) has kernels
    for a GPU of compute ``capability``.

    Machine code for ``sm_XY`` runs on capability X.Y and later minors of X; code for an
    architecture-specific target (``sm_90a``) only on exactly that one; PTX
    (``compute_XY``) is compiled when loaded, for X.Y and everything newer.
    """
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
        if match is None:
            continue
        kind, code = match[1], (int(match[2]), int(match[3]))
        if kind == "compute" and code <= capability:
            return True
        if kind == "sm" and match[4] == "a" and code == capability:
            return True
        if (
            kind == "sm"
            and match[4] != "a"
            and code[0] == capability[0]
            and code[1] <= capability[1]
        ):
            return True
    return False


def check_gpus(unavailable_reason: str | None, require_gpu: bool) -> list[Result]:
    """One row per visible GPU (name, memory, capability, kernels in this build), or why none."""
    if unavailable_reason is not None:
        if require_gpu:
            return [Result("GPU", FAIL, unavailable_reason)]
        return [Result("GPU", WARN, f"{unavailable_reason} (--require-gpu makes this a failure)")]
    arch_list = torch.cuda.get_arch_list()
    results = []
    for index in range(torch.cuda.device_count()):
        gpu = gpus.torch_gpu(index)
        capability = gpus.version_tuple(gpu.compute_capability)
        described = gpu.describe()
        if arch_list and not arch_supported(capability, arch_list):
            results.append(
                Result(
                    f"GPU {index}",
                    FAIL,
                    f"{described}: torch {torch.__version__} has no kernels for it (built for "
                    f"{' '.join(arch_list)}); install a torch build that supports "
                    f"sm_{''.join(map(str, capability))}",
                )
            )
        else:
            results.append(Result(f"GPU {index}", OK, f"{described}, supported by this build"))
    return results


def check_eager_mode() -> Result:
    """Autograd records each call's own graph: grad on, no inference mode, no compile or trace."""
    problems = []
    if not torch.is_grad_enabled():
        problems.append("gradient recording is off (torch.set_grad_enabled(False) at start-up)")
    if torch.is_inference_mode_enabled():
        problems.append("inference mode is on")
    if torch.compiler.is_compiling():
        problems.append("running inside torch.compile")
    if torch.jit.is_tracing():
        problems.append("running inside torch.jit.trace")
    if problems:
        return Result("eager mode", FAIL, "; ".join(problems))
    if torch.is_anomaly_enabled():
        return Result(
            "eager mode",
            WARN,
            "on, but anomaly detection is enabled: every backward is several times slower",
        )
    return Result("eager mode", OK, "grad enabled, not compiling or tracing")


def check_torchscript(environ: Mapping[str, str]) -> Result:
    """``PYTORCH_JIT``: off means torch.jit.script/trace silently do nothing."""
    value = environ.get("PYTORCH_JIT")
    enabled = getattr(getattr(torch.jit, "_state", None), "_enabled", True)
    if not enabled:
        return Result(
            "TorchScript",
            FAIL,
            f"PYTORCH_JIT={value} turns TorchScript off: torch.jit.script/trace return the Python "
            "code unchanged and torch.jit.save fails (eager mode is not affected): unset "
            "PYTORCH_JIT unless you are debugging TorchScript",
        )
    setting = f"PYTORCH_JIT={value}" if value is not None else "PYTORCH_JIT unset"
    return Result("TorchScript", OK, f"{setting}: torch.jit.script/trace work")


def gradient_mismatches(device: str) -> list[str]:
    """The seed documents' worked gradients, computed on ``device``; what differs, in words.

    Each value is exact in float32, so any difference is a real error, not rounding.
    """
    mismatches: list[str] = []

    def leaf(value: float | list[float]) -> torch.Tensor:
        return torch.tensor(value, device=device, requires_grad=True)

    def expect(what: str, tensor: torch.Tensor, expected: float | list[float]) -> None:
        grad = tensor.grad
        if grad is None:
            mismatches.append(f"{what} is None, expected {expected}")
        elif not torch.equal(grad.cpu(), torch.tensor(expected)):
            mismatches.append(f"{what} is {grad.tolist()}, expected {expected}")

    def case(run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as error:
            mismatches.append(f"{run.__doc__} raised {type(error).__name__}: {error}")

    def conditional() -> None:
        """conditional_model"""
        x = leaf([2.0, 3.0])
        conditional_model(x, flag=True).backward()
        expect("d/dx conditional_model([2, 3], flag=True)", x, [4.0, 6.0])
        x = leaf([2.0, 3.0])
        conditional_model(x, flag=False).backward()
        expect("d/dx conditional_model([2, 3], flag=False)", x, [12.0, 27.0])

    def accumulation() -> None:
        """backward() twice"""
        x = leaf([2.0, 3.0])
        conditional_model(x, flag=True).backward()
        conditional_model(x, flag=True).backward()
        expect("d/dx after two backward() without zeroing grads", x, [8.0, 12.0])

    def polynomials() -> None:
        """y = w*x**2, y = x**2+3x+1, (w*x+b)**2"""
        x, w = leaf(2.0), leaf(3.0)
        (w * x**2).backward()
        expect("dy/dx of y = w*x**2 at x=2, w=3", x, 12.0)
        expect("dy/dw of y = w*x**2 at x=2, w=3", w, 4.0)
        x = leaf(2.0)
        (x**2 + 3 * x + 1).backward()
        expect("dy/dx of y = x**2 + 3x + 1 at x=2", x, 7.0)
        x, w, b = leaf(2.0), leaf(1.0), leaf(0.5)
        ((w * x + b) ** 2).backward()
        expect("d/dx of (w*x + b)**2 at x=2, w=1, b=0.5", x, 5.0)
        expect("d/dw of (w*x + b)**2 at x=2, w=1, b=0.5", w, 10.0)
        expect("d/db of (w*x + b)**2 at x=2, w=1, b=0.5", b, 5.0)

    def branch_by_data() -> None:
        """forward_with_condition"""
        x = leaf([1.0, 2.0])
        forward_with_condition(x, threshold=0.5).sum().backward()
        expect("d/dx forward_with_condition([1, 2], 0.5) (mean above: x**2)", x, [2.0, 4.0])
        x = leaf([-1.0, 0.5])
        forward_with_condition(x, threshold=0.5).sum().backward()
        expect("d/dx forward_with_condition([-1, 0.5], 0.5) (mean below: x**3)", x, [3.0, 0.75])

    for run in (conditional, accumulation, polynomials, branch_by_data):
        case(run)
    return mismatches


def check_autograd(device: str) -> Result:
    name = f"autograd {device}"
    mismatches = gradient_mismatches(device)
    if mismatches:
        return Result(name, FAIL, "; ".join(mismatches))
    return Result(
        name,
        OK,
        "seed gradients match: conditional_model [4, 6], w*x**2 12 and 4, x**2+3x+1 7, "
        "(w*x+b)**2 5/10/5, data-dependent branch both ways, accumulation",
    )


def _dynamic_net_gradients(device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DynamicNet().to(device)
    inputs = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) * 2
    with torch.enable_grad():  # grad switched off is the eager mode check's finding
        model(inputs.to(device)).square().mean().backward()
    return {
        name: parameter.grad
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


@contextlib.contextmanager
def _deterministic_kernels() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for eager kernels, undone on exit.

    The public function also sets ``torch._inductor.config.deterministic``, and importing
    that loads all of torch.compile: 1 to 2 s, more than every other check together.
    Eager kernels read only the flag set here.
    """
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch._C._set_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch._C._set_deterministic_algorithms(before, warn_only=warn_only)


def check_determinism(devices: Sequence[str]) -> Result:
    """Two identical backward passes of `DynamicNet` in deterministic mode are bitwise equal.

    The global settings and random number generators are restored afterwards.
    """
    name = "deterministic mode"
    state = snapshot()
    try:
        for device in devices:
            with _deterministic_kernels():
                first, second = _dynamic_net_gradients(device), _dynamic_net_gradients(device)
            for parameter, grad in first.items():
                other = second.get(parameter)
                if other is None or not torch.equal(grad, other):
                    difference = (
                        ""
                        if other is None
                        else f" by up to {(grad - other).abs().max().item():.3g}"
                    )
                    return Result(
                        name,
                        FAIL,
                        f"{device}: the gradient of {parameter} differs between two identical runs"
                        f"{difference} with torch.use_deterministic_algorithms(True)",
                    )
    except RuntimeError as error:
        if "CUBLAS_WORKSPACE_CONFIG" in str(error):
            return Result(
                name,
                WARN,
                f"{device}: this torch needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment "
                "(set before the process starts) for deterministic cuBLAS",
            )
        return Result(name, FAIL, f"{device}: {str(error).strip().splitlines()[0]}")
    finally:
        restore(state)
    return Result(name, OK, f"two runs bitwise equal on {', '.join(devices)}")


def check_shm(path: Path = Path("/dev/shm")) -> Result:
    """DataLoader workers hand batches over in shared memory; Docker gives 64 MiB by default."""
    name = "/dev/shm"
    try:
        stat = os.statvfs(path)
    except OSError:
        return Result(name, WARN, f"{path} is missing: DataLoader workers (num_workers > 0) fail")
    size = stat.f_frsize * stat.f_blocks
    if size < SHM_WARN_BELOW:
        return Result(
            name,
            WARN,
            f"{size / 2**20:.0f} MiB: DataLoader workers (num_workers > 0) die with 'Bus error' "
            "on large batches; start the container with --shm-size=8g (or --ipc=host)",
        )
    return Result(name, OK, f"{size / 2**30:.1f} GiB")


def check_gpu_access(root: Path = Path("/"), cuda_build: bool | None = None) -> Result:
    """Which case of GPU access this is: GPUs passed into a Docker or Podman container,
    none passed (and the switch that passes them), or no container at all."""
    name = "GPU access"
    if (root / "run" / ".containerenv").exists():
        engine = "Podman"
    elif (root / ".dockerenv").exists():
        engine = "Docker"
    else:
        return Result(name, OK, "not in a container: torch sees this machine's GPUs directly")
    devices = sorted(f"/dev/{path.name}" for path in (root / "dev").glob("nvidia[0-9]*"))
    if devices:
        passed = f"{len(devices)} GPU(s) passed into this {engine} container"
        return Result(name, OK, f"{passed}: {', '.join(devices)}")
    if engine == "Podman":
        switch = 'add "--device", "nvidia.com/gpu=all" to runArgs (CDI; podman run --device ...)'
    else:
        switch = (
            "set the VS Code setting dev.containers.gpuAvailability to all, or run "
            "devcontainer up --gpu-availability all (docker run: --gpus all)"
        )
    detail = (
        f'no GPU passed into this {engine} container (hostRequirements.gpu "optional" adds '
        f"--gpus all only when `docker info` lists the NVIDIA runtime); if the host has GPUs, "
        f"{switch}"
    )
    wants_gpu = torch.version.cuda is not None if cuda_build is None else cuda_build
    return Result(name, WARN if wants_gpu else OK, detail)


def _port(environ: Mapping[str, str], variable: str) -> int | str | None:
    """The port in ``variable``: None when unset, the bad text when it is not a port."""
    text = environ.get(variable)
    if text is None:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else text


def _exchange(port: int, request: bytes) -> bytes:
    """Connect to 127.0.0.1:port, send ``request`` (if any) and return the first bytes read.

    A failed connection raises `OSError`; a server that stays silent gives ``b""``.
    """
    chunks: list[bytes] = []
    address = ("127.0.0.1", port)
    # Connecting happens before the suppression starts: only a failed exchange is silenced.
    with (
        socket.create_connection(address, timeout=CONNECT_TIMEOUT_S) as connection,
        contextlib.suppress(OSError),
    ):
        if request:
            connection.sendall(request)
        while sum(map(len, chunks)) < 4096:
            chunk = connection.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
            if not request:  # the SSH banner is one line, sent first
                break
    return b"".join(chunks)


def check_sshd(environ: Mapping[str, str]) -> Result | None:
    """Inside the dev container (``PROJECT_SSH_PORT`` set): sshd answers on that port."""
    port = _port(environ, "PROJECT_SSH_PORT")
    if port is None:
        return None
    if isinstance(port, str):
        return Result("sshd", FAIL, f"PROJECT_SSH_PORT={port!r} is not a port number")
    try:
        banner = _exchange(port, b"")
    except OSError as error:
        return Result("sshd", FAIL, f"nothing answers on 127.0.0.1:{port} ({error}): start sshd")
    if not banner.startswith(b"SSH-"):
        return Result("sshd", FAIL, f"127.0.0.1:{port} answers, but not with an SSH banner")
    return Result("sshd", OK, f"{banner.decode('ascii', 'replace').strip()} on port {port}")


def check_jupyter(environ: Mapping[str, str]) -> Result | None:
    """Inside the dev container with Jupyter (``PROJECT_JUPYTER_PORT`` set): it answers."""
    port = _port(environ, "PROJECT_JUPYTER_PORT")
    if port is None:
        return None
    if isinstance(port, str):
        return Result("jupyter", FAIL, f"PROJECT_JUPYTER_PORT={port!r} is not a port number")
    request = f"GET /api HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        response = _exchange(port, request)
    except OSError as error:
        return Result(
            "jupyter", FAIL, f"nothing answers on 127.0.0.1:{port} ({error}): start JupyterLab"
        )
    header, _, body = response.partition(b"\r\n\r\n")
    try:
        version = json.loads(body)["version"]
    except (ValueError, KeyError, TypeError):
        status = header.split(b"\r\n", 1)[0].decode("ascii", "replace") or "no HTTP response"
        return Result("jupyter", FAIL, f"127.0.0.1:{port}/api is not a Jupyter server ({status})")
    return Result("jupyter", OK, f"Jupyter server {version} on port {port}")


def _rows(name: str, check: Callable[..., Any], *args: Any) -> list[Result]:
    """The rows of ``check(*args)``; an exception is that check's failure, not the doctor's."""
    try:
        outcome = check(*args)
    except Exception as error:  # a broken environment is what the doctor is there for
        return [Result(name, FAIL, f"the check raised {type(error).__name__}: {error}")]
    if outcome is None:
        return []
    return outcome if isinstance(outcome, list) else [outcome]


def run_checks(require_gpu: bool = False, environ: Mapping[str, str] = os.environ) -> list[Result]:
    unavailable_reason = gpus.cuda_unavailable_reason()
    devices = ["cpu"]
    if unavailable_reason is None:
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return [
        *_rows("python", check_python),
        *_rows("torch", check_torch),
        *_rows("NVIDIA driver", check_driver, torch.version.cuda, gpus.driver_version()),
        *_rows("GPU", check_gpus, unavailable_reason, require_gpu),
        *_rows("GPU access", check_gpu_access),
        *_rows("eager mode", check_eager_mode),
        *_rows("TorchScript", check_torchscript, environ),
        *(row for device in devices for row in _rows(f"autograd {device}", check_autograd, device)),
        *_rows("deterministic mode", check_determinism, devices),
        *_rows("/dev/shm", check_shm),
        *_rows("sshd", check_sshd, environ),
        *_rows("jupyter", check_jupyter, environ),
    ]


def format_table(results: Sequence[Result]) -> str:
    width = max(len("check"), *(len(result.check) for result in results))
    lines = [f"{'check':<{width}}  status  detail"]
    lines += [f"{r.check:<{width}}  {r.status:<6}  {r.detail}" for r in results]
    failures = sum(r.status == FAIL for r in results)
    warnings = sum(r.status == WARN for r in results)
    lines.append(f"{failures} failed, {warnings} warning(s), {len(results)} checks")
    return "\n".join(lines)


@reports_errors(f"{PACKAGE}.doctor")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=command_name(f"{PACKAGE}.doctor"),
        description="Check that this environment runs dynamic-graph PyTorch models correctly.",
        epilog="Exit status: 0 when no check FAILs (warnings allowed), 1 otherwise.",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--require-gpu", action="store_true", help="fail when no GPU is usable (default: warn)"
    )
    args = parser.parse_args(argv)
    results = run_checks(require_gpu=args.require_gpu)
    passed = all(result.status != FAIL for result in results)
    if args.json:
        report = {
            "ok": passed,
            "require_gpu": args.require_gpu,
            "checks": [asdict(r) for r in results],
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_table(results))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
