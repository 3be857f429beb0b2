"""The worker's side of the ``ipc`` route (:mod:`transport.weights.routes.ipc`):
:class:`IpcImporter` opens the trainer's slots and copies each version out (sans-I/O);
:class:`IpcReceiver` runs it on the subscriber's thread and hands shm/tcp the versions
:class:`~transport.weights.core.ipc.IpcFallback` gives them."""

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
    IpcHandle,
    IpcHello,
    IpcOffer,
    IpcReady,
)
from fastio.weight_msgs import WeightAnnounce, WeightBucketInfo
from transport import metrics
from transport.weights.binding import Binding
from transport.weights.bucket import BucketApplier, copy_bytes, named_tensors
from transport.weights.bucket import sum64 as checksum
from transport.weights.core.ipc import IpcFallback
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.errors import WeightMismatchError, WeightUpdateError
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes import Receiver

__all__ = ["PATHS", "IpcImporter", "IpcReceiver", "IpcRefused", "ipc_eligible"]

log = logging.getLogger("transport.weights.subscriber")
# Typed loosely: torch's private sharing API has no annotations.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage
#: Values of ``WeightSubscriber(path=...)`` (``None``: whatever the publisher offers).
PATHS = ("ipc", "shm", "tcp")


class IpcRefused(WeightUpdateError):
    """The ipc route cannot serve this worker (other host or pid namespace, no access
    to the trainer's device): use another route."""


def detached(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (a module or mapping) by name, detached."""
    return {k: v.detach() for k, v in named_tensors(state).items()}


def _open_slot(h: IpcHandle) -> tuple[torch.Tensor, Any]:
    """Map the slot of ``h``: the tensor and its CUDA event (``None`` on CPU)."""
    if h.kind == "cpu":
        st = torch.UntypedStorage._new_shared_filename_cpu(h.manager, h.handle, h.size)
        return torch.empty(0, dtype=torch.uint8).set_(st, 0, (h.size,), (1,)), None
    if h.kind != "cuda":
        raise ValueError(f"unknown handle kind {h.kind!r}")
    # pragma: no cover - CUDA: torch's rebuild_cuda_tensor, from msgpack fields
    _cuda._lazy_init()  # pragma: no cover
    st = _Storage._new_shared_cuda(  # pragma: no cover
        h.device, h.handle, h.size, h.offset, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle, h.event_sync_required,
    )  # fmt: skip
    event = _cuda.Event.from_ipc_handle(h.device, h.slot_event)  # pragma: no cover
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device))  # pragma: no cover
    return t.set_(st, 0, (h.size,), (1,)), event  # pragma: no cover


class IpcImporter:
    """The worker's slots (sans-I/O): opens the trainer's offer once and copies each
    version into ``targets`` (a module or ``name -> tensor`` mapping on one device).
    ``atomic``: never a mixed version; ``verify``: check the checksums."""

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
        self.atomic, self.verify, self.version = atomic, verify, version
        self.serving = True
        devices = {t.device for t in self.targets.values()}
        if len(devices) > 1:
            raise ValueError(f"targets on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.applier = BucketApplier(self.targets)
        self.offer: IpcOffer | None = None
        self._slots: list[tuple[torch.Tensor, Any]] = []  # and their CUDA events
        self._staging: torch.Tensor | None = None
        self._starts: list[int] = []  # of each bucket in the staging buffer, and the end
        self._partial: int | None = None  # the version being assembled
        self._expect = 0  # its next bucket
        self._held: list[IpcReady] = []  # its buckets verified, not copied yet
        self._failed = ""  # why it cannot complete

    def hello(self) -> IpcHello:
        dev = (self.device.index or 0) if self.device.type == "cuda" else -1
        start = process_start_time(os.getpid()) or 0
        return IpcHello(self.worker_id, os.getpid(), start, dev, self.version)

    def trainer_alive(self) -> bool:
        return self.offer is not None and process_alive(self.offer.pid, self.offer.start_time)

    def _ack(
        self, r: IpcReady, ok: bool, error: str = "", stats: dict[str, float] | None = None
    ) -> IpcAck:
        v = self.version
        return IpcAck(self.worker_id, r.version, r.bucket, r.slot, ok, v, error, stats or {})

    def _opened(self, error: str = "") -> IpcAck:  # bucket -1: the slots opened, or not
        return self._ack(IpcReady(-1, -1, -1, 0), not error, error)

    def open(self, offer: IpcOffer) -> IpcAck:
        """Open every slot of ``offer``; the :class:`IpcAck` (``bucket=-1``) to send,
        ``ok=False`` with why. :class:`IpcRefused`: refused, or the trainer is not seen."""
        if offer.error:
            raise IpcRefused(offer.error)
        if not process_alive(offer.pid, offer.start_time):
            raise IpcRefused(
                f"trainer pid {offer.pid} is not visible from this worker: another host "
                "or pid namespace; ipc needs one host"
            )
        self.close()  # a version of a previous offer (trainer) never completes now
        try:
            Binding(cast("list[WeightBucketInfo]", offer.buckets), self.targets, strict=True)
        except WeightMismatchError as exc:
            return self._opened(str(exc))
        try:
            self._slots = [_open_slot(s.handle) for s in offer.slots]
        except (RuntimeError, OSError, ValueError) as exc:
            return self._opened(f"cannot open slot: {exc}")
        self.offer = offer
        self._starts = [0, *accumulate(b.nbytes for b in offer.buckets)]
        return self._opened()

    def _why_not(self, slot: torch.Tensor, r: IpcReady) -> str:
        """Why bucket ``r.bucket`` in ``slot`` is not ``r.version`` whole, or ``""``."""
        assert self.offer is not None
        cap = self.offer.slots[0].capacity
        trailer = slot[cap : cap + TRAILER_BYTES].view(torch.int64)
        check = self.verify and self.offer.checksum == "sum64"
        nbytes = self.offer.buckets[r.bucket].nbytes
        if check and bool(
            ((trailer[1] == r.version) & (checksum(slot[:nbytes]) == trailer[0])).item()
        ):
            return ""  # the one host synchronisation of a check
        got = int(trailer[1].item())
        if got != r.version:
            return f"bucket {r.bucket}: the slot holds version {got}, not {r.version}"
        return f"bucket {r.bucket} of version {r.version}: checksum mismatch" if check else ""

    def on_ready(self, r: IpcReady) -> list[IpcAck]:
        """Take one :class:`IpcReady`; the acks to send (held ones with the last)."""
        offer = self.offer
        if offer is None or not (
            0 <= r.slot < len(self._slots) and 0 <= r.bucket < len(offer.buckets)
        ):
            return [self._ack(r, False, "no such slot or bucket (no offer opened?)")]
        if r.version != self._partial:  # a partial version before it never completes now
            self.abandon()
            self._partial = r.version
        if r.bucket != self._expect and not self._failed:
            # Readies come in bucket order on one connection: a gap means this worker
            # joined during the version (or lost a message): not a whole version.
            self._failed = f"version {r.version}: bucket {r.bucket} came before {self._expect}"
        self._expect = r.bucket + 1
        t0 = time.perf_counter()
        slot, event = self._slots[r.slot]
        if event is not None:  # pragma: no cover - CUDA: the trainer's packing is done
            torch.cuda.current_stream(slot.device).wait_event(event)
        self._failed = self._failed or self._why_not(slot, r)
        t1 = time.perf_counter()
        if self._failed:
            held, self._held = self._held, []
            return [self._ack(h, False, self._failed) for h in [*held, r]]
        buckets = cast("list[WeightBucketInfo]", offer.buckets)
        last, done = r.bucket == r.n_buckets - 1, [r]
        if not self.atomic:
            self.applier.apply(buckets[r.bucket], [slot])
            self.serving = False
        elif len(buckets) <= len(self._slots):  # the version fits: verify all, copy, no staging
            self._held.append(r)
            if not last:
                return []
            done, self._held = self._held, []
            for h in done:
                self.applier.apply(buckets[h.bucket], [self._slots[h.slot][0]])
        else:
            end = self._starts[-1]
            if self._staging is None or self._staging.numel() < end:
                self._staging = torch.empty(end, dtype=torch.uint8, device=self.device)
            start, n = self._starts[r.bucket], buckets[r.bucket].nbytes
            copy_bytes(self._staging[start : start + n], slot[:n])
            if last:
                for b, s in zip(buckets, self._starts, strict=False):
                    self.applier.apply(b, [self._staging[s : s + b.nbytes]])
        if slot.device.type == "cuda" or self.device.type == "cuda":  # pragma: no cover - CUDA
            torch.cuda.current_stream(slot.device).synchronize()  # the ack frees the slot
            if self.device != slot.device:
                torch.cuda.current_stream(self.device).synchronize()
        if last:
            self.version, self.serving, self._partial = r.version, True, None
        stats = {"verify_s": t1 - t0, "copy_s": time.perf_counter() - t1}
        return [self._ack(h, True, stats=stats) for h in done]

    def refuse(self, r: IpcReady, why: str) -> list[IpcAck]:
        """The refusing acks of every slot held for ``r``'s version."""
        held = [*self._held, r]
        self.abandon()
        return [self._ack(h, False, why) for h in held]

    def abandon(self) -> None:
        """Drop the version being assembled (the live tensors keep what they hold)."""
        self._partial, self._expect, self._held, self._failed = None, 0, [], ""

    def release(self) -> IpcAck | None:
        """:meth:`close`; the goodbye :class:`IpcAck` (``bucket=-2``) if a slot was open."""
        bye = self._ack(IpcReady(-1, -2, -1, 0), True) if self.offer is not None else None
        self.close()
        return bye

    def close(self) -> None:
        """Unmap the trainer's slots and drop the version being assembled."""
        self.abandon()
        self._slots, self.offer, self._staging = [], None, None


def ipc_eligible(path: str | None, target: Any, loader: Any, dtype: Any, rename: Any) -> bool:
    """Whether a subscriber with these parameters may take the ``ipc`` route;
    ``ValueError`` for an unknown ``path`` or a ``path="ipc"`` that cannot."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, not {path!r}")
    eligible = path in (None, "ipc") and target is not None
    eligible = eligible and loader is None and dtype is None and rename is None
    if path == "ipc" and not eligible:
        raise ValueError("path='ipc' copies into `target` as is: no loader, dtype or rename")
    return eligible


@dataclass(eq=False)
class IpcReceiver:
    """The ``ipc`` route of a :class:`~transport.weights.WeightSubscriber` (its thread);
    ``fetcher`` (shm/tcp) takes a version that fails here or stalls (``IpcFallback``)."""

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
    fallback: IpcFallback = field(default_factory=IpcFallback, init=False)
    _asked: str = field(default="", init=False)  # the publisher id an IpcHello went to
    _t0: float = field(default=0.0, init=False)  # when the version's first IpcReady came

    def hello(self, *, up_to_date: bool) -> None:
        """Ask this publisher for its slots, once, if eligible and up to date."""
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
        self.importer.version = self.core.held_version
        self._asked = self.core.publisher_id
        self.send(self.importer.hello())

    def reset(self, pub_host: str | None = None) -> None:
        """Drop the slots and the version half-read (a new publisher: its versions too)."""
        if self.importer is not None:
            self.importer.close()
        self.opened = False
        self._asked = ""
        if pub_host is not None:
            self.pub_host = pub_host
            self.fallback.reset()

    def close(self) -> bool:
        """Unmap the slots; whether a goodbye was sent."""
        imp, self.importer = self.importer, None
        bye = imp.release() if imp is not None else None
        if bye is not None:
            self.send(bye)
        return bye is not None

    def on_offer(self, offer: IpcOffer) -> None:
        imp = self.importer
        if imp is None or offer.publisher_id != self.core.publisher_id:
            return
        imp.version = self.core.held_version
        try:
            ack = imp.open(offer)
            self.send(ack)
            why = ack.error
        except IpcRefused as exc:
            why = str(exc)
        self.opened, self.refused = not why, why
        if why:
            self.core.count("ipc_refused")
            log.info("worker %s: no ipc path (%s); using shm/tcp", self.worker_id, why)

    def consider(self, ann: WeightAnnounce) -> None:
        """An Announce: kept as the fallback while the slots are open, else fetched."""
        if not (self.opened and self.fallback.keep(ann, self.core.held_version, time.monotonic())):
            self.fetcher.consider(ann)

    def on_ready(self, r: IpcReady) -> None:
        imp = self.importer
        if imp is None or not self.opened:
            return
        self.fallback.progress = time.monotonic()
        if r.bucket == 0:
            self._t0 = self.fallback.progress
        before = imp.version
        locked = r.bucket == r.n_buckets - 1 or not imp.atomic  # the weights are written
        up = self.fetcher.update
        if locked and up is not None and up.locked:
            # A shm/tcp version (one pass, after a fallback) holds the lock on this very
            # thread: never enter it twice. A newer ipc version supersedes it.
            if r.version <= up.ann.version:
                why = f"not applied, version {up.ann.version} is being written by shm/tcp"
                self._after(imp.refuse(r, why), before)
                return
            self.fetcher.abandon(f"superseded by version {r.version} (ipc)")
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
        if imp.version != before:
            assert imp.offer is not None
            stats = UpdateStats(imp.version, "ipc", sum(b.nbytes for b in imp.offer.buckets))
            stats.total_s = time.monotonic() - self._t0
            stats.verify_s = sum(a.stats.get("verify_s", 0.0) for a in acks)
            stats.apply_s = max((a.stats.get("copy_s", 0.0) for a in acks), default=0.0)
            self.core.count("ipc_versions_applied")
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase="total").observe(stats.total_s)
            self.fallback.applied(imp.version)
            self.reporter.applied(stats)
            return
        bad = next((a for a in acks if not a.ok), None)
        if bad is None:
            return
        up = self.fetcher.update
        fetching = up.ann.version if up is not None else None
        act = self.fallback.on_failure(bad.version, self.core.held_version, fetching)
        if act is None:
            return
        self._fell_back(bad.version, f"failed on the ipc path ({bad.error})")
        step, ann = act
        if ann is not None:
            self.fetcher.consider(ann)
        elif step == "fail":
            self.fetcher.fail(bad.version, bad.error, "ipc")

    def _fell_back(self, version: int, why: str) -> None:
        self.core.count("ipc_fallbacks")
        msg = "worker %s: version %d %s; fetching it by shm/tcp"
        log.warning(msg, self.worker_id, version, why)

    def check_timeouts(self, now: float) -> None:
        """Fall back to shm/tcp for a version ipc does not deliver; drop the slots of a
        trainer that is gone."""
        ann = self.fallback.overdue(self.core.held_version, now, self.publisher_timeout)
        if ann is not None:
            self._fell_back(ann.version, f"did not come by ipc in {self.publisher_timeout:.1f} s")
            self.fetcher.consider(ann)
        imp = self.importer
        if self.opened and imp is not None and not imp.trainer_alive():
            self.reset()  # a restarted trainer offers its slots again
