"""Where the publisher stages a version: :class:`VersionBuffers`, the part of
:class:`transport.weights.WeightPublisher` that acquires, reuses and retires buffers.

A version is staged in one buffer, a shared-memory segment when ``/dev/shm`` allows it
(same-host workers read it in place) and private memory otherwise. The buffer is the
version's snapshot: late joiners and re-fetches are served from it.

The buffer rule: a buffer that a worker's process may still read is never overwritten.

* A shared-memory segment is read by the workers that asked for it (a Fetch with
  ``shm``: its *readers*), through their own mappings, from the first "bytes ready"
  notice until they answer the version (an Ack, ok or failed, or a Hello at that
  version or newer: a worker answers only once it is done with the bytes). A segment
  is packed again for a later version only when every reader of the version it holds
  has answered, or its process is known to be gone (same host, same pid and start
  time in :class:`~fastio.weight_msgs.WeightHello`). A reader that is silent but may
  still run (stopped, slow, declared lost by ``worker_timeout``) never has its segment
  rewritten: that segment leaves the pool, and is unlinked when its version retires
  (a mapping of an unlinked file keeps its bytes: Linux frees them with the last
  mapping), and the next version gets a fresh one. So a worker that verified version
  N and copies later copies exactly version N, a dead or silent worker holds no
  trainer memory beyond its own mapping, and no worker blocks reuse for good.
* Reused segments are the point: a fresh one costs the kernel's zeroing and mapping of
  every page (on the trainer) and a new mapping on every worker, several times the
  cost of packing into a warm one (bench/results). Free segments wait in a pool of
  at most ``keep_versions``.
* A private buffer is only read by this process's own zero-copy sends; it is reused
  for a later version once no send may still read it (ZeroMQ's message trackers).
"""

from __future__ import annotations

import logging

import torch

from transport.weights import shm as _shm
from transport.weights.serving import PublisherService
from transport.weights.staging import Staged

__all__ = ["VersionBuffers"]

log = logging.getLogger("transport.weights.publisher")


class VersionBuffers(PublisherService):
    """The buffers of :class:`transport.weights.WeightPublisher` (the buffer rule)."""

    # Set by WeightPublisher.__init__.
    keep_versions: int
    _use_shm: bool
    #: Segments no reader may still read, ready to be packed again.
    _free_segments: list[_shm.ShmSegment]

    def _acquire(self, version: int, total: int) -> Staged:
        """A buffer for a new version (the buffer rule, see the module docstring): a
        free or reusable one of the right size, else a new one."""
        with self._cond:
            seg = self._take_free(total)
            for v, st in sorted(self._versions.items()):
                if seg is not None:
                    break
                done = st.ledger.answered()
                if st is self._latest or not st.sends_done() or st.active or not done:
                    continue
                if st.seg is None and st.capacity >= total:
                    self._forget(v)
                    buf = st.buf
                    st.take_segment()
                    self._count("buffers_reused")
                    return Staged(version, buf, None)
                if st.seg is not None and self.core.readers_done(st.ledger):
                    self._forget(v)
                    self._recycle(st)
                    seg = self._take_free(total)
        if seg is not None:
            self._count("buffers_reused")
            return Staged(version, seg.tensor[:total], seg)
        if self._use_shm:
            try:
                seg = _shm.ShmSegment.create(total)
            except OSError as exc:
                log.warning(
                    "cannot stage %d bytes in /dev/shm (%s); using private memory", total, exc
                )
        self._count("buffers_created")
        if seg is not None:
            return Staged(version, seg.tensor, seg)
        return Staged(version, torch.empty(total, dtype=torch.uint8), None)

    def _take_free(self, total: int) -> _shm.ShmSegment | None:
        """A pooled segment that fits ``total`` without wasting more than half (lock
        held); the others stay pooled."""
        for i, seg in enumerate(self._free_segments):
            if total <= seg.size <= 2 * total or (total == 0 and seg.size == 0):
                return self._free_segments.pop(i)
        return None

    def _forget(self, version: int) -> None:
        """Drop a version from the buffers and the core (lock held)."""
        del self._versions[version]
        self.core.drop(version)

    def _recycle(self, st: Staged) -> None:
        """Take ``st``'s buffer away from it: a segment no one may read goes to the pool
        (bounded by ``keep_versions``), any other is unlinked (lock held)."""
        reusable = self.core.readers_done(st.ledger)
        seg = st.take_segment()
        if seg is None:
            return
        if reusable and not self._closed and len(self._free_segments) < self.keep_versions:
            self._free_segments.append(seg)
            return
        if not reusable:
            self._count("segments_abandoned")  # a reader may still map it: never rewritten
        seg.close()

    def _close_buffers(self) -> None:
        """Free every buffer (the publisher is closing; lock held)."""
        for st in self._versions.values():
            seg = st.take_segment()
            if seg is not None:
                seg.close()
        self._versions.clear()
        self.core.versions.clear()
        for seg in self._free_segments:
            seg.close()
        self._free_segments.clear()

    def _retire(self) -> None:
        """Free buffers of old versions that no one can still need (lock held)."""
        old = [v for v in sorted(self._versions) if self._versions[v] is not self._latest]
        excess = len(self._versions) - self.keep_versions
        for v in old:
            if excess <= 0:
                break
            st = self._versions[v]
            if st.sends_done() and st.ledger.answered():
                self._recycle(st)
                self._forget(v)
                excess -= 1
