"""Routes: where a version's bytes travel between a trainer and a worker.

Every route carries the same buckets under the same control messages
(:mod:`transport.weights.core`); only where the bytes live differs. Each module holds
both sides of its route:

* :mod:`~transport.weights.routes.shm`: a shared-memory segment on the trainer's host;
* :mod:`~transport.weights.routes.tcp`: the data link, a plain TCP connection per worker;
* :mod:`~transport.weights.routes.zmq`: ZeroMQ frames on the control sockets, the
  fallback of both;
* :mod:`~transport.weights.routes.ipc`: the trainer's own memory (CUDA IPC or torch
  shared storage), its worker side in :mod:`~transport.weights.routes.ipc_worker`.

The three receiving sides of shm, tcp and zmq share :func:`take`.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import numpy as np
import torch

from transport.weights.streaming import BLOCK

__all__ = ["Receiver", "take"]


class Receiver(Protocol):
    """What a route's receiving side calls on the worker's version in flight
    (:class:`~transport.weights.fetching.VersionFetcher`; ``up`` is its ``InFlight``,
    ``part`` a bucket arriving)."""

    update: Any
    core: Any

    def partial(self, up: Any, i: int) -> Any: ...

    def hold(self, up: Any) -> bool: ...

    def chunk_done(
        self, up: Any, i: int, part: Any, t: float, ok: bool, last: bool, checksum: int
    ) -> None: ...

    def landed(self, up: Any, i: int, chunks: list[Any], stream: Any) -> None: ...

    def fail(self, version: int, error: str, route: str = "tcp") -> None: ...

    def link_failed(self, why: str) -> None: ...


def part_of(f: Receiver, up: Any, i: int) -> Any:
    """Bucket ``i``'s ``Partial``, begun on its first bytes."""
    part = up.partial.get(i)
    if part is None:
        part = up.partial[i] = f.partial(up, i)
    return part


def take(part: Any, src: Any, n: int, stage: np.ndarray[Any, Any] | None, keep: bool) -> None:
    """Hash the next ``n`` bytes of a bucket and put them where they go.

    Into the weights through ``part.stream`` (one pass), into ``stage`` (atomic), or
    kept in ``part.chunks`` (``keep=False``: the source is the bucket itself, a shared
    segment). ``src`` holds the bytes (a 1-D ``uint8`` array: a frame or a segment,
    never copied to be kept) or reads them (a :class:`~.tcp.DataReceiver`: straight
    into their destination, each block hashed while in cache).
    """
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
