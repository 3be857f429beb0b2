"""What both sides of the ``ipc`` route share: the bucket layout, the ``sum64``
checksum and the slots' memory (an :class:`~fastio.ipc_msgs.IpcHandle`, no pickle)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from fastio.ipc_msgs import TRAILER_BYTES, IpcBucket, IpcHandle, IpcTensor
from transport.weights.bucket import SUM64_ROW, _flat_bytes, named_tensors, plan_spans
from transport.weights.bucket import sum64 as checksum
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.errors import WeightMismatchError, WeightUpdateError

__all__ = [
    "DEFAULT_IPC_BUCKET_BYTES",
    "IpcRefused",
    "checksum",
    "plan_layout",
    "process_alive",
    "process_start_time",
]

#: Default bound of one bucket (and so of one slot).
DEFAULT_IPC_BUCKET_BYTES = 512 << 20
# Typed loosely: torch's private sharing API has no annotations.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage


class IpcRefused(WeightUpdateError):
    """The ipc route cannot serve this worker (other host or pid namespace, no access
    to the trainer's device): use another route."""


def _dtype_name(dt: torch.dtype) -> str:
    # Any dtype torch can view: the slots carry bytes, never cast.
    return str(dt).removeprefix("torch.")


def _named(state: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in named_tensors(state).items()}


def plan_layout(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
) -> list[IpcBucket]:
    """Buckets of ``(name, dtype name, shape)`` in order, each at most ``bucket_bytes``
    (a larger tensor gets a bucket of its own), tensors back to back, each bucket's
    length rounded up to 512 bytes (zeros): :func:`~transport.weights.bucket.plan_spans`."""
    spans = plan_spans(specs, bucket_bytes, 1, lambda name: getattr(torch, name))
    return [
        IpcBucket(i, -(-size // SUM64_ROW) * SUM64_ROW, [IpcTensor(*e) for e in entries])
        for i, (entries, size) in enumerate(spans)
    ]


def _layout_of(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[IpcBucket]:
    specs = ((k, _dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items())
    return plan_layout(specs, bucket_bytes)


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


def _pack(b: IpcBucket, tensors: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
    """Copy bucket ``b`` of ``tensors`` into ``slot``, zero-padded to ``b.nbytes``."""
    srcs = [_flat_bytes(tensors[e.name]) for e in b.tensors]
    used = b.tensors[-1].offset + b.tensors[-1].nbytes
    if slot.device.type == "cpu" and all(s.device.type == "cpu" for s in srcs):
        # one memcpy each, no intra-op threads (see checksum)
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


def _views(layout: list[IpcBucket], slots: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Typed views of every tensor of ``layout`` in ``slots`` (one per bucket)."""
    out: dict[str, torch.Tensor] = {}
    for b in layout:
        slot = slots[b.index]
        for e in b.tensors:
            dt = getattr(torch, e.dtype)
            raw = slot[e.offset : e.offset + e.nbytes]
            if raw.storage_offset() % torch.empty((), dtype=dt).element_size():
                raw = raw.clone()  # a view must be aligned to its dtype
            out[e.name] = raw.view(dt).view(e.shape)
    return out


def _unpack(
    b: IpcBucket, src: torch.Tensor, targets: Mapping[str, torch.Tensor], plans: dict[Any, Any]
) -> None:
    """Copy bucket ``b`` from ``src`` into ``targets`` (the reverse of :func:`_pack`).
    The views are built once per (bucket, source) in ``plans`` and reused by every
    version: one batched copy per bucket, no Python call per tensor."""
    key = (b.index, src.data_ptr())
    plan = plans.get(key)
    if plan is None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        odd: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in b.tensors:
            t = targets[e.name]
            piece = src[e.offset : e.offset + e.nbytes]
            if t.is_contiguous():
                dsts.append(_flat_bytes(t))
                srcs.append(piece)
            else:  # rare: through a contiguous temporary
                odd.append((t, piece))
        plan = plans[key] = (dsts, srcs, odd)
    dsts, srcs, odd = plan
    with torch.no_grad():
        if dsts and src.device.type == "cpu" and dsts[0].device.type == "cpu":
            for d, s in zip(dsts, srcs, strict=True):  # plain memcpys (see checksum)
                np.copyto(d.detach().numpy(), s.numpy())
        elif dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for t, piece in odd:
            tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            _flat_bytes(tmp).copy_(piece)
            t.copy_(tmp)


def _sync(slot: torch.Tensor, device: torch.device) -> None:
    """Wait for the copies out of ``slot``: the ack lets the trainer pack it again."""
    if slot.device.type == "cuda" or device.type == "cuda":  # pragma: no cover - CUDA
        torch.cuda.current_stream(slot.device).synchronize()
        if device != slot.device:
            torch.cuda.current_stream(device).synchronize()


def _check_slot(slot: torch.Tensor, b: IpcBucket, version: int, cap: int, verify: bool) -> str:
    """Why bucket ``b`` of ``version`` in ``slot`` (payload ``cap`` bytes, then the
    trailer) is not to be taken, or ``""``; ``verify``: check its ``sum64`` too."""
    trailer = slot[cap : cap + TRAILER_BYTES].view(torch.int64)
    if verify:
        ok_t = (trailer[1] == version) & (checksum(slot[: b.nbytes]) == trailer[0])
        if bool(ok_t.item()):  # the one host synchronisation of a check
            return ""
    elif int(trailer[1].item()) == version:
        return ""
    got = int(trailer[1].item())
    if got != version:
        return f"bucket {b.index}: the slot holds version {got}, not {version}"
    return f"bucket {b.index} of version {version}: checksum mismatch"


def _new_slot(nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any, IpcHandle | None]:
    """A zeroed slot other processes can open: the tensor, its CUDA interprocess event
    and, on CPU, its handle (one for every worker)."""
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
        "cuda", int(dev), bytes(handle), int(size), int(off), bytes(rc), int(rc_off),
        bytes(ev or b""), bool(ev_sync), bytes(event.ipc_handle()),
    )  # fmt: skip


def _release(slot: torch.Tensor, h: IpcHandle) -> None:
    """Release the references a dead worker's opening of ``h`` took."""
    if h.kind == "cpu":
        slot.untyped_storage()._shared_decref()
    else:  # pragma: no cover - CUDA
        _Storage._release_ipc_counter(h.ref_counter_handle, h.ref_counter_offset, device=h.device)


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
    dev = torch.device("cuda", h.device)  # pragma: no cover
    t = torch.empty(0, dtype=torch.uint8, device=dev)  # pragma: no cover
    return t.set_(st, 0, (h.size,), (1,)), event  # pragma: no cover
