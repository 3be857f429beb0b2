"""Pause, resume and abort of a worker, and the controller operations that ask for them.

Pause: new submissions wait; running handlers see ``ctx.interrupted`` become true and
should return their partial output with ``stop_reason="interrupt"`` (the client
re-submits the rest after resume). The pause reply is sent once no handler is running,
so a weight update that starts after it never races a generation step.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from fastio import fabric_msgs as fm
from transport import metrics
from transport.errors import ResumeRefused
from transport.worker.context import RequestContext

__all__ = ["PauseControl", "ResumeRefused"]


class PauseControl:
    """The pause state of a :class:`~transport.WorkerServer` (its base class)."""

    counters: dict[str, int]
    pause_requests: int
    on_pause: list[Callable[[], Any]]
    on_resume: list[Callable[[], Any]]
    _paused: bool
    _running: int
    _resumed: asyncio.Event | None
    _idle_waiters: list[asyncio.Future[None]]
    _gate: collections.deque[asyncio.Future[None]]
    _tasks: dict[tuple[bytes, int], tuple[asyncio.Task[None], RequestContext]]

    def _send(self, peer: bytes, msg: Any) -> None:
        raise NotImplementedError

    def status(self) -> fm.WorkerStatus:
        """A snapshot of the worker's state."""
        raise NotImplementedError

    # -- pause / resume / abort (also callable in-process) ------------------------------
    async def pause(self, timeout: float = 30.0) -> bool:
        """Stop generation: new requests wait, running ones are interrupted. Returns
        True once no handler runs, False if some still run after ``timeout`` s."""
        assert self._resumed is not None
        self.pause_requests += 1
        if not self._paused:
            metrics.WORKER_PAUSES.inc()
            self._paused = True
            self._resumed.clear()
            for cb in self.on_pause:
                await _maybe_await(cb())
        if self._running == 0:
            return True
        idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(idle)
        try:
            await asyncio.wait_for(idle, timeout)
        except TimeoutError:
            return self._running == 0
        return True

    async def resume(self) -> None:
        """Let generation continue (waiting requests start). :class:`ResumeRefused`
        (from an ``on_resume`` callback) when the worker must stay paused."""
        assert self._resumed is not None
        if self._paused:
            for cb in self.on_resume:
                await _maybe_await(cb())
            self._paused = False
            self._resumed.set()
            self._open_gate(len(self._gate))

    def _open_gate(self, n: int) -> None:
        # Wake up to n waiting requests; each re-checks pause and the slot count.
        gate = self._gate
        while n > 0 and gate:
            fut = gate.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def abort_all(self) -> int:
        """Abort every request (each answers ``ABORTED``); returns how many."""
        n = 0
        for task, ctx in list(self._tasks.values()):
            ctx._aborted = True
            task.cancel()
            n += 1
        return n

    async def _on_control(self, peer: bytes, msg: fm.Control) -> None:
        ok, error = True, ""
        if msg.op == "pause":
            ok = await self.pause(msg.timeout)
            if not ok:
                error = f"{self._running} generations still running after {msg.timeout} s"
        elif msg.op == "resume":
            try:
                await self.resume()
            except ResumeRefused as exc:
                ok, error = False, str(exc)
        elif msg.op == "abort":
            self.abort_all()
        elif msg.op == "health":
            pass
        else:
            ok, error = False, f"unknown control op {msg.op!r}"
            self.counters["bad_messages"] += 1
        self._send(peer, fm.ControlReply(seq=msg.seq, ok=ok, error=error, status=self.status()))


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        await x
