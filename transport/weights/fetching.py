"""Fetching one version on the worker side (the subscriber's thread): check, fetch,
verify, hold.

:class:`VersionFetcher` binds the manifest to the model before a byte moves, keeps
``window`` Fetches in flight over TCP (all of them through shared memory), hashes chunks
as they arrive, re-fetches what fails or times out and commits the verified buckets;
with ``atomic=False`` each bucket is also copied into the model as it is hashed
(:class:`~transport.weights.streaming.BucketStream`), under the lock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from fastio.weight_msgs import WeightAnnounce, WeightBucket, WeightFetch
from transport import metrics
from transport.weights.binding import Binding, DtypeSpec, Rename
from transport.weights.bucket import BucketApplier
from transport.weights.config import SubscriberConfig
from transport.weights.core.subscriber import FetchSchedule, SubscriberCore
from transport.weights.errors import WeightUpdateError
from transport.weights.layout import CHECKSUM_ALGOS, Hasher, _align
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes import shm as _shm
from transport.weights.routes.shm import ShmReader
from transport.weights.routes.tcp import LinkClient
from transport.weights.routes.zmq import receive_frames
from transport.weights.streaming import BucketStream

__all__ = ["InFlight", "Partial", "VersionFetcher"]

log = logging.getLogger("transport.weights.subscriber")


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
    """A bucket whose chunks are arriving: the checksum so far, the frames kept; in
    streaming mode (``atomic=False``) the stream that hashes and applies them."""

    def __init__(self, hasher: Hasher, stream: BucketStream | None = None) -> None:
        self.hasher = hasher
        self.stream = stream
        self.size = 0
        self.verify_s = 0.0
        self.chunks: list[torch.Tensor] = []


class VersionFetcher:
    """Fetches, verifies and commits shm/tcp versions for a
    :class:`~transport.weights.WeightSubscriber` (its thread).

    Parameters
    ----------
    core, reporter:
        The subscriber's protocol core and its :class:`~transport.weights.reporting.Reporter`.
    config:
        The subscriber's settings.
    targets, applier:
        The tensors written in place and the copier into them.
    lock:
        Held while the weights are written (see :class:`~transport.weights.WeightSubscriber`).
    send, keepalive:
        Send a message to the publisher; say Hello if one is due (inside a long copy).
    """

    def __init__(
        self,
        core: SubscriberCore,
        reporter: Reporter,
        config: SubscriberConfig,
        targets: dict[str, torch.Tensor],
        applier: BucketApplier,
        *,
        atomic: bool,
        lock: Any,
        dtype: DtypeSpec,
        rename: Rename,
        loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None,
        on_progress: Callable[[int, int], None] | None,
        send: Callable[[Any], None],
        keepalive: Callable[[], None],
        endpoint: str,
        worker_id: str,
    ) -> None:
        self.core = core
        self.reporter = reporter
        self.config = config
        self.targets = targets
        self.applier = applier
        self.atomic = atomic
        self.lock = lock
        self.dtype = dtype
        self.rename = rename
        self.loader = loader
        self.on_progress = on_progress
        self.send = send
        self.keepalive = keepalive
        self.endpoint = endpoint
        self.worker_id = worker_id
        #: The version being fetched (``None``: none).
        self.update: InFlight | None = None
        #: Whether the publisher's shared memory is readable here (its handshake).
        self.shm_ok = False
        self._staging: np.ndarray[Any, Any] | None = None
        #: The shm route's mappings and the tcp route's data link.
        self.shm = ShmReader()
        self.tcp = LinkClient(
            endpoint, worker_id, config.fetch_timeout, config.max_message_size, core.count
        )

    def new_publisher(self, shm_ok: bool, link_offer: tuple[int, bytes] | None) -> None:
        """A new publisher instance: its offers replace the old one's."""
        self.tcp.new_offer(link_offer)
        self.shm_ok = shm_ok
        self.shm.drop()

    # -- a version -------------------------------------------------------------------
    def consider(self, ann: WeightAnnounce) -> None:
        up = self.update
        supersede, attempt = self.core.consider(
            ann.publisher_id, ann.version, up.ann.version if up is not None else None
        )
        if supersede:
            self.abandon(f"superseded by version {ann.version}")
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
                strict=self.config.strict,
                loader=self.loader is not None,
            )
        except WeightUpdateError as exc:
            self.core.give_up(ann.publisher_id, ann.version)  # retrying will not help
            self.fail(ann.version, str(exc), route="")
            return
        seg = None
        if self.shm_ok and ann.shm_name:
            try:
                seg = self.shm.open(ann.shm_name)
            except OSError as exc:
                log.info("shared memory %s unusable (%s); fetching over TCP", ann.shm_name, exc)
                self.core.count("shm_fallbacks")
        up = InFlight(ann, seg, binding, self.config.window, self.config.retries)
        if seg is None:
            self.tcp.open()
        if seg is None and self.atomic:
            try:
                up.stage = self._stage_for(ann)
            except MemoryError as exc:
                self.fail(ann.version, f"no memory to receive the version: {exc!r}")
                return
        self.update = up
        self.pump()

    def _stage_for(self, ann: WeightAnnounce) -> list[np.ndarray[Any, Any]]:
        """Per bucket, where its bytes land over TCP: a region of one staging buffer
        kept between versions (grown when a version needs more). Each chunk is hashed
        and copied here while in cache and its frame freed at once, so the next chunk
        reuses warm memory; nothing reaches the weights before every bucket verified."""
        sizes = [max(0, b.nbytes) for b in ann.buckets]
        starts = list(itertools.accumulate((_align(n) for n in sizes), initial=0))
        if self._staging is None or self._staging.size < starts[-1]:
            self._staging = None  # the old one goes before the new one is made
            self._staging = np.empty(starts[-1], dtype=np.uint8)
        buf = self._staging
        return [buf[a : a + n] for a, n in zip(starts, sizes, strict=False)]

    def pump(self) -> None:
        """Keep ``window`` fetches in flight."""
        up = self.update
        if up is None:
            return
        shm = up.seg is not None
        for i in up.sched.due(time.monotonic()):
            data = not shm and self.tcp.link is not None
            up.linked[i] = data
            self.send(
                WeightFetch(
                    up.ann.version, i, shm, self.reporter.pid, self.reporter.start_time, data
                )
            )

    def on_bucket(self, msg: WeightBucket) -> None:
        up = self.update
        if up is None or msg.version != up.ann.version or msg.index not in up.sched.outstanding:
            self.core.count("stale_pieces")
            return
        t = time.monotonic()
        if up.seg is not None:
            self.shm.ready(self, up, msg, t)
            return
        receive_frames(self, up, msg, t)

    def chunk_done(
        self, up: InFlight, i: int, part: Partial, t: float, ok: bool, last: bool, checksum: int
    ) -> None:
        """A TCP chunk of bucket ``i`` was taken (``ok``: in order and in bounds): on
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
            self.core.count("checksum_failures")
            error = up.sched.again(i)
            if error is not None:
                self.fail(up.ann.version, error)
                return
            self.core.count("refetches")
            self.pump()
            return
        up.sched.done(i)
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        self.landed(up, i, part.chunks if stage is None else [torch.from_numpy(stage)], part.stream)

    def link_failed(self, why: str) -> None:
        """The data link broke: the buckets asked on it are asked again as ZeroMQ
        frames (the link is opened again for the next version)."""
        self.core.count("data_link_failures")
        log.warning("weight data link closed: %s", why)
        self.tcp.close()
        up = self.update
        if up is None or up.seg is not None:
            return
        for i in [i for i in up.sched.outstanding if up.linked.get(i)]:
            up.sched.requeue(i)
            up.partial.pop(i, None)
        self.pump()

    def partial(self, up: InFlight, i: int) -> Partial:
        """A bucket starting to arrive; in streaming mode with its :class:`BucketStream`."""
        algo = up.ann.checksum_algo
        if self.atomic:
            return Partial(Hasher(algo))
        stream = BucketStream(up.ann.buckets[i], self.targets, up.binding.dests, algo)
        return Partial(stream.hasher, stream)

    def hold(self, up: InFlight) -> bool:
        """Streaming mode: enter the lock before the version's first write, once (it is
        left when the version commits or fails). False when the lock refused: the
        version failed, nothing written."""
        if up.locked:
            return True
        try:
            self.lock.__enter__()
        except Exception as exc:  # e.g. the worker could not stop generating in time
            self.fail(up.ann.version, f"not applied, the weights were not free: {exc}")
            return False
        up.locked = up.wrote = True
        # From the first write the weights hold no complete version: report -1 (and
        # no longer the old digest) until a version commits.
        self.reporter.mixing()
        return True

    def unhold(self, up: InFlight) -> None:
        """Leave the lock :meth:`hold` or the commit entered for ``up`` (if it did)."""
        if up.locked:
            up.locked = False
            self.lock.__exit__(None, None, None)

    def landed(
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
                if not self.hold(up):
                    return
                self.applier.apply(stream.rest_info(), chunks, up.binding.dests)
                self.applier.finish()
                up.stats.buckets[i]["apply_s"] = time.monotonic() - ta
                up.stats.apply_s += up.stats.buckets[i]["apply_s"]
            up.applied.add(i)
            up.received[i] = []  # applied: the frames can go
        self.pump()
        if up.sched.finished:
            self.update = None
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

    def check_timeouts(self, now: float) -> None:
        up = self.update
        silent = self.core.silent(now, self.config.publisher_timeout)
        if up is None:
            if silent and self.shm.segments:
                self.shm.drop()  # a dead publisher's segments: do not pin them
            return
        if silent:
            quiet = now - self.core.last_heard
            self.fail(up.ann.version, f"publisher silent for {quiet:.1f} s (dead?) mid-update")
            return
        again, error = up.sched.timeouts(now, self.config.fetch_timeout)
        if error is not None:
            self.fail(up.ann.version, error)
            return
        for i in again:
            self.core.count("refetches")
            up.partial.pop(i, None)
        self.pump()

    def _commit(self, up: InFlight, parts: list[tuple[Any, list[torch.Tensor]]]) -> None:
        """Every bucket verified: copy what is not in yet under the lock (one pass holds
        it since the first write), run the loader, switch the version, Ack."""
        ann, stats = up.ann, up.stats
        if not up.locked:
            try:
                self.lock.__enter__()
            except Exception as exc:  # e.g. the worker could not stop generating in time
                self.fail(ann.version, f"not applied, the weights were not free: {exc}")
                return
            up.locked = True
        try:  # the lock's body (not a `with`: a lock that refuses fails the version)
            try:
                for b, chunks in parts:
                    up.wrote = True
                    ta = time.monotonic()
                    self.applier.apply(b, chunks, up.binding.dests)
                    stats.buckets[b.index]["apply_s"] = dt = time.monotonic() - ta
                    stats.apply_s += dt
                    self.keepalive()
                self.applier.finish()
            except Exception as exc:  # a copy failed half-way: the weights are mixed
                self.core.consistent = False
                self.fail(ann.version, f"applying failed, weights are mixed: {exc!r}")
                return
            if self.loader is not None:
                ta = time.monotonic()
                try:
                    self.loader(up.binding.named_tensors(parts))
                except Exception as exc:
                    self.core.consistent = False
                    self.core.count("loader_failures")
                    why = f"the loader raised {exc!r}; the engine's weights may be mixed"
                    self.fail(ann.version, why)
                    return
                stats.apply_s += time.monotonic() - ta
            # Before the Ack: once the trainer hears "applied", the engine stamps it.
            self.reporter.now_at(ann.version)
        finally:
            # After a failure marked the weights mixed: the lock sees it.
            self.unhold(up)
        parts.clear()  # drop the frames now, not at the next update
        stats.total_s = time.monotonic() - up.t0
        for phase, secs in (
            ("receive", stats.fetch_s),
            ("verify", stats.verify_s),
            ("apply", stats.apply_s),
            ("total", stats.total_s),
        ):
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase=phase).observe(secs)
        self.reporter.applied(stats, sum(b.nbytes for b in ann.buckets))

    def fail(self, version: int, error: str, route: str = "tcp") -> None:
        """Report ``version`` failed; if it is the one in flight, end it (leaving the
        lock after the weights are marked mixed, if they are)."""
        up = self.update
        if up is not None and up.ann.version == version:
            self.update = None
            if up.wrote:
                self.core.wrote()
            self.unhold(up)
        self.reporter.failed(version, error, route)

    def abandon(self, why: str) -> None:
        """End the version in flight (superseded, the subscriber closing)."""
        if self.update is not None:
            self.fail(self.update.ann.version, why)
