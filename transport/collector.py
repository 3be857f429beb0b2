"""The cyclic garbage collector's setting for processes that hold many requests
(why: ``docs/deploy.md``)."""

from __future__ import annotations

import gc
import os

__all__ = ["GC_THRESHOLD", "tune_gc"]

#: Default of :func:`tune_gc`: allocations between passes over the youngest objects.
GC_THRESHOLD = 50_000


def tune_gc(threshold: int = GC_THRESHOLD, *, freeze: bool = False) -> bool:
    """Make the cyclic collector's passes rarer, process-wide (fastio never calls it): the
    first threshold of :func:`gc.set_threshold` raised to at least ``threshold`` (a zero one
    stays zero), and :func:`gc.freeze` with ``freeze``; a no-op under ``FASTIO_TUNE_GC=0``.
    Returns whether anything changed."""
    if os.environ.get("FASTIO_TUNE_GC", "1") == "0":
        return False
    first, second, third = gc.get_threshold()
    changed = 0 < first < threshold
    if changed:
        gc.set_threshold(threshold, second, third)
    if freeze:
        gc.freeze()
    return changed or freeze
