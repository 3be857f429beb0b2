"""The shm route: a version staged in a file under ``/dev/shm``, mapped read-only by the
workers on its host (:class:`ShmReader`); the creator's ``flock`` marks a live segment
(``docs/weights.md``, "Shared memory")."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import time
from pathlib import Path

import numpy as np
import torch

from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightBucket
from transport.weights.routes import Receiver, Tracker
from transport.weights.routes.zmq import FrameSender, _u8, begin, part_of, take

__all__ = ["NOTICE_BYTES", "SHM_DIR", "NoticeSender", "Probe", "ShmReader", "ShmSegment",
           "cleanup_stale", "host_id", "read_probe", "write_probe"]  # fmt: skip

#: Where segments live (tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
_PREFIX = "fastio-w-"
_GRACE_S = 10.0  # younger files may be between open and flock: left alone
#: Same-host workers get a "bytes ready" notice at most every this many packed bytes.
NOTICE_BYTES = 8 << 20
#: Mappings a worker keeps between versions (the publisher's pool alternates two).
KEEP_MAPPINGS = 2


def host_id() -> str:
    """``boot-id/shm-device:inode``: equal for two processes only on the same running
    kernel with the same ``/dev/shm``."""
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
    """A mapped file in ``/dev/shm`` as a 1-D ``uint8`` :attr:`tensor`: :meth:`create`
    (publisher) or :meth:`open` (subscriber, read-only)."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool, lock_fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._lock_fd = lock_fd  # the owner's flock: the segment is live
        self._mm: mmap.mmap | None = mm
        self.tensor = _u8(np.frombuffer(mm, dtype=np.uint8)[:size])

    @classmethod
    def create(cls, size: int, kind: str = "") -> ShmSegment:
        """A new segment of ``size`` bytes (``kind``: a name prefix), reserved up front (a
        full ``/dev/shm`` raises ``OSError`` here, not ``SIGBUS`` on a write)."""
        name = f"{_PREFIX}{kind}{secrets.token_hex(8)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if size:
                os.posix_fallocate(fd, 0, size)
            mm = _map(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        return cls(name, mm, size, owner=True, lock_fd=fd)

    @classmethod
    def open(cls, name: str) -> ShmSegment:
        """Map an existing segment read-only (``OSError`` if it cannot be)."""
        if not _ours(name):
            raise OSError(errno.EINVAL, f"not a fastio segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return cls(name, _map(fd, size, mmap.PROT_READ), size, owner=False)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Drop the mapping (the owner also unlinks)."""
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        mm, self._mm = self._mm, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still lives: GC unmaps later
                mm.close()


def _map(fd: int, size: int, prot: int) -> mmap.mmap:
    return mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)


def _ours(name: str) -> bool:
    return "/" not in name and name.startswith(_PREFIX)


class Probe:
    """A probe file holding a random :attr:`token`, owned (locked) while this lives."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self._seg = ShmSegment.create(len(self.token), "probe-")
        self._seg.tensor.copy_(torch.frombuffer(bytearray(self.token.encode()), dtype=torch.uint8))
        self.name = self._seg.name

    def close(self) -> None:
        self._seg.close()


#: A probe file holding a random token (:class:`Probe`).
write_probe = Probe


def read_probe(name: str, token: str) -> bool:
    """Whether the probe ``name`` can be read here and holds ``token``."""
    if not _ours(name):
        return False
    try:
        return (SHM_DIR / name).read_bytes()[:64] == token.encode()
    except OSError:
        return False


def cleanup_stale() -> int:
    """Unlink the segments and probes whose owner is gone (its ``flock`` can be taken);
    how many were removed."""
    removed = 0
    now = time.time()
    for p in SHM_DIR.glob(f"{_PREFIX}*"):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            with contextlib.suppress(OSError):  # the owner holds its flock: live
                if now - os.fstat(fd).st_mtime >= _GRACE_S:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    p.unlink()
                    removed += 1
        finally:
            os.close(fd)
    return removed


class ShmReader:
    """The worker's side: its mappings of the publisher's segments and the notices."""

    def __init__(self) -> None:
        self.segments: dict[str, ShmSegment] = {}

    def open(self, name: str) -> ShmSegment:
        """Map ``name``, or reuse its mapping; the most recent ``KEEP_MAPPINGS`` stay."""
        seg = self.segments.pop(name, None)
        if seg is None:
            seg = ShmSegment.open(name)
            while len(self.segments) >= KEEP_MAPPINGS:
                self.segments.pop(next(iter(self.segments))).close()
        self.segments[name] = seg  # most recently used last
        return seg

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    def receive(self, f: Receiver, msg: WeightBucket | None) -> None:
        """A notice: bytes of bucket ``msg.index`` are packed; hashed in place."""
        up = f.update
        assert msg is not None and up is not None and up.seg is not None
        i, t = msg.index, time.monotonic()
        info = up.ann.buckets[i]
        lo = info.shm_offset + msg.offset
        if (
            msg.chunks
            or msg.offset != part_of(f, up, i).size
            or msg.nbytes < 0
            or msg.offset + msg.nbytes > info.nbytes
            or info.shm_offset + info.nbytes > up.seg.size
        ):
            f.fail(up.ann.version, f"bad shared-memory notice for bucket {i}", "shm")
            return
        part = begin(f, up, i, msg.offset, msg.nbytes, t)
        if part is None:  # the lock refused its first write
            return
        take(part, up.seg.tensor[lo : lo + msg.nbytes].numpy(), msg.nbytes, None, keep=False)
        f.chunk_done(up, i, part, t, True, msg.last, msg.checksum)


class _Done:
    done = True  # a notice reads nothing of the buffer once queued


class NoticeSender(FrameSender):
    """The trainer side: "bytes ready" notices (``WeightBucket`` without chunks), at most
    one per :data:`NOTICE_BYTES` packed."""

    def span(self, start: int, ready: int, total: int, complete: bool, step: int) -> int | None:
        return ready if complete or ready - start >= max(step, NOTICE_BYTES) else None

    def send(self, ident: bytes, wid: str, msg: WeightBucket) -> Tracker | None:
        return _Done() if self.out.reply(ident, VERSION_1.encode(msg)) is not False else None
