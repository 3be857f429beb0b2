"""The worker's side of the ``ipc`` route (:class:`IpcReceiver`, a part of
:class:`~transport.weights.WeightSubscriber`, run in its thread).

A worker takes ``ipc`` when it copies into its target as is (no ``loader``, ``dtype`` or
``rename``) and the publisher runs on its host: once it holds the latest version it asks
for the slots (``IpcHello``), opens the ``IpcOffer``, applies versions from ``IpcReady``
notices and acks each slot (``IpcAck``) and each version (``WeightAck(via="ipc")``).
While the slots are open an Announce is kept as the fallback: a version that fails
here, or makes no progress for ``publisher_timeout``, is fetched by shm/tcp.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastio.ipc_msgs import IpcAck, IpcOffer, IpcReady
from fastio.weight_msgs import WeightAnnounce
from transport import metrics
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.fetching import VersionFetcher
from transport.weights.ipc import IpcImporter, IpcRefused
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats

__all__ = ["PATHS", "IpcReceiver", "ipc_eligible"]

log = logging.getLogger("transport.weights.subscriber")

#: Values of ``WeightSubscriber(path=...)`` (``None``: whatever the publisher offers).
PATHS = ("ipc", "shm", "tcp")


def ipc_eligible(path: str | None, target: Any, loader: Any, dtype: Any, rename: Any) -> bool:
    """Whether a subscriber built with these parameters may take the ``ipc`` path;
    raises ``ValueError`` for an unknown ``path`` or ``path="ipc"`` that cannot be."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, not {path!r}")
    eligible = (
        path in (None, "ipc")
        and target is not None
        and loader is None
        and dtype is None
        and rename is None
    )
    if path == "ipc" and not eligible:
        raise ValueError("path='ipc' copies into `target` as is: no loader, dtype or rename")
    return eligible


