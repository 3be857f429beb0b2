"""The cyclic garbage collector's setting for processes that hold many requests
(why: ``docs/deploy.md``)."""

from __future__ import annotations

import gc
import os

__all__ = ["GC_THRESHOLD", "tune_gc"]

#: Default of :func:`tune_gc`: allocations between passes over the youngest objects.
GC_THRESHOLD = 50_000


def tune_gc(threshold: int = GC_THRESHOLD, *, freeze: bool = False) -> bool:
    """Make the cyclic collector's passes rarer, process-wide; returns whether anything
    changed.

    Raises the first threshold of :func:`gc.set_threshold` to at least ``threshold`` (a
    zero one stays zero); ``freeze`` also calls :func:`gc.freeze`. fastio never calls it:
    a program embedding a :class:`~transport.FabricClient` calls it once it has started.
    ``FASTIO_TUNE_GC=0`` in the environment makes it a no-op.
    """
    if os.environ.get("FASTIO_TUNE_GC", "1") == "0":
        return False
    first, second, third = gc.get_threshold()
    changed = 0 < first < threshold
    if changed:
        gc.set_threshold(threshold, second, third)
    if freeze:
        gc.freeze()
    return changed or freeze
