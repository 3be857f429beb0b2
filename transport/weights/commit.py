"""Committing one verified version on the worker side: into the weights, then the Ack.

:class:`VersionCommit` is the part of :class:`transport.weights.WeightSubscriber` that
takes the buckets :class:`~transport.weights.fetching.VersionFetch` verified, enters
the subscriber's ``lock`` (a lock that refuses fails the version and keeps the
weights), copies them into the parameters in place, runs the ``loader``, switches the
version and acknowledges it; or reports a failed version (:meth:`VersionCommit._fail`),
saying when ``atomic=False`` left the weights mixed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from fastio.weight_msgs import WeightAck
from transport import metrics
from transport.weights.bucket import state_digest
from transport.weights.fetching import InFlight, VersionFetch
from transport.weights.results import UpdateStats

__all__ = ["VersionCommit"]

log = logging.getLogger("transport.weights.subscriber")


class VersionCommit(VersionFetch):
    """The committing half of :class:`transport.weights.WeightSubscriber`."""

    # Set by WeightSubscriber.__init__ (see its parameters).
    worker_id: str
    on_applied: Any
    report_digest: bool
    last_stats: UpdateStats
    last_error: str
    _digest: int | None

    def _keepalive(self) -> None:
        raise NotImplementedError

    @property
    def reported_version(self) -> int:
        """The version this worker reports in Hellos and Acks: the last complete one,
        or ``-1`` while the weights are mixed (they hold no complete version)."""
        return self.core.reported_version

    def _commit(self, up: InFlight, parts: list[tuple[Any, list[torch.Tensor]]]) -> None:
        ann, stats, t0 = up.ann, up.stats, up.t0
        if not up.locked:  # streaming mode holds it since the version's first write
            try:
                self.lock.__enter__()
            except Exception as exc:  # e.g. the worker could not stop generating in time
                self._fail(ann.version, f"not applied, the weights were not free: {exc}")
                return
            up.locked = True
        try:  # the lock's body (not a `with`: a lock that refuses fails the version)
            try:
                for b, chunks in parts:
                    up.wrote = True
                    ta = time.monotonic()
                    self._applier.apply(b, chunks, up.binding.dests)
                    dt = time.monotonic() - ta
                    stats.apply_s += dt
                    stats.buckets[b.index]["apply_s"] = dt
                    self._keepalive()
                self._applier.finish()
            except Exception as exc:
                # A copy failed half-way (device error, out of memory): the weights are
                # now mixed, and say so until a later version completes.
                self.core.consistent = False
                self._fail(ann.version, f"applying failed, weights are mixed: {exc!r}")
                return
            if self.loader is not None:
                ta = time.monotonic()
                try:
                    self.loader(up.binding.named_tensors(parts))
                except Exception as exc:
                    self.core.consistent = False
                    self._count("loader_failures")
                    self._fail(
                        ann.version,
                        f"the loader raised {exc!r}; the engine's weights may be mixed",
                    )
                    return
                stats.apply_s += time.monotonic() - ta
            # Still under the lock and before the Ack: once the trainer hears "applied",
            # the engine already stamps the new version on what it generates.
            self._now_at(ann.version)
        finally:
            # A failure above marked the weights mixed first: the lock sees it (the
            # fabric's keeps the worker paused until a later version completes).
            self._unhold(up)
        parts.clear()  # drop the frames now, not at the next update
        stats.total_s = time.monotonic() - t0
        self.last_stats = stats
        for phase, secs in (
            ("receive", stats.fetch_s),
            ("verify", stats.verify_s),
            ("apply", stats.apply_s),
            ("total", stats.total_s),
        ):
            metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase=phase).observe(secs)
        metrics.SUBSCRIBER_BYTES.labels(path=stats.via).inc(sum(b.nbytes for b in ann.buckets))
        self.last_error = ""
        self._count("versions_applied")
        if self.report_digest:
            self._digest = state_digest(self.targets)
        self._send(
            WeightAck(
                self.worker_id,
                ann.version,
                True,
                ann.version,
                "",
                self._digest,
                stats.via,
                stats.flat(),
                os.getpid(),
                self._start_time,
            )
        )

    def _fail(self, version: int, error: str, transport: str = "tcp") -> None:
        up = self._update
        if up is not None and up.ann.version == version:
            self._update = None
            if up.wrote:
                self.core.wrote()
            # Left after the state is known: a lock may keep refusing to serve while
            # the weights are mixed.
            self._unhold(up)
        mixed_before = "weights are mixed" in error
        error = self.core.failed(error, wrote=False)
        if not self.core.consistent and not mixed_before and self.report_digest:
            self._digest = state_digest(self.targets)
        self.last_error = error
        metrics.SUBSCRIBER_FAILURES.inc()
        log.warning(
            "weight version %d not applied (%s); reporting version %d",
            version,
            error,
            self.reported_version,
        )
        self._send(
            WeightAck(
                self.worker_id,
                version,
                False,
                self.reported_version,
                error,
                self._digest,
                transport,
                {},
                os.getpid(),
                self._start_time,
            )
        )

    def _abandon(self, why: str) -> None:
        up = self._update
        if up is not None:
            self._fail(up.ann.version, why)
