"""The client's one set of counts: read as ``FabricClient.stats``, fed to Prometheus."""

from __future__ import annotations

from typing import Any

from transport import metrics

__all__ = ["Counters"]

_NAMES = (
    "submitted", "completed", "failed", "resent", "interrupted", "timeouts", "cancelled",
    "stale", "bad_messages", "overloaded", "workers_died", "workers_joined", "no_worker",
)  # fmt: skip
# Counts that are also Prometheus counters.
_EXPORTED: dict[str, Any] = {
    "resent": metrics.CLIENT_RESENDS,
    "workers_died": metrics.CLIENT_WORKER_DEATHS,
}


class Counters:
    """Event counts of one client (``stats``) and the metrics they feed; the latency
    histogram only with ``observe_latency`` (an observation costs about as much as the
    rest of a call)."""

    __slots__ = ("observe_latency", "stats")

    def __init__(self, observe_latency: bool = False) -> None:
        self.observe_latency = observe_latency
        self.stats: dict[str, int] = dict.fromkeys(_NAMES, 0)

    def add(self, name: str, n: int = 1) -> int:
        """Count ``n`` more ``name`` events; returns the new total."""
        total = self.stats[name] = self.stats[name] + n
        if name in _EXPORTED:
            _EXPORTED[name].inc(n)
        return total

    def latency(self, seconds: float) -> None:
        """A call took ``seconds`` from ``agenerate`` to its response."""
        if self.observe_latency:
            metrics.CLIENT_LATENCY.observe(seconds)
