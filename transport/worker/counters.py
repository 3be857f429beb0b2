"""The counts of one worker (docs/metrics.md): each thread writes its own :class:`Shard`
(plain ints, no lock on the request path); readers sum both."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fastio import fabric_msgs as fm
from transport import metrics
from transport.counting import Counts
from transport.ratelog import RateLimitedLog

__all__ = ["STATUS_KEYS", "Counters", "Shard"]

#: The counts of ``WorkerStatus.counters`` that the worker's threads keep.
STATUS_KEYS = (
    *("received", "completed", "cancelled", "interrupted", "aborted", "errors", "duplicates"),
    *("bad_messages", "overloaded", "undeliverable", "dead_peers", "error_replies_received"),
    *("control", "handshake_failed", "dropped_peers", "incompatible_peers", "pauses"),
)
#: Values of the ``outcome`` label of ``fastio_worker_requests_total``.
OUTCOMES = ("ok", "error", "cancelled", "rejected")


# Hostile input must not flood the log.
_log = RateLimitedLog(logging.getLogger("transport.worker"))


class Shard:
    """What one thread counted (only that thread writes it)."""

    __slots__ = ("counts", "errors", "finished", "generation_tokens", "outcomes", "prompt_tokens")

    def __init__(self) -> None:
        self.counts = Counts(STATUS_KEYS)
        #: Requests by outcome, error replies by ``ErrorCode`` name, finish reasons.
        self.outcomes = Counts(OUTCOMES)
        self.errors = Counts(fm.ErrorCode.__members__)
        self.finished = Counts(metrics.FINISHED_REASONS)
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def result(self, stop_reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A Result left (``stop_reason`` is one of ``FINISHED_REASONS``: checked before)."""
        counts = self.counts
        counts["completed"] += 1
        if stop_reason == "interrupt":
            counts["interrupted"] += 1
        self.outcomes["ok"] += 1
        self.finished[stop_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def note(self, key: str, fmt: str, *args: Any) -> None:
        """Count one ``key`` and log ``fmt % args`` (its first ten and each power of two)."""
        self.counts[key] += 1
        _log.counted(self.counts[key], fmt, *args)

    def bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> fm.Error:
        """The Error reply to a bad message from ``peer``, counted and logged."""
        if code == fm.ErrorCode.BAD_REQUEST:  # a request rejected before it ran
            self.outcomes["rejected"] += 1
        self.note("bad_messages", "bad message from %r: %s", peer, text)
        return self.error(id, code, text)

    def error(self, id: int, code: fm.ErrorCode, text: str) -> fm.Error:
        """An Error reply to send, counted by its code."""
        self.errors[code.name] += 1
        return fm.Error(id=id, code=int(code), message=text)


class Counters(Mapping[str, int]):
    """Every count of one worker, and a read-only mapping of its status counts: the
    shards ``loop`` and ``io``, and ``read``, names of counts other parts keep mapped to
    functions that read them."""

    def __init__(self) -> None:
        self.loop = Shard()
        self.io = Shard()
        self.read: dict[str, Callable[[], int]] = {}
        self._exported: dict[tuple[Any, str], int] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        """The status counts now (from any thread)."""
        a, b = self.loop.counts, self.io.counts
        out = {key: a[key] + b[key] for key in a}
        out.update((key, fn()) for key, fn in self.read.items())
        return out

    def __getitem__(self, key: str) -> int:
        return self.snapshot()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        return len(self.snapshot())

    def export(self) -> None:
        """Add what was counted since the last call to the Prometheus metrics."""
        totals: collections.Counter[tuple[Any, str]] = collections.Counter()
        for shard in (self.loop, self.io):
            for metric, values in (
                (metrics.WORKER_REQUESTS, shard.outcomes),
                (metrics.WORKER_ERRORS, shard.errors),
                (metrics.WORKER_FINISHED, shard.finished),
                (metrics.WORKER_PROMPT_TOKENS, {"": shard.prompt_tokens}),
                (metrics.WORKER_GENERATION_TOKENS, {"": shard.generation_tokens}),
                (metrics.WORKER_PAUSES, {"": shard.counts["pauses"]}),
            ):
                for label, n in list(values.items()):
                    totals[metric, label] += n
        with self._lock:  # two scrapes at once must not add a delta twice
            for (metric, label), n in totals.items():
                delta = n - self._exported.get((metric, label), 0)
                if delta > 0:
                    (metric.labels(label) if label else metric).inc(delta)
                    self._exported[metric, label] = n
