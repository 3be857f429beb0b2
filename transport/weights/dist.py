"""Process-group route: weights broadcast bucket by bucket in a torch.distributed group,
NCCL on GPUs (one device per rank), gloo on CPU (``docs/PROTOCOL.md``, "Process-group
path")."""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import time
from collections.abc import Sequence
from typing import Any

try:
    import torch
    import torch.distributed as _tdist
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "transport.weights.dist") from exc

from fastio.io_struct import AllocationMode, ParamSpec, WeightUpdateMeta
from fastio.weight_msgs import WeightBucketInfo
from transport.weights.binding import Binding, DtypeSpec, parse_dtype_spec
from transport.weights.bucket import (
    DEFAULT_BUCKET_BYTES,
    BucketApplier,
    dtype_name,
    named_tensors,
    pack_bucket,
    plan_buckets,
    wire_tensor,
)
from transport.weights.errors import WeightMismatchError, WeightUpdateError

# Typed loosely: the c10d classes are not re-exported in torch's stubs.
tdist: Any = _tdist

__all__ = ["DeviceConflictError", "WeightGroup", "assign_devices", "param_specs", "trainer_rank",
           "worker_rank", "world_size"]  # fmt: skip

_ADVICE = (
    "NCCL needs one device per rank: give each rank its own GPU (WeightGroup(device=...)), "
    "or put workers that share the trainer's GPU on the ipc route"
)


class DeviceConflictError(WeightUpdateError, ValueError):
    """The NCCL group cannot give every rank its own CUDA device (raised on every rank)."""


def _names(ranks: Sequence[int]) -> str:
    *head, last = (str(r) for r in ranks)
    return f"{', '.join(head)} and {last}" if head else last


def assign_devices(
    hosts: Sequence[str], device_counts: Sequence[int], requested: Sequence[int | None]
) -> list[int]:
    """The CUDA device of every rank of an NCCL group: ``requested[r]`` where given, else
    rank ``r``'s local rank among the devices no rank of its host asked for (the same
    answer on every rank); :class:`DeviceConflictError` when two ranks of one host share
    a device or a host lacks the one asked for.

    >>> assign_devices(["a", "a", "b"], [2, 2, 1], [None, None, None])
    [0, 1, 0]
    """
    n = len(hosts)
    if not n == len(device_counts) == len(requested):
        raise ValueError("hosts, device_counts and requested need one entry per rank")
    out: list[int] = []
    for rank, (host, count, req) in enumerate(zip(hosts, device_counts, requested, strict=True)):
        mates = [r for r in range(n) if hosts[r] == host]
        if req is None:
            free = [d for d in range(count) if d not in {requested[r] for r in mates}]
            k = [r for r in mates if requested[r] is None].index(rank)
            if k >= len(free):
                raise DeviceConflictError(
                    f"ranks {_names(mates)} are on host {host!r}, which has "
                    f"{count} CUDA device(s) ({len(free)} not asked for by a rank); {_ADVICE}"
                )
            req = free[k]
        elif not 0 <= req < count:
            raise DeviceConflictError(
                f"rank {rank} asked for cuda:{req}, but host {host!r} has {count} CUDA "
                f"device(s); {_ADVICE}"
            )
        out.append(req)
    for host, dev in zip(hosts, out, strict=True):
        ranks = [r for r in range(n) if (hosts[r], out[r]) == (host, dev)]
        if len(ranks) > 1:
            raise DeviceConflictError(
                f"ranks {_names(ranks)} are all on cuda:{dev} of host {host!r}; {_ADVICE}"
            )
    return out


def _alloc(meta: WeightUpdateMeta) -> AllocationMode:
    if meta.alloc_mode is None:
        raise ValueError("WeightUpdateMeta.alloc_mode is needed for the process-group route")
    return meta.alloc_mode


def world_size(meta: WeightUpdateMeta) -> int:
    """``gen_world_size + 1`` (the trainer is rank 0)."""
    return _alloc(meta).gen_world_size + 1


