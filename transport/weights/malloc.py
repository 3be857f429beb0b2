"""Opt-in allocator tuning for processes that receive weights over TCP."""

from __future__ import annotations

import functools

from transport.zmqio import tune_malloc as _tune

__all__ = ["tune_malloc"]


@functools.cache
def tune_malloc() -> None:
    """glibc only, process-wide: serve allocations up to 32 MiB from the heap and trim
    it only above 1 GiB free, so that a version's freed chunks are reused by the next
    one instead of faulting in fresh zeroed pages (``tune_malloc=True``)."""
    _tune(32 << 20, 1 << 30)
