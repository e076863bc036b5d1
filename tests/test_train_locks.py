"""The generated ``train``'s run folder lock and the files it appends to, where the folder
is shared or on a cluster filesystem: hard links planted at ``.lock`` and
``metrics.csv`` are refused with their target untouched; a lock held from another
machine (a crashed node's, which NFSv3 keeps until that node restarts) is named with
its holder and age, and ``--take-over-lock PID@HOST`` as printed writes the folder; a
filesystem without locks is named, and ``--take-over-lock unlocked`` as printed runs.

The holder on "another machine" is a real process of this machine holding a real
``fcntl`` lock, which wrote another host's name into the lock file: what `train`
reads of a remote holder is that line and the refused lock, nothing else. The
filesystem without locks is a stand-in: a ``sitecustomize`` makes ``fcntl.lockf``
fail with ``ENOLCK`` (what NFS without its lock service returns; Lustre without
flock returns ``ENOSYS``), which is the one fact of such a filesystem `train` sees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import module_environment
from training import SMALL, TRAIN, plant, run_printed, train

PREFIX = f"python -m {TRAIN}: error: "

NO_LOCKS = """
    import errno
    import fcntl
    import os


    def lockf(descriptor, command, *args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


    fcntl.lockf = lockf
"""

HOLD_LOCK = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(descriptor, fcntl.LOCK_EX)
os.write(descriptor, b"4242 on node-that-crashed\\n")
print("LOCKED", flush=True)
time.sleep(600)
"""


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(PREFIX), result.stderr
    return lines[0].removeprefix(PREFIX)


def test_hard_links_at_the_lock_and_metrics_names_leave_their_targets_untouched(
    default_project: Path, tmp_path: Path
) -> None:
    """O_NOFOLLOW does not see a hard link: it is the target file under a second name. Both
    names are refused in one line and the target keeps its bytes; without them the run
    resumes."""
    run = tmp_path / "run"
    first = train(default_project, *SMALL, "--epochs", "1", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    metrics = (run / "metrics.csv").read_bytes()
    resume = (*SMALL, "--epochs", "2", "--run-dir", str(run), "--resume")
    for name, action in ((".lock", "lock"), ("metrics.csv", "append to")):
        victim = tmp_path / f"victim-{name}"
        victim.write_bytes(metrics)  # a file train would read without complaint
        (run / name).unlink(missing_ok=True)
        os.link(victim, run / name)
        assert error_line(train(default_project, *resume)) == (
            f"cannot {action} {run / name}: it has 2 names (hard links), so it may be a file "
            "of someone else's: nothing was written to it"
        )
        assert victim.read_bytes() == metrics
        (run / name).unlink()
    (run / "metrics.csv").write_bytes(metrics)
    resumed = train(default_project, *resume)
    assert resumed.returncode == 0, resumed.stderr


def test_a_lock_held_from_another_machine_is_named_and_can_be_taken_over(
    default_project: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "LOCKED\n"
        args = (*SMALL, "--epochs", "1", "--run-dir", str(run))
        refused = error_line(train(default_project, *args))
        assert re.fullmatch(
            re.escape(
                f"{run} is being written by another process (PID 4242 on node-that-crashed, "
                f"which has held {run / '.lock'} for "
            )
            + r"0 min \d+ s"
            + re.escape(
                "): wait for it to end, or use another folder; if that process is gone (its "
                "node crashed), pass --take-over-lock 4242@node-that-crashed"
            ),
            refused,
        ), refused
        assert sorted(path.name for path in run.iterdir()) == [".lock"]

        wrong = error_line(
            train(default_project, *args, "--take-over-lock", "4243@node-that-crashed")
        )
        assert wrong == (
            f"cannot take over {run / '.lock'}: --take-over-lock 4243@node-that-crashed does not "
            "name its holder, 4242@node-that-crashed (a holder on this host is alive: the kernel "
            "drops a dead process's locks)"
        )
        command = f"python -m {TRAIN} {' '.join(args)} --take-over-lock 4242@node-that-crashed"
        taken = run_printed(default_project, command)
        assert taken.returncode == 0, taken.stderr
        assert (run / "latest.pt").is_file()
    finally:
        holder.kill()
        holder.wait()


def test_bad_take_over_values(default_project: Path, tmp_path: Path) -> None:
    for value in ("node7", "@node7", "12@", "12@no\nde"):
        args = (*SMALL, "--run-dir", str(tmp_path), "--take-over-lock", value)
        result = train(default_project, *args)
        assert result.returncode == 2
        assert result.stderr.splitlines()[-1] == (
            f"{PREFIX}argument --take-over-lock: must be PID@HOST, as the refusal to lock the run "
            f"folder printed it, or unlocked; got {value!r}"
        )
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_without_locks_is_named(default_project: Path, tmp_path: Path) -> None:
    no_locks = plant(tmp_path / "no-locks", NO_LOCKS)
    run = tmp_path / "run"
    args = (*SMALL, "--epochs", "1", "--run-dir", str(run))
    environ = module_environment(default_project, path=(no_locks,))
    refused = train(default_project, *args, env=environ)
    kind = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    message = error_line(refused)
    assert message.startswith(
        f"cannot lock {run / '.lock'}: No locks available: the folder is on {kind}, "
    ), message
    assert message.endswith(
        ", which offers no file locks there (Lustre without its flock option, NFS without its "
        "lock service); use a run folder on a filesystem with locks, or pass --take-over-lock "
        "unlocked to write without one (nothing then keeps a second run out of the folder)"
    )
    unlocked = train(default_project, *args, "--take-over-lock", "unlocked", env=environ)
    assert unlocked.returncode == 0, unlocked.stderr
    assert (run / "latest.pt").is_file()
