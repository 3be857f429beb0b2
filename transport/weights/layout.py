"""The layout of a version: dtype names, checksums, and plans of flat buckets.

A *plan* (:class:`~fastio.weight_msgs.WeightBucketInfo` list) lays tensors, in order,
into buckets of at most ``bucket_bytes`` (a larger tensor gets its own), each at a
64-byte aligned offset; it depends only on names, shapes and dtypes, so both sides can
compute it. Re-exported by :mod:`transport.weights.bucket`.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastio._optional import lazy, require
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.errors import WeightMismatchError

if TYPE_CHECKING:
    import torch
else:  # torch is imported by the first function that needs it, not by this import
    torch = lazy("torch", "weights", "weight buckets", globals())

__all__ = [
    "ALIGNMENT",
    "CHECKSUM_ALGOS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHECKSUM",
    "Hasher",
    "checksum",
    "dtype_from_name",
    "dtype_name",
    "named_tensors",
    "plan_buckets",
    "plan_for",
    "split_aliases",
]

#: Default bucket size: large enough that per-bucket overheads vanish, small enough that
#: a worker applies one bucket while the next is on the wire.
DEFAULT_BUCKET_BYTES = 256 << 20

#: Byte alignment of every tensor inside a bucket.
ALIGNMENT = 64

#: Wire names of the supported dtypes, each the name of its ``torch`` attribute.
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    return {n: getattr(torch, n) for n in _DTYPE_NAMES}


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _names()[dtype]
    except KeyError:
        raise WeightMismatchError(
            f"unsupported dtype {dtype} for a weight update; supported: {sorted(_DTYPE_NAMES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a wire name; :class:`WeightMismatchError` if unknown."""
    try:
        return _dtypes()[name]
    except KeyError:
        raise WeightMismatchError(f"unknown dtype {name!r} in a weight update") from None


# -- checksums -----------------------------------------------------------------------
_xxhash: Any
try:  # xxh3 is several times faster than crc32 (bench/results); both far above the wire.
    _xxhash = require("xxhash", "weights", "the xxh3_64 checksum")
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

#: Checksum algorithms this side can compute.
CHECKSUM_ALGOS: tuple[str, ...] = ("xxh3_64", "crc32") if _xxhash is not None else ("crc32",)
#: Algorithm a publisher uses unless told otherwise.
DEFAULT_CHECKSUM = CHECKSUM_ALGOS[0]


class Hasher:
    """Streaming checksum over several buffers (``update`` in order, then ``digest``).

    Parameters
    ----------
    algo:
        ``"xxh3_64"`` (needs the ``xxhash`` package) or ``"crc32"``.
    """

    def __init__(self, algo: str = DEFAULT_CHECKSUM) -> None:
        if algo not in CHECKSUM_ALGOS:
            raise ValueError(f"checksum algorithm {algo!r} not available; have {CHECKSUM_ALGOS}")
        self.algo = algo
        self._crc = 0
        self._xxh: Any = _xxhash.xxh3_64() if algo == "xxh3_64" and _xxhash else None

    def update(self, buf: Any) -> None:
        """Feed one bytes-like object (a memoryview of a frame, an array, ...)."""
        if self._xxh is not None:
            self._xxh.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def digest(self) -> int:
        """The checksum of everything fed so far, as an unsigned int."""
        return int(self._xxh.intdigest()) if self._xxh is not None else self._crc


def checksum(buffers: Iterable[Any], algo: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of the concatenation of ``buffers`` (bytes-like objects)."""
    h = Hasher(algo)
    for b in buffers:
        h.update(b)
    return h.digest()


# -- plans ---------------------------------------------------------------------------
def named_tensors(source: Any) -> dict[str, torch.Tensor]:
    """The tensors to update from an ``nn.Module`` (its state dict, detached views that
    share storage with the parameters) or a mapping of name -> tensor."""
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict(keep_vars=False))
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, Iterable):
        return dict(source)
    raise TypeError(f"expected an nn.Module or a mapping of tensors, got {type(source).__name__}")


def split_aliases(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Separate tensors that are the same memory under several names (tied weights).

    Returns ``(unique, aliases)``: ``unique`` keeps the first name of each distinct
    tensor, in order; ``aliases`` maps every other name to that first name. Two names
    are aliases when they view the same bytes the same way (device, address, dtype,
    shape and strides); tensors that merely overlap are distinct.

    >>> w = torch.ones(2, 2)
    >>> split_aliases({"embed": w, "head": w, "b": torch.zeros(2)})[1]
    {'head': 'embed'}
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            unique[name] = t
            continue
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        seen = first.get(key)
        if seen is None:
            first[key] = name
            unique[name] = t
        else:
            aliases[name] = seen
    return unique, aliases


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_buckets(
    specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[WeightBucketInfo]:
    """Lay tensors out in flat buckets.

    Parameters
    ----------
    specs:
        ``(name, dtype_name, shape)`` per tensor, in the order they go on the wire.
    bucket_bytes:
        Upper bound of a bucket's size (a larger tensor gets a bucket of its own).

    Returns
    -------
    list of WeightBucketInfo
        With ``checksum=0`` and ``shm_offset`` set as if the buckets lay back to back in
        one segment.

    Examples
    --------
    >>> plan = plan_buckets([("w", "float32", (4, 4)), ("b", "bfloat16", (4,))], 1 << 20)
    >>> [(t.name, t.offset, t.nbytes) for t in plan[0].tensors]
    [('w', 0, 64), ('b', 64, 8)]
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[WeightBucketInfo] = []
    cur: list[WeightTensor] = []
    size = 0
    seg = 0

    def close() -> None:
        nonlocal cur, size, seg
        if cur:
            buckets.append(WeightBucketInfo(len(buckets), size, 0, cur, seg))
            seg += _align(size)
        cur, size = [], 0

    seen: set[str] = set()
    for name, dname, shape in specs:
        if name in seen:
            raise WeightMismatchError(f"duplicate tensor name {name!r}")
        seen.add(name)
        itemsize = torch.empty((), dtype=dtype_from_name(dname)).element_size()
        nbytes = _numel(shape) * itemsize
        off = _align(size)
        if cur and off + nbytes > bucket_bytes:
            close()
            off = 0
        cur.append(WeightTensor(name, dname, tuple(int(d) for d in shape), off, nbytes))
        size = off + nbytes
    close()
    return buckets


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_for(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[WeightBucketInfo]:
    """:func:`plan_buckets` for a mapping of tensors, in its iteration order."""
    return plan_buckets(
        ((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()), bucket_bytes
    )
