"""The frames route: bucket bytes as ZeroMQ frames (``WeightBucket`` messages) on the
control sockets, the fallback of ``tcp`` and ``shm``.

Trainer side: the serving loop sends each chunk, zero-copy from its staged buffer, as a
``WeightBucket`` with ``track=True`` (:mod:`transport.weights.serving`). Worker side (the
subscriber's thread): :func:`receive_frames` takes a chunk into views of where it goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastio.weight_msgs import WeightBucket
from transport.weights.streaming import BLOCK

if TYPE_CHECKING:
    from transport.weights.routes import Receiver

__all__ = ["receive_frames"]


def receive_frames(f: Receiver, up: Any, msg: WeightBucket, t: float) -> None:
    """Take a chunk of bucket ``msg.index`` (in order, in bounds, ``uint8`` frames):
    hash each block and copy it where it goes (the weights in one pass, the staging
    buffer with ``atomic``, or keep the frame), then let ``f`` check the bucket."""
    i = msg.index
    info = up.ann.buckets[i]
    part = up.partial.get(i)
    if part is None:
        part = up.partial[i] = f.partial(up, i)
    if msg.offset != part.size:
        # Left over from an earlier answer to this bucket (asked again): not ours.
        f.core.count("stale_pieces")
        return
    up.sched.progress(i, t)  # the fetch timeout counts from the last chunk
    ok = True
    stage = up.stage[i] if up.stage is not None else None
    stream = part.stream
    if stream is not None and msg.chunks and not f.hold(up):
        return
    for c in msg.chunks:
        if not isinstance(c, np.ndarray) or c.dtype != np.uint8 or c.ndim != 1:
            ok = False
            break
        end = part.size + c.nbytes
        if end > info.nbytes:
            ok = False
            break
        if stream is not None:
            # The frame is kept only for tensors that need their bytes whole.
            stream.feed(c)
            if stream.rest:
                part.chunks.append(_u8(c))
        elif stage is not None:
            # Hash a block, then copy it while in cache; the frame is freed after.
            base = part.size
            for a in range(0, c.nbytes, BLOCK):
                block = c[a : a + BLOCK]
                part.hasher.update(block)
                np.copyto(stage[base + a : base + a + block.nbytes], block)
        else:
            part.hasher.update(c)
            part.chunks.append(_u8(c))
        part.size = end
    f.chunk_done(up, i, part, t, ok, msg.last, msg.checksum)


def _u8(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    """A uint8 tensor over a received chunk, no copy (frames from zmq are writable)."""
    if not arr.flags.writeable:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)
