"""``TokenArray``: a zero-copy, list-like view of a 1-D numpy array (its dtype rules,
copy-on-write and lifetime: ``docs/concepts.md``, "The codec")."""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["TokenArray"]

_NUMERIC_KINDS = frozenset("biuf")
_NUMBER = (int, float, np.number)


def _hint(op: str) -> str:
    return (
        f"TokenArray does not support '{op}': a list would do one thing and a numpy "
        "array another. Use t.array for numpy arithmetic or t.tolist() for list behaviour."
    )


def _refused(op: str) -> Any:
    def refuse(self: Any, other: Any) -> Any:
        raise TypeError(_hint(op))

    return refuse


def _weak(values: Sequence[Any], like: np.dtype[Any], what: str = "TokenArray") -> npt.NDArray[Any]:
    """Python numbers as a 1-D array in ``like``'s dtype when all fit (NEP 50), else wider."""
    if len(values) == 0:
        return np.empty(0, like)
    arr = _numbers(values, None, what)
    kind, target = arr.dtype.kind, like.kind
    if kind not in _NUMERIC_KINDS:
        raise TypeError(f"{what} holds numbers, got {arr.dtype} values")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of numbers, got shape {arr.shape}")
    if kind == "b" or kind == target == "f":
        return arr.astype(like, copy=False)
    if kind in "iu" and target in "iu":
        info = np.iinfo(like)
        fits = info.min <= arr.min() and arr.max() <= info.max
        return arr.astype(like, copy=False) if fits else arr
    if kind in "iu" and target == "f":
        return arr.astype(like if like.itemsize >= 8 else np.float64)
    return arr


