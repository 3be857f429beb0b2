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

Whether the path is usable is decided by the subscriber, per publisher: the same boot
id and the same ``/dev/shm`` (:func:`host_id`; host names do not matter) *and* it can
read the publisher's probe file and find the expected token in it (a container with a
private ``/dev/shm`` fails this and falls back to TCP).

Ownership is a lock, not a PID: the creator of a segment (or probe) keeps a file
descriptor of it open with an exclusive ``flock`` for as long as it exists. The kernel
drops that lock when the owner dies, whatever PID namespace it lived in, so
:func:`cleanup_stale` removes exactly the files whose lock it can take. (A PID check
would unlink live segments of a container that shares ``/dev/shm`` across PID
namespaces, or keep dead ones whose PID was reused.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import time
import warnings
from pathlib import Path

import torch

__all__ = [
    "SHM_DIR",
    "Probe",
    "ShmSegment",
    "cleanup_stale",
    "host_id",
    "read_probe",
    "write_probe",
]

#: Where segments live (tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
_PREFIX = "fastio-w-"


def host_id() -> str:
    """``boot-id/shm-device:inode``: equal for two processes only on the same running
    kernel *and* with the same ``/dev/shm`` (the same tmpfs, whatever its mount point).

    Host names do not enter it: containers that share ``/dev/shm`` under other host names
    are local to each other, and a container with a private ``/dev/shm`` on the same
    kernel is not.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat(SHM_DIR)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "none"
    return f"{boot}/{shm}"


def available() -> bool:
    """Whether this host has a writable ``/dev/shm``."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmSegment:
    """A mapped file in ``/dev/shm``, viewed as a 1-D ``uint8`` tensor (:attr:`tensor`).

    Use :meth:`create` (publisher) or :meth:`open` (subscriber, read-only).
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool, lock_fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        #: The owner's descriptor holding the flock that marks the segment as live.
        self._lock_fd = lock_fd
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
        name = f"{_PREFIX}{secrets.token_hex(8)}"
        path = SHM_DIR / name
        fd = _create_locked(path, os.O_RDWR)
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
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
            raise
        return cls(name, mm, size, owner=True, lock_fd=fd)

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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        mm, self._mm = self._mm, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still lives: GC unmaps later
                mm.close()


def _create_locked(path: Path, mode: int) -> int:
    """Create ``path`` exclusively and take the owner's lock on it (see the module
    docstring); the descriptor stays open for as long as the file is live."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | mode, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Probe:
    """A probe file holding a random token, owned (locked) while this object lives."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.name = f"{_PREFIX}probe-{secrets.token_hex(6)}"
        self._fd = _create_locked(SHM_DIR / self.name, os.O_WRONLY)
        os.write(self._fd, self.token.encode())

    def close(self) -> None:
        """Unlink the probe and drop its lock."""
        with contextlib.suppress(OSError):
            (SHM_DIR / self.name).unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_probe() -> Probe:
    """Create a probe file holding a random token (:class:`Probe`: ``name``, ``token``)."""
    return Probe()


def read_probe(name: str, token: str) -> bool:
    """Whether the probe ``name`` can be read here and holds ``token``."""
    if not name or "/" in name or not name.startswith(_PREFIX):
        return False
    try:
        return (SHM_DIR / name).read_bytes()[:64] == token.encode()
    except OSError:
        return False


#: Files younger than this are left alone by :func:`cleanup_stale`: their creator may
#: be between ``open`` and ``flock``.
_GRACE_S = 10.0


def cleanup_stale() -> int:
    """Unlink segments and probes in ``/dev/shm`` whose owner is gone.

    A file is stale when its owner's ``flock`` can be taken (the kernel released it when
    the owner died, in any PID namespace). Returns how many were removed. Only names
    with this module's prefix are touched.
    """
    removed = 0
    try:
        entries = list(SHM_DIR.iterdir())
    except OSError:
        return 0
    now = time.time()
    for p in entries:
        if not p.name.startswith(_PREFIX):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < _GRACE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # the owner holds it: live
            with contextlib.suppress(OSError):
                p.unlink()
                removed += 1
        finally:
            os.close(fd)
    return removed
