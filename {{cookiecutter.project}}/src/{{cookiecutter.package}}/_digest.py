"""A SHA-256 digest of a whole zip archive, kept in the archive's own comment, so that
every byte of a checkpoint can be checked before anything in it is read.

``torch.save`` writes a zip archive that ends with its end-of-central-directory record,
whose last field is the length of the archive's comment: 0, no comment. `DigestWriter`
passes what ``torch.save`` writes on to the file and hashes it, all but those two
bytes; `DigestWriter.finish` writes them as the length of the comment
``sha256:<64 lowercase hex digits>``, then the comment. Zip readers (``torch.load``,
`zipfile`) skip comments, so the file is still an ordinary ``torch.save`` archive.

`check` reads it back. The digest covers every byte before the length field; the
length field must be exactly that of such a comment, and the comment exactly the text
of the digest of the bytes read, so a change of any byte of the file (the comment's
included) is found. The digest is for accidents (a disk, a copy, an editor), not for
attacks: whoever can write the file can write a matching digest.

Loading this module does not import torch.
"""

from __future__ import annotations

import enum
import hashlib
from pathlib import Path
from typing import Protocol

__all__ = ["DigestCheck", "DigestWriter", "check"]

_PREFIX = b"sha256:"
_COMMENT_SIZE = len(_PREFIX) + 2 * hashlib.sha256().digest_size  # 71
# The end-of-central-directory record: its signature, then 16 bytes of counts and
# offsets, then the comment's length (2 bytes, little-endian).
_END_SIGNATURE = b"PK\x05\x06"
_END_SIZE = 22
_NO_COMMENT = bytes(2)
_LENGTH = _COMMENT_SIZE.to_bytes(2, "little")
# Bytes hashed per read: enough that the per-call cost is nothing next to hashing them,
# little enough that reading a checkpoint of gigabytes needs no more memory than this.
_CHUNK = 1 << 20


class DigestCheck(enum.Enum):
    """What `check` found at the end of an archive."""

    MATCHES = "the digest matches every byte"
    DIFFERS = "bytes differ from the digest, or the digest itself is damaged"
    ABSENT = "an archive as torch.save ends it, without a digest"


def _comment(hexdigest: str) -> bytes:
    return _PREFIX + hexdigest.encode()


class _Sink(Protocol):
    def write(self, data: bytes | memoryview, /) -> int: ...

    def flush(self) -> None: ...

    def fileno(self) -> int: ...


class DigestWriter:
    """A binary file for ``torch.save`` that passes everything on to ``target`` (which
    has ``write`` and ``flush``) and hashes it; `finish` then writes the digest."""

    def __init__(self, target: _Sink) -> None:
        self._target = target
        self._digest = hashlib.sha256()
        # The last two bytes written so far: the comment's length, once torch.save is done.
        self._held = b""

    def write(self, data: bytes | memoryview) -> int:
        # torch passes a view of its own memory, valid only during this call (no copy of
        # a tensor's bytes is made here: only the two held back are).
        view = memoryview(data).cast("B")
        if len(view) < 2:
            combined = self._held + bytes(view)
            self._pass_on(combined[:-2])
            self._held = combined[-2:]
        else:
            self._pass_on(self._held)
            self._pass_on(view[:-2])
            self._held = bytes(view[-2:])
        return len(view)

    def _pass_on(self, data: bytes | memoryview) -> None:
        self._digest.update(data)
        self._target.write(data)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:  # for writers that fsync what they wrote
        return self._target.fileno()

    def finish(self) -> None:
        """Write the comment's length and the comment (the digest of all the rest)."""
        if self._held != _NO_COMMENT:
            raise ValueError("torch.save did not end its archive without a comment")
        self._target.write(_LENGTH)
        self._target.write(_comment(self._digest.hexdigest()))


def check(path: Path) -> DigestCheck:
    """Whether the digest at the end of the archive ``path`` matches it (`OSError` if it
    cannot be read)."""
    with path.open("rb") as file:
        size = file.seek(0, 2)
        tail_size = min(size, _END_SIZE + _COMMENT_SIZE)
        file.seek(size - tail_size)
        tail = file.read(tail_size)
        if tail[-_END_SIZE : -_END_SIZE + 4] == _END_SIGNATURE and tail[-2:] == _NO_COMMENT:
            return DigestCheck.ABSENT
        end = tail[:-_COMMENT_SIZE]
        if len(end) < _END_SIZE or end[-_END_SIZE:][:4] != _END_SIGNATURE or end[-2:] != _LENGTH:
            return DigestCheck.DIFFERS
        digest = hashlib.sha256()
        file.seek(0)
        remaining = size - _COMMENT_SIZE - len(_LENGTH)
        while remaining:
            chunk = file.read(min(_CHUNK, remaining))
            if not chunk:  # the file was cut short while being read
                return DigestCheck.DIFFERS
            digest.update(chunk)
            remaining -= len(chunk)
    matches = tail[-_COMMENT_SIZE:] == _comment(digest.hexdigest())
    return DigestCheck.MATCHES if matches else DigestCheck.DIFFERS