class TokenArray(Sequence[Any]):
    """A list-like, zero-copy sequence of numbers backed by a 1-D numpy array.

    Parameters
    ----------
    data:
        A list/tuple/iterable of numbers, a 1-D numpy array (wrapped, not copied), a CPU
        torch tensor (shared via ``.numpy()``), or another ``TokenArray`` (shared).
    dtype:
        Element type when ``data`` is not already an array (a conversion otherwise).
        Defaults to numpy's inference (``int64`` for ints, ``float64`` for floats;
        ``int64`` when empty).

    Examples
    --------
    >>> t = TokenArray([1, 2, 3], dtype="int32")
    >>> [0] + t + [4]
    TokenArray([0, 1, 2, 3, 4], dtype=int32)
    >>> t == [1, 2, 3]
    True
    """

    __slots__ = ("_a", "_buf", "_excl")

    _a: npt.NDArray[Any]
    #: Over-allocated private buffer that ``_a`` is a prefix of (unset after :meth:`wrap`).
    _buf: npt.NDArray[Any] | None
    #: No other view of ``_a``: assignment may write in place (unset: False).
    _excl: bool

    def __init__(self, data: Any = (), dtype: npt.DTypeLike | None = None) -> None:
        self._buf = None
        self._excl = False
        if isinstance(data, TokenArray):
            arr = data._a
            data._excl = False
        elif isinstance(data, np.ndarray):
            arr = data
        elif type(data).__module__ == "torch" and type(data).__name__ == "Tensor":
            arr = data.detach().cpu().numpy()
        else:
            if isinstance(data, (str, bytes, dict)) or not isinstance(data, Iterable):
                raise TypeError(
                    f"TokenArray needs a sequence of numbers, got {type(data).__name__}"
                )
            data = data if isinstance(data, (list, tuple)) else list(data)
            arr = _numbers(data, np.int64 if dtype is None and not data else dtype)
            self._excl = True
        if dtype is not None and arr.dtype != np.dtype(dtype):
            arr = arr.astype(dtype)
        if arr.ndim != 1:
            raise ValueError(f"TokenArray needs a 1-D array, got shape {arr.shape}")
        if arr.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"TokenArray needs a numeric dtype, got {arr.dtype}")
        self._a = arr

    @classmethod
    def wrap(cls, arr: npt.NDArray[Any], owned: bool = False) -> TokenArray:
        """A TokenArray over ``arr``, a 1-D numeric array, sharing its memory, with no
        checks (the codec's constructor; ``TokenArray(arr)`` checks). ``owned``: no other
        view of ``arr`` exists, so assignment may write it in place (else it copies)."""
        self = _new(cls)
        self._a = arr
        if owned:
            self._excl = True
        return self

    @property
    def array(self) -> npt.NDArray[Any]:
        """The underlying 1-D numpy array (a view; no copy)."""
        self._excl = False
        return self._a

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element dtype."""
        return self._a.dtype

    def tolist(self) -> list[Any]:
        """A new Python list with the elements as Python scalars; ``copy()`` too, as
        ``list.copy`` (for an independent ``TokenArray`` use ``t[:]``)."""
        return self._a.tolist()  # type: ignore[no-any-return]

    copy = tolist

    def tensor(self) -> torch.Tensor:
        """A CPU ``torch.Tensor`` sharing memory (a read-only array is copied)."""
        import torch

        a = self.array
        return torch.from_numpy(a if a.flags.writeable else a.copy())

    def __array__(
        self, dtype: npt.DTypeLike | None = None, copy: bool | None = None
    ) -> npt.NDArray[Any]:
        if dtype is not None and np.dtype(dtype) != self._a.dtype:
            if copy is False:
                raise ValueError("TokenArray: a dtype conversion needs a copy")
            return self._a.astype(dtype)
        return self._a.copy() if copy else self.array

    def __len__(self) -> int:
        return int(self._a.shape[0])

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> TokenArray: ...
    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        if isinstance(index, slice):
            self._excl = False  # the slice shares memory: assignment copies first
            return TokenArray.wrap(self._a[index])
        try:
            return self._a[_index(index)].item()
        except IndexError:
            raise IndexError("TokenArray index out of range") from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __reversed__(self) -> Iterator[Any]:
        return iter(self._a[::-1].tolist())

    def __contains__(self, value: object) -> bool:
        return isinstance(value, _NUMBER) and bool((self._a == value).any())

    def __bool__(self) -> bool:
        return len(self._a) > 0

    def __repr__(self) -> str:
        return f"TokenArray({self.tolist()!r}, dtype={self._a.dtype})"

    def __reduce__(self) -> tuple[Any, ...]:  # pickle, copy: over a copy of the elements
        return (TokenArray, (np.array(self._a),))

    def count(self, value: Any) -> int:
        """Number of elements equal to ``value``."""
        return int((self._a == value).sum())

    def index(self, value: Any, start: SupportsIndex = 0, stop: SupportsIndex | None = None) -> int:
        """First index of ``value`` (``ValueError`` if absent), as ``list.index``."""
        begin, end, _ = slice(start, stop).indices(len(self))
        hits = np.flatnonzero(self._a[begin:end] == value)
        if hits.size == 0:
            raise ValueError(f"{value!r} is not in TokenArray")
        return int(hits[0]) + begin

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenArray):
            return bool(np.array_equal(self._a, other._a))
        if isinstance(other, (list, tuple)):  # as lists: never equal to a tuple
            return isinstance(other, list) and self.tolist() == other
        if isinstance(other, np.ndarray):
            return other.ndim == 1 and bool(np.array_equal(self._a, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like list

    def _values(self, values: Any, op: str, iterables: bool = False) -> npt.NDArray[Any]:
        """``values`` as an array to join with this one (any iterable when ``iterables``)."""
        if isinstance(values, TokenArray):
            return values._a
        if isinstance(values, np.ndarray):
            if values.ndim != 1 or values.dtype.kind not in _NUMERIC_KINDS:
                raise TypeError(_hint(f"{op} {values.ndim}-D {values.dtype} array"))
            return values
        if isinstance(values, (list, tuple, range)):
            return _weak(values, self._a.dtype)
        if not iterables:
            raise TypeError(_hint(f"{op} {type(values).__name__}"))
        if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
            return _weak(list(values), self._a.dtype)
        raise TypeError(
            f"TokenArray {op} needs an iterable of numbers, got {type(values).__name__}"
        )

    def __add__(self, other: Any) -> TokenArray:
        return TokenArray.wrap(_concat(self._a, self._values(other, "+")))

    def __radd__(self, other: Any) -> TokenArray:
        return TokenArray.wrap(_concat(self._values(other, "+"), self._a))

    def __iadd__(self, other: Any) -> TokenArray:
        self.extend(self._values(other, "+="))
        return self

    def extend(self, values: Iterable[Any]) -> None:
        """Append every element of ``values`` (amortised; never writes a received frame)."""
        extra = self._values(values, "extend", iterables=True)
        n, k = len(self), extra.shape[0]
        if k == 0:
            return
        dtype = extra.dtype if n == 0 else _joined(self._a.dtype, extra.dtype)
        buf = getattr(self, "_buf", None)  # unset on arrays fresh from the decoder
        if buf is None or buf.dtype != dtype or buf.shape[0] < n + k:
            buf = np.empty(max(2 * (n + k), 16), dtype=dtype)
            buf[:n] = self._a
            self._buf = buf
            self._excl = True
        buf[n : n + k] = extra
        self._a = buf[: n + k]

    def append(self, value: Any) -> None:
        """Append one element."""
        self.extend((_number(value),))

    def pop(self, index: SupportsIndex = -1) -> Any:
        """Remove and return the element at ``index`` (default last)."""
        i = self._position(index, "pop")
        value = self._a[i].item()
        self._set_private(np.delete(self._a, i))  # new: views never see later appends
        return value

    def clear(self) -> None:
        """Remove every element (keeps the dtype)."""
        self._set_private(self._a[:0])

    def insert(self, index: SupportsIndex, value: Any) -> None:
        """Insert ``value`` before ``index``, as ``list.insert``."""
        i, _, _ = slice(operator.index(index), None).indices(len(self))
        self[i:i] = (value,)

    def reverse(self) -> None:
        """Reverse in place, as ``list.reverse``."""
        self._set_private(self._a[::-1].copy())

    def sort(self, *, reverse: bool = False) -> None:
        """Sort in place, as ``list.sort`` (no ``key``)."""
        a = np.sort(self._a)
        self._set_private(a[::-1].copy() if reverse else a)

    def _set_private(self, arr: npt.NDArray[Any]) -> None:
        self._a = arr
        self._buf = None
        self._excl = True

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if isinstance(value, TokenArray):
                values = value._a.copy()  # t[a:b] = t reads what it writes
            else:
                values = self._values(value, "slice assignment", iterables=True)
            if step == 1:
                a = self._a
                self._set_private(_concat(a[:start], values, a[max(stop, start) :]))
                return
            n_slot = len(range(start, stop, step))
            if values.shape[0] != n_slot:
                raise ValueError(
                    f"attempt to assign sequence of size {values.shape[0]} "
                    f"to extended slice of size {n_slot}"
                )
        else:
            index = self._position(index, "assignment")
            values = _weak([_number(value)], self._a.dtype)
        # Private writable memory of the joined dtype (copied once if shared).
        a, dtype = self._a, _joined(self._a.dtype, values.dtype)
        if not getattr(self, "_excl", False) or a.dtype != dtype or not a.flags.writeable:
            a = a.astype(dtype)
            self._set_private(a)
        a[index] = values if isinstance(index, slice) else values[0]

    def _position(self, index: Any, op: str) -> int:
        i = _index(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"TokenArray {op} index out of range")
        return i

    def __delitem__(self, index: Any) -> None:
        i = index if isinstance(index, slice) else self._position(index, "assignment")
        self._set_private(np.delete(self._a, i))

    __mul__ = __rmul__ = __imul__ = _refused("*")
    __sub__ = __rsub__ = _refused("-")
    __truediv__ = _refused("/")
    __lt__ = __le__ = __gt__ = __ge__ = _refused("<")


_new = object.__new__


def _number(value: Any) -> Any:
    if not isinstance(value, _NUMBER):
        raise TypeError(f"TokenArray holds numbers only, got {type(value).__name__}")
    return value


def _index(index: Any) -> int:
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(
            f"TokenArray indices must be integers or slices, not {type(index).__name__}"
        ) from None


def _concat(*parts: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The parts joined; an empty part takes no part in the dtype (as ``[] + list``)."""
    dtype = functools.reduce(_joined, [p.dtype for p in parts if p.shape[0]] or [parts[-1].dtype])
    return np.concatenate(parts, dtype=dtype, casting="unsafe")


