"""The worker's slots of the ``ipc`` route, sans-I/O: :class:`IpcImporter` (the rules:
:mod:`transport.weights.routes.ipc`; the trainer's side:
:class:`~transport.weights.routes.ipc_export.IpcExporter`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import numpy as np
import torch

from fastio.ipc_msgs import TRAILER_BYTES, IpcAck, IpcBucket, IpcHello, IpcOffer, IpcReady
from transport.weights.errors import WeightMismatchError
from transport.weights.routes.ipc_tensors import (
    IpcRefused,
    _byte_view,
    _check_layout,
    _named,
    _open_slot,
    checksum,
    process_alive,
    process_start_time,
)

__all__ = ["IpcImporter"]


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
                slot, event = _open_slot(s.handle)
                self._slots.append(slot)
                if event is not None:  # pragma: no cover - CUDA
                    self._events.append(event)
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
