"""Opt-in allocator tuning for processes that receive weights over TCP."""

from __future__ import annotations

import functools

from transport.zmqio import tune_malloc as _tune

__all__ = ["tune_malloc"]


@functools.cache
def tune_malloc() -> None:
    """glibc, process-wide: keep a version's freed chunks for the next (``tune_malloc=True``)."""
    _tune(32 << 20, 1 << 30)