class IpcReceiver:
    """The ``ipc`` route of a :class:`~transport.weights.WeightSubscriber` (its thread).

    Parameters
    ----------
    core, reporter, fetcher:
        The subscriber's protocol core, reporter and shm/tcp fetcher (the fallback).
    targets:
        The tensors written in place.
    eligible:
        From :func:`ipc_eligible`.
    atomic:
        Verify every bucket before the first write (the route's default).
    lock, send:
        As the fetcher's.
    publisher_timeout:
        Seconds without progress on this route before an announced version is fetched
        by shm/tcp.
    """

    def __init__(
        self,
        core: SubscriberCore,
        reporter: Reporter,
        fetcher: VersionFetcher,
        targets: dict[str, Any],
        *,
        eligible: bool,
        atomic: bool,
        lock: Any,
        send: Callable[[Any], None],
        worker_id: str,
        host: str,
        publisher_timeout: float,
    ) -> None:
        self.core = core
        self.reporter = reporter
        self.fetcher = fetcher
        self.targets = targets
        self.eligible = eligible
        self.atomic = atomic
        self.lock = lock
        self.send = send
        self.worker_id = worker_id
        self.host = host
        self.publisher_timeout = publisher_timeout
        self.importer: IpcImporter | None = None
        self.pub_host = ""
        self._asked = ""  # the publisher id an IpcHello went to
        self.opened = False
        self._deferred: WeightAnnounce | None = None
        self._progress = 0.0  # monotonic time of the last IpcReady or deferral
        self._failed: set[int] = set()
        self._t0 = 0.0
        #: Why the ipc route was refused ("" if it was not).
        self.refused = ""

    def hello(self, *, up_to_date: bool) -> None:
        """Ask this publisher for its ipc slots, once, when this worker could take
        them and holds the latest version (a late joiner first catches up from the
        snapshot by shm/tcp: the ipc path carries only versions whole)."""
        if (
            not self.eligible
            or self._asked == self.core.publisher_id
            or not up_to_date
            or self.fetcher.update is not None
            or self.pub_host != self.host
        ):
            return
        if self.importer is None:
            self.importer = IpcImporter(
                self.targets,
                worker_id=self.worker_id,
                atomic=self.atomic,
                version=self.core.version,
            )
        self.importer.version = self.core.version
        self._asked = self.core.publisher_id
        self.send(self.importer.hello())

    def reset(self, pub_host: str) -> None:
        """A new publisher: the old one's slots and versions are gone."""
        if self.importer is not None:
            self.importer.abandon()
            self.importer.close_slots()
        self.pub_host = pub_host
        self._asked = ""
        self.opened = False
        self._deferred = None
        self._failed.clear()

    def close(self) -> bool:
        """Unmap the trainer's slots; whether a goodbye was sent."""
        imp, self.importer = self.importer, None
        if imp is None:
            return False
        bye = imp.release()
        imp.close()
        if bye is not None:
            self.send(bye)
        return bye is not None

    def on_offer(self, offer: IpcOffer) -> None:
        imp = self.importer
        if imp is None or offer.publisher_id != self.core.publisher_id:
            return
        imp.version = self.core.version
        try:
            ack = imp.open(offer)
        except IpcRefused as exc:
            self.opened = False
            self.refused = str(exc)
            self.core.count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, exc)
            return
        self.send(ack)
        self.opened = ack.ok
        self.refused = "" if ack.ok else ack.error
        if not ack.ok:
            self.core.count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, ack.error)

    def consider(self, ann: WeightAnnounce) -> None:
        """An Announce: kept as the fallback while the slots are open, else fetched."""
        # With the ipc slots open, a version comes by IpcReady; its Announce is kept as
        # the fallback, fetched by shm/tcp only if the version fails on the ipc path.
        if self.opened and ann.version not in self._failed:
            if ann.version > self.core.version and (
                self._deferred is None or ann.version > self._deferred.version
            ):
                self._deferred = ann
                self._progress = time.monotonic()
            return
        self.fetcher.consider(ann)

    def on_ready(self, r: IpcReady) -> None:
        imp = self.importer
        if imp is None or not self.opened:
            return
        self._progress = time.monotonic()
        if r.bucket == 0:
            self._t0 = self._progress
        before = imp.version
        last = r.bucket == r.n_buckets - 1
        locked = last or not imp.atomic  # the live weights are written only then
        acks: list[IpcAck]
        up = self.fetcher.update
        if locked and up is not None and up.locked:
            # A shm/tcp version (one-pass, after an ipc fallback) holds the lock on this
            # very thread: never enter it twice. A newer ipc version supersedes it; an
            # older one is refused.
            if r.version > up.ann.version:
                self.fetcher.abandon(f"superseded by version {r.version} (ipc)")
            else:
                why = f"not applied, version {up.ann.version} is being written by shm/tcp"
                self._refuse(r, why, before)
                return
        if locked:
            try:
                self.lock.__enter__()
            except Exception as exc:  # the weights are not free: refuse the version
                self._refuse(r, f"not applied, the weights were not free: {exc}", before)
                return
        try:
            acks = imp.on_ready(r)
            if imp.version != before:
                self.reporter.now_at(imp.version)
            elif not imp.serving:
                self.core.consistent = False
        finally:
            if locked:
                self.lock.__exit__(None, None, None)
        self._after(r, acks, before)

    def _refuse(self, r: IpcReady, why: str, before: int) -> None:
        """Refuse the version ``r`` belongs to: every slot held for it is acked failed."""
        imp = self.importer
        assert imp is not None
        held = [*imp._held, r]
        imp.abandon()
        acks = [
            IpcAck(self.worker_id, h.version, h.bucket, h.slot, False, imp.version, why)
            for h in held
        ]
        self._after(r, acks, before)

    def _after(self, r: IpcReady, acks: list[IpcAck], before: int) -> None:
        """Send the slot acks, then report the version (applied, or fetched again by
        shm/tcp when it failed here)."""
        imp = self.importer
        assert imp is not None
        for a in acks:
            self.send(a)
        bad = next((a for a in acks if not a.ok), None)
        if imp.version != before:
            assert self.offer_layout_bytes is not None
            stats = UpdateStats(
                version=imp.version,
                via="ipc",
                bytes=self.offer_layout_bytes,
                total_s=time.monotonic() - self._t0,
            )
            for a in acks:
                stats.verify_s += a.stats.get("verify_s", 0.0)
                stats.apply_s = max(stats.apply_s, a.stats.get("copy_s", 0.0))
            self.core.count("ipc_versions_applied")
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase="total").observe(stats.total_s)
            if self._deferred is not None and self._deferred.version <= imp.version:
                self._deferred = None
            self.reporter.applied(stats)
        elif bad is not None and bad.version not in self._failed:
            self._failed.add(bad.version)
            self.core.count("ipc_fallbacks")
            log.warning(
                "worker %s: version %d failed on the ipc path (%s); fetching it by shm/tcp",
                self.worker_id, bad.version, bad.error,
            )  # fmt: skip
            ann = self._deferred
            up = self.fetcher.update
            if bad.version <= self.core.version or (
                up is not None and up.ann.version == bad.version
            ):
                pass  # applied already, or being fetched by shm/tcp (opened mid-version)
            elif ann is not None and ann.version == bad.version:
                self._deferred = None
                self.fetcher.consider(ann)
            else:
                self.fetcher.fail(bad.version, bad.error, "ipc")

    @property
    def offer_layout_bytes(self) -> int | None:
        """Bytes of one version on the ipc path (``None``: no offer open)."""
        imp = self.importer
        if imp is None or imp.offer is None:
            return None
        return sum(b.nbytes for b in imp.offer.buckets)

    def check_timeouts(self, now: float) -> None:
        """Fall back to shm/tcp for a version the route does not deliver; drop the
        slots of a trainer that is gone."""
        ann = self._deferred
        if (
            ann is not None
            and ann.version > self.core.version
            and now - self._progress > self.publisher_timeout
        ):
            # An announced version that the ipc path does not deliver (this worker opened
            # the slots after it began, or the trainer gave up on a slot): shm/tcp.
            log.warning(
                "worker %s: version %d did not come by ipc in %.1f s; fetching it by shm/tcp",
                self.worker_id, ann.version, self.publisher_timeout,
            )  # fmt: skip
            self._deferred = None
            self._failed.add(ann.version)
            self.core.count("ipc_fallbacks")
            self.fetcher.consider(ann)
        imp = self.importer
        if self.opened and imp is not None and not imp.trainer_alive():
            # The trainer is gone: a version half-read is dropped (the weights keep the
            # last complete one); a restarted trainer offers its slots again.
            imp.abandon()
            imp.close_slots()
            self.opened = False
            self._asked = ""
