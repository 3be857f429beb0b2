"""The ``ipc`` route: persistent buckets ("slots") of the trainer's own memory, opened
once by every worker on its host and packed again for every version (``docs/PROTOCOL.md``,
"The ipc path"). The buckets are planned, packed and checked as on every route
(:mod:`~transport.weights.bucket`); only where they live is the route's own. Trainer
side: :class:`IpcOffering` over :class:`IpcExporter`; worker side (re-exported here):
:mod:`~transport.weights.routes.ipc_worker`."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch

import fastio
from fastio.ipc_msgs import (
    TRAILER_BYTES,
    IpcAck,
    IpcHandle,
    IpcHello,
    IpcOffer,
    IpcReady,
    IpcSlot,
)
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport import metrics
from transport.weights.bucket import pack_bucket, wire_tensor
from transport.weights.bucket import sum64 as checksum
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.core.publisher import PublisherCore
from transport.weights.errors import WeightUpdateError
from transport.weights.routes.ipc_tensors import (
    DEFAULT_IPC_BUCKET_BYTES,
    IpcRefused,
    _cuda,
    check_layout,
    detached,
    export_cuda,
    layout_of,
    new_slot,
    plan_layout,
    release_slot,
)
from transport.weights.routes.ipc_worker import PATHS, IpcImporter, IpcReceiver, ipc_eligible

__all__ = [
    "DEFAULT_IPC_BUCKET_BYTES",
    "IPC_MODES",
    "PATHS",
    "IpcExporter",
    "IpcImporter",
    "IpcOffering",
    "IpcReceiver",
    "IpcRefused",
    "checksum",
    "ipc_eligible",
    "plan_layout",
]

#: Values of ``WeightPublisher(ipc=...)``.
IPC_MODES = ("auto", "cpu", "off")


@dataclass
class _Worker:
    hello: IpcHello
    opened: bool = False
    exports: list[IpcHandle] = field(default_factory=list)
    offered_at: float = field(default_factory=time.monotonic)


class IpcExporter:
    """The trainer's slots for one layout (sans-I/O): offered to workers, packed per
    version, gated by their acks. ``state`` (a module or ``name -> tensor`` mapping)
    gives the layout and the slots' device; ``slots``: 2 (double buffering) or ``None``
    (one per bucket); ``verify``: write each bucket's :func:`checksum`."""

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
        self.layout = layout_of(tensors, bucket_bytes)
        self.device = next(iter(tensors.values())).device
        self.verify = verify
        self.publisher_id = publisher_id or uuid.uuid4().hex[:12]
        n = len(self.layout) if slots is None else max(1, min(slots, len(self.layout)))
        self.capacity = max(b.nbytes for b in self.layout)
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._cpu_handles: list[IpcHandle | None] = []
        for _ in range(n):
            slot, event, handle = new_slot(self.capacity + TRAILER_BYTES, self.device)
            self._slots.append(slot)
            self._cpu_handles.append(handle)
            if event is not None:  # pragma: no cover - CUDA
                self._events.append(event)
        #: Workers that may still read each slot (sent its last IpcReady, not acked).
        self.pending: list[set[str]] = [set() for _ in range(n)]
        self.workers: dict[str, _Worker] = {}
        self._start_time = process_start_time(os.getpid()) or 0
        #: The version the slots hold whole (one slot per bucket), else ``-1``.
        self.held = -1
        #: Readers of :meth:`snapshot` views still at work: :meth:`publish` waits for them.
        self.snapshot_reads = 0
        self.closed = False

    @property
    def n_slots(self) -> int:
        """Persistent buckets held."""
        return len(self._slots)

    def offer(self, hello: IpcHello) -> IpcOffer:
        """Register a worker and export every slot for it, or refuse (an offer with an
        ``error``): a process this trainer cannot see (another host or pid namespace),
        a CUDA worker without access to the slots' device."""
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
        w = _Worker(hello)
        w.exports = [  # CUDA: one export (reference counter) per worker, released alone
            h or export_cuda(self._slots[k], self._events[k])
            for k, h in enumerate(self._cpu_handles)
        ]
        self.workers[hello.worker_id] = w
        return IpcOffer(
            self.publisher_id,
            os.getpid(),
            self._start_time,
            [IpcSlot(k, self.capacity, h) for k, h in enumerate(w.exports)],
            self.layout,
            checksum="sum64" if self.verify else "",
        )

    def handle_ack(self, ack: IpcAck) -> None:
        """Account one :class:`IpcAck` (unknown workers are ignored): a slot it
        released, the slots it opened or let go."""
        w = self.workers.get(ack.worker_id)
        if w is None:
            return
        if ack.bucket == -2 or (ack.bucket < 0 and not ack.ok):
            self.drop_worker(ack.worker_id, dead=False)  # unmapped, or could not open
        elif ack.bucket < 0:
            w.opened = True
        elif 0 <= ack.slot < self.n_slots:
            self.pending[ack.slot].discard(ack.worker_id)

    def drop_worker(self, worker_id: str, *, dead: bool) -> None:
        """Forget a worker: no slot waits for it any more. ``dead``: its process is gone,
        so the trainer also releases the references its opening took (no leak)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        for p in self.pending:
            p.discard(worker_id)
        if dead and w.opened:
            for k, h in enumerate(w.exports):
                release_slot(self._slots[k], h)

    def reap(self) -> list[str]:
        """Drop every worker whose process is gone; their ids."""
        gone = [
            k for k, w in self.workers.items() if not process_alive(w.hello.pid, w.hello.start_time)
        ]
        for k in gone:
            self.drop_worker(k, dead=True)
        return gone

    def _free(self, k: int) -> bool:
        if self.pending[k]:
            self.reap()
        return not self.pending[k]

    def publish(
        self,
        state: Any,
        version: int,
        *,
        send: Callable[[str, IpcReady], None],
        wait: Callable[[float], object],
        timeout: float = 60.0,
    ) -> None:
        """Pack ``state`` as ``version`` bucket by bucket, ``send`` an :class:`IpcReady`
        to every opened worker after each. ``wait(seconds)`` blocks while a slot is still
        read, handing each :class:`IpcAck` to :meth:`handle_ack`. Raises
        :class:`WeightMismatchError` (not the layout) or :class:`WeightUpdateError` (a
        slot stayed in use by a live worker for ``timeout`` seconds)."""
        tensors = detached(state)
        check_layout(self.layout, tensors)
        deadline = time.monotonic() + timeout
        if not _until(lambda: not self.snapshot_reads, deadline, wait):
            raise WeightUpdateError("the slots are still read for a snapshot")
        self.held = -1
        n = len(self.layout)
        for b in self.layout:
            k = b.index % self.n_slots
            if not _until(partial(self._free, k), deadline, wait):
                raise WeightUpdateError(
                    f"slot {k} is still read by {sorted(self.pending[k])}: not packed again "
                    "(a worker that may read it neither acked nor died in time)"
                )
            slot = self._slots[k]
            pack_bucket(cast("WeightBucketInfo", b), tensors, slot)
            trailer = slot[self.capacity : self.capacity + TRAILER_BYTES].view(torch.int64)
            trailer[0] = checksum(slot[: b.nbytes]) if self.verify else 0
            trailer[1].fill_(version)
            if self._events:  # pragma: no cover - CUDA
                self._events[k].record()
            msg = IpcReady(version, b.index, k, n)
            for wid, w in list(self.workers.items()):
                if w.opened:
                    self.pending[k].add(wid)
                    send(wid, msg)
        self.held = version if self.n_slots >= n else -1

    def snapshot(self, version: int) -> dict[str, torch.Tensor] | None:
        """Typed views of every tensor of ``version`` while the slots hold it whole (else
        ``None``), valid until the next :meth:`publish`, which waits while
        :attr:`snapshot_reads` (raised by the reader) is not zero."""
        if self.held != version or self.closed:
            return None
        return {
            e.name: wire_tensor(cast("WeightTensor", e), [self._slots[b.index]])
            for b in self.layout
            for e in b.tensors
        }

    def close(self) -> None:
        """Drop the slots (their memory is freed once no live worker maps them)."""
        self.reap()
        self.closed = True
        self._slots.clear()
        self._events.clear()
        self._cpu_handles.clear()
        if self.device.type == "cuda":  # pragma: no cover - CUDA
            _cuda.ipc_collect()  # frees blocks whose readers have all let go


def _until(
    done: Callable[[], bool], deadline: float, wait: Callable[[float], object], step: float = 0.2
) -> bool:
    """Call ``wait`` (``step`` seconds at most) until ``done()``; False at the deadline."""
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        wait(min(left, step))
    return True


class IpcOffering:
    """The publisher's ``ipc`` route: its slots (new ones when the layout changes) and
    the workers that asked for them; notices go to :attr:`outbox` and ``wake`` the
    serving thread that sends them."""

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
        """Release the slots of dead workers; their ids (call with the lock held)."""
        return self.exporter.reap() if self.exporter is not None else []

    def _queue(self, wid: str, msg: Any) -> None:
        self.outbox.append((wid.encode(), self.encoder.encode(msg)))
        self.wake()

    def prepare(self, tensors: dict[str, torch.Tensor], closed: Callable[[], bool]) -> None:
        """Slots for this layout (new ones when it changed), offered to every worker
        that asked; those still opening them get a moment to."""
        layout = layout_of(tensors, self.bucket_bytes)
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
        """Pack ``version`` into the slots and queue its IpcReady notices (under the
        lock, released while a slot is still read)."""
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
        """Close the slots (the publisher is closing)."""
        with self.cond:
            exp, self.exporter = self.exporter, None
        if exp is not None:
            exp.close()
