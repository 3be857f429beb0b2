"""The worker's side of the ``ipc`` path inside :class:`~transport.weights.WeightSubscriber`.

:class:`IpcReceiving` holds the subscriber's :class:`~transport.weights.ipc.IpcImporter`.
The path choice: a worker may take ``ipc`` when it copies into its target as is (no
``loader``, ``dtype`` or ``rename``; ``path`` is ``None`` or ``"ipc"``) and the publisher
runs on its host. It then asks for the slots (``IpcHello``) once it holds the latest
version, opens the ``IpcOffer`` (or records the refusal and stays on ``shm``/``tcp``),
applies versions from ``IpcReady`` notices and acknowledges each slot (``IpcAck``) and
each version (``WeightAck`` with ``via="ipc"``). While the slots are open an Announce
is kept, not fetched: it is the fallback. A version that fails on the ``ipc`` path, or
makes no progress there for ``publisher_timeout``, is fetched by ``shm``/``tcp``
(:class:`~transport.weights.fetching.VersionFetch`); a trainer whose process is gone
releases the slots, and a restarted one offers its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastio.ipc_msgs import IpcAck, IpcOffer, IpcReady
from fastio.weight_msgs import WeightAck, WeightAnnounce
from transport import metrics
from transport.weights.bucket import state_digest
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.fetching import VersionFetch
from transport.weights.ipc import IpcImporter, IpcRefused
from transport.weights.results import UpdateStats

__all__ = ["PATHS", "IpcReceiving", "ipc_eligible"]

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


class IpcReceiving(VersionFetch):
    """The ``ipc`` half of :class:`transport.weights.WeightSubscriber`."""

    # Set by WeightSubscriber.__init__ (see its parameters).
    worker_id: str
    on_applied: Any
    report_digest: bool
    last_stats: UpdateStats
    last_error: str
    _digest: int | None
    _ipc_atomic: bool
    _host: str
    core: SubscriberCore

    def _init_ipc(self, eligible: bool) -> None:
        """The ipc state, no slots yet (``eligible``: from :func:`ipc_eligible`; reset for
        each publisher instance by :meth:`_ipc_reset`)."""
        self._ipc_eligible = eligible
        self._imp: IpcImporter | None = None
        self._pub_host = ""
        self._ipc_asked = ""  # the publisher id an IpcHello went to
        self._ipc_open = False
        self._ipc_deferred: WeightAnnounce | None = None
        self._ipc_progress = 0.0  # monotonic time of the last IpcReady or deferral
        self._ipc_failed: set[int] = set()
        self._ipc_t0 = 0.0
        #: Why the ipc path was refused ("" if it was not).
        self.ipc_refused = ""

    @property
    def ipc_open(self) -> bool:
        """Whether this worker has the trainer's ipc slots open (its next versions come
        by ``ipc``)."""
        return self._ipc_open

    def _ipc_hello(self, *, up_to_date: bool) -> None:
        """Ask this publisher for its ipc slots, once, when this worker could take
        them and holds the latest version (a late joiner first catches up from the
        snapshot by shm/tcp: the ipc path carries only versions whole)."""
        if (
            not self._ipc_eligible
            or self._ipc_asked == self.core.publisher_id
            or not up_to_date
            or self._update is not None
            or self._pub_host != self._host
        ):
            return
        if self._imp is None:
            self._imp = IpcImporter(
                self.targets,
                worker_id=self.worker_id,
                atomic=self._ipc_atomic,
                version=self.core.version,
            )
        self._imp.version = self.core.version
        self._ipc_asked = self.core.publisher_id
        self._send(self._imp.hello())

    def _ipc_reset(self) -> None:
        """A new publisher: the old one's slots and versions are gone."""
        if self._imp is not None:
            self._imp.abandon()
            self._imp.close_slots()
        self._ipc_asked = ""
        self._ipc_open = False
        self._ipc_deferred = None
        self._ipc_failed.clear()

    def _ipc_close(self) -> bool:
        """Unmap the trainer's slots; whether a goodbye was sent."""
        imp, self._imp = self._imp, None
        if imp is None:
            return False
        bye = imp.release()
        imp.close()
        if bye is not None:
            self._send(bye)
        return bye is not None

    def _on_ipc_offer(self, offer: IpcOffer) -> None:
        imp = self._imp
        if imp is None or offer.publisher_id != self.core.publisher_id:
            return
        imp.version = self.core.version
        try:
            ack = imp.open(offer)
        except IpcRefused as exc:
            self._ipc_open = False
            self.ipc_refused = str(exc)
            self._count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, exc)
            return
        self._send(ack)
        self._ipc_open = ack.ok
        self.ipc_refused = "" if ack.ok else ack.error
        if not ack.ok:
            self._count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, ack.error)

    def _consider(self, ann: WeightAnnounce) -> None:
        # With the ipc slots open, a version comes by IpcReady; its Announce is kept as
        # the fallback, fetched by shm/tcp only if the version fails on the ipc path.
        if self._ipc_open and ann.version not in self._ipc_failed:
            if ann.version > self.core.version and (
                self._ipc_deferred is None or ann.version > self._ipc_deferred.version
            ):
                self._ipc_deferred = ann
                self._ipc_progress = time.monotonic()
            return
        super()._consider(ann)

    def _on_ipc_ready(self, r: IpcReady) -> None:
        imp = self._imp
        if imp is None or not self._ipc_open:
            return
        self._ipc_progress = time.monotonic()
        if r.bucket == 0:
            self._ipc_t0 = self._ipc_progress
        before = imp.version
        last = r.bucket == r.n_buckets - 1
        locked = last or not imp.atomic  # the live weights are written only then
        acks: list[IpcAck]
        up = self._update
        if locked and up is not None and up.locked:
            # A shm/tcp version (one-pass, after an ipc fallback) holds the lock on this
            # very thread: never enter it twice. A newer ipc version supersedes it; an
            # older one is refused.
            if r.version > up.ann.version:
                self._abandon(f"superseded by version {r.version} (ipc)")
            else:
                why = f"not applied, version {up.ann.version} is being written by shm/tcp"
                self._ipc_refuse(r, why, before)
                return
        if locked:
            try:
                self.lock.__enter__()
            except Exception as exc:  # the weights are not free: refuse the version
                self._ipc_refuse(r, f"not applied, the weights were not free: {exc}", before)
                return
        try:
            acks = imp.on_ready(r)
            if imp.version != before:
                self._now_at(imp.version)
            elif not imp.serving:
                self.core.consistent = False
        finally:
            if locked:
                self.lock.__exit__(None, None, None)
        self._ipc_after(r, acks, before)

    def _ipc_refuse(self, r: IpcReady, why: str, before: int) -> None:
        """Refuse the version ``r`` belongs to: every slot held for it is acked failed."""
        imp = self._imp
        assert imp is not None
        held = [*imp._held, r]
        imp.abandon()
        acks = [
            IpcAck(self.worker_id, h.version, h.bucket, h.slot, False, imp.version, why)
            for h in held
        ]
        self._ipc_after(r, acks, before)

    def _ipc_after(self, r: IpcReady, acks: list[IpcAck], before: int) -> None:
        """Send the slot acks, then report the version (applied, or fetched again by
        shm/tcp when it failed here)."""
        imp = self._imp
        assert imp is not None
        for a in acks:
            self._send(a)
        bad = next((a for a in acks if not a.ok), None)
        if imp.version != before:
            assert self.offer_layout_bytes is not None
            stats = UpdateStats(
                version=imp.version,
                via="ipc",
                bytes=self.offer_layout_bytes,
                total_s=time.monotonic() - self._ipc_t0,
            )
            for a in acks:
                stats.verify_s += a.stats.get("verify_s", 0.0)
                stats.apply_s = max(stats.apply_s, a.stats.get("copy_s", 0.0))
            self.last_stats = stats
            self.last_error = ""
            self._count("versions_applied")
            self._count("ipc_versions_applied")
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase="total").observe(stats.total_s)
            metrics.SUBSCRIBER_BYTES.labels(path="ipc").inc(stats.bytes)
            if self._ipc_deferred is not None and self._ipc_deferred.version <= imp.version:
                self._ipc_deferred = None
            if self.report_digest:
                self._digest = state_digest(self.targets)
            self._send(
                WeightAck(
                    self.worker_id, imp.version, True, imp.version, "", self._digest, "ipc",
                    stats.flat(),
                )
            )  # fmt: skip
        elif bad is not None and bad.version not in self._ipc_failed:
            self._ipc_failed.add(bad.version)
            self._count("ipc_fallbacks")
            log.warning(
                "worker %s: version %d failed on the ipc path (%s); fetching it by shm/tcp",
                self.worker_id, bad.version, bad.error,
            )  # fmt: skip
            ann = self._ipc_deferred
            up = self._update
            if bad.version <= self.core.version or (
                up is not None and up.ann.version == bad.version
            ):
                pass  # applied already, or being fetched by shm/tcp (opened mid-version)
            elif ann is not None and ann.version == bad.version:
                self._ipc_deferred = None
                super()._consider(ann)
            else:
                self._fail(bad.version, bad.error, "ipc")

    @property
    def offer_layout_bytes(self) -> int | None:
        """Bytes of one version on the ipc path (``None``: no offer open)."""
        imp = self._imp
        if imp is None or imp.offer is None:
            return None
        return sum(b.nbytes for b in imp.offer.buckets)

    def _check_timeouts(self, now: float) -> None:
        super()._check_timeouts(now)
        ann = self._ipc_deferred
        if (
            ann is not None
            and ann.version > self.core.version
            and now - self._ipc_progress > self.publisher_timeout
        ):
            # An announced version that the ipc path does not deliver (this worker opened
            # the slots after it began, or the trainer gave up on a slot): shm/tcp.
            log.warning(
                "worker %s: version %d did not come by ipc in %.1f s; fetching it by shm/tcp",
                self.worker_id, ann.version, self.publisher_timeout,
            )  # fmt: skip
            self._ipc_deferred = None
            self._ipc_failed.add(ann.version)
            self._count("ipc_fallbacks")
            super()._consider(ann)
        imp = self._imp
        if self._ipc_open and imp is not None and not imp.trainer_alive():
            # The trainer is gone: a version half-read is dropped (the weights keep the
            # last complete one); a restarted trainer offers its slots again.
            imp.abandon()
            imp.close_slots()
            self._ipc_open = False
            self._ipc_asked = ""
