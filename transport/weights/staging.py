"""Versions on the trainer side: layout, buffer, packing, and their store."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from inspect import GEN_RUNNING, getgeneratorstate
from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np
import torch

from fastio.weight_msgs import WeightAnnounce, WeightBucketInfo, WeightFetch
from transport.weights.binding import FLOAT_DTYPES, parse_dtype
from transport.weights.bucket import (
    Hasher,
    _flat_bytes,
    copy_tensor,
    dtype_from_name,
    dtype_name,
    plan_buckets,
)
from transport.weights.core.publisher import PublisherCore, VersionLedger
from transport.weights.routes import Tracker
from transport.weights.routes import shm as _shm

if TYPE_CHECKING:
    from transport.weights.routes.ipc import IpcOffering

__all__ = ["Send", "Staged", "VersionStore", "pack_steps", "plan_version"]

log = logging.getLogger("transport.weights.publisher")

#: Pack granularity: hashed, then copied while in cache (twice the workers' BLOCK: a
#: quarter less CPU per byte on the trainer).
PACK_BLOCK = 512 << 10


def plan_version(
    tensors: Mapping[str, torch.Tensor], dtype: str, bucket_bytes: int
) -> list[WeightBucketInfo]:
    """The buckets of a version: floating tensors cast while packing to ``dtype`` (``""``:
    none) where it is narrower."""
    to = parse_dtype(dtype) if dtype else None
    wire: dict[str, torch.dtype] = {}
    for n, t in tensors.items():
        narrower = to is not None and to.itemsize < t.dtype.itemsize
        wire[n] = to if to is not None and narrower and t.dtype in FLOAT_DTYPES else t.dtype
    plan = plan_buckets(
        ((n, dtype_name(wire[n]), tuple(t.shape)) for n, t in tensors.items()), bucket_bytes
    )
    for b in plan:
        b.tensors = [
            e
            if wire[e.name] == tensors[e.name].dtype
            else msgspec.structs.replace(e, src_dtype=dtype_name(tensors[e.name].dtype))
            for e in b.tensors
        ]
    return plan


@dataclass(eq=False, slots=True)
class Send:
    """One Fetch being answered: the next chunk's start; whether it took the data link
    (fixed at its first chunk); whether a later Fetch superseded it."""

    ident: bytes
    wid: str
    fetch: WeightFetch
    cursor: int = 0
    linked: bool | None = None
    cancelled: bool = False


class Staged(VersionLedger):
    """One version: its :class:`VersionLedger`, buffer, manifest and packing."""

    def __init__(self, version: int, buf: torch.Tensor, seg: _shm.ShmSegment | None) -> None:
        super().__init__(version)
        self.buf, self.seg = buf, seg
        self.np: np.ndarray[Any, Any] = buf.numpy()  # cheaper to slice than the tensor
        self.trackers: list[Tracker] = []
        self.packed = 0  # bytes packed so far
        self.buckets_done = 0  # buckets packed, their checksum known
        self.job: Generator[None, None, None] | None = None  # the packing still to do
        self.error: BaseException | None = None

    @classmethod
    def ipc_only(cls, version: int) -> Staged:
        """A version published to ipc workers only: no buffer until staged late."""
        st = cls(version, torch.empty(0, dtype=torch.uint8), None)
        st.unstaged = st.ipc_packing = True
        return st

    def prepare(
        self,
        announce: WeightAnnounce,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        cond: threading.Condition,
    ) -> None:
        """Its manifest, and its packing (:meth:`pack_step`) when it has a buffer."""
        self.announce = announce
        if not self.unstaged:
            self.job = pack_steps(self, tensors, chunk_bytes, cond)

    def pack_step(self, cond: threading.Condition) -> bool:
        """Run one step of the packing; False once it ended (if it failed: :attr:`error`)."""
        job = self.job  # read once: end_job may drop it meanwhile
        if job is None:
            return False
        try:
            next(job)
            return True
        except Exception as exc:  # StopIteration: packed; else reported to publish()
            with cond:
                self.error = None if isinstance(exc, StopIteration) else exc
                self.job = None
                cond.notify_all()
            return False

    def slots_packed(self) -> None:
        """The ipc slots hold it whole: parked Fetches may be answered (lock held)."""
        self.ipc_packing = False

    def stage(self, fresh: Staged, job: Generator[None, None, None]) -> None:
        """Staged late: take ``fresh``'s buffer, packed by ``job``."""
        assert self.announce is not None
        self.buf, self.seg, self.np = fresh.buf, fresh.seg, fresh.np
        self.announce.shm_name = self.seg.name if self.seg is not None else ""
        self.unstaged = False
        self.job = job

    def end_job(self) -> None:
        """Drop the packing still to do (a late staging lets go of the ipc slots); not
        while it runs (a serving thread that did not stop)."""
        job = self.job
        if job is not None and getgeneratorstate(job) != GEN_RUNNING:
            with contextlib.suppress(ValueError):  # it started running just now
                job.close()
                self.job = None

    def sends_done(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return not self.trackers

    def take_segment(self) -> _shm.ShmSegment | None:
        """Detach the buffer from this version (which can no longer be served)."""
        seg, self.seg = self.seg, None
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.np = self.buf.numpy()
        return seg


def pack_steps(
    st: Staged, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, cond: threading.Condition
) -> Generator[None, None, None]:
    """Pack and hash ``st.announce``'s buckets, yielding every ``chunk_bytes``."""
    assert st.announce is not None
    told = 0
    for info in st.announce.buckets:
        base = info.shm_offset
        bucket = st.buf[base : base + info.nbytes]
        bnp = bucket.numpy()
        h = Hasher(st.announce.checksum_algo)
        cur = 0  # bytes of this bucket hashed so far
        for e in info.tensors:
            if e.offset > cur:
                bnp[cur : e.offset] = 0
                h.update(bnp[cur : e.offset])
                cur = e.offset
            t = tensors[e.name].detach()
            if e.src_dtype:  # cast for the workers (on the GPU for CUDA tensors)
                t = t.to(dtype_from_name(e.dtype))
            if t.device.type == "cpu" and t.is_contiguous():
                src = _flat_bytes(t).numpy()
                off = e.offset
                for a in range(0, e.nbytes, PACK_BLOCK):
                    b = min(a + PACK_BLOCK, e.nbytes)
                    h.update(src[a:b])  # then copied from cache, the destination never read
                    np.copyto(bnp[off + a : off + b], src[a:b])
                    cur = off + b
                    if base + cur - told >= chunk_bytes:
                        told = base + cur
                        with cond:
                            st.packed = told
                        yield
            else:  # device or strided tensors: one copy, then hash the region
                copy_tensor(bucket[e.offset : e.offset + e.nbytes], t)
                for a in range(cur, e.offset + e.nbytes, PACK_BLOCK):
                    h.update(bnp[a : min(a + PACK_BLOCK, e.offset + e.nbytes)])
                cur = e.offset + e.nbytes
        if info.nbytes > cur:
            bnp[cur:] = 0
            h.update(bnp[cur:])
        with cond:
            info.checksum = h.digest()
            told = st.packed = base + info.nbytes
            st.buckets_done = info.index + 1
        yield


def _read(
    st: Staged,
    src: Mapping[str, torch.Tensor],
    chunk_bytes: int,
    cond: threading.Condition,
    held: contextlib.ExitStack,
) -> Generator[None, None, None]:
    """Pack ``st`` from the snapshot ``src``, which ``held`` lets go of at the end; its
    first step only enters the hold, so that ``close()`` lets go of an unpacked one."""
    with held:
        yield
        yield from pack_steps(st, src, chunk_bytes, cond)


class VersionStore:
    """The staged versions (the core's, in the order announced) and the pool of free
    segments (under ``cond``)."""

    def __init__(
        self, core: PublisherCore, cond: threading.Condition, use_shm: bool, keep_versions: int
    ) -> None:
        self.core = core
        self.cond = cond
        self.use_shm = use_shm
        self.keep_versions = keep_versions
        self.closed = False
        self._free: list[_shm.ShmSegment] = []

    @property
    def versions(self) -> dict[int, Staged]:
        return cast("dict[int, Staged]", self.core.versions)  # every one announced is staged

    def acquire(self, version: int, total: int) -> Staged:
        """A buffer for a new version: a free or reusable one that fits, else a new one."""
        with self.cond:
            seg = self._take_free(total)
            for v in self.core.takeable(self._busy) if seg is None else []:
                st = self.versions[v]
                if st.seg is None and st.buf.numel() >= total:
                    buf = st.buf
                    self._retire(st)
                    self.core.count("buffers_reused")
                    return Staged(version, buf, None)
                if st.seg is not None and self.core.readers_done(st):
                    self._retire(st)
                    if (seg := self._take_free(total)) is not None:
                        break
        if seg is not None:
            self.core.count("buffers_reused")
            return Staged(version, seg.tensor[:total], seg)
        if self.use_shm:
            try:
                seg = _shm.ShmSegment.create(total)
            except OSError as exc:
                log.warning(
                    "cannot stage %d bytes in /dev/shm (%s); using private memory", total, exc
                )
        self.core.count("buffers_created")
        buf = seg.tensor if seg is not None else torch.empty(total, dtype=torch.uint8)
        return Staged(version, buf, seg)

    def stage_late(self, st: Staged, ipc: IpcOffering, chunk_bytes: int) -> None:
        """Stage a version published to ``ipc`` workers only, from the slots while they
        hold it."""
        assert st.announce is not None
        with contextlib.ExitStack() as held:
            src = held.enter_context(ipc.snapshot(st.version)) if st.unstaged else None
            if src is None:
                return
            fresh = self.acquire(st.version, st.announce.total_bytes)
            job = _read(st, src, chunk_bytes, self.cond, held.pop_all())
            next(job)
            with self.cond:
                st.stage(fresh, job)
        self.core.count("versions_staged_late")

    def _take_free(self, total: int) -> _shm.ShmSegment | None:
        i = next((i for i, seg in enumerate(self._free) if self.core.fits(total, seg.size)), -1)
        return self._free.pop(i) if i >= 0 else None

    def _busy(self, version: int) -> bool:
        """``version``'s buffer is still packed (a late staging holds the ipc slots until
        it ends) or bytes of it are still queued."""
        st = self.versions[version]
        return st.job is not None or not st.sends_done()

    def _retire(self, st: Staged) -> None:
        """Drop ``st`` and take its buffer: to the pool if no one may read it, else
        unlinked (lock held)."""
        self.core.drop(st.version, time.monotonic())
        reusable = self.core.readers_done(st)
        seg = st.take_segment()
        if seg is None:
            return
        if reusable and not self.closed and len(self._free) < self.keep_versions:
            self._free.append(seg)
            return
        if not reusable:
            self.core.count("segments_abandoned")
        seg.close()

    def close(self, unannounced: Iterable[Staged] = ()) -> None:
        """Free every buffer, ``unannounced`` versions' too (the publisher is closing and
        its serving thread has stopped; lock held). Again later: frees ``unannounced``."""
        self.closed = True
        held = [*self.versions.values(), *unannounced]
        for st in held:
            st.end_job()
        for seg in [st.take_segment() for st in held] + self._free:
            if seg is not None:
                seg.close()
        self.core.close()
        self._free.clear()

    def retire(self) -> None:
        """Free buffers of old versions that no one can still need (lock held)."""
        for v in self.core.takeable(self._busy, self.keep_versions):
            self._retire(self.versions[v])
