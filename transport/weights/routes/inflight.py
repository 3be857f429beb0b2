"""What the worker is fetching: the version in flight (:class:`InFlight`) and its
buckets arriving (:class:`Partial`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fastio.weight_msgs import WeightAnnounce
from transport.weights.binding import Binding
from transport.weights.bucket import Hasher
from transport.weights.core.subscriber import FetchSchedule
from transport.weights.results import UpdateStats
from transport.weights.streaming import BucketStream

__all__ = ["InFlight", "Partial", "Segment"]


class Segment(Protocol):
    """A mapped shared-memory segment (:class:`~.shm.ShmSegment`)."""

    size: int
    tensor: torch.Tensor


@dataclass(eq=False)
class Partial:
    """A bucket whose chunks are arriving: the checksum so far, the frames kept; in
    one-pass mode the stream that hashes and applies them."""

    hasher: Hasher
    stream: BucketStream | None = None
    size: int = 0
    verify_s: float = 0.0
    chunks: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class InFlight:
    """One version being fetched: through shared memory when ``seg`` is set, else TCP."""

    ann: WeightAnnounce
    seg: Segment | None
    binding: Binding
    sched: FetchSchedule
    #: TCP with ``atomic``: per bucket, its region of the staging buffer.
    stage: list[np.ndarray[Any, Any]] | None = None
    t0: float = field(default_factory=time.monotonic)
    #: Per bucket fetched: whether its bytes were asked on the data link.
    linked: dict[int, bool] = field(default_factory=dict)
    #: Per bucket verified and not applied yet: its bytes.
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    partial: dict[int, Partial] = field(default_factory=dict)
    #: Whether the lock is held for this version (one pass: from its first write).
    locked: bool = False
    #: Whether anything of this version was written into the weights.
    wrote: bool = False

    def __post_init__(self) -> None:
        via = "tcp" if self.seg is None else "shm"
        self.stats = UpdateStats(self.ann.version, via, self.ann.total_bytes)
        self.stats.buckets = [{} for _ in self.ann.buckets]
