"""Frame I/O at the cost of the C calls, and the opt-in allocator settings."""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

__all__ = [
    "COPY_BELOW", "POLLIN", "nbytes", "recv_frames", "send_frames", "tune_malloc", "zmq_poll",
]  # fmt: skip

# Plain ints: ``zmq.POLLIN`` and friends are enums whose ``&`` runs Python code.
POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
# The Cython methods, without pyzmq's Python wrappers (undocumented API: versions pinned
# in pyproject.toml; else the public methods, same signature).
_backend_socket: Any = getattr(getattr(zmq, "backend", None), "Socket", None)
_send: Callable[..., Any] = getattr(_backend_socket, "send", None) or zmq.Socket.send
_recv: Callable[..., Any] = getattr(_backend_socket, "recv", None) or zmq.Socket.recv
#: ``zmq_poll([(sock, POLLIN)], 0)``: does input wait (re-arms the FD)?
zmq_poll: Callable[..., list[Any]] = zmq.zmq_poll

#: The ``copy_threshold`` of the fabric's ROUTERs and DEALERs: smaller frames are copied
#: at send, larger ones lent (a lent buffer comes back through pyzmq's garbage-collector
#: thread, which costs more than copying a smaller one).
COPY_BELOW = 256 << 10
_Frame = zmq.Frame
_ndarray = np.ndarray


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)``, cheaper and as atomic.
    An array over a whole received ``zmq.Frame`` goes as that frame (shared, not copied)."""
    last = len(frames) - 1
    for i in range(last + 1):
        f = frames[i]
        if type(f) is _ndarray:
            base: Any = f.base
            if type(base) is _Frame and f.nbytes == len(base):
                f = base
        _send(sock, f, _SNDMORE_NOBLOCK if i < last else _NOBLOCK, False)


def recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """``sock.recv_multipart(zmq.NOBLOCK, copy=False)``, cheaper; ``zmq.Again`` when empty."""
    frame: zmq.Frame = _recv(sock, _NOBLOCK, False)
    parts = [frame]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        parts.append(frame)
    return parts


def nbytes(frames: list[Any]) -> int:
    """Bytes of a message's frames (a non-buffer counts as small)."""
    n = 0
    for f in frames:
        t = type(f)
        if t is bytes or t is _Frame:
            n += len(f)
        elif t is _ndarray:
            n += f.nbytes
        else:
            try:
                n += memoryview(f).nbytes
            except TypeError:  # pragma: no cover - not a buffer
                n += 64
    return n


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
#: Defaults of :func:`tune_malloc`: messages up to 32 MiB from the heap, and up to
#: 256 MiB of freed heap kept mapped.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Opt in, process-wide: keep freed message memory mapped, so that large received
    messages reuse pages (``docs/deploy.md``). glibc only; returns whether both
    thresholds took; ``FASTIO_TUNE_MALLOC=0`` makes it a no-op."""
    if os.environ.get("FASTIO_TUNE_MALLOC", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # The mmap threshold first: setting either one turns glibc's dynamic one off.
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    return bool(mmap_ok and mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def tune_allocator(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Deprecated alias of :func:`tune_malloc`."""
    warnings.warn("tune_allocator is deprecated: use tune_malloc", DeprecationWarning, 2)
    return tune_malloc(mmap_threshold, trim_threshold)


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """Deprecated alias of :func:`tune_malloc`."""
    warnings.warn("set_malloc is deprecated: use tune_malloc", DeprecationWarning, 2)
    return tune_malloc(mmap_threshold, trim_threshold)
