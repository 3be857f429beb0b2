"""Warnings that hostile or broken peers cannot turn into a log flood."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """The first warning of each kind in full; later ones counted, and a summary line
    at most once per ``interval`` seconds while they keep coming."""

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
