"""Where the publisher stages a version: :class:`VersionBuffers`, the part of
:class:`transport.weights.WeightPublisher` that acquires, prepares and retires buffers.

A version is staged in one buffer, a shared-memory segment when ``/dev/shm`` allows it
(same-host workers read it in place) and private memory otherwise. The buffer is the
version's snapshot: late joiners and re-fetches are served from it.

The buffer rule: a buffer that a worker's process may still read is never overwritten.
A shared-memory segment may be mapped by any same-host worker for as long as that
process lives (even one stopped, or declared lost), so each version gets a fresh
segment (made in the background after the previous publish, so that the kernel's
zeroing of its pages is off the update's path), and retiring a version only unlinks
its name: a worker's mapping of the unlinked file keeps that version's bytes (Linux
frees them with the last mapping). A private buffer is only read by this process's own
zero-copy sends; it is reused for a later version once no send may still read it
(ZeroMQ's message trackers).
"""

from __future__ import annotations

import contextlib
import logging
import threading

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
    _spare: _shm.ShmSegment | None
    _spare_busy: bool

    def _acquire(self, version: int, total: int) -> Staged:
        """A buffer for a new version (the buffer rule, see the module docstring).

        A shared-memory segment is never reused: a worker may hold a mapping of it for
        as long as its process lives (stopped, slow, declared lost), so every version
        gets a fresh segment and a retired one is only unlinked. A private buffer is
        read only by this process's zero-copy sends, so it is reused once none of
        them may still read it.
        """
        with self._cond:
            for v, st in sorted(self._versions.items()):
                if st is self._latest or st.seg is not None or st.capacity < total:
                    continue
                if st.sends_done() and not st.active and st.answered():
                    del self._versions[v]
                    return Staged(version, st.buf, None)
        seg: _shm.ShmSegment | None = None
        if self._use_shm:
            with self._cond:
                spare, self._spare = self._spare, None
            if spare is not None and total <= spare.size <= 2 * total:
                self._count("spare_segments_used")
                return Staged(version, spare.tensor[:total], spare)
            if spare is not None:
                spare.close()
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

    def _prepare_spare(self, size: int) -> None:
        """Create the next version's segment in the background, off the critical path
        (a fresh segment costs the kernel's zeroing of every page). It is fresh: no
        worker has seen its name, so the buffer rule holds."""
        if not self._use_shm or size == 0:
            return
        with self._cond:
            if self._closed or self._spare is not None or self._spare_busy:
                return
            self._spare_busy = True

        def make() -> None:
            seg: _shm.ShmSegment | None = None
            # On failure it is made at publish time instead, where the error is reported.
            with contextlib.suppress(OSError):
                seg = _shm.ShmSegment.create(size)
            with self._cond:
                self._spare_busy = False
                if seg is not None and not self._closed and self._spare is None:
                    self._spare, seg = seg, None
                self._cond.notify_all()
            if seg is not None:
                seg.close()

        threading.Thread(target=make, name="weights-spare-segment", daemon=True).start()

    def _retire(self) -> None:
        """Free buffers of old versions that no one can still need (lock held)."""
        old = [v for v in sorted(self._versions) if self._versions[v] is not self._latest]
        excess = len(self._versions) - self.keep_versions
        for v in old:
            if excess <= 0:
                break
            st = self._versions[v]
            if st.sends_done() and st.answered():
                st.release()
                del self._versions[v]
                excess -= 1
