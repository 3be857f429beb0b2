"""The worker's side of the ``ipc`` route (:mod:`transport.weights.routes.ipc`):
:class:`IpcImporter` opens the trainer's slots and copies each version out (sans-I/O);
:class:`IpcReceiver` runs it on the subscriber's thread and hands a version that fails
here or stalls to shm/tcp from its kept Announce."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from itertools import accumulate
from typing import Any, cast

import torch

from fastio.ipc_msgs import (
    TRAILER_BYTES,
    IpcAck,
    IpcHello,
    IpcOffer,
    IpcReady,
)
from fastio.weight_msgs import WeightAnnounce, WeightBucketInfo
from transport import metrics
from transport.weights.bucket import BucketApplier, copy_bytes, sum64
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.errors import WeightMismatchError
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes import Receiver
from transport.weights.routes.ipc_tensors import (
    IpcRefused,
    check_layout,
    detached,
    open_slot,
    sync_slot,
)

__all__ = ["PATHS", "IpcImporter", "IpcReceiver", "IpcRefused", "ipc_eligible"]

log = logging.getLogger("transport.weights.subscriber")


class IpcImporter:
    """The worker's slots (sans-I/O): opens the trainer's offer once and copies each
    version into ``targets`` (a module or ``name -> tensor`` mapping on one device).
    ``atomic``: never a mixed version; ``verify``: check each bucket's checksum;
    :attr:`version`: the last version fully copied, :attr:`serving` ``False`` while
    ``targets`` hold a partial one."""

    def __init__(
        self,
        targets: Any,
        *,
        worker_id: str | None = None,
        atomic: bool = True,
        verify: bool = True,
        version: int = -1,
    ) -> None:
        self.targets = detached(targets)
        self.worker_id = worker_id or f"ipc-{os.getpid()}"
        self.atomic = atomic
        self.verify = verify
        self.version = version
        self.serving = True
        dev = {t.device for t in self.targets.values()}
        if len(dev) > 1:
            raise ValueError(f"targets on several devices: {sorted(map(str, dev))}")
        self.device = dev.pop() if dev else torch.device("cpu")
        self.applier = BucketApplier(self.targets)
        self.offer: IpcOffer | None = None
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._partial: int | None = None
        self._held: list[IpcReady] = []
        self._failed = ""
        self._staging: torch.Tensor | None = None
        self._starts: list[int] = []  # of each bucket in the staging buffer, and the end
        self._expect = 0

    def hello(self) -> IpcHello:
        dev = (self.device.index or 0) if self.device.type == "cuda" else -1
        start = process_start_time(os.getpid()) or 0
        return IpcHello(self.worker_id, os.getpid(), start, dev, self.version)

    def trainer_alive(self) -> bool:
        return self.offer is not None and process_alive(self.offer.pid, self.offer.start_time)

    def _ack(
        self, r: IpcReady, ok: bool, error: str = "", stats: dict[str, float] | None = None
    ) -> IpcAck:
        return IpcAck(
            self.worker_id, r.version, r.bucket, r.slot, ok, self.version, error, stats or {}
        )

    def _opened(self, error: str = "") -> IpcAck:
        return IpcAck(self.worker_id, -1, -1, -1, not error, self.version, error)

    def open(self, offer: IpcOffer) -> IpcAck:
        """Open every slot of ``offer`` (a new offer replaces the old one); the
        :class:`IpcAck` (``bucket=-1``) to send, ``ok=False`` with the reason when the
        layout does not match or a slot cannot be opened. :class:`IpcRefused`: the offer
        is a refusal, or the trainer's process is not visible from here."""
        if offer.error:
            raise IpcRefused(offer.error)
        if not process_alive(offer.pid, offer.start_time):
            raise IpcRefused(
                f"trainer pid {offer.pid} is not visible from this worker: another host "
                "or pid namespace; ipc needs one host"
            )
        self.abandon()  # a version of a previous offer (trainer) never completes now
        self.close_slots()
        try:
            check_layout(offer.buckets, self.targets)
        except WeightMismatchError as exc:
            return self._opened(str(exc))
        try:
            for s in offer.slots:
                slot, event = open_slot(s.handle)
                self._slots.append(slot)
                if event is not None:  # pragma: no cover - CUDA
                    self._events.append(event)
        except (RuntimeError, OSError, ValueError) as exc:
            self.close_slots()
            return self._opened(f"cannot open slot: {exc}")
        self.offer = offer
        self._starts = [0, *accumulate(b.nbytes for b in offer.buckets)]
        return self._opened()

    def _why_not(self, slot: torch.Tensor, r: IpcReady) -> str:
        """Why bucket ``r.bucket`` in ``slot`` is not ``r.version`` whole, or ``""``."""
        assert self.offer is not None
        cap = self.offer.slots[0].capacity
        trailer = slot[cap : cap + TRAILER_BYTES].view(torch.int64)
        if self.verify and self.offer.checksum == "sum64":
            ok_t = (trailer[1] == r.version) & (
                sum64(slot[: self.offer.buckets[r.bucket].nbytes]) == trailer[0]
            )
            if bool(ok_t.item()):  # the one host synchronisation of a check
                return ""
        elif int(trailer[1].item()) == r.version:
            return ""
        got = int(trailer[1].item())
        if got != r.version:
            return f"bucket {r.bucket}: the slot holds version {got}, not {r.version}"
        return f"bucket {r.bucket} of version {r.version}: checksum mismatch"

    def on_ready(self, r: IpcReady) -> list[IpcAck]:
        """Take one :class:`IpcReady`; the acks to send (held ones with the last)."""
        if (
            self.offer is None
            or not 0 <= r.slot < len(self._slots)
            or not (0 <= r.bucket < len(self.offer.buckets))
        ):
            return [self._ack(r, False, "no such slot or bucket (no offer opened?)")]
        if r.version != self._partial:
            # A new version begins; a partial one before it never completes now.
            self.abandon()
            self._partial, self._expect = r.version, 0
        if r.bucket != self._expect and not self._failed:
            # Readies come in bucket order on one connection: a gap means this worker
            # joined during the version (or lost a message): not a whole version.
            self._failed = f"version {r.version}: bucket {r.bucket} came before {self._expect}"
        self._expect = r.bucket + 1
        t0 = time.perf_counter()
        slot = self._slots[r.slot]
        b = self.offer.buckets[r.bucket]
        if self._events:  # pragma: no cover - CUDA: the trainer's packing is done
            torch.cuda.current_stream(slot.device).wait_event(self._events[r.slot])
        if not self._failed:
            self._failed = self._why_not(slot, r)
        t1 = time.perf_counter()
        last = r.bucket == r.n_buckets - 1
        if self._failed:
            held, self._held = self._held, []
            return [self._ack(h, False, self._failed) for h in [*held, r]]
        buckets = cast("list[WeightBucketInfo]", self.offer.buckets)
        whole = self.atomic and len(buckets) <= len(self._slots)
        if whole:  # the version fits in the slots: verify all, then copy, no staging
            self._held.append(r)
            if not last:
                return []
            for h in self._held:
                self.applier.apply(buckets[h.bucket], [self._slots[h.slot]])
        elif self.atomic:
            st = self._staging
            if st is None or st.numel() < self._starts[-1]:
                st = self._staging = torch.empty(
                    self._starts[-1], dtype=torch.uint8, device=self.device
                )
            start = self._starts[r.bucket]
            copy_bytes(st[start : start + b.nbytes], slot[: b.nbytes])
            if last:
                for bb, s0 in zip(buckets, self._starts, strict=False):
                    self.applier.apply(bb, [st[s0 : s0 + bb.nbytes]])
        else:
            self.applier.apply(buckets[r.bucket], [slot])
            self.serving = False
        sync_slot(slot, self.device)
        if last:
            self._complete(r.version)
        done, self._held = (self._held if whole else [r]), []
        stats = {"verify_s": t1 - t0, "copy_s": time.perf_counter() - t1}
        return [self._ack(h, True, stats=stats) for h in done]

    def _complete(self, version: int) -> None:
        self.version = version
        self.serving = True
        self._partial = None

    def refuse(self, r: IpcReady, why: str) -> list[IpcAck]:
        """The refusing acks of every slot held for ``r``'s version."""
        held = [*self._held, r]
        self.abandon()
        return [self._ack(h, False, why) for h in held]

    def abandon(self) -> None:
        """Drop the version being assembled (the live tensors keep what they hold)."""
        self._partial = None
        self._held = []
        self._failed = ""

    def close_slots(self) -> None:
        self._slots.clear()
        self._events.clear()
        self.offer = None

    def release(self) -> IpcAck | None:
        """Unmap the trainer's slots; the goodbye :class:`IpcAck` (``bucket=-2``), or
        ``None`` when nothing was open."""
        if self.offer is None:
            return None
        self.close_slots()
        return IpcAck(self.worker_id, -1, -2, -1, True, self.version)

    def close(self) -> None:
        """Release all it holds of the trainer's memory (prefer :meth:`release`)."""
        self.abandon()
        self.close_slots()
        self._staging = None


