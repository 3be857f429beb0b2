"""Warnings that hostile or broken peers cannot turn into a log flood."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """A logger's warnings, rate-limited: :meth:`warning` logs the first of each kind in
    full, then one summary line per ``interval`` seconds; :meth:`counted` logs the first
    ten occurrences and each power of two."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self.logger = logger
        self.interval = interval
        self._suppressed: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def warning(self, kind: str, fmt: str, *args: Any) -> None:
        """Log ``fmt % args`` if it is the first of ``kind`` (or a summary is due)."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is None:
            self._last[kind] = now
            self.logger.warning(fmt + " (further %ss are counted, not logged)", *args, kind)
            return
        n = self._suppressed.get(kind, 0) + 1
        if now - last >= self.interval:
            self.logger.warning("%d more %ss in the last %.0f s", n, kind, now - last)
            self._last[kind] = now
            n = 0
        self._suppressed[kind] = n

    def counted(self, n: int, fmt: str, *args: Any) -> None:
        """Log ``fmt % args (occurrence n)`` if ``n`` is at most ten or a power of two."""
        if n <= 10 or (n & (n - 1)) == 0:
            self.logger.warning(fmt + " (occurrence %d)", *args, n)
