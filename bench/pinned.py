"""Pinned host staging for CUDA tensors: the host-memory path at PCIe speed.

* :class:`PinnedRegion` registers memory that already exists (a shared-memory segment's
  mapping, any writable buffer) as pinned with ``cudaHostRegister`` through
  ``torch.cuda.cudart()``, so device-to-host copies land straight in it and host-to-device
  copies read straight from it, asynchronously, without a bounce through a pinned buffer.
* :func:`stage_out` (trainer): per bucket, pack on the device, checksum there
  (:func:`transport.weights.routes.ipc.checksum`), copy into the host region on a side stream;
  bucket k+1 is packed while bucket k crosses PCIe (two device buffers in turn).
* :func:`stage_in` (worker): the reverse into one device staging buffer, every bucket
  checksummed on the device after its copy; :func:`apply_staged` then copies the
  verified version into the live tensors (never a mixed version).

CUDA only; this module imports on CPU-only machines and its functions raise there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastio.ipc_msgs import IpcBucket
from transport.weights.routes.ipc import checksum

__all__ = ["PinnedRegion", "apply_staged", "stage_in", "stage_out"]

_cuda: Any = torch.cuda


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("pinned staging needs a CUDA device")


class PinnedRegion:
    """``tensor`` (a CPU ``uint8`` tensor over existing memory, e.g. ``torch.frombuffer``
    of a shared-memory ``mmap``) registered as pinned memory until :meth:`close`.

    Examples
    --------
    >>> seg = mmap.mmap(fd, nbytes)                                   # doctest: +SKIP
    >>> with PinnedRegion(torch.frombuffer(seg, dtype=torch.uint8)) as host:  # doctest: +SKIP
    ...     host.tensor[:n].copy_(device_bucket, non_blocking=True)
    """

    def __init__(self, tensor: torch.Tensor, *, portable: bool = True) -> None:
        _need_cuda()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("a pinned region is contiguous host memory")
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        # cudaHostRegisterPortable (1): pinned for every CUDA context of this process.
        rc = _cuda.cudart().cudaHostRegister(tensor.data_ptr(), self.nbytes, 1 if portable else 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {rc}")
        self.registered = True

    def close(self) -> None:
        """Unregister (the memory itself stays; its owner unmaps it)."""
        if self.registered:
            _cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _starts(buckets: Sequence[IpcBucket]) -> list[int]:
    out, pos = [], 0
    for b in buckets:
        out.append(pos)
        pos += b.nbytes
    return out


def stage_out(
    buckets: Sequence[IpcBucket],
    tensors: Mapping[str, torch.Tensor],
    host: torch.Tensor,
    *,
    side: Any = None,
) -> tuple[list[torch.Tensor], list[Any]]:
    """Pack every bucket on the device, checksum it there, copy it into ``host`` (pinned,
    buckets back to back); returns the per-bucket checksums (0-d device tensors) and an
    event per bucket that fires when its bytes are in ``host`` (announce then).

    Asynchronous: nothing here waits for the device.
    """
    _need_cuda()
    dev = next(iter(tensors.values())).device
    side = side or _cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    cap = max(b.nbytes for b in buckets)
    bufs = [torch.zeros(cap, dtype=torch.uint8, device=dev) for _ in range(2)]
    freed: list[Any] = [None, None]
    sums: list[torch.Tensor] = []
    done: list[Any] = []
    for b, start in zip(buckets, _starts(buckets), strict=True):
        k = b.index % 2
        if freed[k] is not None:
            main.wait_event(freed[k])  # bucket k-2 left this buffer
        buf = bufs[k]
        used = b.tensors[-1].offset + b.tensors[-1].nbytes
        torch.cat([tensors[e.name].detach().reshape(-1).view(torch.uint8) for e in b.tensors],
                  out=buf[:used])  # fmt: skip
        buf[used : b.nbytes].zero_()
        sums.append(checksum(buf[: b.nbytes]))
        packed = _cuda.Event()
        packed.record(main)
        side.wait_event(packed)
        with torch.cuda.stream(side):
            host[start : start + b.nbytes].copy_(buf[: b.nbytes], non_blocking=True)
            ev = _cuda.Event()
            ev.record(side)
        buf.record_stream(side)
        freed[k] = ev
        done.append(ev)
    return sums, done


def stage_in(
    buckets: Sequence[IpcBucket],
    host: torch.Tensor,
    staging: torch.Tensor,
    expected: Sequence[int],
) -> torch.Tensor:
    """Copy every bucket from ``host`` (pinned) into ``staging`` (device, the same
    layout) and checksum each there; returns a 0-d device bool: all match ``expected``.
    One ``.item()`` on it is the only host synchronisation the caller needs."""
    _need_cuda()
    ok = torch.ones((), dtype=torch.bool, device=staging.device)
    want = torch.tensor(list(expected), dtype=torch.int64).to(staging.device, non_blocking=True)
    for i, (b, start) in enumerate(zip(buckets, _starts(buckets), strict=True)):
        view = staging[start : start + b.nbytes]
        view.copy_(host[start : start + b.nbytes], non_blocking=True)
        ok &= checksum(view) == want[i]
    return ok


def apply_staged(
    buckets: Sequence[IpcBucket], staging: torch.Tensor, targets: Mapping[str, torch.Tensor]
) -> None:
    """Copy a verified staged version into ``targets`` (contiguous tensors; one batched
    copy). Works on any device."""
    dsts, srcs = [], []
    with torch.no_grad():
        for b, start in zip(buckets, _starts(buckets), strict=True):
            for e in b.tensors:
                t = targets[e.name]
                if not t.is_contiguous():
                    raise ValueError(f"{e.name!r} is not contiguous")
                dsts.append(t.detach().reshape(-1).view(torch.uint8))
                srcs.append(staging[start + e.offset : start + e.offset + e.nbytes])
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
