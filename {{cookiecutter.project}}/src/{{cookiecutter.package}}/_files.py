"""Writing files into folders that others may write too, without following their links.

A run folder or a report's folder may be shared (a group's project space, ``/tmp``),
so a file name in it may already be taken by a link planted there. Every file the
commands and the pytest plugin write goes through this module:

- `AtomicFile` / `write_atomically` replace a file as a whole. The new content goes to
  a temporary file with a random name, created exclusively (``O_CREAT | O_EXCL |
  O_NOFOLLOW``: it fails on anything already at that name, a link included) in the
  target's folder, and is renamed over the target (with ``fsync`` before and after
  where it must survive a power cut: checkpoints). A reader sees the old file or the
  whole new one, never a part; ``rename`` replaces a link at the target instead of
  writing through it. On any failure the temporary file is removed, even when closing
  it fails too (a full disk fails the close's last flush), and the target is as it was.
  A commit can keep the target it replaces under a second name (checkpoints keep
  ``previous.pt``), with a complete file under the target's name at every instant.
- `open_to_append` and `read_text` open the target itself with ``O_NOFOLLOW``: a link
  there is refused (with ``O_NONBLOCK`` a planted FIFO cannot hang the open), and so is
  anything but a regular file; a file opened to write with other names (hard links,
  which ``O_NOFOLLOW`` does not see) is refused too.
- `FolderLock`: an ``fcntl`` lock on ``.lock`` in a folder, so one process at a time
  writes it; the kernel releases it when the process dies, however it dies.

Failures are `FileError` s: one line naming the file, what was done and why it failed.
Loading this module does not import torch (the pytest plugin uses it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ._command import CommandError

__all__ = [
    "AtomicFile",
    "FileError",
    "FolderInUse",
    "FolderLock",
    "Holder",
    "filesystem_type",
    "open_to_append",
    "read_text",
    "remove_incomplete",
    "write_atomically",
]

# What os.link raises where a file system has no hard links.
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK}
# Opening a file someone may have replaced: never through a link, never blocking on a FIFO,
# never leaked into a child process.
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# The most random names tried for a temporary file before giving up (tempfile's TMP_MAX).
_NAME_ATTEMPTS = 10_000
# How long a refused `FolderLock` waits for the holder to write its PID into the lock file
# (it does so right after taking the lock: microseconds, unless the machine is swapping).
_HOLDER_WAIT_S = 1.0


class FileError(CommandError):
    """``cannot <action> <path>: <reason>``, where reason is the system's (``No space left on
    device``) or says which link or non-file was refused."""

    def __init__(self, path: Path, action: str, reason: str) -> None:
        super().__init__(path, action, reason)
        self.path, self.action, self.reason = path, action, reason

    @classmethod
    def of(cls, path: Path, action: str, error: OSError) -> FileError:
        if error.errno == errno.ELOOP:
            reason = "it is a symbolic link, which is not followed"
        else:
            reason = error.strerror or str(error)
        return cls(path, action, reason)

    def __str__(self) -> str:
        return f"cannot {self.action} {self.path}: {self.reason}"


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _fsync_folder(folder: Path) -> None:
    # A rename is only on disk once its folder is: without this the new name may not
    # survive a power cut.
    descriptor = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class AtomicFile:
    """The next version of ``path``: written to a temporary file beside it, which `commit`
    renames over ``path``, and `discard` (or leaving a ``with`` block by an exception)
    removes. ``mode`` is that of a new file, before the umask.

    It is a binary file object for writers such as ``torch.save``. An `OSError` from a
    write is remembered, so that a writer that turns it into an error of its own (torch
    reports "unexpected pos" for a full disk) still gets it reported as what it is.
    """

    def __init__(self, path: Path, *, mode: int = 0o666) -> None:
        self.path = path
        self._failure: OSError | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_OPEN
        for _ in range(_NAME_ATTEMPTS):
            name = f"{_temporary_prefix(path)}{secrets.token_hex(6)}.tmp"
            self.temporary = path.parent / name
            try:
                descriptor = os.open(self.temporary, flags, mode)
                break
            except FileExistsError:
                continue
            except OSError as error:
                raise self._failed(error) from None
        else:
            raise FileError(path, "write", f"no free temporary name in {_NAME_ATTEMPTS} tries")
        self._file = os.fdopen(descriptor, "wb")

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            self._failure = self._failure or error
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as error:
            self._failure = self._failure or error
            raise

    def fileno(self) -> int:
        return self._file.fileno()

    def commit(self, *, durable: bool = True, keep_previous: Path | None = None) -> None:
        """Put the content under ``path``; `FileError` (and ``path`` as it was) when that
        fails. ``durable``: on disk first, and the rename too, so that both survive a
        power cut. Without, readers still see the old file or the whole new one, but a
        power cut may leave the old file, or on some file systems an empty one.
        ``keep_previous``: the file ``path`` held (if any) is then under that name, and
        what was there is gone; ``path`` is a complete file at every instant."""
        try:
            self.flush()
            if durable:
                # Before the rename: a rename that reaches the disk before the data would
                # leave an empty or partial file under the name after a power cut.
                os.fsync(self._file.fileno())
            self._file.close()
            if keep_previous is not None:
                _link_previous(self.path, keep_previous)
            os.replace(self.temporary, self.path)
        except OSError as error:
            self.discard()
            raise self._failed(self._failure or error) from None
        if not durable:
            return
        try:
            _fsync_folder(self.path.parent)
        except OSError as error:  # the file is in place; its name may not survive a power cut
            raise FileError.of(self.path.parent, "flush the folder", error) from None

    def discard(self) -> None:
        """Remove the temporary file; ``path`` stays as it was."""
        with contextlib.suppress(OSError):  # a full disk fails the close's flush too
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if error is None:
            return
        self.discard()  # again, after a failed commit: it is harmless
        if isinstance(error, FileError):  # commit's own
            return
        failure = self._failure or (error if isinstance(error, OSError) else None)
        if failure is not None:
            raise self._failed(failure) from error

    def _failed(self, error: OSError) -> FileError:
        """The error, saying that ``path`` is as it was (the temporary file is gone)."""
        failure = FileError.of(self.path, "write", error)
        kept = (
            f"the previous {self.path.name} is intact" if self.path.exists() else "nothing written"
        )
        return FileError(self.path, "write", f"{failure.reason} ({kept})")


def _link_previous(path: Path, previous: Path) -> None:
    """Make ``previous`` a second name of the file at ``path`` (none: nothing to keep).

    A hard link, not a copy or a rename: ``path`` keeps its file until the rename that
    follows replaces it, so a crash at any point leaves ``path`` complete (the old file
    or, after the rename, the new one) and ``previous`` either missing, the generation
    before, or the old file. The old file's bytes were made durable by the commit that
    put them there, so neither name can point at a partial file after a power cut,
    whichever of these steps reach the disk (the folder's ``fsync`` after the rename
    writes both names). ``os.link`` never replaces: what is at ``previous`` goes first.
    On a file system without hard links (FAT, some FUSE mounts) nothing is kept.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(previous)  # a planted link there is removed, never followed
    try:
        os.link(path, previous, follow_symlinks=False)
    except FileNotFoundError:  # the first commit: no file to keep yet
        pass
    except OSError as error:
        if error.errno not in _NO_HARD_LINKS:
            raise


