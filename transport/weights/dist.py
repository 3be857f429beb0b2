"""Process-group path: weights broadcast in a torch.distributed group, bucket by bucket.

Driven by :class:`fastio.WeightUpdateMeta` with ``type="nccl"``, as in the original
system: the trainer is rank 0 of a group of world size ``gen_world_size + 1`` rendezvoused
at ``nccl_master_address:nccl_master_port`` under ``nccl_group_name``; the worker of
generation server ``i`` with tensor-parallel rank ``r`` is rank
``1 + i * gen_tp_size + r``. NCCL on GPUs, gloo on CPU (so it is tested here).

Unlike the original (one broadcast per parameter) both sides lay the parameters listed
in ``nccl_param_specs`` out in the same flat buckets (:func:`plan_buckets` depends only
on names, shapes and dtypes) and broadcast one bucket at a time, two in flight: the
next bucket is on the wire while the worker copies the previous one into its weights.

The group is a standalone process group (its own ``TCPStore`` and ``PrefixStore``), not
the default one, so it coexists with the trainer's own ``init_process_group``.

On a worker, ``atomic=True`` (default) receives every bucket into one staging buffer
(allocated once, reused by later versions) before copying anything into the weights, so
a broadcast that fails half-way (the trainer died: the collective times out) leaves the
previous weights untouched; ``atomic=False`` copies each bucket as it lands (two
bucket-sized buffers only) and a failure leaves the weights mixed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as _tdist

from fastio.io_struct import ParamSpec, WeightUpdateMeta
from fastio.weight_msgs import WeightBucketInfo
from transport.weights.bucket import (
    DEFAULT_BUCKET_BYTES,
    BucketApplier,
    check_manifest,
    dtype_name,
    named_tensors,
    pack_bucket,
    plan_buckets,
)
from transport.weights.errors import WeightUpdateError

# Typed loosely: the c10d classes are not re-exported in torch's stubs.
tdist: Any = _tdist

__all__ = ["WeightGroup", "param_specs", "trainer_rank", "worker_rank", "world_size"]


def world_size(meta: WeightUpdateMeta) -> int:
    """``gen_world_size + 1`` (the trainer is one extra rank)."""
    if meta.alloc_mode is None:
        raise ValueError("WeightUpdateMeta.alloc_mode is needed for the process-group path")
    return meta.alloc_mode.gen_world_size + 1


def trainer_rank() -> int:
    """The trainer's rank: 0, the broadcast source."""
    return 0


def worker_rank(meta: WeightUpdateMeta, server_index: int, tp_rank: int = 0) -> int:
    """Rank of tensor-parallel rank ``tp_rank`` of generation server ``server_index``:
    ``1 + server_index * gen_tp_size + tp_rank``."""
    if meta.alloc_mode is None:
        raise ValueError("WeightUpdateMeta.alloc_mode is needed for the process-group path")
    tp = meta.alloc_mode.gen_tp_size
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp})")
    return 1 + server_index * tp + tp_rank


def param_specs(state: Any) -> list[ParamSpec]:
    """The :class:`ParamSpec` list of a module or state dict (for ``nccl_param_specs``)."""
    return [
        ParamSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in named_tensors(state).items()
    ]


