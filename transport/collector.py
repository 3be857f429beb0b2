"""The cyclic garbage collector's setting for processes that hold many requests.

CPython runs a pass over its youngest objects every 700 net allocations of container
objects, and over everything when enough have survived. A client with thousands of
requests in flight keeps about ten such objects per request (futures, calls, token
arrays, responses) that form no cycles: at the default threshold it runs hundreds of
passes a second and, every few thousand requests, a full pass over all of them, holding
the GIL, and they free nothing.
"""

from __future__ import annotations

import gc
import os

__all__ = ["GC_THRESHOLD", "tune_gc"]

#: Default of :func:`tune_gc`: allocations between passes over the youngest objects.
GC_THRESHOLD = 50_000


def tune_gc(threshold: int = GC_THRESHOLD, *, freeze: bool = False) -> bool:
    """Make the cyclic collector's passes rarer; returns whether anything changed.

    Raises the first threshold of :func:`gc.set_threshold` to at least ``threshold``
    (the others unchanged; a collector disabled by a zero threshold stays so). With
    ``freeze``, every object alive now leaves the collector's passes
    (:func:`gc.freeze`: call it once a program has loaded what it keeps, such as its
    modules and model). The settings are process-wide. Cyclic garbage waits much longer
    to be freed: the older generations' passes become as much rarer.
    ``FASTIO_TUNE_GC=0`` in the environment leaves the collector alone.

    fastio never calls it: a program embedding a :class:`~transport.FabricClient` (a
    rollout process) calls it itself, once it has started. A program whose cyclic garbage
    holds large buffers (GPU tensors) may prefer the default.
    """
    if os.environ.get("FASTIO_TUNE_GC", "1") == "0":
        return False
    changed = False
    first, second, third = gc.get_threshold()
    if 0 < first < threshold:
        gc.set_threshold(threshold, second, third)
        changed = True
    if freeze:
        gc.freeze()
        changed = True
    return changed
