"""Opt-in allocator tuning for processes that receive weights over TCP."""

from __future__ import annotations

import logging

__all__ = ["tune_malloc"]

log = logging.getLogger("transport.weights.subscriber")

_TUNED = False


def tune_malloc() -> None:
    """glibc only: serve allocations up to 32 MiB from the heap, and trim the heap only
    above 1 GiB free at its top.

    libzmq allocates every received message with ``malloc``. A version's chunks are held
    until the commit and then freed together; with glibc's defaults those pages go back
    to the kernel, and the next version's chunks fault in fresh zeroed pages, which more
    than doubles the receive cost (bench/results). 32 MiB is the largest mmap threshold
    glibc itself would adopt dynamically. Process-wide, hence opt-in
    (``WeightSubscriber(tune_malloc=True)``).
    """
    global _TUNED
    if _TUNED:
        return
    _TUNED = True
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        log.debug("mallopt unavailable; allocator left as it is")
