"""The publisher's staged versions and their buffers: :class:`VersionStore`, a part
of :class:`~transport.weights.WeightPublisher` (used under its lock, by its serving
thread and by :meth:`~transport.weights.WeightPublisher.publish`).

A version is staged in one buffer (a ``/dev/shm`` segment, else private memory), the
snapshot that late joiners and re-fetches are served from. The buffer rule
(``docs/PROTOCOL.md``): a segment is packed again only when no process may still read
it (a silent reader's leaves the pool); free segments wait in a pool of at most
``keep_versions``; a private buffer is reused once no zero-copy send reads it.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from transport.weights.core.publisher import PublisherCore
from transport.weights.routes import shm as _shm
from transport.weights.staging import Staged

__all__ = ["VersionStore"]

log = logging.getLogger("transport.weights.publisher")


class VersionStore:
    """The staged versions by number, the latest, and the free segments.

    Parameters
    ----------
    core, cond:
        The publisher's protocol core (who must answer, who may still read) and lock.
    use_shm:
        Stage in shared memory (else private memory).
    keep_versions:
        Versions that keep their buffer when no one needs them, and free segments kept.
    """

    def __init__(
        self, core: PublisherCore, cond: threading.Condition, use_shm: bool, keep_versions: int
    ) -> None:
        self.core = core
        self.cond = cond
        self.use_shm = use_shm
        self.keep_versions = keep_versions
        self.versions: dict[int, Staged] = {}
        self.latest: Staged | None = None
        self.closed = False
        #: Segments no reader may still read, ready to be packed again.
        self._free: list[_shm.ShmSegment] = []

    def add(self, st: Staged) -> None:
        """``st`` was announced: the latest version."""
        self.versions[st.version] = st
        self.latest = st

    def acquire(self, version: int, total: int) -> Staged:
        """A buffer for a new version: a free or reusable one of the right size, else a
        new one (takes the lock; a new segment is made outside it)."""
        with self.cond:
            seg = self._take_free(total)
            for v, st in sorted(self.versions.items()):
                if seg is not None:
                    break
                done = st.ledger.answered()
                if st is self.latest or not st.sends_done() or st.active or not done:
                    continue
                if st.seg is None and st.capacity >= total:
                    self.forget(v)
                    buf = st.buf
                    st.take_segment()
                    self.core.count("buffers_reused")
                    return Staged(version, buf, None)
                if st.seg is not None and self.core.readers_done(st.ledger):
                    self.forget(v)
                    self._recycle(st)
                    seg = self._take_free(total)
        if seg is not None:
            self.core.count("buffers_reused")
            return Staged(version, seg.tensor[:total], seg)
        if self.use_shm:
            try:
                seg = _shm.ShmSegment.create(total)
            except OSError as exc:
                log.warning(
                    "cannot stage %d bytes in /dev/shm (%s); using private memory", total, exc
                )
        self.core.count("buffers_created")
        if seg is not None:
            return Staged(version, seg.tensor, seg)
        return Staged(version, torch.empty(total, dtype=torch.uint8), None)

    def _take_free(self, total: int) -> _shm.ShmSegment | None:
        """A pooled segment that fits ``total`` without wasting more than half (lock
        held); the others stay pooled."""
        for i, seg in enumerate(self._free):
            if total <= seg.size <= 2 * total or (total == 0 and seg.size == 0):
                return self._free.pop(i)
        return None

    def forget(self, version: int) -> None:
        """Drop a version from the buffers and the core (lock held)."""
        del self.versions[version]
        self.core.drop(version, time.monotonic())

    def _recycle(self, st: Staged) -> None:
        """Take ``st``'s buffer away from it: a segment no one may read goes to the pool
        (bounded by ``keep_versions``), any other is unlinked (lock held)."""
        reusable = self.core.readers_done(st.ledger)
        seg = st.take_segment()
        if seg is None:
            return
        if reusable and not self.closed and len(self._free) < self.keep_versions:
            self._free.append(seg)
            return
        if not reusable:
            self.core.count("segments_abandoned")  # a reader may still map it: never rewritten
        seg.close()

    def close(self) -> None:
        """Free every buffer (the publisher is closing; lock held)."""
        for st in self.versions.values():
            seg = st.take_segment()
            if seg is not None:
                seg.close()
        self.versions.clear()
        self.core.versions.clear()
        for seg in self._free:
            seg.close()
        self._free.clear()

    def retire(self) -> None:
        """Free buffers of old versions that no one can still need (lock held)."""
        old = [v for v in sorted(self.versions) if self.versions[v] is not self.latest]
        excess = len(self.versions) - self.keep_versions
        for v in old:
            if excess <= 0:
                break
            st = self.versions[v]
            if st.sends_done() and st.ledger.answered():
                self._recycle(st)
                self.forget(v)
                excess -= 1
