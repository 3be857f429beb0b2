"""Checks and digests of a version against a model's tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from fastio._optional import lazy
from fastio.weight_msgs import WeightBucketInfo
from transport.weights.bucket import DEFAULT_CHECKSUM, Hasher, _flat_bytes

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
    from transport.weights.binding import Binding  # imports torch: on first use

    Binding(buckets, targets, strict=strict)


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
