"""What the machine offers for CUDA, found without initializing CUDA: the facts the
test plugin, ``doctor`` and ``train`` decide on.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initializes in a process, and a
process that initialized CUDA holds a context on its GPU. So everything here that a
test controller needs (driver version, the GPUs and which of them are visible, why
CUDA would not work) comes from ``/proc/driver/nvidia/version`` and ``nvidia-smi``,
and the decisions are plain functions of those facts so they can be tested on any
machine. :data:`MIN_DRIVER_BY_CUDA_MAJOR` is the project's one table of minimum
drivers. Only :func:`cuda_unavailable_reason` and :func:`torch_gpu` import torch, and
only when called.
"""

from __future__ import annotations

import csv
import enum
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MIN_DRIVER_BY_CUDA_MAJOR",
    "DriverCheck",
    "DriverStatus",
    "GpuInfo",
    "assign_devices",
    "check_driver",
    "cuda_unavailable_reason",
    "diagnose_cuda",
    "driver_version",
    "gpu_for_entry",
    "minimum_driver",
    "parse_gpu_query",
    "parse_proc_driver_version",
    "parse_visible_devices",
    "query_gpus",
    "torch_gpu",
    "version_tuple",
    "visible_devices",
]

# Lowest Linux driver for each CUDA major version (CUDA's minor version compatibility).
MIN_DRIVER_BY_CUDA_MAJOR: dict[int, str] = {12: "525.60.13", 13: "580.65.06"}

PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
NVIDIA_SMI_TIMEOUT_S = 20


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as ``nvidia-smi`` lists it (index in PCI bus order)."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    compute_capability: str

    def describe(self) -> str:
        return (
            f"{self.name}, {self.memory_mib / 1024:.1f} GiB, "
            f"compute capability {self.compute_capability}, {self.uuid}"
        )


def torch_gpu(index: int) -> GpuInfo:
    """The CUDA device ``index`` of this process as torch sees it (initializes CUDA)."""
    import torch

    properties = torch.cuda.get_device_properties(index)
    uuid = getattr(properties, "uuid", None)
    return GpuInfo(
        index=index,
        uuid=f"GPU-{uuid}" if uuid is not None else "uuid unknown",
        name=properties.name,
        memory_mib=properties.total_memory // 2**20,
        compute_capability=f"{properties.major}.{properties.minor}",
    )


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading dotted numbers of a version: ``"580.65.06"`` -> ``(580, 65, 6)``."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"not a version number: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def minimum_driver(cuda_version: str) -> str | None:
    """The lowest driver that runs the CUDA runtime ``cuda_version``; None if not known."""
    return MIN_DRIVER_BY_CUDA_MAJOR.get(version_tuple(cuda_version)[0])


class DriverStatus(enum.Enum):
    """How the NVIDIA driver stands against the CUDA runtime torch was built with."""

    NOT_NEEDED = "not needed"  # a CPU-only build of torch
    MISSING = "missing"
    TOO_OLD = "too old"
    MINIMUM_UNKNOWN = "minimum unknown"  # a CUDA major version this table does not list
    SUFFICIENT = "sufficient"


@dataclass(frozen=True)
class DriverCheck:
    status: DriverStatus
    driver: str | None
    cuda_runtime: str | None
    minimum: str | None


def check_driver(cuda_runtime: str | None, driver: str | None) -> DriverCheck:
    """The driver ``driver`` against the minimum for the CUDA runtime ``cuda_runtime``
    (``torch.version.cuda``; None for a CPU-only build)."""
    minimum = minimum_driver(cuda_runtime) if cuda_runtime is not None else None
    if cuda_runtime is None:
        status = DriverStatus.NOT_NEEDED
    elif driver is None:
        status = DriverStatus.MISSING
    elif minimum is None:
        status = DriverStatus.MINIMUM_UNKNOWN
    elif version_tuple(driver) < version_tuple(minimum):
        status = DriverStatus.TOO_OLD
    else:
        status = DriverStatus.SUFFICIENT
    return DriverCheck(status, driver, cuda_runtime, minimum)


