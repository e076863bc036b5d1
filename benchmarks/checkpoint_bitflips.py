"""Single-bit flips over a whole ``train`` checkpoint: how many are refused, how many
resume with the same state, how many resume silently with another one.

A 1-epoch run of the default project (1024 samples, batch 32) writes ``latest.pt``
(format 5: a SHA-256 digest of every byte). For comparison the same entries are
written as format 4 (a CRC-32 per tensor, no digest), as the previous version of
the command wrote them. Each flipped file is read back as ``--resume`` reads it,
in this process (``load_resumable``, what ``main`` does before training), and
counted as:

- refused in one line (the ``argument --resume: ...`` line, no warning shown);
- refused otherwise (an exception other than the usage error, a line break in the
  message, or a warning shown: what the user would see as a traceback or extra lines);
- resumed, the same state: every entry bitwise equal to the unflipped file's, so the
  resumed run is bitwise equal too (training is a function of that state);
- resumed silently with another state (and the entries that differ).

By default each byte gets one flip (of bit ``offset % 8``, so every bit position is
hit across the file); ``--all-bits`` flips every bit (8 times as long).

    python benchmarks/checkpoint_bitflips.py [--all-bits] [--format 4|5] [--src GENERATED/src]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from baking import use_generated_src

RUN = ("--device", "cpu", "--samples", "1024", "--batch-size", "32", "--epochs", "1")


def _bytes_of(tensor):
    """The tensor's elements as bytes, in a new contiguous tensor (a flipped stride in
    the pickle can leave a stride that ``view`` refuses)."""
    import torch

    return tensor.new_empty(tensor.shape).copy_(tensor).view(-1).view(torch.uint8)


def same(a, b) -> bool:
    """Bitwise equality of two loaded values (tensors by dtype, shape and bytes)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes_of(a), _bytes_of(b))
        )
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and same(vars(a), vars(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def differing(state, original) -> list[str]:
    return [
        field.name
        for field in dataclasses.fields(state)
        if field.name != "format"
        and not same(getattr(state, field.name), getattr(original, field.name))
    ]


def sweep(train, path: Path, all_bits: bool) -> tuple[collections.Counter, collections.Counter]:
    """The outcomes of flipping bits of ``path`` (restored after each), and for the silent
    resumes, which entries differed."""
    import torch

    config = train.Config(
        **vars(train.build_parser().parse_args([*RUN, "--resume", "--run-dir", str(path.parent)]))
    )
    launch = train.Launch.from_environment()

    def load():
        return train.load_resumable(config, launch, torch.device("cpu"), log=io.StringIO())

    original = load()
    outcomes: collections.Counter = collections.Counter()
    entries: collections.Counter = collections.Counter()
    descriptor = os.open(path, os.O_RDWR)
    try:
        for offset in range(path.stat().st_size):
            (byte,) = os.pread(descriptor, 1, offset)
            for bit in range(8) if all_bits else (offset % 8,):
                os.pwrite(descriptor, bytes([byte ^ 1 << bit]), offset)
                with warnings.catch_warnings(record=True) as shown:
                    warnings.simplefilter("always")
                    try:
                        state = load()
                    except train.UsageError as error:
                        one_line = "\n" not in str(error) and not shown
                        outcomes["refused in one line" if one_line else "refused otherwise"] += 1
                        continue
                    except Exception:
                        outcomes["refused otherwise"] += 1
                        continue
                    finally:
                        os.pwrite(descriptor, bytes([byte]), offset)
                changed = differing(state, original)
                if changed:
                    outcomes["resumed silently with another state"] += 1
                    entries.update(changed)
                else:
                    outcomes["resumed, the same state"] += 1
    finally:
        os.close(descriptor)
    return outcomes, entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-bits", action="store_true", help="flip every bit, not one a byte")
    parser.add_argument(
        "--format", type=int, choices=(4, 5), action="append", help="only this format"
    )
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    arguments = parser.parse_args()
    use_generated_src(arguments.src)
    import torch
    from dynamic_model import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch, "run")
        folder.mkdir()
        config = train.Config(
            **vars(train.build_parser().parse_args([*RUN, "--run-dir", str(folder)]))
        )
        train.train(config, train.Launch(), torch.device("cpu"), log=io.StringIO())
        latest = folder / "latest.pt"
        entries = torch.load(latest, weights_only=True)
        files = {5: latest.read_bytes()}
        buffer = io.BytesIO()
        torch.save({**entries, "format": 4}, buffer)
        files[4] = buffer.getvalue()
        for version, data in files.items():
            if arguments.format and version not in arguments.format:
                continue
            latest.write_bytes(data)
            started = time.perf_counter()
            outcomes, changed = sweep(train, latest, arguments.all_bits)
            seconds = time.perf_counter() - started
            flips = sum(outcomes.values())
            print(f"format {version}: {len(data)} bytes, {flips} flips ({seconds:.0f} s)")
            for outcome in (
                "refused in one line",
                "refused otherwise",
                "resumed, the same state",
                "resumed silently with another state",
            ):
                print(f"  {outcome}: {outcomes[outcome]}")
            if changed:
                print(
                    "  entries that differed: "
                    + ", ".join(f"{name} {count}" for name, count in changed.most_common())
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
