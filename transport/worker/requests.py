"""The requests a worker holds (admitted, run in a slot of the :class:`PauseGate`,
answered once), their contexts and the gate itself; all on the engine's loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from transport import metrics
from transport.errors import EMPTY_PROMPT, ResumeRefused
from transport.worker.config import WorkerConfig
from transport.worker.context import (
    InvalidHandlerOutput,
    abandon,
    first_step,
    output_problem,
    token_problem,
)
from transport.worker.counters import Shard

__all__ = ["Held", "PauseGate", "RequestContext", "Requests", "ResumeRefused"]

log = logging.getLogger("transport.worker")


# Shared by every context with nothing to send (never appended to: emit() replaces it).
_NO_TOKENS: list[Any] = []


class RequestContext:
    """What a handler knows about its request besides the request itself: ``id`` (the
    submission id, scoped to the client connection) and ``deadline`` (the
    ``time.monotonic()`` by which the client wants the answer; ``inf``: none)."""

    __slots__ = ("_buf", "_first", "_owner", "_seq", "_t0", "deadline", "id", "peer", "stream")

    def __init__(
        self, owner: Requests, peer: bytes, id: int, stream: bool, deadline: float
    ) -> None:
        self._owner = owner
        self.peer = peer
        self.id = id
        self.stream = stream
        self.deadline = deadline
        self._seq = 0
        # (token, logprob, version) emitted and not sent yet: a list of its own once one is.
        self._buf: list[tuple[int, float, int]] = _NO_TOKENS
        self._t0 = time.monotonic() if owner.config.latency_metrics else 0.0
        self._first = 0.0  # when the first token was emitted (0: none yet)

    @property
    def interrupted(self) -> bool:
        """True once the worker is pausing: return the output so far with
        ``stop_reason="interrupt"`` at the next step."""
        return self._owner.gate.paused

    @property
    def version(self) -> int:
        """The weight version the worker serves now (its engine's ``version``)."""
        return self._owner.version()

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        """Stream one generated token (from the worker's loop); those of one loop
        iteration travel in one Stream message. A no-op when no stream was asked for."""
        if not self._first:
            self._first = time.monotonic()
            if self._owner.config.latency_metrics:
                metrics.WORKER_TTFT.observe(self._first - self._t0)
        if not self.stream:
            return
        if not self._buf:
            self._buf = []
            self._owner.flush_soon(self)
        self._buf.append((token, logprob, version))

    def take_stream(self) -> fm.Stream | None:
        """The tokens emitted and not sent yet, as one Stream (None: none)."""
        if not self._buf:
            return None
        tok, lp, ver = zip(*self._buf, strict=True)
        msg = fm.Stream(
            id=self.id,
            seq=self._seq,
            output_tokens=TokenArray(np.array(tok, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(lp, dtype=np.float32)),
            output_versions=TokenArray(np.array(ver, dtype=np.int32)),
        )
        self._seq += 1
        self._buf = _NO_TOKENS
        return msg

    def finished(self, n_tokens: int) -> None:
        """Record the latency histograms of this request's Result of ``n_tokens``."""
        now = time.monotonic()
        metrics.WORKER_E2E.observe(now - self._t0)
        if not self._first:  # nothing streamed: the first token left with the Result
            if n_tokens:
                metrics.WORKER_TTFT.observe(now - self._t0)
        elif n_tokens > 1:
            metrics.WORKER_ITL.observe((now - self._first) / (n_tokens - 1))


class PauseGate:
    """At most ``max_running`` handlers run at once, none starts while paused; pauses
    are counted in ``counts``. The socket thread only reads :attr:`paused` and
    :attr:`running`."""

    def __init__(self, max_running: int, counts: Shard) -> None:
        self.max_running = max_running
        self.counts = counts  # the engine loop's, also the requests'
        self.paused = False
        self.running = 0  # handlers running now
        #: Calls of :meth:`pause`: an in-process pauser sees whether another followed.
        self.pause_requests = 0
        self.on_pause: list[Callable[[], Any]] = []
        self.on_resume: list[Callable[[], Any]] = []
        #: Whether the engine froze its running generations in place when paused (they
        #: go on after the resume, as vLLM's ``pause?mode=keep``): a pause then
        #: completes without waiting for them.
        self.keeps_in_place: Callable[[], bool] = lambda: False
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle: asyncio.Event | None = None  # set once running == 0 (pause() waits)

    def try_enter(self) -> bool:
        """Take a slot if one is free and the worker is not paused."""
        if self.paused or self.running >= self.max_running:
            return False
        self.running += 1
        return True

    async def enter(self) -> None:
        """Take a slot once one is free and the worker is not paused."""
        while not self.try_enter():  # woken: look again
            gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(gate)
            await gate

    def leave(self) -> None:
        """Free a slot."""
        self.running -= 1
        if self.running == 0 and self._idle is not None:
            self._idle.set()  # the pause() calls waiting for it
            self._idle = None
        self._wake(1)

    def _wake(self, n: int) -> None:
        while n > 0 and self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():  # not a request cancelled while it waited
                fut.set_result(None)
                n -= 1

    async def pause(self, timeout: float = 30.0) -> bool:
        """Stop generation: new requests wait, running ones are interrupted (or frozen,
        see :attr:`keeps_in_place`). Returns True once no handler runs (or all are
        frozen), False if some still run after ``timeout`` s."""
        self.pause_requests += 1
        if not self.paused:
            self.counts.counts["pauses"] += 1
            self.paused = True
            await _call_all(self.on_pause)
        if self.running == 0 or self.keeps_in_place():
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return self.running == 0
        return True

    async def resume(self) -> None:
        """Let generation continue (waiting requests start). :class:`ResumeRefused`
        (from an ``on_resume`` callback) when the worker must stay paused."""
        if self.paused:
            await _call_all(self.on_resume)
            self.paused = False
            self._wake(len(self._waiting))


async def _call_all(callbacks: list[Callable[[], Any]]) -> None:
    for cb in callbacks:
        if inspect.isawaitable(out := cb()):
            await out


class Held:
    """One held submission: its task, and what its end needs to know."""

    __slots__ = ("aborted", "ctx", "ran", "started", "sub", "task")

    def __init__(
        self, ctx: RequestContext, sub: fm.Submit, started: Awaitable[LLMResponse] | None
    ) -> None:
        self.ctx = ctx
        self.sub = sub
        self.started = started  # its eagerly started handler
        self.task: asyncio.Task[None] | None = None
        self.ran = False  # the task's body started
        self.aborted = False  # ended by a controller's abort


class Requests:
    """The submissions of one worker, held in ``held`` by ``(peer, id)`` until answered:
    each runs ``handler`` in a slot of ``gate``, is answered through ``send(peer, msg)``
    and counted in ``gate.counts``. ``engine`` (or None) is read for its ``vocab_size``."""

    def __init__(
        self,
        handler: Callable[[LLMRequest, RequestContext], Any],
        engine: Any,
        config: WorkerConfig,
        gate: PauseGate,
        send: Callable[[bytes, Any], None],
    ) -> None:
        self.held: dict[tuple[bytes, int], Held] = {}
        self.handler = handler
        self.engine = engine
        self.config = config
        self.counts = gate.counts
        self.gate = gate
        self._send = send
        self._flushing: list[RequestContext] = []  # contexts with tokens to stream

    def version(self) -> int:
        """The engine's weight version (0 without an engine exposing one)."""
        return int(getattr(self.engine, "version", 0))

    def flush_soon(self, ctx: RequestContext) -> None:
        """Send ``ctx``'s emitted tokens at the end of this loop iteration."""
        if not self._flushing:
            asyncio.get_running_loop().call_soon(self._flush_all)
        self._flushing.append(ctx)

    def _flush_all(self) -> None:
        pending, self._flushing = self._flushing, []
        for ctx in pending:
            msg = ctx.take_stream()
            if msg is not None:
                self._send(ctx.peer, msg)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of the held requests."""
        return [r.task for r in self.held.values() if r.task is not None]

    def cancel(self, peer: bytes, id: int) -> None:
        """Cancel ``peer``'s submission ``id`` if it is held (a client's Cancel)."""
        req = self.held.get((peer, id))
        if req is not None and req.task is not None:
            req.task.cancel()

    def abort_all(self) -> int:
        """Abort every request (each answers ``ABORTED``); returns how many."""
        for req in self.held.values():
            req.aborted = True
            if req.task is not None:
                req.task.cancel()
        return len(self.held)

    def forget(self, peer: bytes) -> list[int]:
        """Cancel ``peer``'s requests (no answer); returns their ids."""
        ids = [id for p, id in self.held if p == peer]
        for id in ids:
            self.cancel(peer, id)
        return ids

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self._send(peer, self.counts.error(id, code, text))

    def _failed(self, peer: bytes, sub: fm.Submit, code: fm.ErrorCode, text: str) -> None:
        # An engine's refusal (or a handler's error, a timeout) is an ``error`` outcome.
        self.counts.counts["errors"] += 1
        self.counts.outcomes["error"] += 1
        self._send_error(peer, sub.id, code, text)

    def _refuse(self, peer: bytes, sub: fm.Submit) -> bool:
        # Whether ``sub`` is refused before it runs (its Error sent).
        if sub.id < 0 or not len(sub.request.input_ids):
            text = f"Submit.id must be >= 0, got {sub.id}" if sub.id < 0 else EMPTY_PROMPT
            self._send(peer, self.counts.bad(peer, sub.id, fm.ErrorCode.BAD_REQUEST, text))
            return True
        vocab = getattr(self.engine, "vocab_size", None)  # an id past it may kill the engine
        if isinstance(vocab, int) and vocab > 0 and type(vocab) is not bool:
            problem = token_problem(sub.request, vocab)
            if problem is not None:
                log.warning("request %s refused by the engine: %s", sub.request.rid, problem)
                self._failed(peer, sub, fm.ErrorCode.HANDLER_ERROR, problem)
                return True
        if len(self.held) < self.config.max_pending:
            return False
        self.counts.counts["overloaded"] += 1
        self.counts.outcomes["rejected"] += 1
        self._send_error(peer, sub.id, fm.ErrorCode.OVERLOADED, "worker holds too many requests")
        return True

    def submit(self, peer: bytes, sub: fm.Submit) -> None:
        """Admit ``sub`` (or refuse it with an Error) and start it."""
        self.counts.counts["received"] += 1
        key = (peer, sub.id)
        if key in self.held:  # a re-send of one in flight: its one answer answers both
            self.counts.counts["duplicates"] += 1
            return
        if self._refuse(peer, sub):
            return
        timeout = sub.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        ctx = RequestContext(self, peer, sub.id, sub.stream, deadline)
        started = None
        if self.config.eager_start and timeout <= 0 and self.gate.try_enter():
            resp, err, started = first_step(self.handler, sub.request, ctx)
            if started is None:  # answered at once: no task, no entry
                self._ended(ctx, sub, resp, err)
                return
        req = Held(ctx, sub, started)
        req.task = task = asyncio.ensure_future(self._run(req))
        task.add_done_callback(functools.partial(self._reap, req))
        self.held[key] = req

    async def _run(self, req: Held) -> None:
        # One request in a task (its handler already running after an eager start).
        req.ran = True
        resp: LLMResponse | None = None
        err: BaseException | None = None
        aw: Any = req.started
        running = aw is not None
        try:
            if aw is None:
                await self.gate.enter()
                running = True
                aw = self.handler(req.sub.request, req.ctx)
            if not hasattr(aw, "__await__"):  # a sync handler's answer
                resp = aw
            elif req.sub.timeout > 0:  # never after an eager start
                resp = await asyncio.wait_for(aw, req.sub.timeout)
            else:
                resp = await aw
        except (Exception, asyncio.CancelledError) as exc:
            err = exc
        self._end(req, running, resp, err)

    def _reap(self, req: Held, _: object) -> None:
        # A task cancelled before its first step (a Cancel in its Submit's batch) never
        # ran _run: do what it would have, or the request would hold its slot forever.
        if not req.ran:
            abandon(req.started)
            self._end(req, req.started is not None, None, asyncio.CancelledError())

    def _end(self, req: Held, running: bool, resp: Any, err: BaseException | None) -> None:
        if running:
            self._ended(req.ctx, req.sub, resp, err, req.aborted)
        else:  # cancelled while waiting for a slot: it never ran
            self.held.pop((req.ctx.peer, req.ctx.id), None)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(req.ctx, req.aborted)

    def _ended(
        self, ctx: RequestContext, sub: fm.Submit, resp: Any, err: Any, aborted: bool = False
    ) -> None:
        # A handler holding a slot returned ``resp`` or raised ``err``: reply, free the slot.
        peer, id = ctx.peer, ctx.id
        try:
            if err is None:
                # Checked here: the client could only say BAD_RESPONSE, not why.
                problem = output_problem(resp)
                if problem is None:
                    self._result(ctx, sub, resp)
                    return
                err = InvalidHandlerOutput(problem)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(ctx, aborted)
            elif isinstance(err, TimeoutError):
                text = f"worker time limit {sub.timeout} s passed"
                self._failed(peer, sub, fm.ErrorCode.TIMEOUT, text)
            else:
                why = f"{type(err).__name__}: {err}"
                if isinstance(err, ValueError):  # the engine refused the input: no traceback
                    log.warning("request %s refused by the engine: %s", sub.request.rid, why)
                else:
                    log.error("handler failed on request %s", sub.request.rid, exc_info=err)
                self._failed(peer, sub, fm.ErrorCode.HANDLER_ERROR, why)
        except Exception:  # a reply that cannot be built must not leak the slot
            self.counts.counts["errors"] += 1
            log.exception("cannot send the reply to request %s", sub.request.rid)
            with contextlib.suppress(Exception):
                self._send_error(peer, id, fm.ErrorCode.HANDLER_ERROR, "invalid handler output")
        finally:
            self.held.pop((peer, id), None)
            self.gate.leave()

    def _result(self, ctx: RequestContext, sub: fm.Submit, resp: LLMResponse) -> None:
        stream = ctx.take_stream()  # tokens not sent yet go before the Result
        if stream is not None:
            self._send(ctx.peer, stream)
        # Counted before it leaves: a health check after the answers sees it.
        n = len(resp.output_tokens)
        self.counts.result(resp.stop_reason, len(sub.request.input_ids), n)
        self._send(
            ctx.peer,
            fm.Result(
                id=ctx.id,
                output_tokens=resp.output_tokens,
                output_logprobs=resp.output_logprobs,
                output_versions=resp.output_versions,
                stop_reason=resp.stop_reason,
            ),
        )
        if self.config.latency_metrics:
            ctx.finished(n)

    def _cancelled(self, ctx: RequestContext, aborted: bool) -> None:
        counts = self.counts
        counts.outcomes["cancelled"] += 1
        if aborted:
            counts.counts["aborted"] += 1
            counts.finished["abort"] += 1
            self._send_error(ctx.peer, ctx.id, fm.ErrorCode.ABORTED, "aborted by a controller")
        else:
            counts.counts["cancelled"] += 1
