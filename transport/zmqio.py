"""Frame I/O on ZeroMQ sockets at the cost of the C calls (:func:`send_frames`,
:func:`recv_frames`), and the allocator settings large messages need
(:func:`tune_allocator`)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["POLLIN", "nbytes", "recv_frames", "send_frames", "tune_allocator", "zmq_poll"]

log = logging.getLogger("transport.sockets")

# Plain ints: ``zmq.POLLIN`` and friends are enums whose ``&`` runs Python code.
POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
# The Cython socket methods, without pyzmq's per-frame Python wrappers. Not pyzmq's
# documented API (the tested versions are pinned in pyproject.toml); without it the
# public methods (same signature) are used.
_backend_socket: Any = getattr(getattr(zmq, "backend", None), "Socket", None)
_send: Callable[..., Any] = getattr(_backend_socket, "send", None) or zmq.Socket.send
_recv: Callable[..., Any] = getattr(_backend_socket, "recv", None) or zmq.Socket.recv
#: "Does input wait?": ``zmq_poll([(sock, POLLIN)], 0)`` asks ZMQ_EVENTS (which re-arms
#: the FD) without the enum lookup of pyzmq's ``get``.
zmq_poll: Callable[..., list[Any]] = zmq.zmq_poll


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)``, cheaper.

    Like it, atomic: ``zmq.Again`` (or ``EHOSTUNREACH``) can only be raised for the
    first frame, before anything is queued. pyzmq copies frames below its copy
    threshold and sends larger ones zero-copy.
    """
    last = len(frames) - 1
    if last == 0:
        _send(sock, frames[0], _NOBLOCK, False)
        return
    for i in range(last):
        _send(sock, frames[i], _SNDMORE_NOBLOCK, False)
    _send(sock, frames[last], _NOBLOCK, False)


def recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """``sock.recv_multipart(zmq.NOBLOCK, copy=False)``, cheaper (``Frame.more``
    instead of a ``RCVMORE`` getsockopt per frame). Raises ``zmq.Again`` when empty."""
    frame: zmq.Frame = _recv(sock, _NOBLOCK, False)
    if not frame.more:
        return [frame]
    parts = [frame]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        parts.append(frame)
    return parts


def nbytes(frames: list[Any]) -> int:
    """Bytes of a message's frames (a non-buffer counts as small)."""
    n = 0
    for f in frames:
        try:
            n += memoryview(f).nbytes
        except TypeError:  # pragma: no cover - not a buffer
            n += 64
    return n


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
#: Defaults of :func:`tune_allocator`: messages up to 32 MiB (glibc's largest mmap
#: threshold) come from the heap, and up to 256 MiB of freed heap stays mapped.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
_tuned: bool | None = None


def tune_allocator(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Keep freed message memory mapped (glibc only; once per process; returns whether
    the allocator is tuned).

    libzmq ``malloc``s each large received message. With glibc's defaults, freed heap
    above a low threshold goes back to the kernel, so after a batch of held responses
    is freed every large message lands in fresh pages: a page fault and a zero-fill per
    4 KiB, more than the copy from the kernel itself. ``FASTIO_TUNE_MALLOC=0`` leaves
    the allocator alone. Called by the first :class:`~transport.sockets.SocketPump`.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("FASTIO_TUNE_MALLOC", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # The mmap threshold first: setting either one turns glibc's dynamic one off.
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    if not _tuned:  # pragma: no cover - glibc refused the values
        log.debug("mallopt refused the thresholds; the allocator keeps its defaults")
    return _tuned
