"""The trainer's slots of the ``ipc`` route, sans-I/O: :class:`IpcExporter` (the rules:
:mod:`transport.weights.routes.ipc`; the worker's side:
:class:`~transport.weights.routes.ipc_import.IpcImporter`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastio.ipc_msgs import (
    TRAILER_BYTES,
    IpcAck,
    IpcBucket,
    IpcHandle,
    IpcHello,
    IpcOffer,
    IpcReady,
    IpcSlot,
)
from transport.weights.errors import WeightUpdateError
from transport.weights.routes.ipc_tensors import (
    DEFAULT_IPC_BUCKET_BYTES,
    _byte_view,
    _check_layout,
    _cuda,
    _export_cuda,
    _layout_of,
    _named,
    _new_slot,
    _release,
    checksum,
    process_alive,
    process_start_time,
)

__all__ = ["IpcExporter", "IpcResult"]


@dataclass
class _Worker:
    hello: IpcHello
    opened: bool = False
    version: int = -1
    exports: list[IpcHandle] = field(default_factory=list)
    acks: dict[int, IpcAck] = field(default_factory=dict)  # version -> its last bucket's ack
    failed: dict[int, str] = field(default_factory=dict)  # version -> why
    #: ``time.monotonic()`` of its offer.
    offered_at: float = field(default_factory=time.monotonic)


@dataclass
class IpcResult:
    """Outcome of a version: the last ack of each worker that applied it, and why the
    others did not (``failed``: refused a bucket, process gone, not done in time)."""

    version: int
    applied: dict[str, IpcAck]
    failed: dict[str, str]

    @property
    def ok(self) -> bool:
        """Every worker applied the version."""
        return not self.failed


class IpcExporter:
    """Trainer side of the ``ipc`` path (sans-IO).

    Parameters
    ----------
    state:
        A module or ``name -> tensor`` mapping: the layout of every version (names,
        shapes, dtypes), and the device of the slots (its first tensor's).
    bucket_bytes:
        Bound of one bucket.
    slots:
        Persistent buckets (2: double buffering; ``None``: one per bucket).
    verify:
        Compute :func:`checksum` into every slot (the workers then check it).

    Examples
    --------
    >>> exp = IpcExporter(model)                        # doctest: +SKIP
    >>> send(w, exp.offer(hello))                       # once per worker
    >>> exp.handle_ack(ack)                             # for every IpcAck received
    >>> exp.publish(model, 7, send=send, wait=pump)     # per version
    >>> exp.result(7, wait=pump, timeout=30)            # doctest: +SKIP
    """

    def __init__(
        self,
        state: Any,
        *,
        bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
        slots: int | None = 2,
        verify: bool = True,
        publisher_id: str | None = None,
    ) -> None:
        tensors = _named(state)
        if not tensors:
            raise ValueError("nothing to share: the state has no tensors")
        self.layout = _layout_of(tensors, bucket_bytes)
        self.device = next(iter(tensors.values())).device
        self.verify = verify
        self.publisher_id = publisher_id or uuid.uuid4().hex[:12]
        n = len(self.layout) if slots is None else max(1, min(slots, len(self.layout)))
        self.capacity = max(b.nbytes for b in self.layout)
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._cpu_handles: list[IpcHandle | None] = []
        for _ in range(n):
            slot, event, handle = _new_slot(self.capacity + TRAILER_BYTES, self.device)
            self._slots.append(slot)
            self._cpu_handles.append(handle)
            if event is not None:  # pragma: no cover - CUDA
                self._events.append(event)
        #: Workers that may still read each slot (sent its last IpcReady, not acked).
        self.pending: list[set[str]] = [set() for _ in range(n)]
        self.workers: dict[str, _Worker] = {}
        self._start_time = process_start_time(os.getpid()) or 0
        self._versions: dict[int, set[str]] = {}  # version -> workers it was sent to
        #: The version every slot holds, when the slots hold a whole version (one slot
        #: per bucket) and it was packed completely; ``-1`` otherwise.
        self.held = -1
        #: Readers of :meth:`snapshot` views still at work: :meth:`publish` waits for them.
        self.snapshot_reads = 0
        self.closed = False

    def _export(self, k: int) -> IpcHandle:
        handle = self._cpu_handles[k]
        if handle is not None:
            return handle
        return _export_cuda(self._slots[k], self._events[k])  # pragma: no cover - CUDA

    @property
    def n_slots(self) -> int:
        """Persistent buckets held."""
        return len(self._slots)

    def offer(self, hello: IpcHello) -> IpcOffer:
        """Register a worker and export every slot for it, or refuse (an offer with an
        ``error``): a process this trainer cannot see is on another host or in another
        pid namespace; a CUDA worker needs access to the slots' device."""
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
        w = _Worker(hello, version=hello.version)
        w.exports = [self._export(k) for k in range(self.n_slots)]
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
        """Account one :class:`IpcAck` (unknown workers are ignored)."""
        w = self.workers.get(ack.worker_id)
        if w is None:
            return
        if ack.bucket == -2:  # it unmapped the slots itself: nothing to release for it
            self.drop_worker(ack.worker_id, dead=False)
            return
        if ack.bucket < 0:
            if ack.ok:
                w.opened = True
            else:
                self.drop_worker(ack.worker_id, dead=False)
            return
        if 0 <= ack.slot < self.n_slots:
            self.pending[ack.slot].discard(ack.worker_id)
        if not ack.ok:
            w.failed.setdefault(ack.version, ack.error or "refused")
        elif ack.bucket == len(self.layout) - 1 and ack.version not in w.failed:
            w.acks[ack.version] = ack
            w.version = ack.version

    def drop_worker(self, worker_id: str, *, dead: bool) -> None:
        """Forget a worker: no slot waits for it any more. ``dead``: its process is gone,
        so the trainer also releases the references its opening took (no leak)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        for p in self.pending:
            p.discard(worker_id)
        if not (dead and w.opened):
            return
        for k, h in enumerate(w.exports):
            _release(self._slots[k], h)

    def reap(self) -> list[str]:
        """Drop every worker whose process is gone; their ids."""
        gone = [
            k for k, w in self.workers.items() if not process_alive(w.hello.pid, w.hello.start_time)
        ]
        for k in gone:
            self.drop_worker(k, dead=True)
        return gone

    # a version
    def _acquire(self, k: int, deadline: float, wait: Callable[[float], object]) -> None:
        while self.pending[k]:
            self.reap()
            if not self.pending[k]:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightUpdateError(
                    f"slot {k} is still read by {sorted(self.pending[k])}: not packed again "
                    "(a worker that may read it neither acked nor died in time)"
                )
            wait(min(left, 0.2))

    def _pack(self, b: IpcBucket, tensors: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        srcs = [_byte_view(tensors[e.name]) for e in b.tensors]
        used = b.tensors[-1].offset + b.tensors[-1].nbytes
        if slot.device.type == "cpu" and all(s.device.type == "cpu" for s in srcs):
            # numpy copies: one memcpy each, no intra-op threads (see checksum)
            dst = slot.numpy()
            for e, s in zip(b.tensors, srcs, strict=True):
                np.copyto(dst[e.offset : e.offset + e.nbytes], s.numpy())
            dst[used : b.nbytes] = 0
            return
        if all(s.device == slot.device for s in srcs):
            torch.cat(srcs, out=slot[:used])
        else:  # sources elsewhere (e.g. CUDA tensors into CPU slots): one copy each
            for e, s in zip(b.tensors, srcs, strict=True):
                slot[e.offset : e.offset + e.nbytes].copy_(s, non_blocking=True)
        slot[used : b.nbytes].zero_()

    def publish(
        self,
        state: Any,
        version: int,
        *,
        send: Callable[[str, IpcReady], None],
        wait: Callable[[float], object],
        timeout: float = 60.0,
    ) -> None:
        """Pack ``state`` as ``version``, bucket by bucket, and ``send`` an
        :class:`IpcReady` to every opened worker after each.

        ``wait(seconds)`` is called while a slot is still read: it should block up to
        that long receiving messages and hand each :class:`IpcAck` to
        :meth:`handle_ack`. Returns once the last bucket is announced (not applied: see
        :meth:`result`).

        Raises
        ------
        WeightMismatchError
            ``state`` does not match the layout.
        WeightUpdateError
            A slot stayed in use by a live worker for ``timeout`` seconds.
        """
        tensors = _named(state)
        _check_layout(self.layout, tensors)
        deadline = time.monotonic() + timeout
        while self.snapshot_reads:  # the previous version is being copied out of the slots
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightUpdateError("the slots are still read for a snapshot")
            wait(min(left, 0.2))
        self.held = -1
        n = len(self.layout)
        sent_to: set[str] = set()
        for b in self.layout:
            k = b.index % self.n_slots
            self._acquire(k, deadline, wait)
            slot = self._slots[k]
            payload = slot[: b.nbytes]
            self._pack(b, tensors, slot)
            trailer = slot[self.capacity : self.capacity + TRAILER_BYTES].view(torch.int64)
            if self.verify:
                trailer[0].copy_(checksum(payload))
            else:
                trailer[0].zero_()
            trailer[1].fill_(version)
            if self._events:  # pragma: no cover - CUDA
                self._events[k].record()
            msg = IpcReady(version, b.index, k, n)
            for wid, w in list(self.workers.items()):
                if w.opened:
                    self.pending[k].add(wid)
                    sent_to.add(wid)
                    send(wid, msg)
        self._versions[version] = sent_to
        for old in [v for v in self._versions if v < version - 8]:
            del self._versions[old]
        self.held = version if self.n_slots >= n else -1

    def snapshot(self, version: int) -> dict[str, torch.Tensor] | None:
        """Typed views of every tensor of ``version`` in the slots, while the slots hold
        it whole (else ``None``). Valid until the next :meth:`publish`; raise
        :attr:`snapshot_reads` while reading them (publish waits for it to drop)."""
        if self.held != version or self.closed:
            return None
        out: dict[str, torch.Tensor] = {}
        for b in self.layout:
            slot = self._slots[b.index]
            for e in b.tensors:
                dt = getattr(torch, e.dtype)
                raw = slot[e.offset : e.offset + e.nbytes]
                if raw.storage_offset() % torch.empty((), dtype=dt).element_size():
                    raw = raw.clone()  # a view must be aligned to its dtype
                out[e.name] = raw.view(dt).view(e.shape)
        return out

    def result(
        self, version: int, *, wait: Callable[[float], object], timeout: float = 60.0
    ) -> IpcResult:
        """Wait until every worker ``version`` was sent to has applied it, refused it or
        is gone (up to ``timeout`` seconds), calling ``wait`` as in :meth:`publish`."""
        targets = self._versions.get(version, set())
        deadline = time.monotonic() + timeout
        while True:
            self.reap()
            open_ = [
                t for t in targets
                if t in self.workers and version not in self.workers[t].acks
                and version not in self.workers[t].failed
            ]  # fmt: skip
            left = deadline - time.monotonic()
            if not open_ or left <= 0:
                break
            wait(min(left, 0.2))
        applied: dict[str, IpcAck] = {}
        failed: dict[str, str] = {}
        for t in sorted(targets):
            w = self.workers.get(t)
            if w is None:
                failed[t] = "worker gone"
            elif version in w.acks:
                applied[t] = w.acks[version]
            else:
                failed[t] = w.failed.get(version, f"not applied within {timeout} s")
        return IpcResult(version, applied, failed)

    def close(self) -> None:
        """Drop the slots (their memory is freed once no live worker maps them)."""
        self.reap()
        self.closed = True
        cuda = self.device.type == "cuda"
        self._slots.clear()
        self._events.clear()
        self._cpu_handles.clear()
        if cuda:  # pragma: no cover - CUDA: free blocks whose readers have all let go
            _cuda.ipc_collect()