def write_atomically(
    path: Path, data: bytes | str, *, mode: int = 0o666, durable: bool = True
) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) as a whole; see `AtomicFile`
    (and its `commit` for ``durable``)."""
    with AtomicFile(path, mode=mode) as target:
        target.write(data.encode() if isinstance(data, str) else data)
        target.commit(durable=durable)


def remove_incomplete(path: Path) -> list[Path]:
    """Delete the temporary files of ``path`` that a killed process left behind."""
    leftovers = sorted(path.parent.glob(f"{_temporary_prefix(path)}*.tmp"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)  # a planted link is removed, never followed
    return leftovers


def _open_regular(path: Path, flags: int, action: str) -> int:
    """A descriptor of the regular file ``path`` itself (no link, FIFO or device);
    `FileNotFoundError` passes through."""
    try:
        descriptor = os.open(path, flags | _SAFE_OPEN, 0o666)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise FileError.of(path, action, error) from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise FileError(path, action, "it is not a regular file")
    if flags & (os.O_WRONLY | os.O_RDWR) and status.st_nlink != 1:
        # O_NOFOLLOW stops symbolic links only: a hard link is the target file itself.
        os.close(descriptor)
        raise FileError(
            path, action,
            f"it has {status.st_nlink} names (hard links), so it may be a file of someone "
            "else's: nothing was written to it",
        )  # fmt: skip
    return descriptor


def open_to_append(path: Path) -> TextIO:
    """``path`` opened to append text (created if missing), never through a link."""
    descriptor = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "append to")
    return os.fdopen(descriptor, "a", newline="", encoding="utf-8")


def read_text(path: Path) -> str | None:
    """The text of ``path``, None when there is no such file; never read through a link."""
    try:
        descriptor = _open_regular(path, os.O_RDONLY, "read")
    except FileNotFoundError:
        return None
    with os.fdopen(descriptor, encoding="utf-8", newline="") as file:
        try:
            return file.read()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "it is not UTF-8 text"
            raise FileError(path, "read", reason or str(error)) from None


# lockf's errors where the filesystem offers no locks at all (Lustre without flock,
# NFS without its lock service, some FUSE filesystems), not another holder.
_LOCKS_UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
# The --take-over-lock value that runs without a lock where the filesystem has none.
UNLOCKED = "unlocked"


@dataclass(frozen=True)
class Holder:
    """Who holds a `FolderLock`, as it wrote into the lock file: ``PID on HOST``."""

    pid: int
    host: str
    since: float  # when it took the lock (the file's modification time)

    def __str__(self) -> str:
        return f"{self.pid}@{self.host}"


def _age(since: float) -> str:
    seconds = max(0, int(time.time() - since))
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {seconds % 60} s"


class FolderInUse(CommandError):
    """Another process holds a folder's `FolderLock`: its PID and host, where it wrote them."""

    def __init__(self, folder: Path, holder: Holder | None) -> None:
        super().__init__(folder, holder)
        self.folder, self.holder = folder, holder

    def __str__(self) -> str:
        lock = self.folder / FolderLock.NAME
        if self.holder is None:
            return (
                f"{self.folder} is being written by another process (it holds {lock} and did "
                "not write its PID): wait for it to end, or use another folder"
            )
        holder = self.holder
        text = (
            f"{self.folder} is being written by another process (PID {holder.pid} on "
            f"{holder.host}, which has held {lock} for {_age(holder.since)}): wait for it to "
            "end, or use another folder"
        )
        if holder.host != socket.gethostname():
            # On NFSv3 a crashed node's locks stay until that node restarts.
            text += f"; if that process is gone (its node crashed), pass --take-over-lock {holder}"
        return text


