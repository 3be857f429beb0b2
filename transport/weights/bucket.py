"""Flat buckets: a state dict packed into a few large byte buffers, and back; the plan,
dtype names and checksums of every route (``docs/weights.md``)."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from fastio._optional import lazy, require
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.errors import WeightMismatchError

if TYPE_CHECKING:
    import torch
else:  # torch is imported by the first function that needs it, not by this import
    torch = lazy("torch", "weights", "weight buckets", globals())

__all__ = [
    "ALIGNMENT", "CHECKSUM_ALGOS", "DEFAULT_BUCKET_BYTES", "DEFAULT_CHECKSUM", "SUM64_ROW",
    "BucketApplier", "Hasher", "checksum", "copy_bytes", "copy_tensor", "default_copy_threads",
    "dtype_from_name", "dtype_name", "named_tensors", "pack_bucket", "plan_buckets",
    "plan_spans", "split_aliases", "sum64", "wire_tensor",
]  # fmt: skip

#: Default bucket size.
DEFAULT_BUCKET_BYTES = 256 << 20
#: Byte alignment of every tensor inside a bucket.
ALIGNMENT = 64
#: Wire names of the supported dtypes, each the name of its ``torch`` attribute.
_DTYPE_NAMES = "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64".split()  # noqa: SIM905
#: Smallest share of a bucket worth a copy thread of its own.
_THREAD_PIECE = 8 << 20

_numel = math.prod


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
try:
    _xxhash = require("xxhash", "weights", "the xxh3_64 checksum")
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

#: Checksum algorithms this side can compute (xxh3 is faster than crc32).
CHECKSUM_ALGOS: tuple[str, ...] = ("xxh3_64", "crc32") if _xxhash is not None else ("crc32",)
#: Algorithm a publisher uses unless told otherwise.
DEFAULT_CHECKSUM = CHECKSUM_ALGOS[0]


class Hasher:
    """Streaming checksum (``update`` in order, then ``digest``): ``"xxh3_64"`` or ``"crc32"``."""

    def __init__(self, algo: str = DEFAULT_CHECKSUM) -> None:
        if algo not in CHECKSUM_ALGOS:
            raise ValueError(f"checksum algorithm {algo!r} not available; have {CHECKSUM_ALGOS}")
        self.algo = algo
        self._crc = 0
        self._xxh: Any = _xxhash.xxh3_64() if algo == "xxh3_64" else None

    def update(self, buf: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def digest(self) -> int:
        return int(self._xxh.intdigest()) if self._xxh is not None else self._crc


def checksum(buffers: Iterable[Any], algo: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of the concatenation of ``buffers`` (bytes-like objects)."""
    h = Hasher(algo)
    for b in buffers:
        h.update(b)
    return h.digest()


# -- plans ---------------------------------------------------------------------------
def named_tensors(source: Any) -> dict[str, torch.Tensor]:
    """``name -> tensor`` of an ``nn.Module`` (its state dict), a mapping or pairs."""
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict(keep_vars=False))
    if isinstance(source, Iterable):
        return dict(source)
    raise TypeError(f"expected an nn.Module or a mapping of tensors, got {type(source).__name__}")


