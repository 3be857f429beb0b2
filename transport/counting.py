"""The event counts every part of fastio keeps, read by ``status()``, health replies and
``stats``, and exported to Prometheus (``docs/metrics.md``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Counts"]


class Counts(dict[str, int]):
    """Named event counts written by one thread (a dict; a name not counted yet reads 0).
    ``exported`` maps names to Prometheus counters: :meth:`add` increments them at once; a
    part counting on a hot path with ``c[name] += 1`` calls :meth:`export` instead.

    >>> c = Counts(["sent"])
    >>> c.add("sent"), c["lost"], c.snapshot()
    (1, 0, {'sent': 1})
    """

    __slots__ = ("_lock", "_sent", "exported")

    def __init__(self, names: Iterable[str] = (), exported: Mapping[str, Any] | None = None):
        super().__init__(dict.fromkeys(names, 0))
        self.exported = dict(exported or {})
        self._sent: dict[str, int] = {}
        self._lock = threading.Lock()

    def __missing__(self, name: str) -> int:
        return 0

    def add(self, name: str, n: int = 1) -> int:
        """Count ``n`` more ``name`` events; returns the total."""
        total = self[name] = self[name] + n
        metric = self.exported.get(name)
        if metric is not None:
            metric.inc(n)
            self._sent[name] = self._sent.get(name, 0) + n
        return total

    def snapshot(self) -> dict[str, int]:
        """The counts now, as a plain dict."""
        return dict(self)

    def export(self) -> None:
        """Add to each exported counter what was counted since the last export (any thread)."""
        with self._lock:
            for name, metric in self.exported.items():
                delta = self[name] - self._sent.get(name, 0)
                if delta > 0:
                    metric.inc(delta)
                    self._sent[name] = self._sent.get(name, 0) + delta