#: Values of ``WeightSubscriber(path=...)`` (``None``: whatever the publisher offers).
PATHS = ("ipc", "shm", "tcp")


def ipc_eligible(path: str | None, target: Any, loader: Any, dtype: Any, rename: Any) -> bool:
    """Whether a subscriber built with these parameters may take the ``ipc`` route;
    ``ValueError`` for an unknown ``path`` or ``path="ipc"`` that cannot be."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, not {path!r}")
    as_is = loader is None and dtype is None and rename is None
    eligible = path in (None, "ipc") and target is not None and as_is
    if path == "ipc" and not eligible:
        raise ValueError("path='ipc' copies into `target` as is: no loader, dtype or rename")
    return eligible


@dataclass(eq=False)
class IpcReceiver:
    """The ``ipc`` route of a :class:`~transport.weights.WeightSubscriber` (its thread):
    acks each slot and version; ``fetcher`` (shm/tcp) takes a version that fails here or
    makes no progress for ``publisher_timeout`` seconds."""

    core: SubscriberCore
    reporter: Reporter
    fetcher: Receiver
    targets: dict[str, Any]
    _: KW_ONLY
    eligible: bool
    atomic: bool
    lock: Any
    send: Callable[[Any], None]
    worker_id: str
    host: str
    publisher_timeout: float
    importer: IpcImporter | None = None
    pub_host: str = ""
    opened: bool = False
    #: Why the ipc route was refused ("" if it was not).
    refused: str = ""
    _asked: str = field(default="", init=False)  # the publisher id an IpcHello went to
    _deferred: WeightAnnounce | None = field(default=None, init=False)
    _progress: float = field(default=0.0, init=False)  # the last IpcReady or deferral
    _failed: set[int] = field(default_factory=set, init=False)
    _t0: float = field(default=0.0, init=False)

    def hello(self, *, up_to_date: bool) -> None:
        """Ask this publisher for its slots, once, when this worker could take them and
        holds the latest version."""
        if (
            not self.eligible
            or self._asked == self.core.publisher_id
            or not up_to_date
            or self.fetcher.update is not None
            or self.pub_host != self.host
        ):
            return
        if self.importer is None:
            self.importer = IpcImporter(self.targets, worker_id=self.worker_id, atomic=self.atomic)
        self.importer.version = self.core.version
        self._asked = self.core.publisher_id
        self.send(self.importer.hello())

    def reset(self, pub_host: str | None = None) -> None:
        """Drop the slots and the version half-read (a new publisher: its versions too)."""
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
        """Unmap the slots; whether a goodbye was sent."""
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
        locked = r.bucket == r.n_buckets - 1 or not imp.atomic  # the weights are written
        up = self.fetcher.update
        if locked and up is not None and up.locked:
            # A shm/tcp version (one pass, after a fallback) holds the lock on this very
            # thread: never enter it twice. A newer ipc version supersedes it.
            if r.version > up.ann.version:
                self.fetcher.abandon(f"superseded by version {r.version} (ipc)")
            else:
                why = f"not applied, version {up.ann.version} is being written by shm/tcp"
                self._after(imp.refuse(r, why), before)
                return
        if locked:
            try:
                self.lock.__enter__()
            except Exception as exc:  # the weights are not free: refuse the version
                self._after(imp.refuse(r, f"not applied, the weights were not free: {exc}"), before)
                return
        try:
            acks = imp.on_ready(r)
            if imp.version != before:
                self.reporter.now_at(imp.version)
            elif not imp.serving:
                self.core.mark_mixed()
        finally:
            if locked:
                self.lock.__exit__(None, None, None)
        self._after(acks, before)

    def _after(self, acks: list[IpcAck], before: int) -> None:
        """Send the acks, then report the version (applied, or to shm/tcp if it failed)."""
        imp = self.importer
        assert imp is not None
        for a in acks:
            self.send(a)
        bad = next((a for a in acks if not a.ok), None)
        if imp.version != before:
            assert imp.offer is not None
            stats = UpdateStats(imp.version, "ipc", sum(b.nbytes for b in imp.offer.buckets))
            stats.total_s = time.monotonic() - self._t0
            stats.verify_s = sum(a.stats.get("verify_s", 0.0) for a in acks)
            stats.apply_s = max((a.stats.get("copy_s", 0.0) for a in acks), default=0.0)
            self.core.count("ipc_versions_applied")
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase="total").observe(stats.total_s)
            if self._deferred is not None and self._deferred.version <= imp.version:
                self._deferred = None
            self.reporter.applied(stats)
        elif bad is not None and bad.version not in self._failed:
            self._fall_back(bad.version, f"failed on the ipc path ({bad.error})")
            ann, up = self._deferred, self.fetcher.update
            # Not when applied already, or fetched by shm/tcp (opened mid-version).
            if bad.version > self.core.version and (up is None or up.ann.version != bad.version):
                if ann is not None and ann.version == bad.version:
                    self._deferred = None
                    self.fetcher.consider(ann)
                else:
                    self.fetcher.fail(bad.version, bad.error, "ipc")

    def _fall_back(self, version: int, why: str) -> None:
        self._failed.add(version)
        self.core.count("ipc_fallbacks")
        log.warning(
            "worker %s: version %d %s; fetching it by shm/tcp", self.worker_id, version, why
        )

    def check_timeouts(self, now: float) -> None:
        """Fall back to shm/tcp for a version the route does not deliver (opened after
        the version began, or the trainer gave up on a slot); drop the slots of a
        trainer that is gone."""
        ann = self._deferred
        if (
            ann is not None
            and ann.version > self.core.version
            and now - self._progress > self.publisher_timeout
        ):
            self._deferred = None
            self._fall_back(ann.version, f"did not come by ipc in {self.publisher_timeout:.1f} s")
            self.fetcher.consider(ann)
        imp = self.importer
        if self.opened and imp is not None and not imp.trainer_alive():
            self.reset()  # a restarted trainer offers its slots again
