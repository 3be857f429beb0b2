"""Read-only constant arrays of any length, as views of one shared array per
``(dtype, value)``, grown by doubling: no allocation nor fill per message (a
``TokenArray`` over one copies before any change)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_SHARED", "constant"]

#: Longest array kept shared (elements); longer ones are allocated per call.
MAX_SHARED = 1 << 24

_arrays: dict[tuple[Any, Any], npt.NDArray[Any]] = {}


def constant(n: int, dtype: Any, value: Any = 0) -> npt.NDArray[Any]:
    """``n`` elements equal to ``value``: a read-only C-contiguous view (thread-safe).

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
