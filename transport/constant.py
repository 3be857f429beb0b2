"""Read-only constant arrays of any length, as views of one shared array per
``(dtype, value)``, grown by doubling: no allocation nor fill per message (a
``TokenArray`` over one copies before any change)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

__all__ = ["MAX_SHARED", "constant", "frame_constant"]

#: Longest array kept shared (elements); longer ones are allocated per call.
MAX_SHARED = 1 << 24

_arrays: dict[tuple[Any, Any], npt.NDArray[Any]] = {}


def constant(n: int, dtype: Any, value: Any = 0) -> npt.NDArray[Any]:
    """``n`` elements equal to ``value``: a read-only C-contiguous view (thread-safe).

    Examples
    --------
    >>> a = constant(3, np.float64)
    >>> a.tolist(), a.flags.writeable
    ([0.0, 0.0, 0.0], False)
    """
    n = max(n, 0)
    key = (dtype, value)
    a = _arrays.get(key)
    if a is None or len(a) < n:
        if n > MAX_SHARED:
            big = np.full(n, value, dtype=dtype)
            big.flags.writeable = False
            return big
        size = min(max(n, 2 * len(a) if a is not None else 1024), MAX_SHARED)
        # Zeros from calloc stay unmapped until read; other values are written once.
        a = np.zeros(size, dtype=dtype) if value == 0 else np.full(size, value, dtype=dtype)
        a.flags.writeable = False
        if len(_arrays) >= 64:  # values come and go (weight versions): keep the recent
            _arrays.clear()
        _arrays[key] = a
    return a[:n]


_frames: dict[tuple[Any, Any, int], npt.NDArray[Any]] = {}
_MAX_FRAMES = 16  # arrays kept
_MAX_FRAME_BYTES = 4 << 20  # per array: the table holds at most 64 MiB


def frame_constant(n: int, dtype: Any, value: Any = 0) -> npt.NDArray[Any]:
    """As :func:`constant`, over a ``zmq.Frame`` of its own: the fabric sends it as that
    frame (libzmq shares it: neither copied nor lent per message). Up to 16 arrays are
    kept, then the table starts afresh (thread-safe); one over 4 MiB is
    :func:`constant`'s view. Never make it writable: every later reply shares it.

    Examples
    --------
    >>> a = frame_constant(3, np.int32, 7)
    >>> a.tolist(), type(a.base).__name__, a is frame_constant(3, np.int32, 7)
    ([7, 7, 7], 'Frame', True)
    """
    n = max(n, 0)
    if n * np.dtype(dtype).itemsize > _MAX_FRAME_BYTES:
        return constant(n, dtype, value)
    key = (dtype, value, n)
    a = _frames.get(key)
    if a is None:
        if len(_frames) >= _MAX_FRAMES:
            _frames.clear()
        frame: Any = zmq.Frame(constant(n, dtype, value), copy=True)
        a = _frames[key] = np.frombuffer(frame, dtype)
        a.flags.writeable = False
    return a
