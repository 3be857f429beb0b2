"""Opt-in allocator tuning for processes that receive weights over TCP."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

__all__ = ["tune_malloc"]


@functools.cache
def tune_malloc() -> None:
    """glibc only, process-wide: serve allocations up to 32 MiB from the heap and trim
    it only above 1 GiB free, so that a version's freed chunks are reused by the next
    one instead of faulting in fresh zeroed pages (``tune_malloc=True``)."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