def _joined(a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype holding both; never a float for two integer dtypes (int64 + uint64)."""
    if a == b:
        return a
    out: np.dtype[Any] = np.result_type(a, b)
    if out.kind == "f" and a.kind in "iu" and b.kind in "iu":
        raise OverflowError(
            f"TokenArray cannot join {a} and {b} values exactly: negative numbers and "
            "numbers of 2**63 or more need more than 64 bits"
        )
    return out


def _numbers(
    data: Sequence[Any], dtype: npt.DTypeLike | None, what: str = "TokenArray"
) -> npt.NDArray[Any]:
    """``np.asarray`` of Python numbers, with a clear error for ints beyond 64 bits."""
    try:
        arr = np.asarray(data, dtype=dtype)
    except OverflowError as exc:
        raise OverflowError(f"{what}: {exc}") from exc
    except ValueError as exc:  # ragged nesting, text
        raise ValueError(f"{what} must be a flat sequence of numbers") from exc
    if arr.dtype.kind == "O" and all(isinstance(x, (int, np.integer)) for x in data):
        raise OverflowError(
            f"{what} holds integers of at most 64 bits (int64, or uint64 for values in "
            "[2**63, 2**64)): no numpy dtype holds larger ones and the wire cannot carry them"
        )
    return arr
