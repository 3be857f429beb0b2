"""Where the ``ipc`` route's buckets live (:mod:`~transport.weights.routes.ipc`): slots of
torch shared storage or CUDA memory, handed over as :class:`~fastio.ipc_msgs.IpcHandle`
(no pickle); planned and checked as on every route (:mod:`~transport.weights.bucket`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from fastio.ipc_msgs import IpcBucket, IpcHandle, IpcTensor
from fastio.weight_msgs import WeightBucketInfo
from transport.weights.binding import Binding
from transport.weights.bucket import SUM64_ROW, dtype_name, named_tensors, plan_spans
from transport.weights.errors import WeightUpdateError

#: Default bound of one bucket (and so of one slot).
DEFAULT_IPC_BUCKET_BYTES = 512 << 20
# Typed loosely: torch's private sharing API has no annotations.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage


class IpcRefused(WeightUpdateError):
    """The ipc route cannot serve this worker (other host or pid namespace, no access
    to the trainer's device): use another route."""


def detached(state: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in named_tensors(state).items()}


def check_layout(buckets: list[IpcBucket], tensors: Mapping[str, torch.Tensor]) -> None:
    """The layout check of every route (:class:`~transport.weights.binding.Binding`)."""
    Binding(cast("list[WeightBucketInfo]", buckets), tensors, strict=True)


def open_slot(h: IpcHandle) -> tuple[torch.Tensor, Any]:
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


def sync_slot(slot: torch.Tensor, device: torch.device) -> None:
    """Wait for the copies out of ``slot``: the ack lets the trainer pack it again."""
    if slot.device.type == "cuda" or device.type == "cuda":  # pragma: no cover - CUDA
        torch.cuda.current_stream(slot.device).synchronize()
        if device != slot.device:
            torch.cuda.current_stream(device).synchronize()


def plan_layout(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
) -> list[IpcBucket]:
    """:func:`~transport.weights.bucket.plan_spans` of ``(name, dtype name, shape)``:
    tensors back to back, each bucket's length rounded up to 512 bytes (``sum64``)."""
    return [
        IpcBucket(i, -(-size // SUM64_ROW) * SUM64_ROW, [IpcTensor(*e) for e in entries])
        for i, (entries, size) in enumerate(plan_spans(specs, bucket_bytes, 1))
    ]


def layout_of(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[IpcBucket]:
    specs = ((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items())
    return plan_layout(specs, bucket_bytes)


def new_slot(nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any, IpcHandle | None]:
    """A zeroed slot other processes can open: the tensor, its CUDA interprocess event
    and, on CPU, its handle (one for every worker)."""
    if device.type == "cuda":  # pragma: no cover - CUDA
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return t, _cuda.Event(interprocess=True, blocking=False), None
    st = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    t = torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,), (1,)).zero_()
    manager, name, size = st._share_filename_cpu_()
    return t, None, IpcHandle("cpu", -1, name, size, manager=manager)


def export_cuda(slot: torch.Tensor, event: Any) -> IpcHandle:  # pragma: no cover - CUDA
    # One export (one producer-side reference counter) per worker and slot, so each
    # worker's release is matched and a dead one's is done by the trainer.
    (dev, handle, size, off, rc, rc_off, ev, ev_sync) = _Storage._share_cuda_(
        slot.untyped_storage()
    )
    return IpcHandle(
        "cuda", int(dev), bytes(handle), int(size), int(off), bytes(rc), int(rc_off),
        bytes(ev or b""), bool(ev_sync), bytes(event.ipc_handle()),
    )  # fmt: skip


def release_slot(slot: torch.Tensor, h: IpcHandle) -> None:
    """Release the references a dead worker's opening of ``h`` took."""
    if h.kind == "cpu":
        slot.untyped_storage()._shared_decref()
    else:  # pragma: no cover - CUDA
        _Storage._release_ipc_counter(h.ref_counter_handle, h.ref_counter_offset, device=h.device)
