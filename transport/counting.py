"""The event counts every part of fastio keeps, read by ``status()``, health replies and
``stats``, and exported to Prometheus (``docs/metrics.md``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Counts"]


class Counts(dict[str, int]):
    """Named event counts written by one thread (a dict; a name not counted yet reads 0).
    ``exported`` maps names to Prometheus counters, which :meth:`add` increments at once
    (a plain ``c[name] += 1`` counts without exporting).

    >>> c = Counts(["sent"])
    >>> c.add("sent"), c["lost"], c.snapshot()
    (1, 0, {'sent': 1})
    """

    __slots__ = ("exported",)

    def __init__(self, names: Iterable[str] = (), exported: Mapping[str, Any] | None = None):
        super().__init__(dict.fromkeys(names, 0))
        self.exported = dict(exported or {})

    def __missing__(self, name: str) -> int:
        return 0

    def add(self, name: str, n: int = 1) -> int:
        """Count ``n`` more ``name`` events; returns the total."""
        total = self[name] = self[name] + n
        metric = self.exported.get(name)
        if metric is not None:
            metric.inc(n)
        return total

    def snapshot(self) -> dict[str, int]:
        """The counts now, as a plain dict."""
        return dict(self)
