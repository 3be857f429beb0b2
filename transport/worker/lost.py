"""What a worker gave up for a client it could not reach, reported when it pings again
(``Error(LOST)``, PROTOCOL.md's "Behaviour of a worker"). Written from two threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind

__all__ = ["LOST_TTL_S", "LostReplies"]

#: Seconds a worker remembers the submissions it gave up for a client that stays away.
LOST_TTL_S = 3600.0


class LostReplies:
    """Per peer: (since when, lost submission ids, undelivered Error replies)."""

    def __init__(self, ttl: float = LOST_TTL_S) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._table: dict[bytes, tuple[float, list[int], list[list[Any]]]] = {}
        #: Ids and replies recorded since the start (the worker's ``lost`` counter).
        self.count = 0

    def __contains__(self, peer: object) -> bool:
        return peer in self._table

    def note(self, peer: bytes, ids: Sequence[int], replies: Sequence[list[Any]] = ()) -> None:
        """Record ``ids`` given up and ``replies`` undelivered for ``peer``."""
        if not ids and not replies:
            return
        with self._lock:
            self.count += len(ids) + len(replies)
            entry = self._table.get(peer)
            if entry is None:
                self._table[peer] = (time.monotonic(), list(ids), list(replies))
            else:
                entry[1].extend(ids)
                entry[2].extend(replies)

    def note_undeliverable(self, frames: list[Any]) -> bytes:
        """Record what an undeliverable ``[peer, *body]`` carried: its Results' ids (to
        be generated again) and copies of its Errors; returns the peer."""
        peer = bytes(frames[0])
        lost, replies = [], []
        for msg in fm.split(frames[1:]):
            _, kind, first = fm.peek(msg)
            if first is None or first < 0:
                continue
            if kind == MsgKind.FABRIC_RESULT:
                lost.append(first)
            elif kind == MsgKind.FABRIC_ERROR:  # a copy: the encoder's buffers are not ours
                replies.append([bytes(f) for f in msg])
        self.note(peer, lost, replies)
        return peer

    def pop(self, peer: bytes) -> tuple[list[int], list[list[Any]]]:
        """Take what was recorded for ``peer`` (to report it)."""
        with self._lock:
            entry = self._table.pop(peer, None)
        if entry is None:
            return [], []
        return entry[1], entry[2]

    def expire(self) -> None:
        """Forget peers recorded more than ``ttl`` seconds ago (not coming back)."""
        now = time.monotonic()
        with self._lock:
            for peer, (since, _, _) in list(self._table.items()):
                if now - since > self.ttl:
                    del self._table[peer]
