"""The ``ipc`` route: persistent buckets ("slots") of the trainer's own memory, opened
once by every worker on its host and packed again for every version (``docs/PROTOCOL.md``,
"The ipc path"): CUDA IPC on a GPU, torch shared-memory files on CPU. Both sides as the
drivers run them: :class:`IpcOffering` (publisher) and :class:`IpcReceiver` (subscriber),
over the sans-I/O slots (:class:`IpcExporter`, :class:`IpcImporter`).

Bucket b goes to slot ``b % slots``, packed and checksummed on the slot's device into its
trailer with the version; a slot is packed again only once every worker sent its last
``IpcReady`` acked it or is gone (the trainer then releases its references).

A version takes the route as the publisher's ``ipc`` allows (``"auto"``: CUDA tensors,
``"cpu"``: any, ``"off"``: never); a worker on the publisher's host that copies into its
target as is asks for the slots (``IpcHello``) once it holds the latest version, opens the
``IpcOffer``, applies ``IpcReady`` notices and acks each slot (``IpcAck``) and version
(``WeightAck(via="ipc")``). A version that fails here, or makes no progress for
``publisher_timeout``, is fetched by shm/tcp from its kept Announce.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import fastio
from fastio.ipc_msgs import IpcAck, IpcHello, IpcOffer, IpcReady
from fastio.weight_msgs import WeightAnnounce
from transport import metrics
from transport.weights.core.publisher import PublisherCore
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.fetching import VersionFetcher
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes.ipc_export import IpcExporter, IpcResult
from transport.weights.routes.ipc_import import IpcImporter
from transport.weights.routes.ipc_tensors import (
    DEFAULT_IPC_BUCKET_BYTES,
    IpcRefused,
    _layout_of,
    checksum,
    plan_layout,
)

__all__ = [
    "DEFAULT_IPC_BUCKET_BYTES",
    "IPC_MODES",
    "PATHS",
    "IpcExporter",
    "IpcImporter",
    "IpcOffering",
    "IpcReceiver",
    "IpcRefused",
    "IpcResult",
    "checksum",
    "ipc_eligible",
    "plan_layout",
]

log = logging.getLogger("transport.weights.subscriber")

#: Values of ``WeightPublisher(ipc=...)``.
IPC_MODES = ("auto", "cpu", "off")


class IpcOffering:
    """The ``ipc`` slots of a publisher and the workers that asked for them.

    Parameters
    ----------
    mode, slots, timeout:
        The publisher's ``ipc``, ``ipc_slots`` and ``ipc_timeout``.
    core, cond:
        The publisher's protocol core (its workers) and lock.
    encoder, wake:
        How a queued notice is encoded, and how the serving thread is woken to send it.
    publisher_id, bucket_bytes:
        The publisher's.
    """

    def __init__(
        self,
        mode: str,
        slots: int | None,
        timeout: float,
        *,
        core: PublisherCore,
        cond: threading.Condition,
        encoder: fastio.Encoder,
        wake: Callable[[], None],
        publisher_id: str,
        bucket_bytes: int,
    ) -> None:
        if mode not in IPC_MODES:
            raise ValueError(f"ipc must be one of {IPC_MODES}, not {mode!r}")
        self.mode = mode
        self.slots = slots
        self.timeout = timeout
        self.core = core
        self.cond = cond
        self.encoder = encoder
        self.wake = wake
        self.publisher_id = publisher_id
        self.bucket_bytes = bucket_bytes
        self.exporter: IpcExporter | None = None
        #: The last IpcHello of each worker that asked (offered again on a new layout).
        self.hellos: dict[str, IpcHello] = {}
        #: Notices for the serving thread to send: (worker identity, frames).
        self.outbox: list[tuple[bytes, list[Any]]] = []

    def wanted(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a version of ``tensors`` takes the route."""
        if self.mode == "off" or not tensors:
            return False
        return self.mode == "cpu" or any(t.is_cuda for t in tensors.values())

    def reader(self, wid: str) -> bool:
        """Whether worker ``wid`` has the slots open (it reads versions there)."""
        with self.cond:
            w = self.exporter.workers.get(wid) if self.exporter is not None else None
            return w is not None and w.opened

    def only(self) -> bool:
        """Whether every live worker reads the next version here and the slots hold a
        whole version (a snapshot to stage from later)."""
        with self.cond:
            exp = self.exporter
            if exp is None or exp.n_slots < len(exp.layout):
                return False
            return all(w in exp.workers and exp.workers[w].opened for w in self.core.alive())

    def handle(self, wid: str, msg: IpcHello | IpcAck, now: float) -> IpcOffer | None:
        """An ``IpcHello`` (offer the slots, or keep it for the first version that takes
        the route) or ``IpcAck`` (a slot released); the offer to send, if any."""
        if msg.worker_id != wid:  # only a peer's own id counts
            self.core.count("ipc_foreign_ids")
            return None
        offer = None
        with self.cond:
            info = self.core.workers.get(wid)
            if info is not None:
                info.last_seen = now
            if isinstance(msg, IpcHello):
                if info is None:
                    return None  # a WeightHello comes first
                self.hellos[wid] = msg
                if self.exporter is not None:
                    offer = self.exporter.offer(msg)
            elif self.exporter is not None:
                self.exporter.handle_ack(msg)
                if msg.bucket == -2:
                    self.hellos.pop(wid, None)
            self.cond.notify_all()
        return offer

    def reap(self) -> list[str]:
        """Release the slots of workers whose process is gone; their ids (lock held)."""
        return self.exporter.reap() if self.exporter is not None else []

    def _queue(self, wid: str, msg: Any) -> None:
        self.outbox.append((wid.encode(), self.encoder.encode(msg)))

    def prepare(self, tensors: dict[str, torch.Tensor], closed: Callable[[], bool]) -> None:
        """Slots for this layout (new ones when it changed), offered to every worker
        that asked; those still opening them get a moment (else this version misses
        them)."""
        layout = _layout_of(tensors, self.bucket_bytes)
        with self.cond:
            if self.exporter is None or self.exporter.layout != layout:
                if self.exporter is not None:
                    self.exporter.close()
                self.exporter = IpcExporter(
                    tensors, bucket_bytes=self.bucket_bytes, slots=self.slots,
                    publisher_id=self.publisher_id,
                )  # fmt: skip
                alive = self.core.alive()
                for wid, hello in self.hellos.items():
                    if wid in alive:
                        self._queue(wid, self.exporter.offer(hello))
                self.wake()
            grace = min(5.0, self.timeout)
            deadline = time.monotonic() + grace
            exp = self.exporter
            while not closed():
                alive = self.core.alive()
                waiting = [
                    w
                    for w, st in exp.workers.items()
                    if not st.opened and time.monotonic() - st.offered_at < 2 * grace and w in alive
                ]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                self.cond.wait(min(left, 0.1))

    def publish(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Pack ``version`` into the slots and queue its IpcReady notices (under the
        lock, released while a slot is still read)."""
        with self.cond:
            exp = self.exporter
            assert exp is not None

            def send(wid: str, ready: Any) -> None:
                self._queue(wid, ready)
                self.wake()

            exp.publish(tensors, version, send=send, wait=self.cond.wait, timeout=self.timeout)
            readers = sum(w.opened for w in exp.workers.values())
        self.wake()
        metrics.PUBLISHER_BYTES.labels(path="ipc").inc(sum(b.nbytes for b in exp.layout) * readers)
        self.core.count("ipc_versions")

    def close(self) -> None:
        """Close the slots (the publisher is closing)."""
        with self.cond:
            exp, self.exporter = self.exporter, None
        if exp is not None:
            exp.close()


#: Values of ``WeightSubscriber(path=...)`` (``None``: whatever the publisher offers).
PATHS = ("ipc", "shm", "tcp")


def ipc_eligible(path: str | None, target: Any, loader: Any, dtype: Any, rename: Any) -> bool:
    """Whether a subscriber built with these parameters may take the ``ipc`` path;
    raises ``ValueError`` for an unknown ``path`` or ``path="ipc"`` that cannot be."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, not {path!r}")
    as_is = loader is None and dtype is None and rename is None
    eligible = path in (None, "ipc") and target is not None and as_is
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
        Seconds without progress here before an announced version goes by shm/tcp.
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

    def reset(self, pub_host: str | None = None) -> None:
        """Drop the slots and the version half-read (the weights keep the last complete
        one); a new publisher (``pub_host``) also forgets the old one's versions."""
        if self.importer is not None:
            self.importer.abandon()
            self.importer.close_slots()
        self.opened = False
        self._asked = ""
        if pub_host is not None:
            self.pub_host = pub_host
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
        """Open the slots of this publisher's offer, or note why they cannot be."""
        imp = self.importer
        if imp is None or offer.publisher_id != self.core.publisher_id:
            return
        imp.version = self.core.version
        ack: IpcAck | None = None
        try:
            ack = imp.open(offer)
            why = ack.error
        except IpcRefused as exc:
            why = str(exc)
        if ack is not None:
            self.send(ack)
        self.opened = ack is not None and ack.ok
        self.refused = "" if self.opened else why
        if not self.opened:
            self.core.count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, why)

    def consider(self, ann: WeightAnnounce) -> None:
        """An Announce: kept as the fallback while the slots are open, else fetched."""
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
            self.reset()  # a restarted trainer offers its slots again