def _nvidia_smi(*args: str) -> str | None:
    """Standard output of ``nvidia-smi ARGS``, or None when it is missing or fails."""
    try:
        result = subprocess.run(
            ["nvidia-smi", *args],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def parse_proc_driver_version(text: str) -> str | None:
    """The driver version in the text of ``/proc/driver/nvidia/version``."""
    match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def driver_version() -> str | None:
    """The NVIDIA driver version, without initializing CUDA; None when there is no driver."""
    try:
        version = parse_proc_driver_version(PROC_DRIVER_VERSION.read_text())
    except OSError:
        version = None
    if version is None:
        output = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
        lines = output.split() if output else []
        version = lines[0] if lines else None
    return version


GPU_QUERY_FIELDS = "index,uuid,name,memory.total,compute_cap"


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """Rows of ``nvidia-smi --query-gpu=GPU_QUERY_FIELDS --format=csv,noheader,nounits``."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) != 5:
            continue
        index, uuid, name, memory, capability = (field.strip() for field in row)
        gpus.append(
            GpuInfo(
                index=int(index),
                uuid=uuid,
                name=name,
                memory_mib=int(memory) if memory.isdigit() else 0,
                compute_capability=capability,
            )
        )
    return gpus


def query_gpus() -> list[GpuInfo]:
    """Every GPU the driver sees (ignoring ``CUDA_VISIBLE_DEVICES``); empty when none."""
    output = _nvidia_smi(f"--query-gpu={GPU_QUERY_FIELDS}", "--format=csv,noheader,nounits")
    return parse_gpu_query(output) if output else []


def parse_visible_devices(value: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, as CUDA reads them.

    Entries are device indices, GPU UUIDs (``GPU-...``, a unique prefix is enough) or
    MIG ids (``MIG-...``). CUDA stops at the first entry that is none of these, so
    ``""``, ``"-1"`` or ``"none"`` hide every device.
    """
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def visible_devices(cuda_visible_devices: str | None, gpus: Sequence[GpuInfo]) -> list[str]:
    """The devices a CUDA process would see, as ``CUDA_VISIBLE_DEVICES`` entries.

    Unset means every GPU (their indices). With ``gpus`` known, the list stops at the
    first index or UUID that names no GPU, as CUDA does; with ``gpus`` unknown (empty:
    no ``nvidia-smi``) and for MIG ids the entries are taken as they are.
    """
    if cuda_visible_devices is None:
        return [str(gpu.index) for gpu in gpus]
    entries = parse_visible_devices(cuda_visible_devices)
    if not gpus:
        return entries
    visible = []
    for entry in entries:
        if not entry.startswith("MIG-") and gpu_for_entry(entry, gpus) is None:
            break
        visible.append(entry)
    return visible


def gpu_for_entry(entry: str, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU a ``CUDA_VISIBLE_DEVICES`` entry names; None if unknown.

    A MIG id is found only in its old form ``MIG-GPU-<uuid>/<gi>/<ci>``: the newer
    ``MIG-<uuid>`` names the instance, which ``nvidia-smi --query-gpu`` does not list.
    """
    for gpu in gpus:
        if entry.isdigit() and int(entry) == gpu.index:
            return gpu
        if entry.startswith("GPU-") and gpu.uuid.startswith(entry):
            return gpu
        if entry.startswith("MIG-") and gpu.uuid in entry:
            return gpu
    return None


def assign_devices(visible: Sequence[str], workers: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``workers`` test processes.

    Round robin over the caller's visible devices: worker ``i`` gets
    ``visible[i % len(visible)]``, so with fewer GPUs than workers some share one.
    """
    if not visible:
        raise ValueError("no visible device to assign to the workers")
    return [visible[worker % len(visible)] for worker in range(workers)]


def diagnose_cuda(
    *,
    torch_version: str,
    cuda_runtime: str | None,
    driver: str | None,
    cuda_visible_devices: str | None,
    gpus: Sequence[GpuInfo] | None,
) -> str | None:
    """Why CUDA cannot work from these facts, in one sentence; None when nothing is wrong.

    ``gpus`` is None when it is not known which GPUs the driver sees (no ``nvidia-smi``).
    """
    found = check_driver(cuda_runtime, driver)
    if found.status is DriverStatus.NOT_NEEDED:
        return (
            f"torch {torch_version} is a CPU-only build (torch.version.cuda is None): "
            "install a CUDA build of torch to use a GPU"
        )
    if found.status is DriverStatus.MISSING:
        return (
            "no NVIDIA driver found (neither nvidia-smi nor /proc/driver/nvidia/version): "
            "run on a machine with an NVIDIA GPU, and start containers with --gpus"
        )
    if found.status is DriverStatus.TOO_OLD:
        return (
            f"NVIDIA driver {driver} is older than {found.minimum}, the minimum for CUDA "
            f"{cuda_runtime} that torch {torch_version} was built with: update the driver "
            "or install a torch build for an older CUDA"
        )
    if gpus is not None and not gpus:
        return f"NVIDIA driver {driver} is loaded but sees no GPU (nvidia-smi lists none)"
    if cuda_visible_devices is not None and not visible_devices(cuda_visible_devices, gpus or ()):
        return (
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU: unset it or "
            "list the devices to use (indices or GPU UUIDs from nvidia-smi -L)"
        )
    return None


def cuda_unavailable_reason(
    *, initialize: bool = True, known_gpus: Sequence[GpuInfo] | None = None
) -> str | None:
    """None if CUDA is usable in this process, else one sentence naming the cause.

    With ``initialize=False`` the answer comes from the driver and ``nvidia-smi``
    only and CUDA is not initialized: what a test controller whose workers will use
    the GPUs needs. Then None means "nothing known to be wrong". ``known_gpus`` is
    what :func:`query_gpus` already returned, to save running ``nvidia-smi`` again.
    """
    import torch

    if initialize and torch.cuda.is_available():
        return None
    gpus = list(known_gpus) if known_gpus is not None else query_gpus()
    driver = driver_version()
    reason = diagnose_cuda(
        torch_version=torch.__version__,
        cuda_runtime=torch.version.cuda,
        driver=driver,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        gpus=gpus or None,
    )
    if reason is None and initialize:
        reason = (
            f"torch.cuda.is_available() is False with NVIDIA driver {driver} and "
            f"{len(gpus)} GPU(s) listed by nvidia-smi: check that the GPU device files "
            "are accessible (in a container: --gpus) and nvidia-smi works"
        )
    return reason
