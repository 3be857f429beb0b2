"""Checks and digests of a version against a model's tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from fastio._optional import lazy
from fastio.weight_msgs import WeightBucketInfo
from transport.weights.bucket import (
    DEFAULT_CHECKSUM,
    Hasher,
    _flat_bytes,
    dtype_from_name,
    dtype_name,
)
from transport.weights.errors import WeightMismatchError
from transport.weights.layout import _numel

if TYPE_CHECKING:
    import torch
else:  # torch is imported by the first function that needs it
    torch = lazy("torch", "weights", "weight checks", globals())

__all__ = ["check_manifest", "state_digest"]


def check_manifest(
    buckets: Sequence[WeightBucketInfo], targets: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Check an update against the worker's tensors before touching any of them.

    Raises
    ------
    WeightMismatchError
        Naming the first problems found: unknown names, shape or dtype mismatches,
        bad offsets, and (``strict``) parameters the update leaves out.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for b in buckets:
        end = 0
        for e in b.tensors:
            if e.name in seen:
                problems.append(f"{e.name!r} appears twice in the update")
            seen.add(e.name)
            t = targets.get(e.name)
            if t is None:
                problems.append(f"{e.name!r} is not a parameter of this worker's model")
                continue
            if tuple(t.shape) != tuple(e.shape):
                problems.append(
                    f"shape mismatch for {e.name!r}: model has {list(t.shape)}, "
                    f"update has {list(e.shape)}"
                )
            try:
                dt = dtype_from_name(e.dtype)
            except WeightMismatchError as exc:
                problems.append(str(exc))
                continue
            if dt != t.dtype:
                problems.append(
                    f"dtype mismatch for {e.name!r}: model has {dtype_name(t.dtype)}, "
                    f"update has {e.dtype}"
                )
            want = _numel(e.shape) * torch.empty((), dtype=dt).element_size()
            if e.nbytes != want or e.offset < end or e.offset + e.nbytes > b.nbytes:
                problems.append(f"bad layout for {e.name!r} in bucket {b.index}")
            end = e.offset + e.nbytes
    if strict:
        missing = [n for n in targets if n not in seen]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(f"parameters missing from the update: {missing[:5]}{more}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightMismatchError("; ".join(problems[:8]) + more)


def state_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> int:
    """A checksum of the tensors' bytes in ``names`` order (default: sorted names).

    Trainer and workers compare it to check that they hold the same weights. CUDA
    tensors are copied to the host for it.
    """
    h = Hasher(DEFAULT_CHECKSUM)
    for n in sorted(tensors) if names is None else names:
        t = tensors[n].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(n.encode())
        h.update(_flat_bytes(t.contiguous()).numpy())
    return h.digest()
