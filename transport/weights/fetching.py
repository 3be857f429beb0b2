"""Fetching one shm/tcp version on the worker (the subscriber's thread): bind, fetch,
verify, fetch again what fails, commit (``docs/weights.md``)."""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import torch

from fastio.weight_msgs import WeightAnnounce, WeightBucket, WeightFetch
from transport import metrics
from transport.weights.binding import Binding
from transport.weights.bucket import CHECKSUM_ALGOS, BucketApplier, Hasher, _align
from transport.weights.config import SubscriberConfig
from transport.weights.core.subscriber import FetchSchedule, SubscriberCore, choose_atomic
from transport.weights.errors import WeightUpdateError
from transport.weights.reporting import Reporter
from transport.weights.routes.inflight import InFlight, Partial
from transport.weights.routes.shm import ShmReader
from transport.weights.routes.tcp import LinkClient
from transport.weights.routes.zmq import FrameReceiver
from transport.weights.streaming import BucketStream

__all__ = ["VersionFetcher"]

log = logging.getLogger("transport.weights.subscriber")


@dataclass(eq=False)
class VersionFetcher:
    """Fetches, verifies and commits shm/tcp versions for a
    :class:`~transport.weights.WeightSubscriber`; ``bind``: a manifest -> its
    :class:`~transport.weights.binding.Binding`."""

    core: SubscriberCore
    reporter: Reporter
    config: SubscriberConfig
    bind: Callable[..., Binding]
    _: KW_ONLY
    lock: Any
    loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None
    on_progress: Callable[[int, int], None] | None
    keepalive: Callable[[], None]
    endpoint: str
    update: InFlight | None = field(default=None, init=False)
    shm_ok: bool = field(default=False, init=False)
    shm: ShmReader = field(default_factory=ShmReader, init=False)
    frames: FrameReceiver = field(default_factory=FrameReceiver, init=False)
    _staging: np.ndarray[Any, Any] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        cfg, loader = self.config, self.loader
        refuses_mixed = getattr(self.lock, "refuses_mixed", False)
        self.atomic = choose_atomic(cfg.atomic, refuses_mixed, loader is not None)
        self.applier = BucketApplier(self.reporter.targets, copy_threads=cfg.copy_threads)
        try:
            self.loader_takes_version = loader is not None and (
                "version" in inspect.signature(loader).parameters
            )
        except (TypeError, ValueError):  # no signature to read
            self.loader_takes_version = False
        self.tcp = LinkClient(
            self.endpoint, self.reporter.worker_id, cfg.fetch_timeout, cfg.max_message_size,
            self.core.count,
        )  # fmt: skip

    def new_publisher(self, shm_ok: bool, link_offer: tuple[int, bytes] | None) -> None:
        """A new publisher instance: its offers replace the old one's."""
        self.tcp.new_offer(link_offer)
        self.shm_ok = shm_ok
        self.shm.close()

    def consider(self, ann: WeightAnnounce) -> None:
        """An Announce: fetch its version if the core says so."""
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
            binding = self.bind(ann.buckets, aliases=ann.aliases)
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
        n, cfg = len(ann.buckets), self.config
        sched = FetchSchedule(ann.version, n, cfg.window, cfg.retries, shm=seg is not None)
        up = InFlight(ann, seg, binding, sched)
        if seg is None:
            self.tcp.open()
        if seg is None and self.atomic:  # one staging buffer, kept between versions
            sizes = [max(0, b.nbytes) for b in ann.buckets]
            starts = list(itertools.accumulate((_align(s) for s in sizes), initial=0))
            try:
                if self._staging is None or self._staging.size < starts[-1]:
                    self._staging = None  # the old one goes before the new one is made
                    self._staging = np.empty(starts[-1], dtype=np.uint8)
            except MemoryError as exc:
                self.fail(ann.version, f"no memory to receive the version: {exc!r}")
                return
            up.stage = [self._staging[a : a + n] for a, n in zip(starts, sizes, strict=False)]
        self.update = up
        self.pump()

    def pump(self) -> None:
        """Keep ``window`` fetches in flight."""
        up = self.update
        if up is None:
            return
        shm = up.seg is not None
        r = self.reporter
        for i in up.sched.due(time.monotonic()):
            up.linked[i] = data = not shm and self.tcp.link is not None
            r.send(WeightFetch(up.ann.version, i, shm, r.pid, r.start_time, data))

    def on_bucket(self, msg: WeightBucket) -> None:
        up = self.update
        if up is None or msg.version != up.ann.version or msg.index not in up.sched.outstanding:
            self.core.count("stale_pieces")
        else:
            (self.shm if up.seg is not None else self.frames).receive(self, msg)

    def chunk_done(
        self, up: InFlight, i: int, part: Partial, t: float, ok: bool, last: bool, checksum: int
    ) -> None:
        """A chunk of bucket ``i`` taken (``ok``: in order, in bounds); at the last (or a bad)
        one, the bucket is kept, fetched again, or fails its version."""
        dt = time.monotonic() - t
        up.stats.verify_s += dt
        part.verify_s += dt
        if ok and not last:
            return
        del up.partial[i]
        info = up.ann.buckets[i]
        if not ok or part.size != info.nbytes or part.hasher.digest() != checksum:
            self.core.count("checksum_failures")
            if (error := up.sched.again(i)) is not None:
                self.fail(up.ann.version, error, "tcp" if up.seg is None else "shm")
            else:
                self.core.count("refetches")
                self.pump()
            return
        up.sched.done(i)
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        if up.seg is not None:
            chunks = [up.seg.tensor[info.shm_offset : info.shm_offset + info.nbytes]]
        else:
            chunks = part.chunks if up.stage is None else [torch.from_numpy(up.stage[i])]
        self.landed(up, i, chunks, part.stream)

    def link_failed(self, why: str) -> None:
        """The data link broke: its buckets are asked again as ZeroMQ frames."""
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
        """A bucket starting to arrive; in one-pass mode with its :class:`BucketStream`."""
        algo = up.ann.checksum_algo
        if self.atomic:
            return Partial(Hasher(algo))
        stream = BucketStream(up.ann.buckets[i], self.reporter.targets, up.binding.dests, algo)
        return Partial(stream.hasher, stream)

    def hold(self, up: InFlight, *, writing: bool = True) -> bool:
        """Enter the lock for ``up`` once (``writing``: a write follows); False: refused."""
        if not up.locked:
            try:
                self.lock.__enter__()
            except Exception as exc:  # e.g. the worker could not stop generating in time
                self.fail(up.ann.version, f"not applied, the weights were not free: {exc}")
                return False
            up.locked = True
            if writing:
                up.wrote = True
                self.reporter.mixing()
        return True

    def landed(
        self, up: InFlight, i: int, chunks: list[torch.Tensor], stream: BucketStream | None
    ) -> None:
        """Bucket ``i`` verified: kept, or (one pass) the rest its stream could not apply."""
        if self.on_progress is not None:
            self.on_progress(up.ann.version, i)
        if stream is None:
            up.received[i] = chunks
        else:
            up.stats.buckets[i]["apply_s"] = 0.0
            if stream.rest:
                ta = time.monotonic()
                if not self.hold(up):
                    return
                self.applier.apply(stream.rest_info(), chunks, up.binding.dests)
                self.applier.finish()
                up.stats.buckets[i]["apply_s"] = time.monotonic() - ta
                up.stats.apply_s += up.stats.buckets[i]["apply_s"]
        self.pump()
        if up.sched.finished:
            self.update = None
            up.stats.fetch_s = time.monotonic() - up.t0
            rest = [(b, up.received[b.index]) for b in up.ann.buckets if b.index in up.received]
            up.received.clear()
            self._commit(up, rest)

    def check_timeouts(self, now: float) -> None:
        up = self.update
        silent = self.core.silent(now, self.config.publisher_timeout)
        if up is None:
            if silent and self.shm.segments:
                self.shm.close()  # a dead publisher's segments: do not pin them
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
        """Every bucket verified: copy the rest under the lock, load, switch, Ack."""
        ann, stats = up.ann, up.stats
        if not self.hold(up, writing=False):
            return
        loading = False
        try:  # the lock's body
            try:
                for b, chunks in parts:
                    ta = time.monotonic()
                    self.applier.apply(b, chunks, up.binding.dests)
                    stats.buckets[b.index]["apply_s"] = dt = time.monotonic() - ta
                    stats.apply_s += dt
                    self.keepalive()
                self.applier.finish()
                if self.loader is not None:
                    loading, ta = True, time.monotonic()
                    kw = {"version": ann.version} if self.loader_takes_version else {}
                    self.loader(up.binding.named_tensors(parts), **kw)
                    stats.apply_s += time.monotonic() - ta
            except Exception as exc:  # a copy or the load failed part-way: the weights are mixed
                self.core.mark_mixed()
                why = f"applying failed, weights are mixed: {exc!r}"
                if loading:
                    self.core.count("loader_failures")
                    why = f"the loader raised {exc!r}; the engine's weights may be mixed"
                self.fail(ann.version, why)
                return
            self.reporter.now_at(ann.version)
        finally:
            self.unhold(up)  # after a failure marked the weights mixed: the lock sees it
        parts.clear()  # drop the frames now, not at the next update
        stats.total_s = time.monotonic() - up.t0
        phases = {"receive": stats.fetch_s, "verify": stats.verify_s, "apply": stats.apply_s}
        for phase, secs in {**phases, "total": stats.total_s}.items():
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase=phase).observe(secs)
        self.reporter.applied(stats, sum(b.nbytes for b in ann.buckets))

    def unhold(self, up: InFlight) -> None:
        """Leave the lock :meth:`hold` entered for ``up`` (if it did)."""
        if up.locked:
            up.locked = False
            self.lock.__exit__(None, None, None)

    def fail(self, version: int, error: str, route: str = "tcp") -> None:
        """Report ``version`` failed; end it if it is in flight."""
        up = self.update
        if up is not None and up.ann.version == version:
            self.update = None
            if up.wrote:  # before the lock is left: its release sees the weights mixed
                self.core.mark_mixed()
            self.unhold(up)
        self.reporter.failed(version, error, route)

    def abandon(self, why: str) -> None:
        """End the version in flight (superseded, the subscriber closing)."""
        if self.update is not None:
            self.fail(self.update.ann.version, why)
