"""The ``ipc`` weight path: persistent buckets of the trainer's memory, opened once by
every worker on its node, packed again for every version.

On a GPU the buckets are CUDA allocations shared by CUDA IPC (the worker maps the
trainer's device memory; a copy into its parameters runs device to device). On CPU the
same code shares torch's shared-memory files (``_share_filename_cpu_``), so every rule
below is exercised without a GPU; only the lines marked CUDA differ.

Sans-IO: :class:`IpcExporter` (trainer) and :class:`IpcImporter` (worker) turn the
messages of :mod:`fastio.ipc_msgs` into actions and back; who carries the messages is the
caller's business (:mod:`transport.weights.ipc_link` is a minimal ZeroMQ driver).

* **Slots.** The trainer allocates ``slots`` buckets (two by default: bucket k+1 is packed
  while the workers copy bucket k; ``slots=None``: one per bucket, the whole model) of
  the largest bucket's size, ``bucket_bytes`` at most unless one tensor is larger, and
  exports each handle once per worker (an :class:`~fastio.ipc_msgs.IpcOffer`).
* **A version.** Bucket b goes to slot ``b % slots``: packed with one ``torch.cat`` per
  bucket, checksummed on the slot's device (:func:`checksum`) into the slot's trailer
  together with the version, then (CUDA) the slot's inter-process event is recorded and
  an :class:`~fastio.ipc_msgs.IpcReady` goes to every worker. The trainer never waits
  for its own device.
* **The worker** waits on the slot's event (CUDA), checks the trailer's version and
  checksum on the device, copies (``torch._foreach_copy_``) and acks the slot.
* **Reuse.** A slot is packed again only once every worker sent its last ``IpcReady``
  has acked it or its process is gone (``pid`` and start time: ipc is one host).
* **Never a mixed version.** ``atomic=True`` (default): when the whole version fits in
  the slots the worker verifies every bucket before copying any (no extra memory);
  otherwise it assembles the version in a private staging buffer first. Either way a
  trainer that dies mid-version leaves the worker on its previous version.
  ``atomic=False`` copies each bucket as it lands; a version cut short leaves the worker
  with ``serving == False`` until the next complete one.
* **Leaks.** A worker that leaves says so (``IpcAck(bucket=-2)`` from
  :meth:`IpcImporter.release`, after unmapping). A worker whose process is gone without
  saying so has its references released by the trainer (CPU: the shared file's
  reference count; CUDA: torch's IPC reference counter of that worker's export), so
  closing the exporter frees the memory while the trainer lives on.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
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
    IpcTensor,
)
from transport.weights.errors import WeightMismatchError, WeightUpdateError

__all__ = [
    "DEFAULT_IPC_BUCKET_BYTES",
    "IpcExporter",
    "IpcImporter",
    "IpcRefused",
    "IpcResult",
    "checksum",
    "plan_layout",
    "process_alive",
    "process_start_time",
]

#: Default bound of one bucket (and so of one slot).
DEFAULT_IPC_BUCKET_BYTES = 512 << 20
_ROW = 512  # bytes per checksum row; bucket lengths are multiples of it
# Typed loosely: torch's private sharing API has no annotations.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage


class IpcRefused(WeightUpdateError):
    """The ipc path cannot serve this worker (other host or pid namespace, no access to
    the trainer's device, layout mismatch): use another path."""


# -- helpers ---------------------------------------------------------------------------
def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), ``None`` when this
    process cannot see ``pid`` (gone, or another pid namespace)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":  # a zombie holds no memory and runs no code
        return None
    return int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` that started at ``start_time`` still runs (a reused pid
    has another start time)."""
    return process_start_time(pid) == start_time


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _named(state: Any) -> dict[str, torch.Tensor]:
    if isinstance(state, torch.nn.Module):
        state = state.state_dict(keep_vars=True)
    return {k: v.detach() for k, v in state.items()}


def plan_layout(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
) -> list[IpcBucket]:
    """Buckets of ``(name, dtype name, shape)`` in order, each at most ``bucket_bytes``
    (a larger tensor gets a bucket of its own), tensors back to back, each bucket's
    length rounded up to 512 bytes (zeros)."""
    out: list[IpcBucket] = []
    cur: list[IpcTensor] = []
    pos = 0

    def close() -> None:
        nonlocal cur, pos
        if cur:
            out.append(IpcBucket(len(out), -(-pos // _ROW) * _ROW, cur))
        cur, pos = [], 0

    for name, dtype, shape in specs:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if cur and pos + nbytes > bucket_bytes:
            close()
        cur.append(IpcTensor(name, dtype, tuple(shape), pos, nbytes))
        pos += nbytes
    close()
    return out


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def checksum(payload: torch.Tensor) -> torch.Tensor:
    """``sum64`` of a bucket: a 0-d int64 tensor on ``payload``'s device, computed there
    (no host synchronisation): the bytes read as int64 words in rows of 64, each row's
    wrapping sum times the row's number (from 1), summed with wrap-around. Exact and
    order-independent, so the trainer's and the worker's devices agree bit for bit;
    catches stale, torn and shifted data (not an adversary). ``payload``: 1-D uint8, a
    multiple of 512 bytes, 8-byte aligned.

    On CPU the sums run in numpy, single-threaded: torch's intra-op threads spin and
    wait on a host whose cores are busy (a trainer's), costing several times the
    work itself (bench/results)."""
    if payload.device.type == "cpu":
        words = payload.numpy().view(np.int64).reshape(-1, _ROW // 8)
        rows_np = words.sum(axis=1, dtype=np.int64)
        n = rows_np.size
        weights = np.arange(1, n + 1, dtype=np.int64)
        return torch.tensor(int((rows_np * weights).sum(dtype=np.int64)), dtype=torch.int64)
    rows = payload.view(torch.int64).view(-1, _ROW // 8).sum(dim=1)
    key = (rows.numel(), rows.device)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    return (rows * w).sum()


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _check_layout(buckets: list[IpcBucket], tensors: Mapping[str, torch.Tensor]) -> None:
    names = set()
    for b in buckets:
        for e in b.tensors:
            names.add(e.name)
            t = tensors.get(e.name)
            if t is None:
                raise WeightMismatchError(f"{e.name!r} is in the layout but not in the model")
            if tuple(t.shape) != e.shape or _dtype_name(t.dtype) != e.dtype:
                raise WeightMismatchError(
                    f"{e.name!r}: layout {e.dtype}{list(e.shape)}, "
                    f"model {_dtype_name(t.dtype)}{list(t.shape)}"
                )
    extra = sorted(set(tensors) - names)
    if extra:
        raise WeightMismatchError(f"tensors not in the layout: {extra[:5]}")


# -- trainer side ----------------------------------------------------------------------
@dataclass
class _Worker:
    hello: IpcHello
    opened: bool = False
    version: int = -1
    exports: list[IpcHandle] = field(default_factory=list)
    acks: dict[int, IpcAck] = field(default_factory=dict)  # version -> its last bucket's ack
    failed: dict[int, str] = field(default_factory=dict)  # version -> why


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
        self.layout = plan_layout(
            ((k, _dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()), bucket_bytes
        )
        self.device = next(iter(tensors.values())).device
        self.verify = verify
        self.publisher_id = publisher_id or uuid.uuid4().hex[:12]
        n = len(self.layout) if slots is None else max(1, min(slots, len(self.layout)))
        self.capacity = max(b.nbytes for b in self.layout)
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._cpu_handles: list[IpcHandle] = []
        for _ in range(n):
            self._slots.append(self._allocate(self.capacity + TRAILER_BYTES))
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

    # slots and handles
    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":  # pragma: no cover - CUDA
            t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._events.append(_cuda.Event(interprocess=True, blocking=False))
            return t
        st = torch.UntypedStorage._new_using_filename_cpu(nbytes)
        t = torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,), (1,)).zero_()
        manager, name, size = st._share_filename_cpu_()
        self._cpu_handles.append(IpcHandle("cpu", -1, name, size, manager=manager))
        return t

    def _export(self, k: int) -> IpcHandle:
        if self.device.type != "cuda":
            return self._cpu_handles[k]
        # pragma: no cover - CUDA: one export (one producer-side reference counter) per
        # worker and slot, so each worker's release is matched and a dead one's is done
        # by drop_worker.
        (dev, handle, size, off, rc, rc_off, ev, ev_sync) = (  # pragma: no cover
            _Storage._share_cuda_(self._slots[k].untyped_storage())
        )
        return IpcHandle(  # pragma: no cover
            "cuda", int(dev), bytes(handle), int(size), int(off), bytes(rc), int(rc_off),
            bytes(ev or b""), bool(ev_sync), bytes(self._events[k].ipc_handle()),
        )  # fmt: skip

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
            if h.kind == "cpu":
                self._slots[k].untyped_storage()._shared_decref()
            else:  # pragma: no cover - CUDA
                _Storage._release_ipc_counter(
                    h.ref_counter_handle, h.ref_counter_offset, device=h.device
                )

    def reap(self) -> list[str]:
        """Drop every worker whose process is gone; their ids."""
        gone = [
            k for k, w in self.workers.items() if not process_alive(w.hello.pid, w.hello.start_time)
        ]
        for k in gone:
            self.drop_worker(k, dead=True)
        return gone

    # a version
    def _acquire(self, k: int, deadline: float, wait: Callable[[float], None]) -> None:
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
        wait: Callable[[float], None],
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
        self, version: int, *, wait: Callable[[float], None], timeout: float = 60.0
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


# -- worker side -----------------------------------------------------------------------
class IpcImporter:
    """Worker side of the ``ipc`` path (sans-IO): opens the trainer's slots once and
    copies each version into ``targets``, its live tensors.

    Parameters
    ----------
    targets:
        A module or ``name -> tensor`` mapping (the same names, shapes and dtypes as the
        trainer's layout); all on one device (CPU or CUDA).
    atomic:
        Never a mixed version (see the module docstring); ``False``: copy each bucket as
        it lands, ``serving`` is ``False`` while a version is partly copied.
    verify:
        Check each bucket's checksum (when the trainer computed one).

    Attributes
    ----------
    version:
        The last version fully copied into ``targets`` (``-1``: none).
    serving:
        ``False`` while ``targets`` hold a partial version (``atomic=False`` only).
    """

    def __init__(
        self,
        targets: Any,
        *,
        worker_id: str | None = None,
        atomic: bool = True,
        verify: bool = True,
        version: int = -1,
    ) -> None:
        self.targets = _named(targets)
        self.worker_id = worker_id or f"ipc-{os.getpid()}"
        self.atomic = atomic
        self.verify = verify
        self.version = version
        self.serving = True
        dev = {t.device for t in self.targets.values()}
        if len(dev) > 1:
            raise ValueError(f"targets on several devices: {sorted(map(str, dev))}")
        self.device = dev.pop() if dev else torch.device("cpu")
        self.offer: IpcOffer | None = None
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._partial: int | None = None
        self._held: list[IpcReady] = []
        self._failed: str = ""
        self._staging: torch.Tensor | None = None
        self._copied_any = False
        self._starts: list[int] = []
        self._expect = 0
        self._plans: dict[tuple[int, int], Any] = {}

    def hello(self) -> IpcHello:
        """The :class:`IpcHello` this worker sends (again after a trainer restart)."""
        return IpcHello(
            self.worker_id,
            os.getpid(),
            process_start_time(os.getpid()) or 0,
            (self.device.index or 0) if self.device.type == "cuda" else -1,
            self.version,
        )

    def trainer_alive(self) -> bool:
        """Whether the trainer whose offer this worker opened still runs."""
        return self.offer is not None and process_alive(self.offer.pid, self.offer.start_time)

    def _ack(
        self, r: IpcReady, ok: bool, error: str = "", stats: dict[str, float] | None = None
    ) -> IpcAck:
        return IpcAck(
            self.worker_id, r.version, r.bucket, r.slot, ok, self.version, error, stats or {}
        )

    def open(self, offer: IpcOffer) -> IpcAck:
        """Open every slot of ``offer`` (once; a new offer replaces the old one).

        Returns the :class:`IpcAck` (``bucket=-1``) to send: ``ok=False`` with the reason
        when the layout does not match or a handle cannot be opened.

        Raises
        ------
        IpcRefused
            The offer is a refusal, or the trainer's process is not visible from here.
        """
        if offer.error:
            raise IpcRefused(offer.error)
        if not process_alive(offer.pid, offer.start_time):
            raise IpcRefused(
                f"trainer pid {offer.pid} is not visible from this worker: another host "
                "or pid namespace; ipc needs one host"
            )
        self.abandon()  # a version of a previous offer (trainer) never completes now
        self.close_slots()
        nack = IpcAck(self.worker_id, -1, -1, -1, False, self.version)
        try:
            _check_layout(offer.buckets, self.targets)
        except WeightMismatchError as exc:
            return _replace(nack, error=str(exc))
        try:
            for s in offer.slots:
                self._slots.append(self._open_slot(s))
        except (RuntimeError, OSError, ValueError) as exc:
            self.close_slots()
            return _replace(nack, error=f"cannot open slot: {exc}")
        self.offer = offer
        self._starts = []
        pos = 0
        for b in offer.buckets:
            self._starts.append(pos)
            pos += b.nbytes
        return _replace(nack, ok=True)

    def _open_slot(self, s: IpcSlot) -> torch.Tensor:
        h = s.handle
        if h.kind == "cpu":
            st = torch.UntypedStorage._new_shared_filename_cpu(h.manager, h.handle, h.size)
            return torch.empty(0, dtype=torch.uint8).set_(st, 0, (h.size,), (1,))
        if h.kind != "cuda":
            raise ValueError(f"unknown handle kind {h.kind!r}")
        # pragma: no cover - CUDA: the rebuild of torch.multiprocessing.reductions'
        # rebuild_cuda_tensor, from msgpack fields instead of a pickle.
        _cuda._lazy_init()  # pragma: no cover
        st = torch.UntypedStorage._new_shared_cuda(  # pragma: no cover
            h.device, h.handle, h.size, h.offset, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required,
        )  # fmt: skip
        self._events.append(_cuda.Event.from_ipc_handle(h.device, h.slot_event))  # pragma: no cover
        dev = torch.device("cuda", h.device)  # pragma: no cover
        return torch.empty(0, dtype=torch.uint8, device=dev).set_(
            st, 0, (h.size,), (1,)
        )  # pragma: no cover

    @property
    def _deferred(self) -> bool:
        # the whole version fits in the slots: verify all, then copy, no staging
        return self.offer is not None and len(self.offer.buckets) <= len(self.offer.slots)

    def on_ready(self, r: IpcReady) -> list[IpcAck]:
        """Take one :class:`IpcReady`; the acks to send (several at once when the
        worker held buckets until its version was complete)."""
        if (
            self.offer is None
            or not 0 <= r.slot < len(self._slots)
            or not (0 <= r.bucket < len(self.offer.buckets))
        ):
            return [self._ack(r, False, "no such slot or bucket (no offer opened?)")]
        if r.version != self._partial:
            self._start(r.version)
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
            self._failed = self._check(slot, b, r.version)
        t1 = time.perf_counter()
        last = r.bucket == r.n_buckets - 1
        if self._failed:
            held, self._held = self._held, []
            if not self.atomic and self._copied_any:
                self.serving = False
            return [self._ack(h, False, self._failed) for h in [*held, r]]
        stats = {"verify_s": t1 - t0}
        if self.atomic and self._deferred:
            self._held.append(r)
            if not last:
                return []
            t2 = time.perf_counter()
            for h in self._held:
                self._copy(self.offer.buckets[h.bucket], self._slots[h.slot])
            self._sync(slot)
            done, self._held = self._held, []
            self._complete(r.version)
            stats["copy_s"] = time.perf_counter() - t2
            return [self._ack(h, True, stats=stats) for h in done]
        if self.atomic:
            st = self._staging_for()
            start = self._starts[r.bucket]
            st[start : start + b.nbytes].copy_(slot[: b.nbytes])
            if last:
                for bb, s0 in zip(self.offer.buckets, self._starts, strict=True):
                    self._copy(bb, st[s0 : s0 + bb.nbytes])
        else:
            self._copy(b, slot)
            self._copied_any = True
            self.serving = False
        self._sync(slot)
        if last:
            self._complete(r.version)
        stats["copy_s"] = time.perf_counter() - t1
        return [self._ack(r, True, stats=stats)]

    def _start(self, version: int) -> None:
        # A new version begins; a partial one before it never completed (the trainer
        # restarted, or a bucket was refused): its buckets are dropped.
        self._partial = version
        self._held = []
        self._failed = ""
        self._expect = 0

    def _complete(self, version: int) -> None:
        self.version = version
        self.serving = True
        self._copied_any = False
        self._partial = None

    def _check(self, slot: torch.Tensor, b: IpcBucket, version: int) -> str:
        assert self.offer is not None
        cap = self.offer.slots[0].capacity
        trailer = slot[cap : cap + TRAILER_BYTES].view(torch.int64)
        if self.verify and self.offer.checksum == "sum64":
            ok_t = (trailer[1] == version) & (checksum(slot[: b.nbytes]) == trailer[0])
            ok = bool(ok_t.item())  # the one host synchronisation of a check
            if ok:
                return ""
        elif int(trailer[1].item()) == version:
            return ""
        got = int(trailer[1].item())
        if got != version:
            return f"bucket {b.index}: the slot holds version {got}, not {version}"
        return f"bucket {b.index} of version {version}: checksum mismatch"

    def _staging_for(self) -> torch.Tensor:
        assert self.offer is not None
        total = sum(b.nbytes for b in self.offer.buckets)
        if self._staging is None or self._staging.numel() < total:
            self._plans.clear()  # they may hold views of the old buffer
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        return self._staging

    def _copy(self, b: IpcBucket, src: torch.Tensor) -> None:
        # The views are built once per (bucket, source) and reused by every version:
        # one batched copy per bucket, no Python call per tensor.
        key = (b.index, src.data_ptr())
        plan = self._plans.get(key)
        if plan is None:
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            odd: list[tuple[torch.Tensor, torch.Tensor]] = []
            for e in b.tensors:
                t = self.targets[e.name]
                piece = src[e.offset : e.offset + e.nbytes]
                if t.is_contiguous():
                    dsts.append(_byte_view(t))
                    srcs.append(piece)
                else:  # rare: through a contiguous temporary
                    odd.append((t, piece))
            plan = self._plans[key] = (dsts, srcs, odd)
        dsts, srcs, odd = plan
        with torch.no_grad():
            if dsts and src.device.type == "cpu" and self.device.type == "cpu":
                for d, s in zip(dsts, srcs, strict=True):  # plain memcpys (see checksum)
                    np.copyto(d.detach().numpy(), s.numpy())
            elif dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            for t, piece in odd:
                tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                _byte_view(tmp).copy_(piece)
                t.copy_(tmp)

    def _sync(self, slot: torch.Tensor) -> None:
        if slot.device.type == "cuda" or self.device.type == "cuda":  # pragma: no cover
            # the copies must be done before the ack lets the trainer pack the slot again
            torch.cuda.current_stream(slot.device).synchronize()  # pragma: no cover
            if self.device != slot.device:  # pragma: no cover
                torch.cuda.current_stream(self.device).synchronize()  # pragma: no cover

    def abandon(self) -> None:
        """The trainer is gone (or gave up on the version being assembled): drop it.
        The live tensors keep the last complete version, except with ``atomic=False``
        after a partial copy (``serving`` stays ``False`` until the next version)."""
        self._partial = None
        self._held = []
        self._failed = ""
        if self._copied_any:
            self.serving = False

    def close_slots(self) -> None:
        """Unmap the trainer's slots (a new offer reopens)."""
        self._plans.clear()
        self._slots.clear()
        self._events.clear()
        self.offer = None

    def release(self) -> IpcAck | None:
        """Unmap the trainer's slots and return the :class:`IpcAck` (``bucket=-2``) that
        tells the trainer so (then it does not release them on this worker's behalf when
        its process is gone); ``None`` when nothing was open."""
        if self.offer is None:
            return None
        self.close_slots()
        return IpcAck(self.worker_id, -1, -2, -1, True, self.version)

    def close(self) -> None:
        """Release everything this importer holds of the trainer's memory (prefer
        :meth:`release` and send its ack)."""
        self.abandon()
        self.close_slots()
        self._staging = None


def _replace(ack: IpcAck, **changes: Any) -> IpcAck:
    return msgspec.structs.replace(ack, **changes)
