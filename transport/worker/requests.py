"""The requests a worker holds: admitted, run in a slot, answered once (engine's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from transport.errors import EMPTY_PROMPT
from transport.worker.config import WorkerConfig
from transport.worker.context import (
    InvalidHandlerOutput,
    RequestContext,
    abandon,
    first_step,
    output_problem,
    token_problem,
)
from transport.worker.counters import Shard, log_counted
from transport.worker.pausing import PauseGate

__all__ = ["Held", "Requests"]

log = logging.getLogger("transport.worker")

_INF = float("inf")


class Held:
    """One held submission: its task, and what its end needs to know."""

    __slots__ = ("aborted", "ctx", "ran", "started", "sub", "task")

    def __init__(self, ctx: RequestContext, sub: fm.Submit) -> None:
        self.ctx = ctx
        self.sub = sub
        self.started: Awaitable[LLMResponse] | None = None  # its eagerly started handler
        self.task: asyncio.Task[None] | None = None
        self.ran = False  # the task's body started
        self.aborted = False  # ended by a controller's abort


class Requests:
    """The submissions of one worker, held in ``held`` by ``(peer, id)`` until answered.

    Each runs ``handler`` in a slot of ``gate`` and is answered through ``send(peer,
    msg)``; counted in ``counts``. Their contexts read the weight ``version()``;
    ``engine`` (or None) is read for its ``vocab_size``.
    """

    def __init__(
        self,
        held: dict[tuple[bytes, int], Held],
        handler: Callable[[LLMRequest, RequestContext], Any],
        engine: Any,
        config: WorkerConfig,
        counts: Shard,
        gate: PauseGate,
        send: Callable[[bytes, Any], None],
        version: Callable[[], int],
    ) -> None:
        self.held = held
        self.handler = handler
        self.engine = engine
        self.config = config
        self.counts = counts
        self.gate = gate
        self._send = send
        self.version = version
        #: Record the latency histograms.
        self.latency_metrics = config.latency_metrics
        self._flushing: list[RequestContext] = []  # contexts with tokens to stream

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
        ids = []
        for (p, id), req in list(self.held.items()):
            if p == peer:
                if req.task is not None:
                    req.task.cancel()
                ids.append(id)
        return ids

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self.counts.errors[code.name] += 1
        self._send(peer, fm.Error(id=id, code=int(code), message=text))

    def _bad(self, peer: bytes, id: int, text: str) -> None:
        log_counted(self.counts.bad(), "bad message from %r: %s", peer, text)
        self._send_error(peer, id, fm.ErrorCode.BAD_REQUEST, text)

    def submit(self, peer: bytes, sub: fm.Submit) -> None:
        """Admit ``sub`` (or refuse it with an Error) and start it."""
        counts = self.counts
        counts.counts["received"] += 1
        key = (peer, sub.id)
        if key in self.held:  # a re-send of one in flight: its one answer answers both
            counts.counts["duplicates"] += 1
            return
        if sub.id < 0:
            self._bad(peer, sub.id, f"Submit.id must be >= 0, got {sub.id}")
            return
        if not len(sub.request.input_ids):
            self._bad(peer, sub.id, EMPTY_PROMPT)
            return
        vocab = getattr(self.engine, "vocab_size", None)  # an id past it may kill the engine
        if isinstance(vocab, int) and vocab > 0 and type(vocab) is not bool:
            problem = token_problem(sub.request, vocab)
            if problem is not None:  # answered as the engine's own refusal would be
                counts.counts["errors"] += 1
                counts.outcomes["error"] += 1
                log.warning("request %s refused by the engine: %s", sub.request.rid, problem)
                self._send_error(peer, sub.id, fm.ErrorCode.HANDLER_ERROR, problem)
                return
        if len(self.held) >= self.config.max_pending:
            counts.counts["overloaded"] += 1
            counts.outcomes["rejected"] += 1
            text = "worker holds too many requests"
            self._send_error(peer, sub.id, fm.ErrorCode.OVERLOADED, text)
            return
        timeout = sub.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else _INF
        ctx = RequestContext(self, peer, sub.id, sub.stream, deadline)
        started = None
        if self.config.eager_start and timeout <= 0 and self.gate.try_enter():
            resp, err, started = first_step(self.handler, sub.request, ctx)
            if started is None:  # answered at once: no task, no entry
                self._ended(ctx, sub, resp, err)
                return
        req = Held(ctx, sub)
        req.started = started
        req.task = task = asyncio.ensure_future(self._run(req))
        task.add_done_callback(functools.partial(self._reap, req))
        self.held[key] = req

    async def _run(self, req: Held) -> None:
        """One request in a task (its handler already running after an eager start)."""
        req.ran = True
        resp: LLMResponse | None = None
        err: BaseException | None = None
        started = req.started
        running = started is not None
        try:
            if started is not None:
                resp = await started
            else:
                await self.gate.enter()
                running = True
                sub = req.sub
                aw = self.handler(sub.request, req.ctx)
                if not hasattr(aw, "__await__"):  # a sync handler's answer
                    resp = aw
                elif sub.timeout > 0:
                    resp = await asyncio.wait_for(aw, sub.timeout)
                else:
                    resp = await aw
        except (Exception, asyncio.CancelledError) as exc:
            err = exc
        if running:
            self._ended(req.ctx, req.sub, resp, err, req.aborted)
        else:  # cancelled while waiting for a slot: it never ran
            self.held.pop((req.ctx.peer, req.ctx.id), None)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(req.ctx, req.aborted)

    def _reap(self, req: Held, _: object) -> None:
        # A task cancelled before its first step (a Cancel in its Submit's batch) never
        # ran _run: do what it would have, or the request would hold its slot forever.
        if req.ran:
            return
        abandon(req.started)
        if req.started is not None:
            self._ended(req.ctx, req.sub, None, asyncio.CancelledError(), req.aborted)
        else:
            self.held.pop((req.ctx.peer, req.ctx.id), None)
            self._cancelled(req.ctx, req.aborted)

    def _ended(
        self, ctx: RequestContext, sub: fm.Submit, resp: LLMResponse | None,
        err: BaseException | None, aborted: bool = False,
    ) -> None:  # fmt: skip
        """A handler holding a slot returned ``resp`` or raised ``err`` (``aborted``: its
        task was cancelled by an abort): reply, free the slot."""
        peer, id = ctx.peer, ctx.id
        counts = self.counts
        try:
            if err is None:
                # Checked here: the client could only say BAD_RESPONSE, not why.
                problem = output_problem(resp)
                if problem is None:
                    assert resp is not None
                    stream = ctx.take_stream()  # tokens not sent yet go before the Result
                    if stream is not None:
                        self._send(peer, stream)
                    # Counted before it leaves: a health check after the answers sees it.
                    n = len(resp.output_tokens)
                    counts.result(resp.stop_reason, len(sub.request.input_ids), n)
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
                    if self.latency_metrics:
                        ctx.finished(n)
                    return
                err = InvalidHandlerOutput(problem)
            if isinstance(err, asyncio.CancelledError):
                self._cancelled(ctx, aborted)
                return
            counts.counts["errors"] += 1
            counts.outcomes["error"] += 1
            if isinstance(err, TimeoutError):
                text = f"worker time limit {sub.timeout} s passed"
                self._send_error(peer, id, fm.ErrorCode.TIMEOUT, text)
                return
            if isinstance(err, ValueError):  # the engine refused the input: no traceback
                why = f"{type(err).__name__}: {err}"
                log.warning("request %s refused by the engine: %s", sub.request.rid, why)
            else:
                log.error("handler failed on request %s", sub.request.rid, exc_info=err)
            self._send_error(peer, id, fm.ErrorCode.HANDLER_ERROR, f"{type(err).__name__}: {err}")
        except Exception:  # a reply that cannot be built must not leak the slot
            counts.counts["errors"] += 1
            log.exception("cannot send the reply to request %s", sub.request.rid)
            with contextlib.suppress(Exception):
                self._send_error(peer, id, fm.ErrorCode.HANDLER_ERROR, "invalid handler output")
        finally:
            self.held.pop((peer, id), None)
            self.gate.leave()

    def _cancelled(self, ctx: RequestContext, aborted: bool) -> None:
        counts = self.counts
        counts.outcomes["cancelled"] += 1
        if aborted:
            counts.counts["aborted"] += 1
            counts.finished["abort"] += 1
            self._send_error(ctx.peer, ctx.id, fm.ErrorCode.ABORTED, "aborted by a controller")
        else:
            counts.counts["cancelled"] += 1
