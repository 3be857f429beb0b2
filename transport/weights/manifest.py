"""Checks and digests of a version against a model's tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from fastio.weight_msgs import WeightBucketInfo
from transport.weights.bucket import DEFAULT_CHECKSUM, Hasher, _flat_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["check_manifest", "state_digest"]


def check_manifest(
    buckets: Sequence[WeightBucketInfo], targets: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Check an update against the worker's tensors before touching any;
    :class:`~transport.weights.errors.WeightMismatchError` names every problem."""
    from transport.weights.binding import Binding  # imports torch: on first use

    Binding(buckets, targets, strict=strict)


def state_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> int:
    """A checksum of the tensors' bytes in ``names`` order (default: sorted names), for
    trainer and workers to compare; CUDA tensors are copied to the host for it."""
    h = Hasher(DEFAULT_CHECKSUM)
    for n in sorted(tensors) if names is None else names:
        h.update(n.encode())
        h.update(_flat_bytes(tensors[n].detach().cpu().contiguous()).numpy())
    return h.digest()
