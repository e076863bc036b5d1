"""Training throughput of the train command on each device, read off its progress lines.

    python benchmarks/gpu_checks/throughput.py [--samples N] [--batch-size B]... cuda cpu

in the baked project. Runs ``python -m dynamic_model.train --device D --epochs 3``
(on its default data set, or N samples) with each batch size B (default: the seed
command line's 64, and 1024) and takes the samples/s of the last epoch (the first
one pays for start-up and CUDA's warm-up). Prints one line per run and, per batch
size, each device's throughput as a multiple of the last device's.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

BATCH_SIZES = [64, 1024]
EPOCHS = 3
THROUGHPUT = re.compile(r"^epoch .* ([\d,]+) samples/s", re.MULTILINE)


def samples_per_second(device: str, batch_size: int, samples: list[str]) -> float:
    command = [sys.executable, "-m", "dynamic_model.train", "--device", device, *samples]
    command += ["--epochs", str(EPOCHS), "--batch-size", str(batch_size)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {run.returncode}:\n{run.stdout}{run.stderr}")
    epochs = THROUGHPUT.findall(run.stderr)
    if len(epochs) != EPOCHS:
        sys.exit(f"expected {EPOCHS} progress lines from {' '.join(command)}, got:\n{run.stderr}")
    return float(epochs[-1].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--samples", help="passed to train (default: its own)")
    parser.add_argument("--batch-size", type=int, action="append", help="64 and 1024 unless given")
    parser.add_argument("devices", nargs="+", help="the last one is the baseline")
    arguments = parser.parse_args()
    devices = list(dict.fromkeys(arguments.devices))  # a dry run names cpu twice
    samples = ["--samples", arguments.samples] if arguments.samples else []
    for batch_size in arguments.batch_size or BATCH_SIZES:
        measured = {device: samples_per_second(device, batch_size, samples) for device in devices}
        for device, rate in measured.items():
            print(f"train --device {device} --batch-size {batch_size}: {rate:,.0f} samples/s")
        baseline = devices[-1]
        ratios = ", ".join(
            f"{device} {rate / measured[baseline]:.2f}x" for device, rate in measured.items()
        )
        print(f"batch size {batch_size}, relative to {baseline}: {ratios}")


if __name__ == "__main__":
    main()
