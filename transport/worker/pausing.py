"""The pause gate of a worker: handler slots, pause and resume (on the engine's loop)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from transport.errors import ResumeRefused
from transport.worker.counters import Shard

__all__ = ["PauseGate", "ResumeRefused"]


class PauseGate:
    """At most ``max_running`` handlers run at once, none starts while paused; pauses
    are counted in ``counts``. The socket thread only reads :attr:`paused` and
    :attr:`running`."""

    def __init__(self, max_running: int, counts: Shard) -> None:
        self.max_running = max_running
        self.paused = False
        #: Handlers running now.
        self.running = 0
        #: Calls of :meth:`pause`: an in-process pauser sees whether another followed.
        self.pause_requests = 0
        self.on_pause: list[Callable[[], Any]] = []
        self.on_resume: list[Callable[[], Any]] = []
        #: Whether the engine froze its running generations in place when paused (they
        #: go on after the resume, as vLLM's ``pause?mode=keep``): a pause then
        #: completes without waiting for them to return.
        self.keeps_in_place: Callable[[], bool] = lambda: False
        self._counts = counts
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        # pause() calls waiting for no handler to run (no Event set by every request).
        self._idle: list[asyncio.Future[None]] = []

    def try_enter(self) -> bool:
        """Take a slot if one is free and the worker is not paused."""
        if self.paused or self.running >= self.max_running:
            return False
        self.running += 1
        return True

    async def enter(self) -> None:
        """Take a slot once one is free and the worker is not paused."""
        while self.paused or self.running >= self.max_running:  # woken: look again
            gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(gate)
            await gate
        self.running += 1

    def leave(self) -> None:
        """Free a slot."""
        self.running -= 1
        if self.running == 0 and self._idle:
            waiters, self._idle = self._idle, []
            for idle in waiters:
                if not idle.done():
                    idle.set_result(None)
        if self._waiting:
            self._wake(1)

    def _wake(self, n: int) -> None:
        waiting = self._waiting
        while n > 0 and waiting:
            fut = waiting.popleft()
            if not fut.done():  # not a request cancelled while it waited
                fut.set_result(None)
                n -= 1

    async def pause(self, timeout: float = 30.0) -> bool:
        """Stop generation: new requests wait, running ones are interrupted (or frozen,
        see :attr:`keeps_in_place`). Returns True once no handler runs (or all are
        frozen), False if some still run after ``timeout`` s."""
        self.pause_requests += 1
        if not self.paused:
            self._counts.counts["pauses"] += 1
            self.paused = True
            for cb in self.on_pause:
                await _maybe_await(cb())
        if self.running == 0 or self.keeps_in_place():
            return True
        idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(idle)
        try:
            await asyncio.wait_for(idle, timeout)
        except TimeoutError:
            return self.running == 0
        return True

    async def resume(self) -> None:
        """Let generation continue (waiting requests start). :class:`ResumeRefused`
        (from an ``on_resume`` callback) when the worker must stay paused."""
        if self.paused:
            for cb in self.on_resume:
                await _maybe_await(cb())
            self.paused = False
            self._wake(len(self._waiting))


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        await x
