"""What both sides of the ``ipc`` path share (see :mod:`transport.weights.ipc`): the
bucket layout, the ``sum64`` checksum and the process-liveness checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from fastio.ipc_msgs import IpcBucket, IpcTensor
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
_ROW = 512  # bytes per checksum row; bucket lengths are multiples of it
# Typed loosely: torch's private sharing API has no annotations.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage


class IpcRefused(WeightUpdateError):
    """The ipc path cannot serve this worker (other host or pid namespace, no access to
    the trainer's device, layout mismatch): use another path."""


# -- helpers ---------------------------------------------------------------------------
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
