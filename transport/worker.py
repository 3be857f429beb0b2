"""Generation worker: a ROUTER socket hosting an async generate handler.

The handler is the adapter point for an engine (vLLM, SGLang, or the reference engine
of :mod:`transport.engine`)::

    async def handler(req: LLMRequest, ctx: RequestContext) -> LLMResponse

Each Submit runs as its own asyncio task, so thousands are in flight at once. The
worker answers heartbeats, serves controller operations (pause / resume / abort /
health), streams what ``ctx.emit`` is given, and never lets bad input stop it: an
undecodable message gets an Error reply (when its sender can be named) and is logged
and counted.

Pause: new submissions wait; running handlers see ``ctx.interrupted`` become true and
should return their partial output with ``stop_reason="interrupt"`` (the client
re-submits the rest after resume). The pause reply is sent once no handler is running,
so a weight update that starts after it never races a generation step.

Run one as a process::

    python -m transport.worker --bind tcp://127.0.0.1:5555 --engine reference

It prints one JSON line ``{"ready": [endpoints], "pid": ...}`` when it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from fastio import DecodeError, Decoder, Encoder, LLMRequest, LLMResponse, MessageTooLarge
from fastio import fabric_msgs as fm
from fastio.protocol import PROTOCOL_VERSION, MsgKind
from fastio.tokens import TokenArray
from transport.sockets import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE_SIZE,
    CurveConfig,
    SocketPump,
    WorkerAuthenticator,
    make_router,
)

__all__ = ["Handler", "RequestContext", "WorkerConfig", "WorkerServer", "echo_handler", "main"]

log = logging.getLogger("transport.worker")

_CoroutineType = types.CoroutineType

Handler = Callable[[LLMRequest, "RequestContext"], Awaitable[LLMResponse]]
#: A background job started with the server in its loop (e.g. a weight subscriber).
Background = Callable[["WorkerServer"], Awaitable[None]]


class _Engine(Protocol):
    async def generate(self, req: LLMRequest, ctx: RequestContext) -> LLMResponse: ...


@dataclass
class WorkerConfig:
    """Settings of a :class:`WorkerServer`.

    Parameters
    ----------
    bind:
        Addresses to bind (``tcp://127.0.0.1:0`` picks a free port; ``ipc://path``).
    worker_id:
        Stable name reported in heartbeats and status (default ``host:pid``).
    max_concurrency:
        Handlers running at once; more submissions wait for a slot.
    max_pending:
        Running plus waiting; a Submit beyond it gets an ``OVERLOADED`` Error reply.
    client_timeout:
        A client silent this long (no ping, no message) is presumed dead and its
        requests are cancelled; should it ping again (it had only stalled), each is
        reported to it as ``LOST`` and it re-sends them. Keep it a few times the
        clients' heartbeat interval.
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    extra:
        Options for plugins (``--plugin-opt key=value``).
    eager_start:
        Run each handler's first step at once, in the callback that received its
        Submit (as Python 3.12's eager tasks), instead of in a new task on the next
        loop iteration: a handler that returns without awaiting costs no task, and
        one that awaits continues in a task. During that first step
        ``asyncio.current_task()`` is not the request's task; set False for handlers
        that need it (``asyncio.timeout()`` before their first ``await``, say).
    """

    bind: str | list[str] = "tcp://127.0.0.1:0"
    worker_id: str = ""
    max_concurrency: int = 4096
    max_pending: int = 65536
    client_timeout: float = 10.0
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    hwm: int = DEFAULT_HWM
    curve: CurveConfig | None = None
    extra: dict[str, str] = field(default_factory=dict)
    eager_start: bool = True


class RequestContext:
    """What a handler knows about its request besides the request itself.

    Attributes
    ----------
    id:
        The submission id (scoped to the client connection).
    deadline:
        ``time.monotonic()`` by which the client wants the answer (``inf``: none).
    """

    __slots__ = (
        "_aborted",
        "_lp",
        "_ran",
        "_seq",
        "_server",
        "_tok",
        "_ver",
        "deadline",
        "id",
        "peer",
        "stream",
    )

    def __init__(
        self, server: WorkerServer, peer: bytes, id: int, stream: bool, deadline: float
    ) -> None:
        self._server = server
        self.peer = peer
        self.id = id
        self.stream = stream
        self.deadline = deadline
        self._seq = 0
        self._tok: list[int] = []
        self._lp: list[float] = []
        self._ver: list[int] = []
        self._aborted = False
        self._ran = False  # its task started (see WorkerServer._reap)

    @property
    def interrupted(self) -> bool:
        """True once the worker is pausing: return the output so far with
        ``stop_reason="interrupt"`` at the next step."""
        return self._server.paused

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        """Stream one generated token. Tokens emitted in the same loop iteration travel
        in one Stream message; does nothing when the client asked for no stream."""
        if not self.stream:
            return
        if not self._tok:
            self._server._schedule_flush(self)
        self._tok.append(token)
        self._lp.append(logprob)
        self._ver.append(version)

    def _flush(self) -> None:
        if not self._tok:
            return
        msg = fm.Stream(
            id=self.id,
            seq=self._seq,
            output_tokens=TokenArray(np.array(self._tok, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(self._lp, dtype=np.float32)),
            output_versions=TokenArray(np.array(self._ver, dtype=np.int32)),
        )
        self._seq += 1
        self._tok, self._lp, self._ver = [], [], []
        self._server._send(self.peer, msg)


async def echo_handler(req: LLMRequest, ctx: RequestContext) -> LLMResponse:
    """Answers with the prompt as the output (for benchmarks and tests): logprobs 0, every
    token of the worker's current weight version."""
    n = len(req.input_ids)
    lp, ver = _echo_fill(n, ctx._server.version)
    return LLMResponse(
        input_tokens=req.input_ids,
        output_tokens=req.input_ids,
        output_logprobs=TokenArray._wrap(lp),
        output_versions=TokenArray._wrap(ver),
        stop_reason="stop",
    )


_echo_cache: dict[tuple[int, int], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}


def _echo_fill(n: int, version: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Read-only zero logprobs and constant versions of length ``n``, shared between
    echoes of the same length (they are only encoded): the benchmark's worker should
    spend its time on the fabric, not on allocating constant arrays."""
    key = (n, version)
    arrays = _echo_cache.get(key)
    if arrays is None:
        lp = np.zeros(n, dtype=np.float32)
        ver = np.full(n, version, dtype=np.int32)
        lp.flags.writeable = ver.flags.writeable = False
        arrays = (lp, ver)
        if n <= 4096:
            if len(_echo_cache) >= 256:
                _echo_cache.clear()
            _echo_cache[key] = arrays
    return arrays


class InvalidHandlerOutput(ValueError):
    """A handler returned something that cannot be sent as a Result (the client gets
    ``HANDLER_ERROR`` with this message)."""


_STOP_REASONS = frozenset(("length", "stop", "interrupt"))


def _output_problem(resp: Any) -> str | None:
    """Why ``resp`` cannot be sent as a Result, or None."""
    if not isinstance(resp, LLMResponse):
        return f"the handler returned {type(resp).__name__}, not an LLMResponse"
    try:
        n = len(resp.output_tokens)
        n_lp, n_ver = len(resp.output_logprobs), len(resp.output_versions)
    except TypeError as exc:
        return f"output arrays without a length ({exc})"
    if n_lp != n or n_ver != n:
        return (
            "output_tokens, output_logprobs and output_versions must have equal lengths, "
            f"got {n}, {n_lp} and {n_ver}"
        )
    if resp.stop_reason not in _STOP_REASONS:
        return f"stop_reason must be one of {sorted(_STOP_REASONS)}, got {resp.stop_reason!r}"
    return None


_ACCEPTED_KINDS = {MsgKind.FABRIC_SUBMIT, MsgKind.FABRIC_CANCEL, MsgKind.FABRIC_HEARTBEAT}
_ACCEPTED_KINDS |= {MsgKind.FABRIC_CONTROL, MsgKind.FABRIC_ERROR}
#: Seconds a worker remembers the submissions it gave up for a client that stays away.
_LOST_TTL_S = 3600.0


class WorkerServer:
    """Serves a generate handler (or an engine with a ``generate`` method) on a ROUTER.

    Parameters
    ----------
    handler:
        ``async (req, ctx) -> LLMResponse``, or an engine object whose ``generate`` is
        one; the engine is then :attr:`engine` (weight updates reach it there).
    config:
        :class:`WorkerConfig`.
    background:
        Coroutine functions ``f(server)`` started in the server's loop once it serves
        and cancelled at close: the hook for a weight subscriber living in the worker
        process. Keep them non-blocking (run heavy copies in a thread).

    Examples
    --------
    >>> async def main():
    ...     server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
    ...     endpoints = await server.start()
    ...     await server.close()
    """

    def __init__(
        self,
        handler: Handler | _Engine,
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
        self.endpoints: list[str] = []
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "received", "completed", "cancelled", "interrupted", "aborted", "errors",
                "bad_messages", "overloaded", "undeliverable", "dead_peers", "error_replies_received",
                "control", "handshake_failed", "lost",
            ),
            0,
        )  # fmt: skip
        self._paused = False
        #: How many times :meth:`pause` was called: lets an in-process pauser (a weight
        #: copy) tell whether someone else paused the worker after it did.
        self.pause_requests = 0
        self._running = 0
        self._tasks: dict[tuple[bytes, int], tuple[asyncio.Task[None], RequestContext]] = {}
        self._peers: dict[bytes, float] = {}
        #: Submissions given up without an answer reaching their client (it seemed dead,
        #: or its connection was down), per peer: (since when, ids, undelivered Error
        #: replies). When the peer pings again each id is reported with an Error(LOST),
        #: so the client re-sends it, and each Error reply is sent again as it was.
        self._lost: dict[bytes, tuple[float, list[int], list[list[Any]]]] = {}
        self._enc = Encoder()
        self._dec = Decoder(fm.CLIENT_TO_WORKER, max_message_size=self.config.max_message_size)
        self._ctx: zmq.Context[Any] | None = None
        self._pump: SocketPump | None = None
        self._monitor: SocketPump | None = None
        self._auth: WorkerAuthenticator | None = None
        self._resumed: asyncio.Event | None = None
        # Futures of pause() calls waiting for no handler to run (set by _ended); not an
        # Event toggled by every request: that cost ~1 us a request.
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._max_running = self.config.max_concurrency
        self._gate: collections.deque[asyncio.Future[None]] = collections.deque()
        self._flush_pending: list[RequestContext] = []
        self._bg_tasks: list[asyncio.Task[Any]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed: asyncio.Event | None = None
        self._aux: set[asyncio.Task[Any]] = set()

    # -- public state -------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Whether generation is paused."""
        return self._paused

    @property
    def version(self) -> int:
        """The engine's weight version (0 without an engine exposing one)."""
        return int(getattr(self.engine, "version", 0))

    def status(self) -> fm.WorkerStatus:
        """A snapshot of this worker's state and counters."""
        counters = dict(self.counters)
        if self._auth is not None:
            counters["auth_denied"] = self._auth.denied
        return fm.WorkerStatus(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            version=self.version,
            paused=self._paused,
            running=self._running,
            waiting=len(self._tasks) - self._running,
            counters=counters,
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Bind, start serving and the background jobs; returns the bound endpoints."""
        cfg = self.config
        self._ctx = zmq.Context()
        if cfg.curve is not None:
            self._auth = WorkerAuthenticator(self._ctx, cfg.curve)
        sock, self.endpoints = make_router(
            self._ctx, cfg.bind, hwm=cfg.hwm, max_message_size=cfg.max_message_size, curve=cfg.curve
        )
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closed = asyncio.Event()
        self._pump = SocketPump(
            sock,
            self._on_message,
            on_undeliverable=self._on_undeliverable,
            router=True,
            batch_frames=True,
        )
        if cfg.curve is not None:
            # A peer without CURVE, or with another server key, fails the handshake
            # before any authenticator sees it: only a socket monitor can tell.
            mon = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            self._monitor = SocketPump(mon, self._on_monitor)
        self._sweeper = asyncio.get_running_loop().call_later(
            cfg.client_timeout / 4, self._sweep_peers
        )
        for job in self.background:
            task = asyncio.ensure_future(job(self))
            task.add_done_callback(self._background_done)
            self._bg_tasks.append(task)
        log.info("worker %s serving on %s", self.worker_id, ", ".join(self.endpoints))
        return self.endpoints

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` is called (from a signal handler, say)."""
        if self._pump is None:
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
        if self._pump is not None:
            if self._monitor is not None:
                self._monitor.close()
            self._pump.close()
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._closed is not None:
            self._closed.set()

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background job failed", exc_info=task.exception())

    # -- pause / resume / abort (also callable in-process) ------------------------------
    async def pause(self, timeout: float = 30.0) -> bool:
        """Stop generation: new requests wait, running ones are interrupted. Returns
        True once no handler runs, False if some still run after ``timeout`` s."""
        assert self._resumed is not None
        self.pause_requests += 1
        if not self._paused:
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
        except asyncio.TimeoutError:
            return self._running == 0
        return True

    async def resume(self) -> None:
        """Let generation continue (waiting requests start)."""
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

    # -- sending ----------------------------------------------------------------------
    def _send(self, peer: bytes, msg: Any) -> None:
        assert self._pump is not None
        frames = self._enc.encode(msg)
        frames.insert(0, peer)
        self._pump.send(frames)

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self._send(peer, fm.Error(id=id, code=int(code), message=text))

    def _on_undeliverable(self, frames: list[Any]) -> None:
        # The peer's connection is down: gone for good, or reset and about to reconnect
        # under the same routing id. Its running requests keep running (a reconnected
        # client gets their answers; one that stays silent is forgotten after
        # client_timeout); the submissions whose final answer is lost here are
        # reported to it when it is heard from again.
        self.counters["undeliverable"] += 1
        peer = bytes(frames[0])
        _log_counted(
            self.counters["undeliverable"], "client %r unreachable: a reply is dropped", peer
        )
        lost, replies = [], []
        for msg in fm.split(frames[1:]):
            _, kind, first = fm.peek(msg)
            if first is None or first < 0:
                continue
            if kind == MsgKind.FABRIC_RESULT:
                lost.append(first)  # an output can be large: generated again instead
            elif kind == MsgKind.FABRIC_ERROR:
                # Small, and its code matters (ABORTED, TIMEOUT, ...): kept to be sent
                # again, as a private copy (the encoder's buffers are not ours to keep).
                replies.append([bytes(f) for f in msg])
        self._note_lost(peer, lost, replies)

    def _note_lost(self, peer: bytes, ids: list[int], replies: Sequence[list[Any]] = ()) -> None:
        if not ids and not replies:
            return
        self.counters["lost"] += len(ids) + len(replies)
        entry = self._lost.get(peer)
        if entry is None:
            self._lost[peer] = (time.monotonic(), ids, list(replies))
        else:
            entry[1].extend(ids)
            entry[2].extend(replies)

    def _report_lost(self, peer: bytes) -> None:
        assert self._pump is not None
        _, ids, replies = self._lost.pop(peer)
        # Undeliverable again (the peer left at once): noted again by the above.
        for id in ids:
            self._send_error(
                peer, id, fm.ErrorCode.LOST, "the worker gave up this submission; re-send it"
            )
        for msg in replies:
            self._pump.send([peer, *msg])

    def _schedule_flush(self, ctx: RequestContext) -> None:
        if not self._flush_pending:
            asyncio.get_running_loop().call_soon(self._flush_streams)
        self._flush_pending.append(ctx)

    def _flush_streams(self) -> None:
        pending, self._flush_pending = self._flush_pending, []
        for ctx in pending:
            ctx._flush()

    # -- receiving --------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        self._peers[peer] = time.monotonic()
        if len(frames) > 1:
            for body in fm.split(frames[1:]):
                self._on_one(peer, body)
        else:
            self._on_one(peer, [])

    def _on_one(self, peer: bytes, body: list[zmq.Frame]) -> None:
        if not body:
            self._bad(peer, -1, fm.ErrorCode.BAD_MESSAGE, "empty message")
            return
        try:
            msg = self._dec.decode(body)
        except MessageTooLarge as exc:
            _, _, first = fm.peek(body)
            self._bad(peer, first if first is not None else -1, fm.ErrorCode.TOO_LARGE, str(exc))
            return
        except DecodeError as exc:
            self._bad_decode(peer, body, exc)
            return
        tp = type(msg)
        if tp is fm.Submit:
            self._on_submit(peer, msg)
        elif tp is fm.Heartbeat:
            if peer in self._lost:
                self._report_lost(peer)
            self._send(
                peer,
                fm.Heartbeat(
                    sent_at=msg.sent_at,
                    worker_id=self.worker_id,
                    incarnation=self.incarnation,
                    in_flight=len(self._tasks),
                    paused=self._paused,
                    version=self.version,
                ),
            )
        elif tp is fm.Cancel:
            entry = self._tasks.get((peer, msg.id))
            if entry is not None:
                entry[0].cancel()
        elif tp is fm.Control:
            self.counters["control"] += 1
            task = asyncio.ensure_future(self._on_control(peer, msg))
            self._aux.add(task)
            task.add_done_callback(self._aux.discard)
        elif tp is fm.Error:
            self.counters["error_replies_received"] += 1
            log.warning(
                "client %r reports error %s on id %s: %s", peer, msg.code, msg.id, msg.message
            )

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        self.counters["handshake_failed"] += 1
        _log_counted(
            self.counters["handshake_failed"],
            "refused a peer at the CURVE handshake (%s on %s)",
            zmq.Event(event["event"]).name,
            event["endpoint"],
        )

    def _bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self.counters["bad_messages"] += 1
        _log_counted(self.counters["bad_messages"], "bad message from %r: %s", peer, text)
        self._send_error(peer, id, code, text)

    def _bad_decode(self, peer: bytes, body: list[Any], exc: DecodeError) -> None:
        version, kind, first = fm.peek(body)
        if version is not None and version != PROTOCOL_VERSION:
            self._bad(peer, -1, fm.ErrorCode.UNSUPPORTED_VERSION, str(exc))
        elif kind == MsgKind.FABRIC_SUBMIT and first is not None:
            self._bad(peer, first, fm.ErrorCode.BAD_REQUEST, str(exc))
        elif kind is not None and kind not in _ACCEPTED_KINDS:
            self._bad(
                peer, -1, fm.ErrorCode.UNKNOWN_KIND, f"message kind {kind} not accepted by a worker"
            )
        else:
            self._bad(peer, -1, fm.ErrorCode.BAD_MESSAGE, str(exc))

    def _on_submit(self, peer: bytes, sub: fm.Submit) -> None:
        self.counters["received"] += 1
        key = (peer, sub.id)
        tasks = self._tasks
        if key in tasks:
            self._bad(peer, sub.id, fm.ErrorCode.BAD_REQUEST, f"id {sub.id} is already in flight")
            return
        if len(tasks) >= self.config.max_pending:
            self.counters["overloaded"] += 1
            self._send_error(
                peer, sub.id, fm.ErrorCode.OVERLOADED, "worker holds too many requests"
            )
            return
        timeout = sub.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        ctx = RequestContext(self, peer, sub.id, sub.stream, deadline)
        if (
            self.config.eager_start
            and timeout <= 0
            and not self._paused
            and self._running < self._max_running
        ):
            self._start_eager(key, ctx, sub)
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
        task.add_done_callback(functools.partial(self._reap, ctx, sub, started))
        self._tasks[key] = (task, ctx)

    def _reap(self, ctx: RequestContext, sub: fm.Submit, started: Any, _: object) -> None:
        """A task ended. If it was cancelled (a Cancel or an abort in the same batch as
        its Submit) before its first step, the body of :meth:`_run` never ran: do what
        it would have done, or the request would hold its slot and table entry forever
        (and a pause would wait for it) and an abort would never be answered."""
        if ctx._ran:
            return
        if isinstance(started, _Resume):
            started.close()
        elif asyncio.isfuture(started):
            started.cancel()
        if started is not None:
            self._ended(ctx, sub, None, asyncio.CancelledError())
        else:
            self._tasks.pop((ctx.peer, ctx.id), None)
            self._cancelled(ctx)

    def _start_eager(self, key: tuple[bytes, int], ctx: RequestContext, sub: fm.Submit) -> None:
        # The handler's first step runs here, in the receive callback (as Python 3.12's
        # eager tasks do): a handler that answers without waiting (an echo, a cache hit,
        # a refusal) costs no task, no loop iteration and no timer, and its reply leaves
        # in this same wake-up. A handler that awaits continues in a task from there.
        self._running += 1
        try:
            aw = self.handler(sub.request, ctx)
            if type(aw) is not _CoroutineType:
                # An awaitable that is not a coroutine (a Future, say): a task awaits it.
                self._spawn(key, ctx, sub, aw)
                return
            step = aw.send(None)
        except StopIteration as stop:
            self._ended(ctx, sub, stop.value, None)
            return
        except (Exception, asyncio.CancelledError) as exc:
            self._ended(ctx, sub, None, exc)
            return
        self._spawn(key, ctx, sub, _Resume(aw, step))

    async def _run(
        self, ctx: RequestContext, sub: fm.Submit, started: Awaitable[LLMResponse] | None = None
    ) -> None:
        """One request in a task; ``started``: its handler, already running (it holds
        a slot since :meth:`_start_eager`)."""
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
                if sub.timeout > 0:
                    resp = await asyncio.wait_for(self.handler(sub.request, ctx), sub.timeout)
                else:
                    resp = await self.handler(sub.request, ctx)
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
                problem = _output_problem(resp)
                if problem is not None:
                    err = InvalidHandlerOutput(problem)
            if err is None:
                assert resp is not None
                ctx._flush()
                if resp.stop_reason == "interrupt":
                    self.counters["interrupted"] += 1
                self.counters["completed"] += 1
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
            elif isinstance(err, asyncio.CancelledError):
                self._cancelled(ctx)
            elif isinstance(err, asyncio.TimeoutError):
                self.counters["errors"] += 1
                self._send_error(
                    peer, id, fm.ErrorCode.TIMEOUT, f"worker time limit {sub.timeout} s passed"
                )
            else:
                self.counters["errors"] += 1
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

    def _cancelled(self, ctx: RequestContext) -> None:
        if ctx._aborted:
            self.counters["aborted"] += 1
            self._send_error(ctx.peer, ctx.id, fm.ErrorCode.ABORTED, "aborted by a controller")
        else:
            self.counters["cancelled"] += 1

    async def _on_control(self, peer: bytes, msg: fm.Control) -> None:
        ok, error = True, ""
        if msg.op == "pause":
            ok = await self.pause(msg.timeout)
            if not ok:
                error = f"{self._running} generations still running after {msg.timeout} s"
        elif msg.op == "resume":
            await self.resume()
        elif msg.op == "abort":
            self.abort_all()
        elif msg.op == "health":
            pass
        else:
            ok, error = False, f"unknown control op {msg.op!r}"
            self.counters["bad_messages"] += 1
        self._send(peer, fm.ControlReply(seq=msg.seq, ok=ok, error=error, status=self.status()))

    # -- dead clients -----------------------------------------------------------------
    def _sweep_peers(self) -> None:
        now = time.monotonic()
        limit = self.config.client_timeout
        for peer, (since, _, _) in list(self._lost.items()):
            if now - since > _LOST_TTL_S:  # that client is not coming back
                del self._lost[peer]
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
        self._note_lost(peer, lost)
        return len(lost)


class _Resume:
    """Awaitable that continues a coroutine already stepped once, from the value its
    first step yielded: the task awaiting it drives the coroutine as if it had started
    it (cancellation and errors are passed through)."""

    __slots__ = ("_coro", "_step")

    def __init__(self, coro: Coroutine[Any, Any, LLMResponse], step: Any) -> None:
        self._coro = coro
        self._step = step

    def close(self) -> None:
        """End the handler's coroutine (its task was cancelled before awaiting it)."""
        self._coro.close()

    def __await__(self) -> Generator[Any, None, LLMResponse]:
        coro, out = self._coro, self._step
        self._step = None
        while True:
            try:
                yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    out = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
            else:
                try:
                    out = coro.send(None)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        await x


def _log_counted(n: int, fmt: str, *args: Any) -> None:
    # Hostile input must not flood the log: the first ten, then every power of two.
    if n <= 10 or (n & (n - 1)) == 0:
        log.warning(fmt + " (occurrence %d)", *args, n)


# -- command line ---------------------------------------------------------------------
def _load_plugin(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"expected module:function, got {spec!r}")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m transport.worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bind", action="append", required=True, help="address to bind (repeatable)")
    p.add_argument(
        "--engine",
        default="reference",
        help="reference | echo | module:factory (factory(opts) returns a handler or an engine)",
    )
    p.add_argument("--worker-id", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--token-interval", type=float, default=0.0, help="simulated seconds per token")
    p.add_argument("--max-concurrency", type=int, default=4096)
    p.add_argument("--max-pending", type=int, default=65536)
    p.add_argument("--client-timeout", type=float, default=10.0)
    p.add_argument("--max-message-size", type=int, default=DEFAULT_MAX_MESSAGE_SIZE)
    p.add_argument("--curve-secret", help="this worker's .key_secret certificate (enables CURVE)")
    p.add_argument("--curve-clients", help="directory of authorized client .key certificates")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="module:function(server, opts) run in the worker's loop",
    )
    p.add_argument("--plugin-opt", action="append", default=[], help="key=value passed to plugins")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


async def _amain(args: argparse.Namespace) -> None:
    if args.engine == "reference":
        from transport.engine import ReferenceEngine

        handler: Any = ReferenceEngine(
            vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers, seed=args.seed,
            token_interval=args.token_interval,
        )  # fmt: skip
    elif args.engine == "echo":
        handler = echo_handler
    else:
        # The adapter point for a real engine (vLLM, SGLang, ...): module:factory.
        handler = _load_plugin(args.engine)(dict(o.split("=", 1) for o in args.plugin_opt))
    curve = None
    if args.curve_secret:
        curve = CurveConfig(
            secret_key_file=args.curve_secret, authorized_clients_dir=args.curve_clients
        )
    opts = dict(o.split("=", 1) for o in args.plugin_opt)
    config = WorkerConfig(
        bind=args.bind, worker_id=args.worker_id, max_concurrency=args.max_concurrency,
        max_pending=args.max_pending, client_timeout=args.client_timeout,
        max_message_size=args.max_message_size, curve=curve, extra=opts,
    )  # fmt: skip
    plugins = [_load_plugin(s) for s in args.plugin]
    background: list[Background] = []
    for plugin in plugins:
        job = plugin
        background.append(lambda server, job=job: job(server, opts))  # type: ignore[misc]
    server = WorkerServer(handler, config, background=background)
    endpoints = await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.close()))
    print(
        json.dumps({"ready": endpoints, "pid": os.getpid(), "worker_id": server.worker_id}),
        flush=True,
    )
    await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m transport.worker``."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    with contextlib.suppress(ImportError):
        import torch

        # One generation thread per worker process: workers share the cores.
        torch.set_num_threads(1)
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
