"""The generation worker's server, on the engine's loop (the ROUTER is the socket thread's)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import zmq

from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from transport import metrics
from transport.engines.api import BoundHooks, Engine, engine_hooks
from transport.errors import ResumeRefused
from transport.sockets import WorkerAuthenticator
from transport.worker.config import WorkerConfig, checked_config
from transport.worker.context import InvalidHandlerOutput
from transport.worker.counters import Counters
from transport.worker.iothread import DROPPED, SocketThread
from transport.worker.requests import PauseGate, RequestContext, Requests

__all__ = ["Background", "Handler", "InvalidHandlerOutput", "WorkerServer"]

log = logging.getLogger("transport.worker")

Handler = Callable[[LLMRequest, RequestContext], Awaitable[LLMResponse]]
#: A background job started with the server in its loop (e.g. a weight subscriber).
Background = Callable[["WorkerServer"], Awaitable[None]]


class WorkerServer:
    """Serves a generate handler (or an engine with a ``generate`` method) on a ROUTER.

    Parameters
    ----------
    handler:
        ``async (req, ctx) -> LLMResponse``, a plain function of the same shape (it may
        block the engine's loop), or an engine whose ``generate`` is one (then
        :attr:`engine`). A token id outside an engine's int ``vocab_size`` is refused
        before the engine sees it (``HANDLER_ERROR``).
    config:
        :class:`WorkerConfig` (or its fields by name); ``ValueError`` names a bad one.
    background:
        Coroutine functions ``f(server)`` run in the server's loop from start to close.

    Examples
    --------
    >>> from transport.worker import echo_handler
    >>> async def main():
    ...     server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
    ...     endpoints = await server.start()
    ...     await server.close()
    """

    def __init__(
        self,
        handler: Handler | Engine,
        config: WorkerConfig | Mapping[str, Any] | None = None,
        *,
        background: Sequence[Background] = (),
    ) -> None:
        self.config = cfg = checked_config(config)
        gen = getattr(handler, "generate", None)
        self.engine: Any = None if gen is None else handler
        self.handler: Handler = handler if gen is None else gen  # type: ignore[assignment]
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.incarnation = uuid.uuid4().hex[:16]
        self.background = list(background)
        #: The engine's ``queue_depth()``, added to pongs' ``waiting``.
        self.engine_load: Callable[[], int] | None = None
        self.endpoints: list[str] = []
        self.counters = Counters()
        self.gate = PauseGate(cfg.max_concurrency, self.counters.loop)
        self.add_hooks(engine_hooks(self.engine))
        inline = cfg.inline if cfg.inline is not None else bool(getattr(self.handler, "inline", 0))
        self.io = SocketThread(self, threaded=not inline)
        self.lost = self.io.lost
        self.counters.read["lost"] = lambda: self.lost.count
        self.counters.read["discarded"] = self.io.discarded
        self.requests = Requests(self.handler, self.engine, cfg, self.gate, self.io.send)
        self._zctx: zmq.Context[Any] | None = None
        self._auth: WorkerAuthenticator | None = None
        self._bg_tasks: list[asyncio.Task[Any]] = []
        self._aux: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed: asyncio.Event | None = None
        self._unexport: Callable[[], None] | None = None

    def add_hooks(self, hooks: BoundHooks) -> None:
        """Take an engine's optional hooks (:func:`~transport.engines.api.engine_hooks`)."""
        self.gate.on_pause.extend(hooks.on_pause)
        self.gate.on_resume.extend(hooks.on_resume)
        if hooks.keeps_in_place is not None:
            self.gate.keeps_in_place = hooks.keeps_in_place
        if hooks.queue_depth is not None:
            self.engine_load = hooks.queue_depth
        if hooks.lifetime is not None:
            self.background.insert(0, hooks.lifetime)

    @property
    def paused(self) -> bool:
        """Whether generation is paused."""
        return self.gate.paused

    @property
    def pause_requests(self) -> int:
        """How many times :meth:`pause` was called."""
        return self.gate.pause_requests

    @property
    def on_pause(self) -> list[Callable[[], Any]]:
        """Callbacks run (in the loop) when a pause starts."""
        return self.gate.on_pause

    @property
    def on_resume(self) -> list[Callable[[], Any]]:
        """Callbacks run before generation resumes (:class:`ResumeRefused`: stay paused)."""
        return self.gate.on_resume

    @property
    def version(self) -> int:
        """The engine's weight version (0 without an engine exposing one)."""
        return self.requests.version()

    def status(self) -> fm.WorkerStatus:
        """A snapshot of this worker's state and counters (callable from any thread)."""
        return fm.WorkerStatus(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            version=self.version,
            paused=self.gate.paused,
            running=self.gate.running,
            waiting=self._waiting(),
            counters=self.counters.snapshot(),
        )

    def _waiting(self) -> int:
        return max(0, len(self.requests.held) - self.gate.running)

    def _engine_waiting(self) -> int:
        try:
            return max(0, int(self.engine_load())) if self.engine_load is not None else 0
        except Exception:  # a failing hook must not cost the pong
            return 0

    async def pause(self, timeout: float = 30.0) -> bool:
        """Stop generation: new requests wait, running ones are interrupted. Returns
        True once no handler runs, False if some still run after ``timeout`` s."""
        return await self.gate.pause(timeout)

    async def resume(self) -> None:
        """Let generation continue (:class:`ResumeRefused`: an ``on_resume`` refused)."""
        await self.gate.resume()

    def abort_all(self) -> int:
        """Abort every request (each answers ``ABORTED``); returns how many."""
        return self.requests.abort_all()

    async def start(self) -> list[str]:
        """Bind, start serving and the background jobs; returns the bound endpoints.
        Raises ``zmq.ZMQError`` if an address cannot be bound, ``RuntimeError`` if a
        background job failed as it started (the server is closed again)."""
        cfg = self.config
        self._zctx = zmq.Context()
        if cfg.curve is not None:
            self._auth = auth = WorkerAuthenticator(self._zctx, cfg.curve)
            self.counters.read["auth_denied"] = lambda: auth.denied
        self._closed = asyncio.Event()
        try:
            self.endpoints = await self.io.start(self._zctx)
        except BaseException:
            await self.close()
            raise
        # Read when scraped, never written per request (one server per process).
        metrics.expose("worker")
        self._unexport = metrics.on_scrape("worker", self.counters.export)
        for gauge, fn in (
            (metrics.WORKER_INFLIGHT, lambda: self.gate.running),
            (metrics.WORKER_QUEUE_DEPTH, lambda: self._waiting() + self.io.queued_submits()),
            (metrics.WORKER_WEIGHT_VERSION, lambda: self.version),
            (metrics.WORKER_PAUSED, lambda: int(self.gate.paused)),
        ):
            if (set_function := getattr(gauge, "set_function", None)) is not None:
                set_function(fn)
        self._sweep_peers()  # and every client_timeout / 4 s from now on
        self._bg_tasks = tasks = [asyncio.ensure_future(job(self)) for job in self.background]
        for _ in range(2 if tasks else 0):
            await asyncio.sleep(0)
        for task, job in zip(tasks, self.background, strict=True):
            # A worker must not report ready without what it was told to run.
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                await self.close()
                name = getattr(job, "__qualname__", repr(job))
                raise RuntimeError(
                    f"background job {name} failed at start: {type(exc).__name__}: {exc}"
                ) from exc
        for task in tasks:
            task.add_done_callback(_log_failure)
        log.info("worker %s serving on %s", self.worker_id, ", ".join(self.endpoints))
        return self.endpoints

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` is called (from a signal handler, say)."""
        if self._closed is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()

    async def close(self) -> None:
        """Stop serving: cancel requests and background jobs, close the socket."""
        tasks = self._bg_tasks + self.requests.tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.io.close()
        if self._auth is not None:
            self._auth.stop()
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        if self._unexport is not None:
            self.counters.export()  # what it counted stays in the metrics
            self._unexport()
        if self._closed is not None:
            self._closed.set()

    def _dispatch(self, peer: bytes, msg: Any) -> None:
        tp = type(msg)
        if tp is fm.Submit:
            self.requests.submit(peer, msg)
        elif tp is fm.Cancel:
            self.requests.cancel(peer, msg.id)
        elif tp is fm.Control:
            self.counters.loop.counts["control"] += 1
            task = asyncio.ensure_future(self._on_control(peer, msg))
            self._aux.add(task)
            task.add_done_callback(self._aux.discard)
        elif msg is DROPPED:
            n = self._forget_peer(peer)
            log.warning("client %r stopped reading: dropped, %d requests cancelled", peer, n)

    async def _on_control(self, peer: bytes, msg: fm.Control) -> None:
        ok, error = True, ""
        if msg.op == "pause":
            ok = await self.gate.pause(msg.timeout)
            if not ok:
                error = f"{self.gate.running} generations still running after {msg.timeout} s"
        elif msg.op == "resume":
            try:
                await self.gate.resume()
            except ResumeRefused as exc:
                ok, error = False, str(exc)
        elif msg.op == "abort":
            self.abort_all()
        elif msg.op != "health":
            ok, error = False, f"unknown control op {msg.op!r}"
            self.counters.loop.counts["bad_messages"] += 1
        self.io.send(peer, fm.ControlReply(seq=msg.seq, ok=ok, error=error, status=self.status()))

    def _sweep_peers(self) -> None:
        now = time.monotonic()
        limit = self.config.client_timeout
        self.lost.expire()  # clients that are not coming back
        for peer, seen in list(self.io.peers.items()):  # a quiet controller holds nothing
            if now - seen > limit and self._forget_peer(peer):
                self.counters.loop.counts["dead_peers"] += 1
                log.warning("client %r silent for %.1f s: cancelled its requests", peer, now - seen)
        self._sweeper = asyncio.get_running_loop().call_later(limit / 4, self._sweep_peers)

    def _forget_peer(self, peer: bytes) -> int:
        # Perhaps only stalled: what is cancelled here is reported LOST if it pings again.
        self.io.peers.pop(peer, None)
        lost = self.requests.forget(peer)
        self.lost.note(peer, lost)
        return len(lost)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background job failed", exc_info=task.exception())
