"""What a worker tells about its weights (:class:`Reporter`): version switches, the
digest, the last stats, and the ``WeightAck``s of every route."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from fastio.weight_msgs import WeightAck
from transport import metrics
from transport.weights.binding import state_digest
from transport.weights.core.process import process_start_time
from transport.weights.core.subscriber import SubscriberCore
from transport.weights.results import UpdateStats

__all__ = ["Reporter"]

log = logging.getLogger("transport.weights.subscriber")


@dataclass(eq=False)
class Reporter:
    """Version switches and Acks of one worker; ``send`` sends to the publisher."""

    core: SubscriberCore
    worker_id: str
    targets: Mapping[str, torch.Tensor]
    send: Callable[[Any], None]
    _: KW_ONLY
    report_digest: bool
    on_applied: Callable[[int], None] | None
    cond: threading.Condition = field(default_factory=threading.Condition, init=False)
    digest: int | None = field(default=None, init=False)
    last_error: str = field(default="", init=False)  # of the last failed version
    last_stats: UpdateStats = field(default_factory=UpdateStats, init=False)  # the last applied
    pid: int = field(default_factory=os.getpid, init=False)

    def __post_init__(self) -> None:
        self.digest = state_digest(self.targets) if self.report_digest else None
        self.start_time = process_start_time(self.pid) or 0

    def mixing(self) -> None:
        """A version's first write: no complete version (nor digest) until it ends."""
        self.core.mark_mixed()
        self.digest = None

    def now_at(self, version: int) -> None:
        """The weights are all of ``version``: wake waiters, then ``on_applied``."""
        with self.cond:
            self.core.applied(version)
            self.cond.notify_all()
        if self.on_applied is not None:
            self.on_applied(version)

    def applied(self, stats: UpdateStats, nbytes: int | None = None) -> None:
        """Report ``stats.version`` applied (after :meth:`now_at`)."""
        self.last_stats = stats
        self.last_error = ""
        self.core.count("versions_applied")
        metrics.SUBSCRIBER_BYTES.labels(path=stats.via).inc(
            stats.bytes if nbytes is None else nbytes
        )
        if self.report_digest:
            self.digest = state_digest(self.targets)
        v, ipc = stats.version, stats.via == "ipc"
        self.send(
            WeightAck(
                self.worker_id, v, True, v, "", self.digest, stats.via, stats.flat(),
                0 if ipc else self.pid, 0 if ipc else self.start_time,
            )
        )  # fmt: skip

    def failed(self, version: int, error: str, route: str) -> None:
        """Report ``version`` failed."""
        reported = self.core.failed(error)
        if reported != error and self.report_digest:  # the weights were left mixed
            self.digest = state_digest(self.targets)
        self.last_error = reported
        metrics.SUBSCRIBER_FAILURES.inc()
        log.warning(
            "weight version %d not applied (%s); reporting version %d",
            version, reported, self.core.reported_version,
        )  # fmt: skip
        self.send(
            WeightAck(
                self.worker_id, version, False, self.core.reported_version, reported,
                self.digest, route, {}, self.pid, self.start_time,
            )
        )  # fmt: skip