class FolderLock:
    """One writer per folder: an exclusive ``fcntl`` (POSIX record) lock on ``.lock`` in it.

    The kernel drops the lock when its process dies, SIGKILL included, so a killed
    run never leaves a stale lock; the file holds the holder's PID and host, for the
    message of the process that is refused. POSIX locks belong to the process, not to
    forked children (DataLoader workers do not keep a dead run's folder locked), and
    work across the machines of NFS and other cluster file systems that support them.
    `release` removes the file while still holding the lock; a process that opened it
    just before finds, once it has the lock, that the name now leads elsewhere, and
    tries again.

    Where locks end otherwise (README, "Run folders on shared filesystems"): a lock
    held from a node that crashed stays until that node restarts (NFSv3) or its lease
    ends (NFSv4, 90 s by default); ``take_over`` naming that holder (``PID@HOST``, as
    `FolderInUse` prints it) writes the folder anyway. A filesystem with no locks
    (`_LOCKS_UNSUPPORTED`) is named in the refusal; ``take_over`` `UNLOCKED` runs
    without one. Node-local locks (NFS mounted ``nolock``, Lustre ``localflock``,
    BeeGFS by default) only keep out writers on the same node.
    """

    NAME = ".lock"

    def __init__(self, path: Path, descriptor: int) -> None:
        self.path, self._descriptor = path, descriptor

    @classmethod
    def acquire(cls, folder: Path, *, take_over: str | None = None) -> FolderLock:
        """Lock ``folder`` (which must exist); `FolderInUse` when another process has it."""
        path = folder / cls.NAME
        while True:
            try:
                descriptor = _open_regular(path, os.O_RDWR | os.O_CREAT, "lock")
            except FileNotFoundError as error:  # the folder itself is missing
                raise FileError.of(path, "lock", error) from None
            try:
                fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno in _LOCKS_UNSUPPORTED and take_over == UNLOCKED:
                    return cls._taken(path, descriptor)
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(descriptor)
                    raise _no_locks(path, error) from None
                holder = _holder(descriptor)
                elsewhere = holder is not None and holder.host != socket.gethostname()
                if elsewhere and take_over == str(holder):
                    return cls._taken(path, descriptor)
                os.close(descriptor)
                if take_over is not None and take_over != UNLOCKED:
                    raise FileError(
                        path, "take over",
                        f"--take-over-lock {take_over} does not name its holder, "
                        f"{holder if holder is not None else 'unknown'} (a holder on this "
                        "host is alive: the kernel drops a dead process's locks)",
                    ) from None  # fmt: skip
                raise FolderInUse(folder, holder) from None
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                current = None
            locked = os.fstat(descriptor)
            if current is not None and (current.st_dev, current.st_ino) == (
                locked.st_dev,
                locked.st_ino,
            ):
                return cls._taken(path, descriptor)
            os.close(descriptor)  # released and removed while we waited: lock the new one

    @classmethod
    def _taken(cls, path: Path, descriptor: int) -> FolderLock:
        """The lock, with this process written in as its holder (only into a file of this
        user's: in a shared folder the name may lead to someone else's file)."""
        if os.fstat(descriptor).st_uid == os.geteuid():
            holder = f"{os.getpid()} on {socket.gethostname()}\n".encode()
            with contextlib.suppress(OSError):  # only for the message; the lock is held
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, holder, 0)
        return cls(path, descriptor)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._descriptor)  # closing drops the lock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _no_locks(path: Path, error: OSError) -> FileError:
    """The refusal for a lock that failed for another reason than a holder."""
    if error.errno not in _LOCKS_UNSUPPORTED:
        return FileError.of(path, "lock", error)
    kind = filesystem_type(path) or "a filesystem of unknown type"
    return FileError(
        path, "lock",
        f"{error.strerror}: the folder is on {kind}, which offers no file locks there (Lustre "
        "without its flock option, NFS without its lock service); use a run folder on a "
        f"filesystem with locks, or pass --take-over-lock {UNLOCKED} to write without one "
        "(nothing then keeps a second run out of the folder)",
    )  # fmt: skip


def _holder(descriptor: int) -> Holder | None:
    """Who holds the lock, as its holder wrote into the lock file ("PID on HOST"), once
    it has. The file is in a folder others may write: what is not a number and a
    printable host name is not shown."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        text = os.pread(descriptor, 4096, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    pid, _, host = text.partition(" on ")
    if pid.isdecimal() and host.isprintable() and host and " " not in host and "@" not in host:
        return Holder(int(pid), host, os.fstat(descriptor).st_mtime)
    return None


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing folder) is on."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    target = os.path.realpath(existing)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # Spaces, tabs and newlines in mount points are written as octal escapes.
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind
