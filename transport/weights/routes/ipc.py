"""The ``ipc`` route: persistent buckets ("slots") of the trainer's memory, opened once by
every worker on its host and packed again for every version (``docs/PROTOCOL.md``, "The
ipc path"). Trainer side: :class:`IpcExporter` (sans-I/O) under :class:`IpcOffering`;
worker side (re-exported here): :mod:`~transport.weights.routes.ipc_worker`."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from typing import Any, cast

import torch

import fastio
from fastio.ipc_msgs import (
    TRAILER_BYTES,
    IpcAck,
    IpcBucket,
    IpcHandle,
    IpcHello,
    IpcOffer,
    IpcReady,
    IpcSlot,
    IpcTensor,
)
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport import metrics
from transport.weights.binding import Binding
from transport.weights.bucket import SUM64_ROW, dtype_name, pack_bucket, plan_spans, wire_tensor
from transport.weights.bucket import sum64 as checksum
from transport.weights.core.ipc import SlotLedger
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.core.publisher import PublisherCore
from transport.weights.errors import WeightUpdateError
from transport.weights.routes.ipc_worker import (
    PATHS,
    IpcImporter,
    IpcReceiver,
    IpcRefused,
    _cuda,
    _Storage,
    detached,
    ipc_eligible,
)

__all__ = ["DEFAULT_IPC_BUCKET_BYTES", "IPC_MODES", "PATHS", "IpcExporter", "IpcImporter",
           "IpcOffering", "IpcReceiver", "IpcRefused", "checksum", "ipc_eligible", "plan_layout"]  # fmt: skip

#: Default bound of one bucket (and so of one slot).
DEFAULT_IPC_BUCKET_BYTES = 512 << 20
#: Values of ``WeightPublisher(ipc=...)``.
IPC_MODES = ("auto", "cpu", "off")


def plan_layout(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
) -> list[IpcBucket]:
    """:func:`~transport.weights.bucket.plan_spans` of ``(name, dtype name, shape)``:
    tensors back to back, each bucket's length rounded up to 512 bytes (``sum64``)."""
    return [
        IpcBucket(i, -(-size // SUM64_ROW) * SUM64_ROW, [IpcTensor(*e) for e in entries])
        for i, (entries, size) in enumerate(plan_spans(specs, bucket_bytes, 1))
    ]


def _layout(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[IpcBucket]:
    return plan_layout(
        ((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()), bucket_bytes
    )


def _until(
    done: Callable[[], bool], deadline: float, wait: Callable[[float], object], step: float = 0.2
) -> bool:
    """``wait`` (``step`` s at most each) until ``done()``; False at the deadline."""
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        wait(min(left, step))
    return True


def _new_slot(nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any, IpcHandle | None]:
    """A zeroed slot: the tensor, its CUDA event, on CPU its handle (one for all)."""
    if device.type == "cuda":  # pragma: no cover - CUDA
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return t, _cuda.Event(interprocess=True, blocking=False), None
    st = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    t = torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,), (1,)).zero_()
    manager, name, size = st._share_filename_cpu_()
    return t, None, IpcHandle("cpu", -1, name, size, manager=manager)


def _export_cuda(slot: torch.Tensor, event: Any) -> IpcHandle:  # pragma: no cover - CUDA
    # One export (one producer-side reference counter) per worker and slot, so each
    # worker's release is matched and a dead one's is done by the trainer.
    (dev, handle, size, off, rc, rc_off, ev, ev_sync) = _Storage._share_cuda_(
        slot.untyped_storage()
    )
    return IpcHandle(
        "cuda",
        int(dev),
        bytes(handle),
        int(size),
        int(off),
        bytes(rc),
        int(rc_off),
        bytes(ev or b""),
        bool(ev_sync),
        bytes(event.ipc_handle()),
    )


def _release_slot(slot: torch.Tensor, h: IpcHandle) -> None:
    """Release the references a dead worker's opening of ``h`` took."""
    if h.kind == "cpu":
        slot.untyped_storage()._shared_decref()
    else:  # pragma: no cover - CUDA
        _Storage._release_ipc_counter(h.ref_counter_handle, h.ref_counter_offset, device=h.device)


@dataclass
class _Worker:
    hello: IpcHello
    exports: list[IpcHandle]
    opened: bool = False
    offered_at: float = field(default_factory=time.monotonic)


class IpcExporter:
    """The trainer's slots for one layout (sans-I/O), offered to workers and packed per
    version. ``state`` (a module or ``name -> tensor`` mapping): the layout and device;
    ``slots``: 2 (double buffering) or ``None`` (one per bucket); ``verify``: checksums."""

    def __init__(
        self,
        state: Any,
        *,
        bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
        slots: int | None = 2,
        verify: bool = True,
        publisher_id: str | None = None,
    ) -> None:
        tensors = detached(state)
        if not tensors:
            raise ValueError("nothing to share: the state has no tensors")
        self.layout = _layout(tensors, bucket_bytes)
        self.device = next(iter(tensors.values())).device
        self.verify = verify
        self.publisher_id = publisher_id or uuid.uuid4().hex[:12]
        n = len(self.layout) if slots is None else max(1, min(slots, len(self.layout)))
        self.capacity = max(b.nbytes for b in self.layout)
        self._slots = [_new_slot(self.capacity + TRAILER_BYTES, self.device) for _ in range(n)]
        self.ledger = SlotLedger(n, len(self.layout))
        self.workers: dict[str, _Worker] = {}
        self._start_time = process_start_time(os.getpid()) or 0
        #: Readers of :meth:`snapshot` views still at work: :meth:`publish` waits for them.
        self.snapshot_reads = 0
        self.closed = False

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def offer(self, hello: IpcHello) -> IpcOffer:
        """Export every slot to a worker, or refuse it (an offer with an ``error``)."""
        if self.closed:
            raise WeightUpdateError("exporter closed")
        why = ""
        if not process_alive(hello.pid, hello.start_time):
            why = (
                f"worker {hello.worker_id!r} (pid {hello.pid}) is not visible from the "
                "trainer: another host or pid namespace; ipc needs one host"
            )
        elif self.device.type == "cuda":  # pragma: no cover - CUDA
            mine = self.device.index or 0
            if hello.device < 0:
                why = "the slots are CUDA memory and the worker has no CUDA device"
            elif hello.device != mine and not torch.cuda.can_device_access_peer(hello.device, mine):
                why = f"cuda:{hello.device} has no peer access to cuda:{mine}"
        if why:
            return IpcOffer(self.publisher_id, os.getpid(), self._start_time, [], [], error=why)
        old = self.workers.get(hello.worker_id)
        if old is not None:  # a restarted worker: its old process holds nothing now
            self.drop_worker(
                hello.worker_id, dead=not process_alive(old.hello.pid, old.hello.start_time)
            )
        exports = [h or _export_cuda(s, ev) for s, ev, h in self._slots]
        self.workers[hello.worker_id] = w = _Worker(hello, exports)  # once they exist (may fail)
        return IpcOffer(
            self.publisher_id,
            os.getpid(),
            self._start_time,
            [IpcSlot(k, self.capacity, h) for k, h in enumerate(w.exports)],
            self.layout,
            checksum="sum64" if self.verify else "",
        )

    def handle_ack(self, ack: IpcAck) -> None:
        """One :class:`IpcAck`: a slot released, the slots opened or let go."""
        w = self.workers.get(ack.worker_id)
        if w is None:
            return
        if ack.bucket == -2 or (ack.bucket < 0 and not ack.ok):
            self.drop_worker(ack.worker_id, dead=False)  # unmapped, or could not open
        elif ack.bucket < 0:
            w.opened = True
        else:
            self.ledger.released(ack.slot, ack.worker_id)

    def drop_worker(self, worker_id: str, *, dead: bool) -> None:
        """Forget a worker (``dead``: also release the references its opening took)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        self.ledger.drop(worker_id)
        if dead and w.opened:
            for (slot, _, _), h in zip(self._slots, w.exports, strict=False):
                _release_slot(slot, h)

    def reap(self) -> list[str]:
        """Drop every worker whose process is gone; their ids."""
        gone = [
            k for k, w in self.workers.items() if not process_alive(w.hello.pid, w.hello.start_time)
        ]
        for k in gone:
            self.drop_worker(k, dead=True)
        return gone

    def _free(self, k: int) -> bool:
        if self.ledger.readers[k]:
            self.reap()
        return not self.ledger.readers[k]

    def publish(
        self,
        state: Any,
        version: int,
        *,
        send: Callable[[str, IpcReady], None],
        wait: Callable[[float], object],
        timeout: float = 60.0,
    ) -> None:
        """Pack ``state`` as ``version``, ``send`` an :class:`IpcReady` to every opened
        worker per bucket; ``wait(seconds)`` blocks (acks handled) while a slot is read.
        :class:`WeightUpdateError` when a live reader holds a slot for ``timeout`` s."""
        tensors = detached(state)
        Binding(cast("list[WeightBucketInfo]", self.layout), tensors, strict=True)
        deadline = time.monotonic() + timeout
        if not _until(lambda: not self.snapshot_reads, deadline, wait):
            raise WeightUpdateError("the slots are still read for a snapshot")
        self.ledger.packing()
        for b in self.layout:
            k = self.ledger.slot(b.index)
            if not _until(partial(self._free, k), deadline, wait):
                raise WeightUpdateError(
                    f"slot {k} is still read by {sorted(self.ledger.readers[k])}: not packed "
                    "again (a worker that may read it neither acked nor died in time)"
                )
            slot, event, _ = self._slots[k]
            pack_bucket(cast("WeightBucketInfo", b), tensors, slot)
            trailer = slot[self.capacity : self.capacity + TRAILER_BYTES].view(torch.int64)
            trailer[0] = checksum(slot[: b.nbytes]) if self.verify else 0
            trailer[1].fill_(version)
            if event is not None:  # pragma: no cover - CUDA
                event.record()
            msg = IpcReady(version, b.index, k, len(self.layout))
            readers = [wid for wid, w in self.workers.items() if w.opened]
            self.ledger.packed(k, readers)
            for wid in readers:
                send(wid, msg)
        self.ledger.done(version)

    def snapshot(self, version: int) -> dict[str, torch.Tensor] | None:
        """Views of ``version``'s tensors while the slots hold it whole, else ``None``
        (valid until :meth:`publish`, which waits while :attr:`snapshot_reads`)."""
        if not self.ledger.holds(version) or self.closed:
            return None
        return {
            e.name: wire_tensor(cast("WeightTensor", e), [self._slots[b.index][0]])
            for b in self.layout
            for e in b.tensors
        }

    def close(self) -> None:
        """Drop the slots (their memory is freed once no live worker maps them)."""
        self.reap()
        self.closed = True
        self._slots.clear()
        if self.device.type == "cuda":  # pragma: no cover - CUDA
            _cuda.ipc_collect()  # frees blocks whose readers have all let go


@dataclass(eq=False)
class IpcOffering:
    """The publisher's ``ipc`` route: the slots of the current layout and the workers
    that asked; notices go to :attr:`outbox` and ``wake`` the serving thread."""

    mode: str
    slots: int | None
    timeout: float
    _: KW_ONLY
    core: PublisherCore
    cond: threading.Condition
    encoder: fastio.Encoder
    wake: Callable[[], None]
    publisher_id: str
    bucket_bytes: int
    exporter: IpcExporter | None = None
    #: The last IpcHello of each worker that asked (offered again on a new layout).
    hellos: dict[str, IpcHello] = field(default_factory=dict)
    #: Notices for the serving thread to send: (worker identity, frames).
    outbox: list[tuple[bytes, list[Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in IPC_MODES:
            raise ValueError(f"ipc must be one of {IPC_MODES}, not {self.mode!r}")

    def wanted(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a version of ``tensors`` takes the route."""
        cuda = any(t.is_cuda for t in tensors.values())
        return self.mode != "off" and bool(tensors) and (self.mode == "cpu" or cuda)

    def _opened(self, wid: str) -> bool:
        w = self.exporter.workers.get(wid) if self.exporter is not None else None
        return w is not None and w.opened

    def reader(self, wid: str) -> bool:
        """Whether worker ``wid`` has the slots open."""
        with self.cond:
            return self._opened(wid)

    def only(self) -> bool:
        """Whether every live worker reads here and the slots hold a whole version."""
        with self.cond:
            exp = self.exporter
            whole = exp is not None and exp.n_slots >= len(exp.layout)
            return whole and all(self._opened(w) for w in self.core.alive())

    def handle(self, wid: str, msg: IpcHello | IpcAck, now: float) -> IpcOffer | None:
        """An ``IpcHello`` (kept, and offered the slots) or ``IpcAck``; the offer to send."""
        if msg.worker_id != wid:  # only a peer's own id counts
            self.core.count("ipc_foreign_ids")
            return None
        offer = None
        with self.cond:
            known = self.core.seen(wid, now)
            if isinstance(msg, IpcHello):
                if not known:
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
        """Release the slots of dead workers; their ids (lock held)."""
        return self.exporter.reap() if self.exporter is not None else []

    @contextlib.contextmanager
    def snapshot(self, version: int) -> Iterator[dict[str, torch.Tensor] | None]:
        """The slots' views of ``version`` (``None``: not held whole), left alone by
        :meth:`publish` until the block ends."""
        with self.cond:
            exp = self.exporter
            src = exp.snapshot(version) if exp is not None else None
            if exp is not None and src is not None:
                exp.snapshot_reads += 1
        try:
            yield src
        finally:
            if exp is not None and src is not None:
                with self.cond:
                    exp.snapshot_reads -= 1
                    self.cond.notify_all()

    def take_outbox(self) -> list[tuple[bytes, list[Any]]]:
        """The notices queued for the serving thread, taken (lock held)."""
        out, self.outbox = self.outbox, []
        return out

    def _queue(self, wid: str, msg: Any) -> None:
        self.outbox.append((wid.encode(), self.encoder.encode(msg)))
        self.wake()

    def prepare(self, tensors: dict[str, torch.Tensor], closed: Callable[[], bool]) -> None:
        """Slots for this layout (new ones when it changed) offered to every worker that
        asked; those still opening them get a moment to."""
        layout = _layout(tensors, self.bucket_bytes)
        with self.cond:
            if self.exporter is None or self.exporter.layout != layout:
                if self.exporter is not None:
                    self.exporter.close()
                self.exporter = IpcExporter(
                    tensors,
                    bucket_bytes=self.bucket_bytes,
                    slots=self.slots,
                    publisher_id=self.publisher_id,
                )
                alive = self.core.alive()
                for wid, hello in self.hellos.items():
                    if wid in alive:
                        self._queue(wid, self.exporter.offer(hello))
            grace = min(5.0, self.timeout)
            workers = self.exporter.workers

            def settled() -> bool:
                alive, now = self.core.alive(), time.monotonic()
                return closed() or not any(
                    not st.opened and now - st.offered_at < 2 * grace and w in alive
                    for w, st in workers.items()
                )

            _until(settled, time.monotonic() + grace, self.cond.wait, 0.1)

    def publish(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Pack ``version`` into the slots, queue its IpcReady notices (lock held)."""
        with self.cond:
            exp = self.exporter
            assert exp is not None
            exp.publish(
                tensors, version, send=self._queue, wait=self.cond.wait, timeout=self.timeout
            )
            readers = sum(w.opened for w in exp.workers.values())
        metrics.PUBLISHER_BYTES.labels(path="ipc").inc(sum(b.nbytes for b in exp.layout) * readers)
        self.core.count("ipc_versions")

    def close(self) -> None:
        with self.cond:
            exp, self.exporter = self.exporter, None
        if exp is not None:
            exp.close()
