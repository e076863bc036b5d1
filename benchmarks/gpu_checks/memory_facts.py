"""What the CUDA caching allocator and the driver report for the memory the plugin checks.

    python benchmarks/gpu_checks/memory_facts.py      # on a machine with an NVIDIA GPU

The plugin's after-test check compares ``torch.cuda.memory_allocated`` when a GPU
test's body starts with the value after its teardown, a garbage collection and
freeing cuBLAS's workspaces, once the device is warmed up (context, RNG state). This
prints, after each step below, the allocator's numbers (allocated, reserved) and the
driver's (memory in use on the device from ``torch.cuda.mem_get_info``, and, around
the global tensor, this process's from ``nvidia-smi`` where its PID is visible), and
asserts the facts the check relies on:

- a tensor kept in a global adds its size to ``memory_allocated``; dropping it takes
  the size off again (the allocator may keep the block reserved, and the driver count
  it, until ``torch.cuda.empty_cache()``: shown, not asserted);
- what the first matmuls of each kind leave allocated (cuBLAS and cuBLASLt
  workspaces, one per stream; shown) is all freed by
  ``torch._C._cuda_clearCublasWorkspaces()``.

What cuFFT's plan cache, cuDNN convolution and attention leave allocated is shown,
not asserted (the pytest check in plugin_gpu.sh asserts there is no false report).
Ends with "memory facts hold" when every assertion holds.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import torch
import torch.nn.functional as F

MIB = 2**20
device = torch.device("cuda", 0)
KEPT: torch.Tensor | None = None


def process_used_mib() -> str:
    """This process's device memory according to nvidia-smi, or why it is not known."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi: {error}"
    for line in listing.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return f"{used.strip()} MiB"
    return "PID not listed (another PID namespace?)"


def show(event: str, *, per_process: bool = False) -> int:
    """Print one row of numbers after ``event`` (with nvidia-smi's, which takes a while,
    when ``per_process``); return memory_allocated."""
    torch.cuda.synchronize(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    process = f", this process {process_used_mib()}" if per_process else ""
    print(
        f"{event:<44} allocated {allocated:>11,} B  reserved {reserved / MIB:>8.1f} MiB  "
        f"driver: device in use {(total - free) / MIB:>9.1f} MiB{process}"
    )
    return allocated


def first_call_leftover(event: str, call: Callable[[], object]) -> int:
    """Bytes still allocated after ``call()`` returned and its results were dropped."""
    before = show(f"before {event}")
    call()
    return show(f"after {event}") - before


def first_matmuls() -> None:
    """The process's first matmul of each kind, each followed by what it left allocated."""
    a = torch.randn(512, 512, device=device)
    stream = torch.cuda.Stream(device)

    def on_side_stream() -> None:
        with torch.cuda.stream(stream):
            a @ a
        stream.synchronize()

    matmuls = {
        "the first float32 matmul": lambda: a @ a,
        "a float16 matmul": lambda: a.half() @ a.half(),
        "a bfloat16 matmul": lambda: a.bfloat16() @ a.bfloat16(),
        "a linear layer with bias (cuBLASLt)": lambda: F.linear(a, a, a[0]),
        "a matmul on a side stream": on_side_stream,
    }
    for event, call in matmuls.items():
        print(f"left allocated by {event}: {first_call_leftover(event, call):,} bytes")


def main() -> None:
    assert torch.cuda.is_available(), f"torch {torch.__version__}: CUDA is not available"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    with torch.random.fork_rng(devices=[0]):  # what the plugin's warm-up does
        torch.randn(1, device=device)
    start = show("after the warm-up", per_process=True)

    global KEPT
    KEPT = torch.ones(64 * MIB // 4, device=device)
    kept = show("a 64 MiB tensor kept in a global", per_process=True)
    KEPT = None
    dropped = show("the global set to None", per_process=True)
    torch.cuda.empty_cache()
    show("torch.cuda.empty_cache()", per_process=True)
    assert kept - start == 64 * MIB, f"the global added {kept - start} bytes, not {64 * MIB}"
    assert dropped == start, f"{dropped - start} bytes still allocated after dropping the global"

    first_matmuls()
    before_clear = show("the matmul inputs freed")
    torch._C._cuda_clearCublasWorkspaces()
    cleared = show("torch._C._cuda_clearCublasWorkspaces()")
    print(f"cuBLAS workspaces held {before_clear - cleared:,} bytes in all")
    assert cleared == start, f"{cleared - start} bytes still allocated after clearing workspaces"

    x = torch.randn(8, 4096, device=device)
    others = {
        "cuFFT (rfft)": lambda: torch.fft.rfft(x),
        "cuDNN conv2d": lambda: F.conv2d(x.view(8, 1, 64, 64), x.new_ones(4, 1, 3, 3)),
        "scaled_dot_product_attention (float16)": lambda: F.scaled_dot_product_attention(
            *(x.half().view(2, 4, 64, 64),) * 3
        ),
    }
    for event, call in others.items():
        print(f"left allocated by {event}: {first_call_leftover(event, call):,} bytes")
    torch.backends.cuda.cufft_plan_cache[0].clear()
    show("cuFFT plan cache cleared")
    print("memory facts hold")


if __name__ == "__main__":
    main()
