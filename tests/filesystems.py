"""Real file-system faults for the tests: a read-only folder, a full disk.

Both take a mount, made in a private mount namespace (``unshare --mount``, with
``--map-root-user`` so that it also works without root where user namespaces are
allowed) for one shell command: the mounts exist for that command and its children
alone and vanish with them, and the machine's own mounts are never touched. The
faults are the kernel's own: a read-only bind mount answers every write with EROFS,
a full tmpfs answers with ENOSPC. Where no such namespace can be made, the test is
skipped with unshare's reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNSHARE = ("unshare", "--mount", "--map-root-user")


def in_private_mounts(
    script: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` in a mount namespace of its own (``env`` names its paths)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.strip()}")
    return subprocess.run(
        [*UNSHARE, "sh", "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


# Make $FOLDER read-only for the rest of the script (a bind mount of it onto itself).
READ_ONLY = 'mount --bind "$FOLDER" "$FOLDER" && mount -o remount,bind,ro "$FOLDER"'
# Mount a tmpfs of $SIZE on $FOLDER for the rest of the script.
SMALL_DISK = 'mount -t tmpfs -o "size=$SIZE" tmpfs "$FOLDER"'
# Fill the file system of $FOLDER up (dd stops at "No space left on device").
FILL = 'dd if=/dev/zero of="$FOLDER/filler" bs=4096 2>/dev/null; true'
