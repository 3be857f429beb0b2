"""The frames route: bucket bytes as ``WeightBucket`` messages on the control sockets,
the fallback of ``tcp`` and ``shm``.

Trainer side: the serving loop sends each chunk zero-copy from its staged buffer
(:mod:`transport.weights.serving`). Worker side: :func:`receive_frames`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio.weight_msgs import WeightBucket
from transport.weights.routes import Receiver
from transport.weights.routes.receive import part_of, take

__all__ = ["receive_frames"]


def receive_frames(f: Receiver, up: Any, msg: WeightBucket, t: float) -> None:
    """Take a chunk of bucket ``msg.index`` (in order, in bounds, ``uint8`` frames)
    where it goes, then let ``f`` check the bucket."""
    i = msg.index
    part = part_of(f, up, i)
    if msg.offset != part.size:
        # Left over from an earlier answer to this bucket (asked again): not ours.
        f.core.count("stale_pieces")
        return
    up.sched.progress(i, t)  # the fetch timeout counts from the last chunk
    if part.stream is not None and msg.chunks and not f.hold(up):
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