class WeightGroup:
    """One member of the weight-update process group.

    Parameters
    ----------
    meta:
        ``type="nccl"`` metadata: address, port, group name, allocation mode and the
        parameter specs to broadcast.
    rank:
        :func:`trainer_rank` or a :func:`worker_rank`.
    backend:
        ``"gloo"`` or ``"nccl"``; default NCCL where CUDA is available, else gloo.
    bucket_bytes:
        Bucket size; must be the same on every rank (it shapes the plan).
    timeout:
        Seconds a collective may wait for the others before failing.

    Examples
    --------
    >>> meta = WeightUpdateMeta.from_param_specs(alloc, param_specs(model))  # doctest: +SKIP
    >>> WeightGroup(meta, trainer_rank()).send(model)  # trainer   # doctest: +SKIP
    >>> WeightGroup(meta, worker_rank(meta, 0)).recv(model)  # worker  # doctest: +SKIP
    """

    def __init__(
        self,
        meta: WeightUpdateMeta,
        rank: int,
        *,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 300.0,
    ) -> None:
        if meta.type != "nccl":
            raise ValueError(f"WeightGroup needs a type='nccl' WeightUpdateMeta, got {meta.type!r}")
        self.meta = meta
        self.rank = rank
        self.world_size = world_size(meta)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the group of {self.world_size}")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if (self.backend == "nccl")
            else torch.device("cpu")
        )
        self.plan: list[WeightBucketInfo] = plan_buckets(
            ((p.name, p.dtype, p.shape) for p in meta.nccl_param_specs), bucket_bytes
        )
        td = datetime.timedelta(seconds=timeout)
        store = tdist.TCPStore(
            meta.nccl_master_address,
            meta.nccl_master_port,
            self.world_size,
            is_master=rank == 0,
            timeout=td,
            wait_for_workers=False,
        )
        self._store = tdist.PrefixStore(meta.nccl_group_name, store)
        self.pg: Any
        if self.backend == "gloo":
            self.pg = tdist.ProcessGroupGloo(self._store, rank, self.world_size, td)
        else:  # pragma: no cover - needs GPUs
            opts = tdist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.pg = tdist.ProcessGroupNCCL(self._store, rank, self.world_size, opts)
        self._bufs: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None
        #: Per-bucket timings of the last send/recv (seconds).
        self.last_timings: list[dict[str, float]] = []

    def _buffer(self, i: int, nbytes: int) -> torch.Tensor:
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[i][:nbytes]

    def _bcast(self, t: torch.Tensor) -> Any:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([t], opts)

    def send(self, state: Any) -> None:
        """Rank 0: broadcast ``state`` (module or state dict) bucket by bucket.

        Packing bucket k+1 overlaps the broadcast of bucket k (two buffers in turn).
        """
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends")
        tensors = named_tensors(state)
        self.last_timings = []
        works: list[Any] = [None, None]
        t0 = time.monotonic()
        for k, info in enumerate(self.plan):
            if works[k % 2] is not None:
                works[k % 2].wait()
            buf = self._buffer(k % 2, info.nbytes)
            ta = time.monotonic()
            if self.device.type == "cpu":
                pack_bucket(info, tensors, buf)
            else:  # pragma: no cover - needs GPUs
                _pack_device(info, tensors, buf)
            works[k % 2] = self._bcast(buf)
            self.last_timings.append({"pack_s": time.monotonic() - ta, "start_s": ta - t0})
        for w in works:
            if w is not None:
                w.wait()

    def recv(self, target: Any, *, atomic: bool = True, strict: bool = True) -> None:
        """Workers: receive a version into ``target`` (module or name -> tensor).

        Raises
        ------
        WeightMismatchError
            Before any collective, when the specs do not match ``target`` (the trainer
            then times out in its broadcast: a mismatch is a deployment error).
        WeightUpdateError
            When a broadcast fails; with ``atomic=True`` the weights are untouched.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 sends")
        targets = named_tensors(target)
        check_manifest(self.plan, targets, strict=strict)
        applier = BucketApplier(targets)
        self.last_timings = []
        t0 = time.monotonic()
        try:
            if atomic:
                self._recv_atomic(targets, applier, t0)
            else:
                self._recv_streaming(applier, t0)
        except RuntimeError as exc:
            raise WeightUpdateError(f"process-group weight broadcast failed: {exc}") from exc

    def _recv_atomic(
        self, targets: Mapping[str, torch.Tensor], applier: BucketApplier, t0: float
    ) -> None:
        total = self.plan[-1].shm_offset + self.plan[-1].nbytes if self.plan else 0
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        works = []
        for info in self.plan:
            view = self._staging[info.shm_offset : info.shm_offset + info.nbytes]
            works.append(self._bcast(view))
        views = []
        for info, w in zip(self.plan, works, strict=True):
            w.wait()
            self.last_timings.append({"recv_s": time.monotonic() - t0})
            views.append(self._staging[info.shm_offset : info.shm_offset + info.nbytes])
        for info, view in zip(self.plan, views, strict=True):
            ta = time.monotonic()
            _apply(applier, info, view, targets)
            self.last_timings[info.index]["apply_s"] = time.monotonic() - ta
        applier.finish()

    def _recv_streaming(self, applier: BucketApplier, t0: float) -> None:
        pending: list[tuple[WeightBucketInfo, torch.Tensor, Any]] = []
        for k, info in enumerate(self.plan):
            buf = self._buffer(k % 2, info.nbytes)
            pending.append((info, buf, self._bcast(buf)))
            if len(pending) == 2:
                self._land(applier, *pending.pop(0), t0=t0)
        for p in pending:
            self._land(applier, *p, t0=t0)
        applier.finish()

    def _land(
        self,
        applier: BucketApplier,
        info: WeightBucketInfo,
        buf: torch.Tensor,
        work: Any,
        *,
        t0: float,
    ) -> None:
        work.wait()
        ta = time.monotonic()
        _apply(applier, info, buf, applier.targets)
        self.last_timings.append({"recv_s": ta - t0, "apply_s": time.monotonic() - ta})

    def close(self) -> None:
        """Leave the group (drops the process group and the store)."""
        self.pg = None
        self._bufs.clear()
        self._staging = None

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apply(
    applier: BucketApplier,
    info: WeightBucketInfo,
    buf: torch.Tensor,
    targets: Mapping[str, torch.Tensor],
) -> None:
    if buf.device.type == "cpu":
        applier.apply(info, [buf])
        return
    # pragma: no cover - device buffer: device-to-device copies, no host staging
    with torch.no_grad():  # pragma: no cover
        for e in info.tensors:
            dst = targets[e.name]
            src = buf[e.offset : e.offset + e.nbytes].view(dst.dtype).view(dst.shape)
            dst.copy_(src, non_blocking=True)


def _pack_device(
    info: WeightBucketInfo, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor
) -> None:  # pragma: no cover - needs GPUs
    for e in info.tensors:
        t = tensors[e.name].detach()
        buf[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