def split_aliases(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Separate tensors that are one memory under several names (tied weights):
    ``(unique, aliases)``, the first name of each in order and every other name -> it.
    Aliases view the same bytes the same way; tensors that merely overlap are distinct.

    >>> w = torch.ones(2, 2)
    >>> split_aliases({"embed": w, "head": w, "b": torch.zeros(2)})[1]
    {'head': 'embed'}
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() == 0 or key not in first:
            first.setdefault(key, name)
            unique[name] = t
        else:
            aliases[name] = first[key]
    return unique, aliases


def _targets_of(
    e: WeightTensor,
    targets: Mapping[str, torch.Tensor],
    dests: Mapping[str, Sequence[str]] | None,
) -> Iterable[torch.Tensor]:
    """The targets of ``e`` (through ``dests``, default its own name), tied ones once."""
    found: dict[tuple[Any, ...], torch.Tensor] = {}
    for name in (e.name,) if dests is None else dests.get(e.name, ()):
        dst = targets.get(name)
        if dst is not None and e.nbytes:
            key = (dst.device, dst.data_ptr(), dst.dtype, tuple(dst.shape), dst.stride())
            found.setdefault(key, dst)
    return found.values()


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_spans(
    specs: Iterable[tuple[str, str, Sequence[int]]],
    bucket_bytes: int,
    align: int,
    dtype: Callable[[str], torch.dtype] = dtype_from_name,
) -> Iterator[tuple[list[tuple[str, str, tuple[int, ...], int, int]], int]]:
    """The one planner of every route: ``(name, dtype_name, shape)`` in order, in buckets
    of at most ``bucket_bytes`` (a larger tensor alone), offsets multiples of ``align``;
    yields each bucket's ``(name, dtype, shape, offset, nbytes)`` entries and length."""
    cur: list[tuple[str, str, tuple[int, ...], int, int]] = []
    size = 0
    seen: set[str] = set()
    for name, dname, shape in specs:
        if name in seen:
            raise WeightMismatchError(f"duplicate tensor name {name!r}")
        seen.add(name)
        nbytes = _numel(shape) * dtype(dname).itemsize
        off = -(-size // align) * align
        if cur and off + nbytes > bucket_bytes:
            yield cur, size
            cur, off = [], 0
        cur.append((name, dname, tuple(int(d) for d in shape), off, nbytes))
        size = off + nbytes
    if cur:
        yield cur, size


def plan_buckets(
    specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[WeightBucketInfo]:
    """:func:`plan_spans` as :class:`WeightBucketInfo` (``checksum=0``, ``shm_offset``
    as if the buckets lay back to back in one segment).

    >>> plan = plan_buckets([("w", "float32", (4, 4)), ("b", "bfloat16", (4,))], 1 << 20)
    >>> [(t.name, t.offset, t.nbytes) for t in plan[0].tensors]
    [('w', 0, 64), ('b', 64, 8)]
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[WeightBucketInfo] = []
    seg = 0
    for i, (entries, size) in enumerate(plan_spans(specs, bucket_bytes, ALIGNMENT)):
        buckets.append(WeightBucketInfo(i, size, 0, [WeightTensor(*e) for e in entries], seg))
        seg += _align(size)
    return buckets


#: Bytes per ``sum64`` row; a bucket it checks is a multiple of it.
SUM64_ROW = 512


@functools.cache
def _sum64_weights(n: int, device: Any) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device)


def sum64(payload: torch.Tensor) -> torch.Tensor:
    """``sum64`` of a bucket (1-D ``uint8``, a multiple of 512 bytes, 8-byte aligned): a
    0-d int64 tensor on ``payload``'s device, no host synchronisation."""
    if payload.device.type == "cpu":
        # numpy, single-threaded: torch's intra-op threads spin on a busy trainer host
        words = payload.numpy().view(np.int64).reshape(-1, SUM64_ROW // 8)
        rows_np = words.sum(axis=1, dtype=np.int64)
        weights = np.arange(1, rows_np.size + 1, dtype=np.int64)
        return torch.tensor(int((rows_np * weights).sum(dtype=np.int64)), dtype=torch.int64)
    rows = payload.view(torch.int64).view(-1, SUM64_ROW // 8).sum(dim=1)
    return (rows * _sum64_weights(rows.numel(), rows.device)).sum()


# -- packing and applying ----------------------------------------------------------
def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pack_bucket(
    info: WeightBucketInfo, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> None:
    """Copy the bucket's tensors into ``out`` (uint8, at least ``info.nbytes``), the
    padding zeroed so the checksum is deterministic."""
    pos = 0
    cuda = False
    for e in info.tensors:
        out[pos : e.offset].zero_()
        dst = out[e.offset : e.offset + e.nbytes]
        cuda = copy_tensor(dst, tensors[e.name].detach(), sync=False) or cuda
        pos = e.offset + e.nbytes
    out[pos : info.nbytes].zero_()
    if cuda and out.device.type == "cpu":
        torch.cuda.synchronize()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two 1-D uint8 tensors of equal size (CPU to CPU by ``numpy.copyto``:
    one memcpy, GIL released, no spinning intra-op threads)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


def copy_tensor(dst: torch.Tensor, t: torch.Tensor, *, sync: bool = True) -> bool:
    """Copy ``t`` into the uint8 region ``dst``; whether it was a (non-blocking) CUDA copy."""
    if t.device.type == "cuda":
        dst.copy_(_flat_bytes(t.contiguous()), non_blocking=True)
        if sync:
            torch.cuda.synchronize()
        return True
    if t.is_contiguous():
        copy_bytes(dst, _flat_bytes(t))
    else:
        dst.view(t.dtype).view(t.shape).copy_(t)
    return False


def _spans(chunks: Sequence[Any], starts: list[int], lo: int, hi: int) -> Iterator[tuple[Any, int]]:
    """Bytes ``[lo, hi)`` of ``chunks`` (chunk k from ``starts[k]``): (part, offset from lo)."""
    k, pos = bisect.bisect_right(starts, lo) - 1, lo
    while pos < hi:
        if k >= len(chunks):
            raise ValueError("bucket chunks end before the tensor does")
        part = chunks[k][pos - starts[k] : hi - starts[k]]
        yield part, pos - lo
        pos += len(part)
        k += 1


def _starts(chunks: Sequence[Any]) -> list[int]:
    return list(itertools.accumulate((len(c) for c in chunks), initial=0))


def wire_tensor(e: WeightTensor, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensor ``e`` of a bucket in ``chunks`` (1-D uint8): a view where it can, else a copy."""
    dt = dtype_from_name(e.dtype)
    parts = list(_spans(chunks, _starts(chunks), e.offset, e.offset + e.nbytes))
    if len(parts) == 1 and parts[0][0].storage_offset() % dt.itemsize == 0:
        raw: torch.Tensor = parts[0][0]
    else:
        raw = torch.empty(e.nbytes, dtype=torch.uint8)
        for part, rel in parts:
            raw[rel : rel + part.numel()].copy_(part)
    return raw.view(dt).view(e.shape)


def default_copy_threads() -> int:
    """Copy threads per worker by default: one per 4 usable cores, 1 to 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 4))


class BucketApplier:
    """Copies received buckets into ``targets`` (name -> parameter or detached view), in
    place; CUDA targets through two pinned host buffers of ``pinned_bytes``, CPU targets
    on ``copy_threads`` threads (default: :func:`default_copy_threads`)."""

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor],
        *,
        pinned_bytes: int = 32 << 20,
        copy_threads: int | None = None,
    ):
        self.targets = targets
        self.copy_threads = default_copy_threads() if copy_threads is None else max(1, copy_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pinned_bytes = pinned_bytes
        self._pinned: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._turn = 0
        self._cuda = any(t.device.type == "cuda" for t in targets.values())

    def apply(
        self,
        info: WeightBucketInfo,
        chunks: Sequence[torch.Tensor],
        dests: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Copy every tensor of bucket ``info`` from ``chunks`` (1-D uint8, the bucket in
        order) into its targets; ``dests``: travelling name -> target names (default: its
        own). Unknown names are skipped, other dtypes cast, tied targets written once."""
        starts = _starts(chunks)
        plain: list[tuple[np.ndarray[Any, Any], int]] = []  # CPU: at the end, on threads
        with torch.no_grad():
            for e in info.tensors:
                for dst in _targets_of(e, self.targets, dests):
                    if dtype_name(dst.dtype) != e.dtype or not dst.is_contiguous():
                        dst.copy_(wire_tensor(e, chunks))  # a cast, or one strided copy
                    elif dst.device.type == "cpu":
                        plain.append((_flat_bytes(dst).numpy(), e.offset))
                    else:
                        flat = _flat_bytes(dst)
                        for part, rel in _spans(chunks, starts, e.offset, e.offset + e.nbytes):
                            self._copy(flat[rel : rel + part.numel()], part)
        if plain:
            self._copy_plain(plain, [c.numpy() for c in chunks], starts)

    def _copy_plain(
        self,
        jobs: list[tuple[np.ndarray[Any, Any], int]],
        arrs: list[np.ndarray[Any, Any]],
        starts: list[int],
    ) -> None:
        """The plain CPU copies, in pieces over threads (``np.copyto`` releases the GIL)."""

        def run(dst: np.ndarray[Any, Any], off: int) -> None:
            for part, rel in _spans(arrs, starts, off, off + dst.size):
                np.copyto(dst[rel : rel + part.size], part)

        step = _THREAD_PIECE
        if self.copy_threads < 2 or sum(d.size for d, _ in jobs) < 2 * step:
            for d, off in jobs:
                run(d, off)
            return
        pool = self._pool = self._pool or ThreadPoolExecutor(self.copy_threads, "weights-copy")
        futures = [
            pool.submit(run, d[a : a + step], off + a)
            for d, off in jobs
            for a in range(0, d.size, step)
        ]
        # Every copy has stopped before this returns or raises: none may still read the
        # source (or write a target) once the version is answered.
        wait(futures)
        for f in futures:
            f.result()  # surfaces a failed copy

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type != "cuda" or src.device.type != "cpu":
            copy_bytes(dst, src)
            return
        # Staged through two pinned buffers in turn, so the H2D copy is asynchronous; an
        # event guards a buffer until its copy has run.
        if not self._pinned:
            self._pinned = [
                torch.empty(self._pinned_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)
            ]
        step = self._pinned_bytes
        for a in range(0, src.numel(), step):
            part = src[a : a + step]
            i = self._turn
            self._turn ^= 1
            if self._events[i] is not None:
                self._events[i].synchronize()
            buf = self._pinned[i][: part.numel()]
            copy_bytes(buf, part)
            dst[a : a + part.numel()].copy_(buf, non_blocking=True)
            self._events[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._events[i].record()

    def finish(self) -> None:
        """Wait until every copy issued so far has landed (a no-op on CPU)."""
        if self._cuda:
            torch.cuda.synchronize()
