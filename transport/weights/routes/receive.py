"""The step the worker sides of shm, tcp and zmq share: a bucket's bytes, hashed, into
the views where they go."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from transport.weights.routes.inflight import InFlight, Partial
from transport.weights.streaming import BLOCK

if TYPE_CHECKING:
    from transport.weights.routes import Receiver

__all__ = ["begin", "part_of", "take"]


def part_of(f: Receiver, up: InFlight, i: int) -> Partial:
    """Bucket ``i``'s :class:`Partial`, begun on its first bytes."""
    part = up.partial.get(i)
    if part is None:
        part = up.partial[i] = f.partial(up, i)
    return part


def begin(f: Receiver, up: InFlight, i: int, offset: int, n: int, t: float) -> Partial | None:
    """Bucket ``i``'s :class:`Partial` for a chunk of ``n`` bytes at ``offset``; None
    when the chunk is not to be taken: left over from an earlier answer (counted), or the
    lock refused its first write (the version failed)."""
    part = part_of(f, up, i)
    if offset != part.size:
        f.core.count("stale_pieces")
        return None
    up.sched.progress(i, t)  # the fetch timeout counts from the last chunk
    if part.stream is not None and n and not f.hold(up):
        return None
    return part


def take(part: Partial, src: Any, n: int, stage: np.ndarray[Any, Any] | None, keep: bool) -> None:
    """Hash the next ``n`` bytes of a bucket and put them where they go: into the
    weights through ``part.stream``, into ``stage`` (atomic), or kept in ``part.chunks``
    (``keep=False``: the source is the bucket itself, a shared segment). ``src`` holds
    the bytes (a 1-D ``uint8`` array, never copied to be kept) or reads them (a
    :class:`~.tcp.DataReceiver`: straight into their destination)."""
    stream = part.stream
    mem = isinstance(src, np.ndarray)
    if stream is not None and (mem or stream.rest):
        data = src if mem else _read(src, n)
        stream.feed(data)
        if keep and stream.rest:  # tensors that need their bytes whole keep the chunk
            part.chunks.append(_u8(data))
    elif stream is not None:
        stream.take(n, src.fill, src.scratch(BLOCK))
    elif stage is not None:
        dst = stage[part.size : part.size + n]
        for a in range(0, n, BLOCK):
            blk = dst[a : a + BLOCK]
            if mem:
                np.copyto(blk, src[a : a + BLOCK])
            else:
                src.fill(blk)
            part.hasher.update(blk)
    else:
        data = src if mem else _read(src, n)
        part.hasher.update(data)
        if keep:
            part.chunks.append(_u8(data))
    part.size += n


def _read(src: Any, n: int) -> np.ndarray[Any, Any]:
    data = np.empty(n, dtype=np.uint8)
    src.fill(data)
    return data


def _u8(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    """A uint8 tensor over received bytes, no copy (a read-only one is only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
