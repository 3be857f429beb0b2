"""The frames route: bucket bytes as ``WeightBucket`` messages on the control sockets,
the fallback of ``tcp`` and ``shm``. Trainer side: :class:`FrameSender`; worker side:
:class:`FrameReceiver`."""

from __future__ import annotations

import time
from typing import cast

import numpy as np

from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightBucket
from transport.weights.routes import Receiver, Replies, Tracker
from transport.weights.routes.receive import begin, take

__all__ = ["FrameReceiver", "FrameSender", "stream_span"]


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
