"""Verify-and-copy in one pass (``atomic=False``): each block of a bucket hashed, then
copied into the live parameters while in cache (:class:`BucketStream`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.bucket import Hasher, _flat_bytes, _targets_of, dtype_name

__all__ = ["BLOCK", "BucketStream"]

#: Hash-then-copy granularity (fits the L2 cache), for packing, streaming and the link.
BLOCK = 256 << 10


class BucketStream:
    """One bucket's bytes, fed in order: hashed and copied into the plain (CPU,
    contiguous, wire dtype) tensors of ``targets``; ``rest``: the others, applied from
    the complete bucket (:meth:`rest_info`); ``size``: bytes fed so far."""

    __slots__ = ("_k", "_spans", "hasher", "info", "rest", "size")

    def __init__(
        self,
        info: WeightBucketInfo,
        targets: Mapping[str, torch.Tensor],
        dests: Mapping[str, Sequence[str]] | None,
        algo: str,
    ) -> None:
        self.info = info
        self.hasher = Hasher(algo)
        self.size = 0
        self._k = 0
        # (first byte, end, destination arrays) per plain tensor, in bucket order.
        self._spans: list[tuple[int, int, list[np.ndarray[Any, Any]]]] = []
        self.rest: list[WeightTensor] = []
        for e in sorted(info.tensors, key=lambda t: t.offset):
            outs: list[np.ndarray[Any, Any]] = []
            other = False
            for dst in _targets_of(e, targets, dests):
                plain = dst.device.type == "cpu" and dst.is_contiguous()
                if plain and dtype_name(dst.dtype) == e.dtype:
                    outs.append(_flat_bytes(dst).numpy())
                else:
                    other = True
            if outs:
                self._spans.append((e.offset, e.offset + e.nbytes, outs))
            if other:
                self.rest.append(e)

    def rest_info(self) -> WeightBucketInfo:
        """The bucket restricted to :attr:`rest` (for ``BucketApplier.apply``)."""
        return msgspec.structs.replace(self.info, tensors=self.rest)

    def feed(self, data: np.ndarray[Any, Any]) -> None:
        """The next bytes of the bucket (1-D uint8): hashed, then copied, per block."""
        n = data.size
        for a in range(0, n, BLOCK):
            blk = data[a : a + BLOCK]
            self.hasher.update(blk)
            self._copy(self.size + a, blk)
        self.size += n

    def take(
        self, n: int, fill: Callable[[np.ndarray[Any, Any]], None], scratch: np.ndarray[Any, Any]
    ) -> None:
        """The next ``n`` bytes, which ``fill`` writes into the array it is given: a plain
        tensor's bytes, else ``scratch`` (:data:`BLOCK` bytes) then :meth:`feed`."""
        end = self.size + n
        spans = self._spans
        while self.size < end:
            off = self.size
            k = self._k
            while k < len(spans) and spans[k][1] <= off:
                k += 1
            self._k = k
            lo, hi, outs = spans[k] if k < len(spans) else (end, end, [])
            if lo <= off and len(outs) == 1:
                m = min(BLOCK, end - off, hi - off)
                dst = outs[0][off - lo : off - lo + m]
                fill(dst)
                self.hasher.update(dst)
                self.size += m
            else:
                m = min(BLOCK, end - off, (hi if lo <= off else lo) - off)
                blk = scratch[:m]
                fill(blk)
                self.feed(blk)

    def _copy(self, off: int, blk: np.ndarray[Any, Any]) -> None:
        spans = self._spans
        end = off + blk.size
        k = self._k
        while k < len(spans):
            lo, hi, outs = spans[k]
            if lo >= end:
                break
            a, b = max(lo, off), min(hi, end)
            if a < b:
                src = blk[a - off : b - off]
                for d in outs:
                    np.copyto(d[a - lo : b - lo], src)
            if hi > end:
                break
            k += 1
        self._k = k
