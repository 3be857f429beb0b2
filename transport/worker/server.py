"""The generation worker's server: requests, pause / resume / abort, dead clients.

The handler is the adapter point for an engine (vLLM, SGLang, the reference engine of
:mod:`transport.engine`, the transformers engine of :mod:`transport.hf_engine`)::

    async def handler(req: LLMRequest, ctx: RequestContext) -> LLMResponse

Two kinds of work never share a thread. The ROUTER belongs to a socket thread
(:mod:`transport.worker.iothread`) that answers pings and moves bytes; every handler
runs on the server's own asyncio loop (the *engine's loop*, the one that awaited
:meth:`WorkerServer.start`), where each Submit is its own task, so thousands are in
flight at once. A handler may block that loop (a torch forward, a sync sleep): its
requests wait, pings are still answered at once.

Pause: new submissions wait; running handlers see ``ctx.interrupted`` become true and
should return their partial output with ``stop_reason="interrupt"`` (the client
re-submits the rest after resume). The pause reply is sent once no handler is running,
so a weight update that starts after it never races a generation step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq

from fastio import LLMRequest, LLMResponse, versions
from fastio import fabric_msgs as fm
from transport import metrics
from transport.engines.api import Engine, attach_engine
from transport.errors import EMPTY_PROMPT
from transport.sockets import WorkerAuthenticator
from transport.worker.context import (
    InvalidHandlerOutput,
    RequestContext,
    WorkerConfig,
    output_problem,
)
from transport.worker.eager import reap, start_eager
from transport.worker.iothread import DROPPED, SocketThread, log_counted
from transport.worker.lost import LostReplies
from transport.worker.pausing import PauseControl

__all__ = ["Background", "Handler", "InvalidHandlerOutput", "WorkerServer"]


log = logging.getLogger("transport.worker")

#: The labelled counter of the hot path, looked up once.
_REQUESTS_OK = metrics.WORKER_REQUESTS.labels(outcome="ok")
#: Longest delay of an answer's count in WORKER_REQUESTS{outcome="ok"} (without
#: WorkerConfig.latency_metrics; see WorkerServer._count_ok).
_OK_REPORT_S = 0.2
_INF = float("inf")

Handler = Callable[[LLMRequest, RequestContext], Awaitable[LLMResponse]]
#: A background job started with the server in its loop (e.g. a weight subscriber).
Background = Callable[["WorkerServer"], Awaitable[None]]


class WorkerServer(PauseControl):
    """Serves a generate handler (or an engine with a ``generate`` method) on a ROUTER.

    Parameters
    ----------
    handler:
        ``async (req, ctx) -> LLMResponse``, a plain function ``(req, ctx) ->
        LLMResponse`` (it may block: it runs on the engine's loop, never on the socket
        thread), or an engine object whose ``generate`` is one of those; the engine is
        then :attr:`engine` (weight updates reach it there).
    config:
        :class:`WorkerConfig`.
    background:
        Coroutine functions ``f(server)`` started in the server's loop once it serves
        and cancelled at close: the hook for a weight subscriber living in the worker
        process. Keep them non-blocking (run heavy copies in a thread).

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
        config: WorkerConfig | None = None,
        *,
        background: Sequence[Background] = (),
    ) -> None:
        self.config = config or WorkerConfig()
        gen = getattr(handler, "generate", None)
        if gen is not None:
            self.engine: Any = handler
            self.handler: Handler = gen
        else:
            self.engine = None
            self.handler = handler  # type: ignore[assignment]
        self.worker_id = self.config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.incarnation = uuid.uuid4().hex[:16]
        self.background = list(background)
        #: Callbacks run (in the loop) when a pause starts / when generation resumes.
        self.on_pause: list[Callable[[], Any]] = []
        self.on_resume: list[Callable[[], Any]] = []
        #: The engine's ``queue_depth()`` (requests waiting inside it), added to pongs' ``waiting``.
        self.engine_load: Callable[[], int] | None = None
        if self.engine is not None:
            attach_engine(self, self.engine)  # its optional hooks (transport.engines.api)
        self.endpoints: list[str] = []
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "received", "completed", "cancelled", "interrupted", "aborted", "errors",
                "bad_messages", "overloaded", "undeliverable", "dead_peers", "error_replies_received",
                "control", "duplicates",
            ),
            0,
        )  # fmt: skip
        self._paused = False
        #: How many times :meth:`pause` was called: lets an in-process pauser (a weight
        #: copy) tell whether someone else paused the worker after it did.
        self.pause_requests = 0
        self._running = 0
        self._tasks: dict[tuple[bytes, int], tuple[asyncio.Task[None], RequestContext]] = {}
        #: Last time each peer was heard from (written by the socket thread).
        self._peers: dict[bytes, float] = {}
        #: Submissions given up without an answer reaching their client (it seemed dead,
        #: or its connection was down): reported Error(LOST) when the peer pings again.
        self._lost = LostReplies()
        #: Replies to peers not heard from: version 1, which every peer reads.
        self._enc = versions.VERSION_1
        self._ctx: zmq.Context[Any] | None = None
        self._io: SocketThread | None = None
        self._auth: WorkerAuthenticator | None = None
        self._resumed: asyncio.Event | None = None
        # Futures of pause() calls waiting for no handler to run (set by _ended); not an
        # Event toggled by every request, which would cost every request a call.
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._max_running = self.config.max_concurrency
        self._latency_metrics = self.config.latency_metrics
        #: Tokens and finish reasons, read when the metrics are scraped.
        self._tally = metrics.WorkerTally()
        # Answers counted in WORKER_REQUESTS{outcome="ok"} in batches (see _count_ok).
        self._ok_unreported = 0
        self._ok_timer: asyncio.TimerHandle | None = None
        self._gate: collections.deque[asyncio.Future[None]] = collections.deque()
        self._flush_pending: list[RequestContext] = []
        self._bg_tasks: list[asyncio.Task[Any]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed: asyncio.Event | None = None
        self._aux: set[asyncio.Task[Any]] = set()
        self._starting = False

    # -- public state -------------------------------------------------------------------
    def _queue_depth(self) -> int:
        """Submissions received and not running: waiting for a slot, a resume, or the
        engine's loop to take them."""
        io = self._io
        return max(0, len(self._tasks) - self._running) + (io.queued_submits() if io else 0)

    @property
    def paused(self) -> bool:
        """Whether generation is paused."""
        return self._paused

    @property
    def version(self) -> int:
        """The engine's weight version (0 without an engine exposing one)."""
        return int(getattr(self.engine, "version", 0))

    def status(self) -> fm.WorkerStatus:
        """A snapshot of this worker's state and counters (callable from any thread)."""
        counters = dict(self.counters)
        counters["lost"] = self._lost.count
        if self._io is not None:
            for key, n in self._io.snapshot_counters().items():
                counters[key] = counters.get(key, 0) + n
        if self._auth is not None:
            counters["auth_denied"] = self._auth.denied
        return fm.WorkerStatus(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            version=self.version,
            paused=self._paused,
            running=self._running,
            waiting=max(0, len(self._tasks) - self._running),
            counters=counters,
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Bind, start serving and the background jobs; returns the bound endpoints.

        Raises
        ------
        zmq.ZMQError
            An address cannot be bound.
        RuntimeError
            A background job failed as it started (the server is closed again).
        """
        cfg = self.config
        self._ctx = zmq.Context()
        if cfg.curve is not None:
            self._auth = WorkerAuthenticator(self._ctx, cfg.curve)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closed = asyncio.Event()
        inline = (
            cfg.inline if cfg.inline is not None else bool(getattr(self.handler, "inline", False))
        )
        self._io = SocketThread(self, self._ctx, threaded=not inline)
        try:
            self.endpoints = await self._io.start()
        except BaseException:
            await self.close()
            raise
        _set_gauges(self)
        self._sweeper = asyncio.get_running_loop().call_later(
            cfg.client_timeout / 4, self._sweep_peers
        )
        for job in self.background:
            task = asyncio.ensure_future(job(self))
            task.add_done_callback(self._background_done)
            self._bg_tasks.append(task)
        if self._bg_tasks:
            self._starting = True
            # A job that fails as it starts (bad options, say) fails the start: a
            # worker must not report ready without what it was told to run.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            for task, job in zip(self._bg_tasks, self.background, strict=True):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    await self.close()
                    name = getattr(job, "__qualname__", repr(job))
                    raise RuntimeError(
                        f"background job {name} failed at start: {type(exc).__name__}: {exc}"
                    ) from exc
            self._starting = False
        log.info("worker %s serving on %s", self.worker_id, ", ".join(self.endpoints))
        return self.endpoints

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` is called (from a signal handler, say)."""
        if self._io is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()

    async def close(self) -> None:
        """Stop serving: cancel requests and background jobs, close the socket."""
        for task in self._bg_tasks:
            task.cancel()
        for task, _ in list(self._tasks.values()):
            task.cancel()
        pending = [t for t, _ in self._tasks.values()] + self._bg_tasks
        if pending:
            await asyncio.wait(pending, timeout=5)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._ok_timer is not None:
            self._ok_timer.cancel()
        self._report_ok()
        if self._io is not None:
            self._io.close()
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._closed is not None:
            self._closed.set()

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        if self._starting:
            return  # start() raises it
        if not task.cancelled() and task.exception() is not None:
            log.error("background job failed", exc_info=task.exception())

    # -- sending ----------------------------------------------------------------------
    def _send(self, peer: bytes, msg: Any) -> None:
        io = self._io
        assert io is not None
        # Each peer gets what it reads (the versions its pings state; see SocketThread).
        frames = io.encoders.get(peer, self._enc).encode(msg)
        frames.insert(0, peer)
        io.post_here(frames)

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        metrics.WORKER_ERRORS.labels(code=code.name).inc()
        self._send(peer, fm.Error(id=id, code=int(code), message=text))

    def _schedule_flush(self, ctx: RequestContext) -> None:
        if not self._flush_pending:
            asyncio.get_running_loop().call_soon(self._flush_streams)
        self._flush_pending.append(ctx)

    def _flush_streams(self) -> None:
        pending, self._flush_pending = self._flush_pending, []
        for ctx in pending:
            ctx._flush()

    # -- receiving (what the socket thread hands over) ----------------------------------
    def _drain_inbox(self) -> None:
        io = self._io
        if io is None:
            return
        # Cleared before taking: a message queued after this schedules another drain.
        io._in_scheduled = False
        inbox = io.inbox
        dispatch = self._dispatch
        while inbox:
            _, peer, msg = inbox.popleft()
            dispatch(peer, msg)

    def _dispatch(self, peer: bytes, msg: Any) -> None:
        tp = type(msg)
        if tp is fm.Submit:
            self._on_submit(peer, msg)
        elif tp is fm.Cancel:
            entry = self._tasks.get((peer, msg.id))
            if entry is not None:
                entry[0].cancel()
        elif tp is fm.Control:
            self.counters["control"] += 1
            task = asyncio.ensure_future(self._on_control(peer, msg))
            self._aux.add(task)
            task.add_done_callback(self._aux.discard)
        elif msg is DROPPED:
            n = self._forget_peer(peer)
            log.warning("client %r stopped reading: dropped, %d requests cancelled", peer, n)

    def _bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self.counters["bad_messages"] += 1
        metrics.WORKER_REQUESTS.labels(outcome="rejected").inc()
        log_counted(self.counters["bad_messages"], "bad message from %r: %s", peer, text)
        self._send_error(peer, id, code, text)

    def _on_submit(self, peer: bytes, sub: fm.Submit) -> None:
        self.counters["received"] += 1
        key = (peer, sub.id)
        tasks = self._tasks
        if key in tasks:
            # A re-send of a submission still in flight (docs/PROTOCOL.md): its one
            # answer answers both; the running one is not disturbed.
            self.counters["duplicates"] += 1
            return
        if sub.id < 0:
            self._bad(
                peer, sub.id, fm.ErrorCode.BAD_REQUEST, f"Submit.id must be >= 0, got {sub.id}"
            )
            return
        if not len(sub.request.input_ids):
            # An engine would generate from nothing until max_new_tokens: refuse it.
            self._bad(peer, sub.id, fm.ErrorCode.BAD_REQUEST, EMPTY_PROMPT)
            return
        if len(tasks) >= self.config.max_pending:
            self.counters["overloaded"] += 1
            metrics.WORKER_REQUESTS.labels(outcome="rejected").inc()
            self._send_error(
                peer, sub.id, fm.ErrorCode.OVERLOADED, "worker holds too many requests"
            )
            return
        timeout = sub.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else _INF
        ctx = RequestContext(self, peer, sub.id, sub.stream, deadline)
        if (
            self.config.eager_start
            and timeout <= 0
            and not self._paused
            and self._running < self._max_running
        ):
            start_eager(self, key, ctx, sub)
            return
        self._spawn(key, ctx, sub)

    def _spawn(
        self,
        key: tuple[bytes, int],
        ctx: RequestContext,
        sub: fm.Submit,
        started: Awaitable[LLMResponse] | None = None,
    ) -> None:
        task = asyncio.ensure_future(self._run(ctx, sub, started))
        task.add_done_callback(functools.partial(reap, self, ctx, sub, started))
        self._tasks[key] = (task, ctx)

    async def _run(
        self, ctx: RequestContext, sub: fm.Submit, started: Awaitable[LLMResponse] | None = None
    ) -> None:
        """One request in a task; ``started``: its handler, already running (it holds
        a slot since ``eager.start_eager``)."""
        ctx._ran = True
        resp: LLMResponse | None = None
        err: BaseException | None = None
        running = started is not None
        try:
            if started is not None:
                resp = await started
            else:
                # Fast path: no pause, a free slot. Otherwise wait for a wake-up (resume
                # or a finished request) and look again.
                while self._paused or self._running >= self._max_running:
                    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    self._gate.append(gate)
                    await gate
                running = True
                self._running += 1
                aw = self.handler(sub.request, ctx)
                if not hasattr(aw, "__await__"):  # a sync handler's answer
                    resp = aw  # type: ignore[assignment]
                elif sub.timeout > 0:
                    resp = await asyncio.wait_for(aw, sub.timeout)
                else:
                    resp = await aw
        except (Exception, asyncio.CancelledError) as exc:
            err = exc
        if running:
            self._ended(ctx, sub, resp, err)
        else:  # cancelled while waiting for a slot: it never ran
            self._tasks.pop((ctx.peer, ctx.id), None)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(ctx)

    def _ended(
        self,
        ctx: RequestContext,
        sub: fm.Submit,
        resp: LLMResponse | None,
        err: BaseException | None,
    ) -> None:
        """A handler holding a slot returned ``resp`` or raised ``err``: reply, free
        the slot."""
        peer, id = ctx.peer, ctx.id
        try:
            if err is None:
                # Checked here, not at the client: a reply it could not decode would
                # fail there as a BAD_RESPONSE with no word of what the handler did wrong.
                problem = output_problem(resp)
                if problem is None:
                    assert resp is not None
                    if ctx._tok:
                        ctx._flush()
                    # Counted before the answer leaves: a health request its client
                    # sends once it has every answer sees them all.
                    counters = self.counters
                    if resp.stop_reason == "interrupt":
                        counters["interrupted"] += 1
                    counters["completed"] += 1
                    self._tally.result(
                        resp.stop_reason, len(sub.request.input_ids), len(resp.output_tokens)
                    )
                    if self._latency_metrics:
                        _REQUESTS_OK.inc()  # (scraped: counted at once)
                    else:
                        self._count_ok()
                    self._send(
                        peer,
                        fm.Result(
                            id=id,
                            output_tokens=resp.output_tokens,
                            output_logprobs=resp.output_logprobs,
                            output_versions=resp.output_versions,
                            stop_reason=resp.stop_reason,
                        ),
                    )
                    if self._latency_metrics:
                        ctx._finished(len(resp.output_tokens))
                    return
                err = InvalidHandlerOutput(problem)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(ctx)
            elif isinstance(err, TimeoutError):
                self.counters["errors"] += 1
                metrics.WORKER_REQUESTS.labels(outcome="error").inc()
                self._send_error(
                    peer, id, fm.ErrorCode.TIMEOUT, f"worker time limit {sub.timeout} s passed"
                )
            else:
                self.counters["errors"] += 1
                metrics.WORKER_REQUESTS.labels(outcome="error").inc()
                if isinstance(err, ValueError):
                    # The engine refused this request's input (ids outside its
                    # vocabulary, say): the sender's mistake, one line, no traceback.
                    log.warning(
                        "request %s refused by the engine: %s: %s",
                        sub.request.rid, type(err).__name__, err,
                    )  # fmt: skip
                else:
                    log.error("handler failed on request %s", sub.request.rid, exc_info=err)
                self._send_error(
                    peer, id, fm.ErrorCode.HANDLER_ERROR, f"{type(err).__name__}: {err}"
                )
        except Exception:
            # A reply that cannot be built (a handler returning a wrong type, say) must
            # not leak the slot.
            self.counters["errors"] += 1
            log.exception("cannot send the reply to request %s", sub.request.rid)
            with contextlib.suppress(Exception):
                self._send_error(peer, id, fm.ErrorCode.HANDLER_ERROR, "invalid handler output")
        finally:
            self._tasks.pop((peer, id), None)
            self._running -= 1
            if self._running == 0 and self._idle_waiters:
                waiters, self._idle_waiters = self._idle_waiters, []
                for idle in waiters:
                    if not idle.done():
                        idle.set_result(None)
            if self._gate:
                self._open_gate(1)

    def _count_ok(self) -> None:
        # WORKER_REQUESTS{outcome="ok"} costs a lock and four calls per increment: the
        # answers are added to it in batches, at most _OK_REPORT_S late (and at once by
        # close()). With latency metrics on (someone scrapes) each answer
        # is counted as it leaves.
        self._ok_unreported += 1
        if self._ok_timer is None:
            self._ok_timer = asyncio.get_running_loop().call_later(_OK_REPORT_S, self._report_ok)

    def _report_ok(self) -> None:
        self._ok_timer = None
        n = self._ok_unreported
        if n:
            self._ok_unreported -= n
            _REQUESTS_OK.inc(n)

    def _cancelled(self, ctx: RequestContext) -> None:
        metrics.WORKER_REQUESTS.labels(outcome="cancelled").inc()
        if ctx._aborted:
            self.counters["aborted"] += 1
            self._tally.aborted()
            self._send_error(ctx.peer, ctx.id, fm.ErrorCode.ABORTED, "aborted by a controller")
        else:
            self.counters["cancelled"] += 1

    # -- dead clients -----------------------------------------------------------------
    def _sweep_peers(self) -> None:
        now = time.monotonic()
        limit = self.config.client_timeout
        self._lost.expire()  # clients that are not coming back
        for peer, seen in list(self._peers.items()):
            # A quiet controller holds no requests: forgotten without a fuss.
            if now - seen > limit and self._forget_peer(peer):
                self.counters["dead_peers"] += 1
                log.warning("client %r silent for %.1f s: cancelled its requests", peer, now - seen)
        self._sweeper = asyncio.get_running_loop().call_later(limit / 4, self._sweep_peers)

    def _forget_peer(self, peer: bytes) -> int:
        # Presumed dead, but perhaps only stalled (a client whose loop blocked longer
        # than client_timeout): what is cancelled here is reported if it pings again.
        self._peers.pop(peer, None)
        lost = []
        for (p, id), (task, _ctx) in list(self._tasks.items()):
            if p == peer:
                task.cancel()
                lost.append(id)
        self._lost.note(peer, lost)
        return len(lost)


def _set_gauges(server: WorkerServer) -> None:
    # Read when scraped, not written per request (the hot path stays free of them).
    # One worker per process: the last server started is the one reported.
    metrics.expose("worker")
    for gauge, fn in (
        (metrics.WORKER_INFLIGHT, lambda: server._running),
        (metrics.WORKER_QUEUE_DEPTH, lambda: server._queue_depth()),
        (metrics.WORKER_WEIGHT_VERSION, lambda: server.version),
        (metrics.WORKER_PAUSED, lambda: int(server._paused)),
    ):
        set_function = getattr(gauge, "set_function", None)
        if set_function is not None:
            set_function(fn)
