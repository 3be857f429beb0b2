"""Flat buckets: a state dict packed into a few large byte buffers, and back.

The layout (dtypes, checksums, plans) is :mod:`transport.weights.layout`, re-exported
here. Applying is one copy per byte into the live tensor; CUDA targets go through two
pinned host buffers in turn, so one slice's host copy overlaps the previous one's
device copy.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from fastio._optional import lazy
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.layout import (
    ALIGNMENT,
    CHECKSUM_ALGOS,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHECKSUM,
    Hasher,
    checksum,
    dtype_from_name,
    dtype_name,
    named_tensors,
    plan_buckets,
    plan_for,
    split_aliases,
)

if TYPE_CHECKING:
    import torch
else:  # torch is imported by the first function that needs it, not by this import
    torch = lazy("torch", "weights", "weight buckets", globals())

__all__ = [
    "ALIGNMENT",
    "CHECKSUM_ALGOS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHECKSUM",
    "BucketApplier",
    "Hasher",
    "checksum",
    "copy_bytes",
    "copy_tensor",
    "default_copy_threads",
    "dtype_from_name",
    "dtype_name",
    "named_tensors",
    "pack_bucket",
    "plan_buckets",
    "plan_for",
    "split_aliases",
    "wire_tensor",
]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's memory."""
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def pack_bucket(
    info: WeightBucketInfo, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> None:
    """Copy the bucket's tensors into ``out`` (a CPU uint8 tensor of at least
    ``info.nbytes`` bytes); the padding between tensors is zeroed so the checksum is
    deterministic. CUDA tensors are copied with ``non_blocking=True`` and synchronised
    once at the end (``out`` should be pinned for the copies to be asynchronous)."""
    pos = 0
    cuda = False
    for e in info.tensors:
        if e.offset > pos:
            out[pos : e.offset].zero_()
        t = tensors[e.name].detach()
        cuda = copy_tensor(out[e.offset : e.offset + e.nbytes], t, sync=False) or cuda
        pos = e.offset + e.nbytes
    if cuda:
        torch.cuda.synchronize()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two 1-D uint8 tensors of equal size.

    CPU to CPU goes through ``numpy.copyto`` (one memcpy, GIL released): torch's
    ``copy_`` splits large copies over intra-op threads that spin on busy cores. A
    worker started with ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=131072``
    copies faster (non-temporal stores for blocks of a few MiB; see bench/results).
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


def copy_tensor(dst: torch.Tensor, t: torch.Tensor, *, sync: bool = True) -> bool:
    """Copy tensor ``t`` into the uint8 region ``dst`` (C order); returns whether it
    was a CUDA copy (non-blocking; synchronised here when ``sync``)."""
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


# -- applying ---------------------------------------------------------------------
def _copy_span(
    dst: np.ndarray[Any, Any], arrs: list[np.ndarray[Any, Any]], starts: list[int], offset: int
) -> None:
    """Copy bytes ``[offset, offset + dst.size)`` of a bucket held in the chunks ``arrs``
    (chunk ``k`` starts at byte ``starts[k]``) into ``dst``."""
    n = dst.size
    k = bisect.bisect_right(starts, offset) - 1
    pos = 0
    while pos < n:
        if k >= len(arrs):
            raise ValueError("bucket chunks end before the tensor does")
        arr = arrs[k]
        a = offset + pos - starts[k]
        take = min(n - pos, arr.size - a)
        np.copyto(dst[pos : pos + take], arr[a : a + take])
        pos += take
        k += 1


def _chunk_spans(
    chunks: Sequence[torch.Tensor], lo: int, hi: int
) -> Iterator[tuple[torch.Tensor, int]]:
    """Chunks of bytes ``[lo, hi)`` of a bucket split into ``chunks``: (chunk, offset
    of the chunk relative to ``lo``)."""
    base = 0
    for c in chunks:
        n = c.numel()
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            yield c[a - base : b - base], a - lo
        base += n
        if base >= hi:
            break


def wire_tensor(e: WeightTensor, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensor ``e`` of a bucket held in ``chunks`` (1-D uint8 chunks in order), typed and
    shaped: a view when it lies in one chunk at an aligned offset, else a copy."""
    dt = dtype_from_name(e.dtype)
    size = torch.empty((), dtype=dt).element_size()
    lo, hi = e.offset, e.offset + e.nbytes
    base = 0
    raw: torch.Tensor | None = None
    for c in chunks:
        n = c.numel()
        if base <= lo and hi <= base + n and (lo - base) % size == 0:
            raw = c[lo - base : hi - base]
            break
        if base + n > lo:
            break
        base += n
    if raw is None:
        raw = torch.empty(e.nbytes, dtype=torch.uint8)
        base = 0
        for c in chunks:
            n = c.numel()
            a, b = max(lo, base), min(hi, base + n)
            if a < b:
                raw[a - lo : b - lo].copy_(c[a - base : b - base])
            base += n
            if base >= hi:
                break
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dt)
    return raw.view(dt).view(e.shape)


class BucketApplier:
    """Copies received buckets into live tensors, in place.

    Parameters
    ----------
    targets:
        Name -> the tensor to overwrite (parameters or their detached views).
    pinned_bytes:
        Size of each of the two pinned host buffers used for CUDA targets.
    """

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
        self._events: list[Any] = []
        self._turn = 0
        self._cuda = any(t.device.type == "cuda" for t in targets.values())

    def apply(
        self,
        info: WeightBucketInfo,
        chunks: Sequence[torch.Tensor],
        dests: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Copy every tensor of bucket ``info`` from ``chunks`` (1-D uint8 CPU tensors
        whose concatenation is the bucket) into its target.

        ``dests`` maps a travelling name to the target names it goes to (renaming and
        aliases, see :class:`transport.weights.binding.Binding`; default: its own name).
        Names that are no target are skipped; a target of another dtype gets the cast
        value (``Tensor.copy_`` semantics); targets that are one memory are written once.
        """
        with torch.no_grad():
            # CPU targets: numpy views of the chunks made once, a tensor's first chunk
            # found by bisection; the copies run at the end, on copy_threads threads.
            arrs: list[np.ndarray[Any, Any]] | None = None
            starts: list[int] = []
            plain: list[tuple[np.ndarray[Any, Any], int]] = []
            for e in info.tensors:
                if e.nbytes == 0:
                    continue
                names = (e.name,) if dests is None else dests.get(e.name, ())
                written: set[tuple[Any, ...]] = set()
                for name in names:
                    dst = self.targets.get(name)
                    if dst is None:
                        continue
                    key = (dst.device, dst.data_ptr(), dst.dtype, tuple(dst.shape), dst.stride())
                    if key in written:
                        continue  # tied on this side too: one copy
                    written.add(key)
                    if dtype_name(dst.dtype) != e.dtype:
                        dst.copy_(wire_tensor(e, chunks))
                    elif dst.device.type == "cpu" and dst.is_contiguous():
                        if arrs is None:
                            arrs = [c.numpy() for c in chunks]
                            starts = list(itertools.accumulate((a.size for a in arrs), initial=0))
                        plain.append((_flat_bytes(dst).numpy(), e.offset))
                    elif dst.is_contiguous():
                        dflat = _flat_bytes(dst)
                        for chunk, rel in _chunk_spans(chunks, e.offset, e.offset + e.nbytes):
                            self._copy(dflat[rel : rel + chunk.numel()], chunk)
                    else:  # rare: assemble, then one strided copy
                        tmp = torch.empty(e.nbytes, dtype=torch.uint8)
                        for chunk, rel in _chunk_spans(chunks, e.offset, e.offset + e.nbytes):
                            copy_bytes(tmp[rel : rel + chunk.numel()], chunk)
                        dst.copy_(tmp.view(dst.dtype).view(dst.shape))
            if plain and arrs is not None:
                self._copy_plain(plain, arrs, starts)

    def _copy_plain(
        self,
        jobs: list[tuple[np.ndarray[Any, Any], int]],
        arrs: list[np.ndarray[Any, Any]],
        starts: list[int],
    ) -> None:
        """Run the plain CPU copies: inline, or cut into slices of at least
        ``_THREAD_PIECE`` bytes spread over ``copy_threads`` threads (``np.copyto``
        releases the GIL, so memory-bound copies of a large bucket run in parallel)."""
        total = sum(d.size for d, _ in jobs)
        threads = min(self.copy_threads, total // _THREAD_PIECE)
        if threads <= 1:
            for dst, off in jobs:
                _copy_span(dst, arrs, starts, off)
            return
        share = -(-total // threads)
        groups: list[list[tuple[np.ndarray[Any, Any], int]]] = [[] for _ in range(threads)]
        g = filled = 0
        for dst, off in jobs:
            pos = 0
            while pos < dst.size:
                take = min(dst.size - pos, share - filled)
                groups[g].append((dst[pos : pos + take], off + pos))
                pos += take
                filled += take
                if filled >= share and g < threads - 1:
                    g, filled = g + 1, 0

        def run(group: list[tuple[np.ndarray[Any, Any], int]]) -> None:
            for d, o in group:
                _copy_span(d, arrs, starts, o)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="weights-copy")
        futures = [self._pool.submit(run, grp) for grp in groups[1:] if grp]
        try:
            run(groups[0])
        finally:
            # Every copy has stopped before this returns or raises: none may still
            # read the source (or write a target) once the version is answered.
            wait(futures)
        for f in futures:
            f.result()  # surfaces a failed copy

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type != "cuda":
            copy_bytes(dst, src)
            return
        # Device target: stage through pinned memory so the H2D copy is asynchronous,
        # alternating two buffers; an event guards a buffer until its copy has run.
        if not self._pinned:
            self._pinned = [
                torch.empty(self._pinned_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)
            ]
            self._events = [None, None]
        step = self._pinned_bytes
        for a in range(0, src.numel(), step):
            part = src[a : a + step]
            i = self._turn
            self._turn ^= 1
            ev = self._events[i]
            if ev is not None:
                ev.synchronize()
            buf = self._pinned[i][: part.numel()]
            copy_bytes(buf, part)
            dst[a : a + part.numel()].copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            self._events[i] = ev

    def finish(self) -> None:
        """Wait until every copy issued so far has landed (a no-op on CPU)."""
        if self._cuda:
            torch.cuda.synchronize()


#: Smallest share of a bucket worth a copy thread of its own.
_THREAD_PIECE = 8 << 20


def default_copy_threads() -> int:
    """Copy threads per worker by default: one per 4 cores this process may use, 1 to
    4 (memory-bound copies gain little beyond that, and every worker on the host
    copies at the same time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))