def trainer_rank() -> int:
    """The trainer's rank: 0, the broadcast source."""
    return 0


def worker_rank(meta: WeightUpdateMeta, server_index: int, tp_rank: int = 0) -> int:
    """Rank of tensor-parallel rank ``tp_rank`` of generation server ``server_index``:
    ``1 + server_index * gen_tp_size + tp_rank``."""
    tp = _alloc(meta).gen_tp_size
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp})")
    return 1 + server_index * tp + tp_rank


def param_specs(state: Any) -> list[ParamSpec]:
    """The :class:`ParamSpec` list of a module or state dict (for ``nccl_param_specs``)."""
    return [
        ParamSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in named_tensors(state).items()
    ]


class WeightGroup:
    """One member of the weight-update process group: ``meta`` (``type="nccl"``), ``rank``
    (:func:`trainer_rank` or a :func:`worker_rank`), ``backend`` (``"gloo"`` or ``"nccl"``,
    default NCCL where CUDA is available), ``bucket_bytes`` (the same on every rank: it
    shapes the plan), ``timeout`` and ``join_timeout`` (seconds a collective, and forming
    the group, default ``min(timeout, 60)``, may take), ``device`` (NCCL only: this rank's
    CUDA device, default :func:`assign_devices`). :attr:`last_timings`: the per-bucket
    timings of the last :meth:`send` or :meth:`recv` (seconds).

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
        join_timeout: float | None = None,
        device: int | None = None,
    ) -> None:
        if meta.type != "nccl":
            raise ValueError(f"WeightGroup needs a type='nccl' WeightUpdateMeta, got {meta.type!r}")
        self.meta = meta
        self.rank = rank
        self.world_size = world_size(meta)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the group of {self.world_size}")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.plan: list[WeightBucketInfo] = plan_buckets(
            ((p.name, p.dtype, p.shape) for p in meta.nccl_param_specs), bucket_bytes
        )
        td = datetime.timedelta(seconds=timeout)
        join = min(timeout, 60.0) if join_timeout is None else join_timeout
        where = f"{meta.nccl_master_address}:{meta.nccl_master_port}"
        try:
            store = tdist.TCPStore(
                meta.nccl_master_address,
                meta.nccl_master_port,
                self.world_size,
                is_master=rank == 0,
                timeout=datetime.timedelta(seconds=join),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:  # DistNetworkError, DistStoreError
            raise WeightUpdateError(
                f"rank {rank}: the weight group's store at {where} was not reachable "
                f"within join_timeout={join} s (trainer dead or not started): {exc}"
            ) from exc
        self._store = tdist.PrefixStore(meta.nccl_group_name, store)
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            self.device = torch.device("cuda", self._exchange_devices(device))
        self.pg: Any
        try:
            if self.backend == "gloo":
                self.pg = tdist.ProcessGroupGloo(self._store, rank, self.world_size, td)
            else:  # pragma: no cover - needs GPUs
                torch.cuda.set_device(self.device)
                opts = tdist.ProcessGroupNCCL.Options()
                opts._timeout = td
                self.pg = tdist.ProcessGroupNCCL(self._store, rank, self.world_size, opts)
        except RuntimeError as exc:
            raise WeightUpdateError(
                f"rank {rank}: the weight group at {where} did not form within {join} s: {exc}"
            ) from exc
        store.set_timeout(td)  # formed: later store operations wait as long as a collective
        self._bufs = [torch.empty(0, dtype=torch.uint8, device=self.device)] * 3  # 2: staging
        self.last_timings: list[dict[str, float]] = []

    def _exchange_devices(self, device: int | None) -> int:
        me = [socket.gethostname(), torch.cuda.device_count(), device]
        self._store.set(f"fastio-device/{self.rank}", json.dumps(me))
        rows = [
            json.loads(bytes(self._store.get(f"fastio-device/{r}"))) for r in range(self.world_size)
        ]
        self._store.set(f"fastio-device-read/{self.rank}", "1")
        if self.rank == 0:
            # The store lives in this process: keep it up until every rank has read the
            # rows, so a refused group fails with the same error everywhere.
            with contextlib.suppress(RuntimeError):
                self._store.wait([f"fastio-device-read/{r}" for r in range(self.world_size)])
        hosts, counts, requested = zip(*rows, strict=True)
        return assign_devices(hosts, counts, requested)[self.rank]

    def _buffer(self, i: int, nbytes: int) -> torch.Tensor:
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[i][:nbytes]

    def _bcast(self, t: torch.Tensor) -> Any:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([t], opts)

    def send(self, state: Any) -> None:
        """Rank 0: broadcast ``state`` (module or state dict) bucket by bucket, packing
        bucket k+1 while bucket k is on the wire."""
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
            pack_bucket(info, tensors, buf)  # on a GPU: NCCL's stream waits for the copies
            works[k % 2] = self._bcast(buf)
            self.last_timings.append({"pack_s": time.monotonic() - ta, "start_s": ta - t0})
        for w in works:
            if w is not None:
                w.wait()

    def recv(
        self, target: Any, *, atomic: bool = True, strict: bool = True, dtype: DtypeSpec = None
    ) -> None:
        """Workers: receive a version into ``target`` (module or name -> tensor); ``atomic``:
        every bucket lands before anything is copied (``False``: each as it lands);
        ``strict``: every target must be in the plan; ``dtype``: as for
        :class:`transport.weights.WeightSubscriber`. :class:`WeightMismatchError` before
        any collective when the specs do not fit, :class:`WeightUpdateError` when a
        broadcast fails."""
        if self.rank == 0:
            raise RuntimeError("rank 0 sends")
        targets = named_tensors(target)
        spec = parse_dtype_spec(dtype)
        try:
            binding = Binding(self.plan, targets, dtype=spec, strict=strict)
        except WeightMismatchError as exc:
            if spec is None and "dtype mismatch" in str(exc):
                raise WeightMismatchError(
                    f"{exc} (recv(..., dtype=...) casts: a dtype, name -> dtype, or 'auto' "
                    "for each parameter's own dtype)"
                ) from None
            raise
        applier = BucketApplier(targets)
        self.last_timings = []

        def land(info: WeightBucketInfo, buf: torch.Tensor, work: Any) -> None:
            work.wait()
            ta = time.monotonic()
            if buf.device.type == "cpu":
                applier.apply(info, [buf], binding.dests)
            else:  # pragma: no cover - needs GPUs: device-to-device copies
                with torch.no_grad():
                    for e in info.tensors:
                        src = wire_tensor(e, [buf])
                        for name in binding.dests.get(e.name, ()) if e.nbytes else ():
                            applier.targets[name].copy_(src, non_blocking=True)
            self.last_timings.append({"recv_s": ta - t0, "apply_s": time.monotonic() - ta})

        if atomic and self.plan:
            staging = self._buffer(2, self.plan[-1].shm_offset + self.plan[-1].nbytes)
        t0 = time.monotonic()
        landing: list[tuple[WeightBucketInfo, torch.Tensor, Any]] = []
        try:
            for k, info in enumerate(self.plan):
                if atomic:
                    buf = staging[info.shm_offset : info.shm_offset + info.nbytes]
                else:
                    buf = self._buffer(k % 2, info.nbytes)
                landing.append((info, buf, self._bcast(buf)))
                if not atomic and k >= 1:  # frees bucket k-1's buffer for bucket k+1
                    land(*landing[k - 1])
            if atomic:  # every bucket is here before the first copy
                for _, _, work in landing:
                    work.wait()
            for item in landing if atomic else landing[-1:]:
                land(*item)
            applier.finish()
        except RuntimeError as exc:
            raise WeightUpdateError(f"process-group weight broadcast failed: {exc}") from exc

    def close(self) -> None:
        """Leave the group."""
        self.pg = None
        self._bufs = [torch.empty(0, dtype=torch.uint8)] * 3

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
