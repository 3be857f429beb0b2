"""``TokenArray``: a zero-copy, list-like view of a 1-D numpy array.

The seed types declare token ids, logprobs, versions and latencies as ``List[int]`` /
``List[float]``. Lists cost a Python object per element to build, encode and decode;
numpy arrays cost nothing but change the meaning of user code (``a + b`` concatenates
lists but adds arrays elementwise). ``TokenArray`` keeps the data in a numpy array (a
view of the received frame after decoding, never copied) and gives it *list*
semantics for every operation rollout code applies to these fields:

========================  ===============================================
operation                 behaviour
========================  ===============================================
``len(t)``, ``t[i]``      as a list; items are Python ``int`` / ``float``
``t[a:b]``                a ``TokenArray`` *view* (no copy)
``iter(t)``               Python scalars
``t + seq``, ``seq + t``  concatenation into a new ``TokenArray``
``t += seq``, ``extend``  in-place append, amortised O(len(seq))
``append``, ``pop``       as a list
``t == seq``              ``True`` / ``False``, element by element as lists
``list(t)``, ``tolist``   a real list
``np.asarray(t)``         the underlying array, no copy
``t.tensor()``            ``torch.from_numpy`` of it, no copy
========================  ===============================================

Operations whose list and array meanings disagree and that the seed's users do not
apply (``t * 2``, ``t - x``, ``t < x``, ``t + 1``, item assignment) raise
``TypeError`` with a hint, instead of silently doing the other thing. Use
``t.array`` for numpy arithmetic.

Lifetime: a ``TokenArray`` produced by :func:`fastio.decode` is a view of a received
frame and keeps that frame alive; it is writable when the frame is (``zmq.Frame``),
read-only when it is ``bytes``. ``append``/``extend`` never write into a received
frame: the first growth copies into a private buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["TokenArray"]

_NUMERIC_KINDS = frozenset("biuf")


def _hint(op: str) -> str:
    return (
        f"TokenArray does not support '{op}': a list would do one thing and a numpy "
        "array another. Use t.array for numpy arithmetic or t.tolist() for list behaviour."
    )


class TokenArray(Sequence[Any]):
    """A list-like, zero-copy sequence of numbers backed by a 1-D numpy array.

    Parameters
    ----------
    data:
        A list/tuple/iterable of numbers, a 1-D numpy array (wrapped, not copied), a CPU
        torch tensor (shared via ``.numpy()``), or another ``TokenArray`` (shared).
    dtype:
        Element type when ``data`` is not already an array. Defaults to numpy's inference
        (``int64`` for ints, ``float64`` for floats; ``int64`` when empty).

    Examples
    --------
    >>> t = TokenArray([1, 2, 3], dtype="int32")
    >>> [0] + t + [4]
    TokenArray([0, 1, 2, 3, 4], dtype=int32)
    >>> t == [1, 2, 3]
    True
    """

    __slots__ = ("_a", "_buf")

    _a: npt.NDArray[Any]
    #: Over-allocated private buffer that ``_a`` is a prefix of, or None.
    _buf: npt.NDArray[Any] | None

    def __init__(self, data: Any = (), dtype: npt.DTypeLike = None) -> None:
        self._buf = None
        if isinstance(data, TokenArray):
            arr = data._a
        elif isinstance(data, np.ndarray):
            arr = data
        elif type(data).__module__ == "torch" and type(data).__name__ == "Tensor":
            arr = data.detach().cpu().numpy()
        else:
            if not isinstance(data, (list, tuple)):
                data = list(data)
            if dtype is None and len(data) == 0:
                dtype = np.int64
            arr = np.asarray(data, dtype=dtype)
        if dtype is not None and arr.dtype != np.dtype(dtype):
            arr = arr.astype(dtype)
        if arr.ndim != 1:
            raise ValueError(f"TokenArray needs a 1-D array, got shape {arr.shape}")
        if arr.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"TokenArray needs a numeric dtype, got {arr.dtype}")
        self._a = arr

    # -- access ------------------------------------------------------------------
    @property
    def array(self) -> npt.NDArray[Any]:
        """The underlying 1-D numpy array (a view; no copy)."""
        return self._a

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element dtype."""
        return self._a.dtype

    def tolist(self) -> list[Any]:
        """A new Python list with the elements as Python scalars."""
        return self._a.tolist()  # type: ignore[no-any-return]

    def tensor(self) -> torch.Tensor:
        """A CPU ``torch.Tensor`` sharing memory with this array (no copy)."""
        import torch

        return torch.from_numpy(self._a)

    def copy(self) -> TokenArray:
        """An independent copy."""
        return TokenArray(self._a.copy())

    def __array__(self, dtype: npt.DTypeLike = None, copy: bool | None = None) -> npt.NDArray[Any]:
        if dtype is not None and np.dtype(dtype) != self._a.dtype:
            return self._a.astype(dtype)
        return self._a.copy() if copy else self._a

    def __len__(self) -> int:
        return int(self._a.shape[0])

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> TokenArray: ...
    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        if isinstance(index, slice):
            return TokenArray(self._a[index])
        return self._a[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._a.tolist())

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self._a.tolist())

    def __contains__(self, value: object) -> bool:
        return bool((self._a == value).any())

    def __bool__(self) -> bool:
        return self._a.shape[0] > 0

    def __repr__(self) -> str:
        return f"TokenArray({self._a.tolist()!r}, dtype={self._a.dtype})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenArray, (np.array(self._a),))

    def count(self, value: Any) -> int:
        """Number of elements equal to ``value``."""
        return int((self._a == value).sum())

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        """First index of ``value`` (``ValueError`` if absent), as ``list.index``."""
        hits = np.flatnonzero(self._a[start:stop] == value)
        if hits.size == 0:
            raise ValueError(f"{value!r} is not in TokenArray")
        return int(hits[0]) + (start if start >= 0 else len(self) + start)

    # -- comparison --------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenArray):
            return bool(np.array_equal(self._a, other._a))
        if isinstance(other, (list, tuple)):
            return self._a.tolist() == list(other)
        if isinstance(other, np.ndarray):
            return other.ndim == 1 and bool(np.array_equal(self._a, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]  # mutable, like list

    # -- concatenation and growth ------------------------------------------------
    @staticmethod
    def _as_seq(other: Any, op: str) -> npt.NDArray[Any]:
        if isinstance(other, TokenArray):
            return other._a
        if isinstance(other, np.ndarray) and other.ndim == 1:
            return other
        if isinstance(other, (list, tuple, range)):
            return np.asarray(other) if len(other) else np.empty(0, np.int64)
        raise TypeError(_hint(f"{op} {type(other).__name__}"))

    def _concat(self, first: npt.NDArray[Any], second: npt.NDArray[Any]) -> TokenArray:
        if first.size == 0:
            dtype = second.dtype if second.size else self._a.dtype
        elif second.size == 0:
            dtype = first.dtype
        else:
            dtype = np.result_type(first.dtype, second.dtype)
        return TokenArray(np.concatenate((first, second)).astype(dtype, copy=False))

    def __add__(self, other: Any) -> TokenArray:
        return self._concat(self._a, self._as_seq(other, "+"))

    def __radd__(self, other: Any) -> TokenArray:
        return self._concat(self._as_seq(other, "+"), self._a)

    def __iadd__(self, other: Any) -> TokenArray:
        self.extend(self._as_seq(other, "+="))
        return self

    def extend(self, values: Iterable[Any]) -> None:
        """Append every element of ``values`` (amortised, never writes a received frame)."""
        extra = (
            self._as_seq(values, "extend")
            if isinstance(values, (TokenArray, np.ndarray, list, tuple, range))
            else np.asarray(list(values))
        )
        n, k = len(self), len(extra)
        if k == 0:
            return
        if n == 0 and self._buf is None:
            dtype = extra.dtype
        else:
            dtype = np.result_type(self._a.dtype, extra.dtype)
        buf = self._buf
        if buf is None or buf.dtype != dtype or buf.shape[0] < n + k:
            buf = np.empty(max(2 * (n + k), 16), dtype=dtype)
            buf[:n] = self._a
            self._buf = buf
        buf[n : n + k] = extra
        self._a = buf[: n + k]

    def append(self, value: Any) -> None:
        """Append one element."""
        self.extend((value,))

    def pop(self, index: int = -1) -> Any:
        """Remove and return the element at ``index`` (default last)."""
        n = len(self)
        if n == 0:
            raise IndexError("pop from empty TokenArray")
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError("pop index out of range")
        value = self._a[i].item()
        self._a = np.concatenate((self._a[:i], self._a[i + 1 :]))
        self._buf = None  # views of the old prefix must never see later appends
        return value

    def clear(self) -> None:
        """Remove every element (keeps the dtype)."""
        self._a = self._a[:0]
        self._buf = None

    # -- operations that would silently change meaning -----------------------------
    def __mul__(self, other: Any) -> TokenArray:
        raise TypeError(_hint("*"))

    __rmul__ = __mul__
    __imul__ = __mul__

    def __sub__(self, other: Any) -> TokenArray:
        raise TypeError(_hint("-"))

    __rsub__ = __sub__

    def __truediv__(self, other: Any) -> TokenArray:
        raise TypeError(_hint("/"))

    def __lt__(self, other: Any) -> bool:
        raise TypeError(_hint("<"))

    __le__ = __gt__ = __ge__ = __lt__

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(_hint("item assignment"))
