"""A version on the trainer side: its layout, its buffer, and the packing into it.

:func:`plan_version` lays a state dict out in buckets, in the dtypes the version travels
in; :class:`Staged` is one version's buffer (a fresh shared-memory segment, or private
memory) with its manifest and bookkeeping; :func:`pack_steps` packs and hashes the
buckets in steps that the publisher's serving thread interleaves with its sends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

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
from transport.weights.core.publisher import VersionLedger
from transport.weights.routes import shm as _shm
from transport.weights.routes.tcp import Sent
from transport.weights.streaming import BLOCK

__all__ = ["BLOCK", "Send", "Staged", "pack_steps", "plan_version"]


def plan_version(
    tensors: Mapping[str, torch.Tensor], wanted: set[str], bucket_bytes: int
) -> list[WeightBucketInfo]:
    """The buckets of a version, in the dtypes it travels in.

    ``wanted`` holds the dtype each live worker asked for in its Hello (``""``: none).
    When every live worker asked for the same floating dtype and it is narrower
    than a tensor's, the tensor is cast here while packing (fewer bytes to move);
    otherwise it travels as it is and each worker casts during its copy.
    """
    cast = parse_dtype(wanted.pop()) if len(wanted) == 1 and "" not in wanted else None
    wire: dict[str, torch.dtype] = {}
    for n, t in tensors.items():
        narrower = cast is not None and cast.itemsize < t.dtype.itemsize
        wire[n] = cast if cast is not None and narrower and t.dtype in FLOAT_DTYPES else t.dtype
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


class Send:
    """One Fetch being answered: where the next chunk starts."""

    __slots__ = ("cancelled", "cursor", "fetch", "ident", "linked", "shm", "wid")

    def __init__(self, ident: bytes, fetch: WeightFetch) -> None:
        self.ident = ident
        self.wid = ident.decode("utf-8", "replace")
        self.fetch = fetch
        self.shm = fetch.shm
        self.cursor = 0
        #: Over TCP, the channel this answer took at its first chunk (the data link or
        #: ZeroMQ frames; ``None`` before): one bucket never comes on both.
        self.linked: bool | None = None
        #: Superseded by a later Fetch of the same bucket from the same worker.
        self.cancelled = False


class Staged:
    """One version's buffer, manifest and bookkeeping."""

    def __init__(self, version: int, buf: torch.Tensor, seg: _shm.ShmSegment | None) -> None:
        self.version = version
        self.buf = buf
        self.seg = seg
        self._view: np.ndarray[Any, Any] | None = None
        self._view_of: torch.Tensor | None = None
        self.announce: WeightAnnounce | None = None
        #: Who must answer this version and who may still read its buffer (the core's).
        self.ledger = VersionLedger(version)
        #: Sends that may still read the buffer: ZeroMQ trackers, data-link chunks.
        self.trackers: list[zmq.MessageTracker | Sent] = []
        #: Bytes of the buffer packed so far (buckets are packed in order).
        self.packed = 0
        #: Buckets packed completely, their checksum known.
        self.buckets_done = 0
        #: Fetches being answered, chunk by chunk as packing progresses.
        self.active: list[Send] = []
        #: The packing still to do (run by the serving thread), and its failure.
        self.job: Iterator[None] | None = None
        #: Published to ``ipc`` workers only: no buffer yet (staged on first need).
        self.unstaged = False
        #: Being packed into the ipc slots (which become its snapshot once done).
        self.ipc_packing = False
        self.error: BaseException | None = None

    def view(self) -> np.ndarray[Any, Any]:
        """The buffer as a numpy array (cheaper to slice per chunk sent than a tensor)."""
        if self._view is None or self._view_of is not self.buf:
            self._view, self._view_of = self.buf.numpy(), self.buf
        return self._view

    @property
    def capacity(self) -> int:
        return int(self.buf.numel())

    def sends_done(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return not self.trackers

    def take_segment(self) -> _shm.ShmSegment | None:
        """Detach the buffer from this version (which can no longer be served)."""
        seg, self.seg = self.seg, None
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._view = self._view_of = None
        return seg


def pack_steps(
    st: Staged,
    plan: list[WeightBucketInfo],
    tensors: Mapping[str, torch.Tensor],
    *,
    checksum_algo: str,
    chunk_bytes: int,
    cond: threading.Condition,
) -> Iterator[None]:
    """Pack and hash bucket after bucket, block by block (each block of a tensor is
    hashed, then copied while still in cache), yielding to the serving loop after every
    ``chunk_bytes`` of progress.

    The loop works on numpy views made once per tensor: slicing a torch tensor costs a
    few microseconds, which over the thousands of blocks of a GiB added tens of ms.
    """
    block = BLOCK
    told = 0
    for info in plan:
        base = info.shm_offset
        bucket = st.buf[base : base + info.nbytes]
        bnp = bucket.numpy()
        h = Hasher(checksum_algo)
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
                for a in range(0, e.nbytes, block):
                    b = min(a + block, e.nbytes)
                    # Hash the source block, then copy it from cache: the destination
                    # is only written (with non-temporal stores where glibc's
                    # threshold allows), never read back.
                    h.update(src[a:b])
                    np.copyto(bnp[off + a : off + b], src[a:b])
                    cur = off + b
                    if base + cur - told >= chunk_bytes:
                        told = base + cur
                        with cond:
                            st.packed = told
                        yield
            else:  # device or strided tensors: one copy, then hash the region
                copy_tensor(bucket[e.offset : e.offset + e.nbytes], t)
                for a in range(cur, e.offset + e.nbytes, block):
                    h.update(bnp[a : min(a + block, e.offset + e.nbytes)])
                cur = e.offset + e.nbytes
        if info.nbytes > cur:
            bnp[cur:] = 0
            h.update(bnp[cur:])
        with cond:
            info.checksum = h.digest()
            told = st.packed = base + info.nbytes
            st.buckets_done = info.index + 1
        yield
