"""Fetching one version on the worker side: check, fetch, verify, hold.

:class:`VersionFetch` is the part of :class:`transport.weights.WeightSubscriber` that
turns an Announce into verified buckets: it binds the manifest to the worker's model
(:class:`~transport.weights.binding.Binding`) before a byte moves, keeps ``window``
Fetches in flight over TCP (all of them through shared memory), hashes pieces as they
arrive, re-fetches what fails or times out, and hands the verified buckets to the
commit. In ``atomic=False`` mode (the default) each bucket is also copied into the model
as it is hashed (:class:`~transport.weights.streaming.BucketStream`), under the lock
held from the version's first write; ``atomic=True`` writes nothing here.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch
import zmq

from fastio.weight_msgs import WeightAnnounce, WeightBucket, WeightFetch
from transport.weights import datalink
from transport.weights import shm as _shm
from transport.weights.binding import Binding, DtypeSpec, Rename
from transport.weights.bucket import CHECKSUM_ALGOS, BucketApplier, Hasher, _align
from transport.weights.core.subscriber import FetchSchedule, SubscriberCore
from transport.weights.datalink import DataReceiver
from transport.weights.errors import WeightUpdateError
from transport.weights.results import UpdateStats
from transport.weights.streaming import BucketStream

__all__ = ["InFlight", "Partial", "VersionFetch"]

log = logging.getLogger("transport.weights.subscriber")

#: Seconds before a data link that could not be opened is tried again.
LINK_RETRY_S = 60.0

#: Hash-then-copy granularity over TCP (fits the L2 cache).
_BLOCK = 256 << 10

#: Shared-memory mappings a subscriber keeps between versions (the publisher's pool
#: holds two segments in turn for a steady stream of versions).
_KEEP_MAPPINGS = 2


class InFlight:
    """State of one version being fetched over TCP."""

    def __init__(
        self,
        ann: WeightAnnounce,
        seg: _shm.ShmSegment | None,
        binding: Binding,
        window: int,
        retries: int,
    ) -> None:
        self.ann = ann
        self.seg = seg
        self.binding = binding
        self.t0 = time.monotonic()
        # Through shared memory nothing but "ready" notices come back: ask for all.
        n = len(ann.buckets)
        self.sched = FetchSchedule(ann.version, n, n if seg is not None else window, retries)
        #: Per bucket fetched: whether its bytes were asked on the data link.
        self.linked: dict[int, bool] = {}
        self.received: dict[int, list[torch.Tensor]] = {}
        self.stats = UpdateStats(ann.version, "tcp" if seg is None else "shm", ann.total_bytes)
        self.stats.buckets = [{} for _ in ann.buckets]
        self.applied: set[int] = set()
        self.partial: dict[int, Partial] = {}
        #: Over TCP with ``atomic``: per bucket, its region of the staging buffer.
        self.stage: list[np.ndarray[Any, Any]] | None = None
        #: Whether the subscriber's lock is held for this version (streaming mode:
        #: from its first write until it commits or fails).
        self.locked = False
        #: Whether anything of this version was written into the weights.
        self.wrote = False


class Partial:
    """A bucket whose pieces are arriving: the checksum so far, the frames kept; in
    streaming mode (``atomic=False``) the stream that hashes and applies them."""

    def __init__(self, hasher: Hasher, stream: BucketStream | None = None) -> None:
        self.hasher = hasher
        self.stream = stream
        self.size = 0
        self.verify_s = 0.0
        self.chunks: list[torch.Tensor] = []


class VersionFetch:
    """The fetching half of :class:`transport.weights.WeightSubscriber`."""

    # Set by WeightSubscriber.__init__ (see its parameters).
    targets: dict[str, torch.Tensor]
    atomic: bool
    window: int
    fetch_timeout: float
    retries: int
    strict: bool
    dtype: DtypeSpec
    rename: Rename
    loader: Any
    lock: Any
    on_progress: Any
    on_applied: Any
    counters: dict[str, int]
    core: SubscriberCore
    _digest: int | None
    _applier: BucketApplier
    _cond: threading.Condition
    _shm_ok: bool
    _start_time: int
    publisher_timeout: float
    _update: InFlight | None
    _segments: dict[str, _shm.ShmSegment]
    _staging: np.ndarray[Any, Any] | None
    worker_id: str
    endpoint: str
    _poller: zmq.Poller | None
    _link: DataReceiver | None
    _link_offer: tuple[int, bytes] | None
    _link_retry_at: float
    max_message_size: int

    def _now_at(self, version: int) -> None:
        """The weights are now all of ``version``: record it, wake waiters, and tell
        ``on_applied`` (before any Ack goes out)."""
        with self._cond:
            self.core.applied(version)
            self._cond.notify_all()
        if self.on_applied is not None:
            self.on_applied(version)

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _send(self, msg: Any) -> None:
        raise NotImplementedError

    def _fail(self, version: int, error: str, transport: str = "tcp") -> None:
        raise NotImplementedError

    def _abandon(self, why: str) -> None:
        raise NotImplementedError

    def _commit(self, up: InFlight, parts: list[tuple[Any, list[torch.Tensor]]]) -> None:
        raise NotImplementedError

    # -- a version -------------------------------------------------------------------
    def _consider(self, ann: WeightAnnounce) -> None:
        up = self._update
        supersede, attempt = self.core.consider(
            ann.publisher_id, ann.version, up.ann.version if up is not None else None
        )
        if supersede:
            self._abandon(f"superseded by version {ann.version}")
        if not attempt:
            return
        try:
            if ann.checksum_algo not in CHECKSUM_ALGOS:
                raise WeightUpdateError(f"checksum {ann.checksum_algo!r} not available here")
            binding = Binding(
                ann.buckets,
                self.targets,
                aliases=ann.aliases,
                rename=self.rename,
                dtype=self.dtype,
                strict=self.strict,
                loader=self.loader is not None,
            )
        except WeightUpdateError as exc:
            self.core.give_up(ann.publisher_id, ann.version)  # retrying will not help
            self._fail(ann.version, str(exc), transport="")
            return
        seg = None
        if self._shm_ok and ann.shm_name:
            try:
                seg = self._segment(ann.shm_name)
            except OSError as exc:
                log.info("shared memory %s unusable (%s); fetching over TCP", ann.shm_name, exc)
                self._count("shm_fallbacks")
        up = InFlight(ann, seg, binding, self.window, self.retries)
        if seg is None:
            self._open_link()
        if seg is None and self.atomic:
            try:
                up.stage = self._stage_for(ann)
            except MemoryError as exc:
                self._fail(ann.version, f"no memory to receive the version: {exc!r}")
                return
        self._update = up
        self._pump()

    def _stage_for(self, ann: WeightAnnounce) -> list[np.ndarray[Any, Any]]:
        """Per bucket, where its bytes land over TCP: a region of one staging buffer
        kept from version to version (reallocated only when a version needs more).

        Each piece is hashed as it arrives, copied here while it is still in cache,
        and its frame freed at once, so the allocator hands the next piece the same
        warm memory; holding every frame until the commit instead faults in fresh
        pages for each version (bench/results). The buffer is the version's only
        copy on this side until every bucket is verified (never a mixed version)."""
        sizes = [max(0, b.nbytes) for b in ann.buckets]
        starts = list(itertools.accumulate((_align(n) for n in sizes), initial=0))
        if self._staging is None or self._staging.size < starts[-1]:
            self._staging = None  # the old one goes before the new one is made
            self._staging = np.empty(starts[-1], dtype=np.uint8)
        buf = self._staging
        return [buf[a : a + n] for a, n in zip(starts, sizes, strict=False)]

    def _segment(self, name: str) -> _shm.ShmSegment:
        # Mappings are kept from version to version (the publisher packs the same
        # segments again, so mapping anew each version would cost a page-table fill
        # per version), the most recently used _KEEP_MAPPINGS of them: an older one
        # may name a segment the publisher unlinked, whose pages this mapping pins.
        seg = self._segments.pop(name, None)
        if seg is None:
            seg = _shm.ShmSegment.open(name)
            while len(self._segments) >= _KEEP_MAPPINGS:
                self._segments.pop(next(iter(self._segments))).close()
        self._segments[name] = seg  # most recently used last
        return seg

    def _drop_segments(self) -> None:
        """Unmap every kept segment (a new or silent publisher, closing)."""
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()

    def _pump(self) -> None:
        """Keep ``window`` fetches in flight."""
        up = self._update
        if up is None:
            return
        shm = up.seg is not None
        for i in up.sched.due(time.monotonic()):
            data = not shm and self._link is not None
            up.linked[i] = data
            self._send(WeightFetch(up.ann.version, i, shm, os.getpid(), self._start_time, data))

    def _on_bucket(self, msg: WeightBucket) -> None:
        up = self._update
        if up is None or msg.version != up.ann.version or msg.index not in up.sched.outstanding:
            self._count("stale_pieces")
            return
        i = msg.index
        info = up.ann.buckets[i]
        t = time.monotonic()
        if up.seg is not None:
            self._on_shm_ready(up, msg, t)
            return
        part = up.partial.get(i)
        if part is None:
            part = up.partial[i] = self._partial(up, i)
        if msg.offset != part.size:
            # Left over from an earlier answer to this bucket (asked again): not ours.
            self._count("stale_pieces")
            return
        up.sched.progress(i, t)  # the fetch timeout counts from the last piece
        ok = True
        stage = up.stage[i] if up.stage is not None else None
        stream = part.stream
        if stream is not None and msg.chunks and not self._hold(up):
            return
        for c in msg.chunks:
            if not ok:
                break
            if not isinstance(c, np.ndarray) or c.dtype != np.uint8 or c.ndim != 1:
                ok = False
                break
            end = part.size + c.nbytes
            if end > info.nbytes:
                ok = False
                break
            if stream is not None:
                # Hash a block, copy it into the weights while it is in cache; the
                # frame is kept only for tensors that need their bytes whole.
                stream.feed(c)
                if stream.rest:
                    part.chunks.append(_u8(c))
            elif stage is not None:
                # Hash a block, then copy it while it is in the L2 cache; the frame is
                # freed once this message is handled.
                base = part.size
                for a in range(0, c.nbytes, _BLOCK):
                    block = c[a : a + _BLOCK]
                    part.hasher.update(block)
                    np.copyto(stage[base + a : base + a + block.nbytes], block)
            else:
                part.hasher.update(c)
                part.chunks.append(_u8(c))
            part.size = end
        self._piece_done(up, i, part, t, ok, msg.last, msg.checksum)

    def _piece_done(
        self, up: InFlight, i: int, part: Partial, t: float, ok: bool, last: bool, checksum: int
    ) -> None:
        """A TCP piece of bucket ``i`` was taken (``ok``: in order and in bounds): on
        the last one (or a bad one) check the bucket, then keep it or fetch it again."""
        info = up.ann.buckets[i]
        stage = up.stage[i] if up.stage is not None else None
        dt = time.monotonic() - t
        up.stats.verify_s += dt
        part.verify_s += dt
        if ok and not last:
            return
        del up.partial[i]
        ok = ok and part.size == info.nbytes and part.hasher.digest() == checksum
        if not ok:
            self._count("checksum_failures")
            error = up.sched.again(i)
            if error is not None:
                self._fail(up.ann.version, error)
                return
            self._count("refetches")
            self._pump()
            return
        up.sched.done(i)
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        self._landed(
            up, i, part.chunks if stage is None else [torch.from_numpy(stage)], part.stream
        )

    # -- the data link (transport.weights.datalink) -----------------------------------
    def _open_link(self) -> None:
        """Connect the data link the publisher offers, if not open (a TCP version)."""
        if self._link is not None or self._link_offer is None or self._poller is None:
            return
        if time.monotonic() < self._link_retry_at:
            return
        port, token = self._link_offer
        try:
            self._link = datalink.connect(
                self.endpoint, port, self.worker_id, token, min(self.fetch_timeout, 2.0)
            )
        except (OSError, ValueError) as exc:
            # Not reachable (a firewall, another network namespace) or refused: ZeroMQ
            # frames, and no new attempt for a while (it blocks this thread).
            self._link_retry_at = time.monotonic() + LINK_RETRY_S
            self._count("data_link_refused")
            log.info("weight data link unavailable (%s); fetching as ZeroMQ frames", exc)
            return
        self._poller.register(self._link, zmq.POLLIN)
        self._count("data_links")

    def _close_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            if self._poller is not None:
                self._poller.unregister(link)
            link.close()

    def _link_failed(self, why: str) -> None:
        """The data link broke: close it; the buckets asked on it are asked again as
        ZeroMQ frames (the link is opened again for the next version)."""
        self._count("data_link_failures")
        log.warning("weight data link closed: %s", why)
        self._close_link()
        up = self._update
        if up is None or up.seg is not None:
            return
        for i in [i for i in up.sched.outstanding if up.linked.get(i)]:
            up.sched.requeue(i)
            up.partial.pop(i, None)
        self._pump()

    def _on_data(self) -> None:
        """A piece on the data link: its bytes go straight where they belong."""
        link = self._link
        assert link is not None
        try:
            p = link.header()
            if p.nbytes > self.max_message_size:
                # Never read gigabytes away on the word of a header.
                raise datalink.DataLinkError(f"a piece of {p.nbytes} bytes (larger than allowed)")
            up = self._update
            if (
                up is None
                or up.seg is not None
                or p.version != up.ann.version
                or p.bucket not in up.sched.outstanding
            ):
                self._count("stale_pieces")
                link.discard(p.nbytes)
                return
            i = p.bucket
            if p.offset + p.nbytes > up.ann.buckets[i].nbytes:
                raise datalink.DataLinkError(f"a piece beyond the end of bucket {i}")
            t = time.monotonic()
            part = up.partial.get(i)
            if part is None:
                part = up.partial[i] = self._partial(up, i)
            if p.offset != part.size:
                # Left over from an earlier answer to this bucket (asked again).
                self._count("stale_pieces")
                link.discard(p.nbytes)
                return
            up.sched.progress(i, t)
            ok = True
            if not self._take(up, i, part, link, p.nbytes):
                return  # the version failed (its lock refused); the bytes were read away
        except datalink.DataLinkError as exc:
            self._link_failed(str(exc))
            return
        self._piece_done(up, i, part, t, ok, p.last, p.checksum)

    def _take(self, up: InFlight, i: int, part: Partial, link: DataReceiver, n: int) -> bool:
        """Receive ``n`` bytes of bucket ``i`` from the link where they go: the weights
        (one-pass mode), the staging buffer (atomic), or a buffer kept for the bucket."""
        stream = part.stream
        if stream is not None:
            if n and not self._hold(up):
                link.discard(n)
                return False
            if stream.rest:
                # Tensors that need their bytes whole: keep the piece for them.
                c = np.empty(n, dtype=np.uint8)
                link.fill(c)
                stream.feed(c)
                part.chunks.append(torch.from_numpy(c))
            else:
                stream.take(n, link.fill, link.scratch(_BLOCK))
        elif up.stage is not None:
            stage = up.stage[i]
            base = part.size
            for a in range(0, n, _BLOCK):
                block = stage[base + a : base + min(a + _BLOCK, n)]
                link.fill(block)
                part.hasher.update(block)
        else:
            c = np.empty(n, dtype=np.uint8)
            link.fill(c)
            part.hasher.update(c)
            part.chunks.append(torch.from_numpy(c))
        part.size += n
        return True

    def _on_shm_ready(self, up: InFlight, msg: WeightBucket, t: float) -> None:
        """Bytes of bucket ``msg.index`` are packed in the segment: hash them in place
        as they come; on the last notice compare with the checksum."""
        assert up.seg is not None
        i = msg.index
        info = up.ann.buckets[i]
        part = up.partial.get(i)
        if part is None:
            part = up.partial[i] = self._partial(up, i)
        up.sched.progress(i, t)
        lo = info.shm_offset + msg.offset
        if (
            msg.chunks
            or msg.offset != part.size
            or msg.nbytes < 0
            or msg.offset + msg.nbytes > info.nbytes
            or info.shm_offset + info.nbytes > up.seg.size
        ):
            self._fail(up.ann.version, f"bad shared-memory notice for bucket {i}", "shm")
            return
        if part.stream is not None:
            if msg.nbytes and not self._hold(up):
                return
            part.stream.feed(up.seg.tensor[lo : lo + msg.nbytes].numpy())
        else:
            part.hasher.update(up.seg.tensor[lo : lo + msg.nbytes].numpy())
        part.size += msg.nbytes
        dt = time.monotonic() - t
        part.verify_s += dt
        up.stats.verify_s += dt
        if not msg.last:
            return
        up.sched.done(i)
        del up.partial[i]
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        if part.size != info.nbytes or part.hasher.digest() != msg.checksum:
            # The segment is the snapshot itself: fetching again would read the same bytes.
            self._count("checksum_failures")
            self._fail(
                up.ann.version,
                f"bucket {i} of version {up.ann.version} fails its checksum in shared memory",
                "shm",
            )
            return
        self._landed(
            up,
            i,
            [up.seg.tensor[info.shm_offset : info.shm_offset + info.nbytes]],
            part.stream,
        )

    def _partial(self, up: InFlight, i: int) -> Partial:
        """A bucket starting to arrive; in streaming mode with its :class:`BucketStream`."""
        algo = up.ann.checksum_algo
        if self.atomic:
            return Partial(Hasher(algo))
        stream = BucketStream(up.ann.buckets[i], self.targets, up.binding.dests, algo)
        return Partial(stream.hasher, stream)

    def _hold(self, up: InFlight) -> bool:
        """Streaming mode: enter the lock before the version's first write, once (it is
        left when the version commits or fails). False when the lock refused: the
        version failed, nothing written."""
        if up.locked:
            return True
        try:
            self.lock.__enter__()
        except Exception as exc:  # e.g. the worker could not stop generating in time
            self._fail(up.ann.version, f"not applied, the weights were not free: {exc}")
            return False
        up.locked = up.wrote = True
        # From the first write the weights hold no complete version: report -1 until
        # the commit (``_now_at``) or, if the version fails, until a later one lands;
        # the previous version's digest no longer describes them (``_fail`` sends the
        # mixed weights' digest).
        self.core.wrote()
        self._digest = None
        return True

    def _unhold(self, up: InFlight) -> None:
        """Leave the lock :meth:`_hold` or the commit entered for ``up`` (if it did)."""
        if up.locked:
            up.locked = False
            self.lock.__exit__(None, None, None)

    def _landed(
        self, up: InFlight, i: int, chunks: list[torch.Tensor], stream: BucketStream | None
    ) -> None:
        """Bucket ``i`` arrived and is verified: keep it, or, streaming, apply what its
        stream could not (tensors that need their bytes whole)."""
        up.received[i] = chunks
        if self.on_progress is not None:
            self.on_progress(up.ann.version, i)
        if stream is not None:
            # The copy of the plain tensors ran with the checksum (in ``verify_s``).
            up.stats.buckets[i]["apply_s"] = 0.0
            if stream.rest:
                ta = time.monotonic()
                if not self._hold(up):
                    return
                self._applier.apply(stream.rest_info(), chunks, up.binding.dests)
                self._applier.finish()
                up.stats.buckets[i]["apply_s"] = time.monotonic() - ta
                up.stats.apply_s += up.stats.buckets[i]["apply_s"]
            up.applied.add(i)
            up.received[i] = []  # applied: the frames can go
        self._pump()
        if up.sched.finished:
            self._update = None
            up.stats.fetch_s = time.monotonic() - up.t0
            try:
                self._commit(
                    up,
                    [
                        (b, up.received[b.index])
                        for b in up.ann.buckets
                        if b.index not in up.applied
                    ],
                )
            finally:
                up.received.clear()

    def _check_timeouts(self, now: float) -> None:
        up = self._update
        silent = self.core.silent(now, self.publisher_timeout)
        if up is None:
            if silent and self._segments:
                self._drop_segments()  # a dead publisher's segments: do not pin them
            return
        if silent:
            quiet = now - self.core.last_heard
            self._fail(up.ann.version, f"publisher silent for {quiet:.1f} s (dead?) mid-update")
            return
        again, error = up.sched.timeouts(now, self.fetch_timeout)
        if error is not None:
            self._fail(up.ann.version, error)
            return
        for i in again:
            self._count("refetches")
            up.partial.pop(i, None)
        self._pump()


def _u8(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    """A uint8 tensor over a received chunk, no copy (frames from zmq are writable)."""
    if not arr.flags.writeable:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)
