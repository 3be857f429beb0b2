"""The frames route: bucket bytes as ``WeightBucket`` messages on the control sockets,
the fallback of ``tcp`` and ``shm`` (trainer side :class:`FrameSender`, worker side
:class:`FrameReceiver`); and the hash-then-copy step the worker sides of shm, tcp and
zmq share (:func:`begin`, :func:`take`)."""

from __future__ import annotations

import time
import warnings
from typing import Any, cast

import numpy as np
import torch

from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightBucket
from transport.weights.routes import Receiver, Replies, Tracker
from transport.weights.routes.inflight import InFlight, Partial
from transport.weights.streaming import BLOCK

__all__ = ["FrameReceiver", "FrameSender", "begin", "part_of", "stream_span", "take"]


def stream_span(start: int, ready: int, total: int, complete: bool, step: int) -> int | None:
    """Chunks of ``step`` bytes, each sent once packed (the span of zmq and tcp)."""
    end = min(start + step, total)
    return None if end > ready else end


class FrameSender:
    """The trainer side: each chunk a tracked, zero-copy ``WeightBucket`` through
    ``out.reply`` (looked up at each send)."""

    def __init__(self, out: Replies) -> None:
        self.out = out

    span = staticmethod(stream_span)

    def send(self, ident: bytes, wid: str, msg: WeightBucket) -> Tracker | None:
        return cast("Tracker | None", self.out.reply(ident, VERSION_1.encode(msg), track=True))

    def close(self) -> None:
        """Nothing of its own (the control socket is the serving loop's)."""


class FrameReceiver:
    """The worker side: a chunk of bucket ``msg.index`` (in order, in bounds, ``uint8``
    frames) where it goes, then ``f`` checks the bucket."""

    def receive(self, f: Receiver, msg: WeightBucket | None) -> None:
        assert msg is not None
        up = f.update
        assert up is not None
        i, t = msg.index, time.monotonic()
        part = begin(f, up, i, msg.offset, len(msg.chunks), t)
        if part is None:
            return
        ok = True
        stage = up.stage[i] if up.stage is not None else None
        for c in msg.chunks:
            ok = (
                isinstance(c, np.ndarray)
                and c.dtype == np.uint8
                and c.ndim == 1
                and part.size + c.nbytes <= up.ann.buckets[i].nbytes
            )
            if not ok:
                break
            take(part, c, c.nbytes, stage, keep=True)
        f.chunk_done(up, i, part, t, ok, msg.last, msg.checksum)

    def close(self) -> None:
        """Nothing held between chunks."""


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
    """Hash the next ``n`` bytes of a bucket into the weights (``part.stream``),
    ``stage`` (atomic) or ``part.chunks`` (when ``keep``); ``src``: a 1-D ``uint8`` array
    or a :class:`~.tcp.DataReceiver` that reads straight into the destination."""
    stream = part.stream
    if stream is not None and not stream.rest and not isinstance(src, np.ndarray):
        stream.take(n, src.fill, src.scratch(BLOCK))
    elif stream is None and stage is not None:
        dst = stage[part.size : part.size + n]
        for a in range(0, n, BLOCK):
            blk = dst[a : a + BLOCK]
            if isinstance(src, np.ndarray):
                np.copyto(blk, src[a : a + BLOCK])
            else:
                src.fill(blk)
            part.hasher.update(blk)
    else:
        data = src
        if not isinstance(src, np.ndarray):
            data = np.empty(n, dtype=np.uint8)
            src.fill(data)
        if stream is None:
            part.hasher.update(data)
        else:
            stream.feed(data)
        if keep and (stream is None or stream.rest):  # a tensor needing its bytes whole
            part.chunks.append(_u8(data))
    part.size += n


def _u8(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    """A uint8 tensor over received bytes, no copy (a read-only one is only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
