"""Same-host fast path: buckets in a shared-memory segment under ``/dev/shm``.

The publisher stages every version in a segment (a file in ``/dev/shm`` mapped with
``MAP_SHARED``); a subscriber on the same host maps it read-only and copies straight
from it into its parameters, so the bytes cross no socket and the only copy on the
worker is the one into the destination.

Why not :mod:`multiprocessing.shared_memory`: before Python 3.13 every process that
*attaches* registers the segment with its resource tracker, which unlinks it when that
process exits, pulling it from under the others. Plain files in ``/dev/shm`` behave as
documented here instead: the publisher creates and unlinks; a mapping stays valid after
the unlink (or the publisher's death) until the reader drops it.

Whether the path is usable is decided by the subscriber, per publisher: same boot id
(:func:`host_id`) *and* it can read the publisher's probe file and find the expected
token in it (a container with a private ``/dev/shm`` fails this and falls back to TCP).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import socket
import warnings
from pathlib import Path

import torch

__all__ = ["SHM_DIR", "ShmSegment", "cleanup_stale", "host_id", "read_probe", "write_probe"]

#: Where segments live (tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
_PREFIX = "fastio-w-"


def host_id() -> str:
    """``hostname/boot-id``: equal for two processes only on the same running kernel."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def available() -> bool:
    """Whether this host has a writable ``/dev/shm``."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmSegment:
    """A mapped file in ``/dev/shm``, viewed as a 1-D ``uint8`` tensor (:attr:`tensor`).

    Use :meth:`create` (publisher) or :meth:`open` (subscriber, read-only).
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        with warnings.catch_warnings():
            # A read-only mapping yields a read-only tensor: it is only ever read.
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = (
                torch.frombuffer(mm, dtype=torch.uint8)
                if size
                else torch.empty(0, dtype=torch.uint8)
            )

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Create and map a new segment of ``size`` bytes, space reserved up front.

        Raises ``OSError`` (e.g. ``ENOSPC``) when ``/dev/shm`` cannot hold it; reserving
        with ``posix_fallocate`` turns what would be a ``SIGBUS`` on a later write into
        this clean error, and the caller falls back to private memory.
        """
        name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(
                fd,
                max(size, 1),
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        return cls(name, mm, size, owner=True)

    @classmethod
    def open(cls, name: str) -> ShmSegment:
        """Map an existing segment read-only (``OSError`` if it cannot be opened)."""
        if "/" in name or not name.startswith(_PREFIX):
            raise OSError(errno.EINVAL, f"not a fastio segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(
                fd, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    def unlink(self) -> None:
        """Remove the name; mappings (ours and readers') stay valid until closed."""
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.name).unlink()

    def close(self) -> None:
        """Drop the mapping (the owner also unlinks). Views handed out must be gone."""
        if self.owner:
            self.unlink()
        mm, self._mm = self._mm, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still lives: GC unmaps later
                mm.close()


def write_probe() -> tuple[str, str]:
    """Create a probe file holding a random token; returns ``(name, token)``."""
    token = secrets.token_hex(16)
    name = f"{_PREFIX}{os.getpid()}-probe-{secrets.token_hex(4)}"
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return name, token


def read_probe(name: str, token: str) -> bool:
    """Whether the probe ``name`` can be read here and holds ``token``."""
    if not name or "/" in name or not name.startswith(_PREFIX):
        return False
    try:
        return (SHM_DIR / name).read_bytes()[:64] == token.encode()
    except OSError:
        return False


def cleanup_stale() -> int:
    """Unlink segments left in ``/dev/shm`` by publishers that died (their pid is gone).

    Returns how many were removed. Only names with this module's prefix are touched.
    """
    removed = 0
    try:
        entries = list(SHM_DIR.iterdir())
    except OSError:
        return 0
    for p in entries:
        if not p.name.startswith(_PREFIX):
            continue
        try:
            pid = int(p.name[len(_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
