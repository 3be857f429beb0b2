"""Rollout side: an asyncio client that spreads requests over generation workers.

One DEALER per worker carries every request to it, matched by a per-submission id in
an in-flight table, so thousands of requests share one connection. Per request:

* **Scheduling**: least outstanding requests among live workers with a free slot;
  requests with the same ``rid`` go to the same worker while it lives (KV-cache reuse).
* **Backpressure**: at most ``max_in_flight_per_worker`` on a worker; the rest wait in
  the client's queue (memory grows with the requests callers are awaiting, nothing
  more), never in a socket.
* **Liveness**: the client pings every worker each ``heartbeat_interval``; a worker
  silent for ``heartbeat_interval * heartbeat_liveness`` is dead, detected at most one
  interval later. Its in-flight requests are re-sent elsewhere under new ids, so a late
  answer from it is recognised as stale and dropped: the caller sees neither an error
  nor a duplicate. A restarted worker answers pings again and rejoins. A request a
  worker gave up by itself (it took this client for dead, or could not deliver the
  answer while the connection was down) is reported ``LOST`` and re-sent the same way;
  every DEALER carries this client's routing id, so a reconnect keeps its identity.
* **Interrupt and resume**: a response with ``stop_reason="interrupt"`` (the worker
  paused for a weight update) is accumulated and the rest re-submitted with
  ``input_ids + output so far`` and ``max_new_tokens`` reduced, until done. The caller
  gets one :class:`~fastio.LLMResponse` whose ``output_versions`` say which weight
  version produced each token.
* **Streaming**: workers stream tokens; ``ttft`` and ``itl`` are measured from their
  arrival times.
* **Timeouts and cancellation**: past its timeout, or when the awaiting task is
  cancelled, a request is cancelled on its worker.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import zmq

from fastio import DecodeError, Decoder, Encoder, LLMRequest, LLMResponse, VLMRequest, VLMResponse
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from fastio.tokens import TokenArray
from transport.errors import (
    ClientClosed,
    NoWorkers,
    RemoteError,
    RequestAborted,
    RequestTimeout,
)
from transport.sockets import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE_SIZE,
    CurveConfig,
    SocketPump,
    make_dealer,
)

__all__ = ["ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"]

log = logging.getLogger("transport.client")

T = TypeVar("T")
ChunkCallback = Callable[[TokenArray, TokenArray, TokenArray], None]


@dataclass
class ClientConfig:
    """Settings of a :class:`FabricClient`.

    Parameters
    ----------
    heartbeat_interval:
        Seconds between pings to each worker.
    heartbeat_liveness:
        Intervals of silence after which a worker is dead (the zguide's Paranoid
        Pirate uses 3). Detection takes at most ``interval * (liveness + 1)``.
    request_timeout:
        Default per-request timeout in seconds (the seed used 3600).
    max_in_flight_per_worker:
        Requests on one worker at once; the rest queue in the client. Keep it below the
        worker's ``max_pending``.
    max_resends:
        Times a request may be re-sent after its worker died before it fails.
    stream:
        Ask workers to stream tokens (real ``ttft``/``itl``); off saves a message per
        loop iteration of the worker per request.
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    sticky_cache_size:
        How many rid -> worker assignments are remembered (when full, the older half
        is forgotten).
    """

    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3
    request_timeout: float = 3600.0
    max_in_flight_per_worker: int = 1024
    max_resends: int = 8
    stream: bool = True
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    hwm: int = DEFAULT_HWM
    curve: CurveConfig | None = None
    sticky_cache_size: int = 100_000


@dataclass
class WorkerInfo:
    """What the client knows about one worker."""

    address: str
    alive: bool
    draining: bool
    in_flight: int
    worker_id: str
    incarnation: str
    version: int
    paused: bool
    last_seen_s_ago: float


class GenerateFuture(asyncio.Future[LLMResponse], Coroutine[Any, Any, LLMResponse]):
    """The pending result of :meth:`FabricClient.agenerate`.

    An :class:`asyncio.Future` (``await`` it, ``asyncio.gather`` or ``asyncio.wait_for``
    it: no task is made for it) that also speaks the coroutine protocol, so
    ``asyncio.create_task``, ``TaskGroup.create_task`` and ``asyncio.run`` accept it
    as they accept the coroutine of an ``async def agenerate``. Cancelling it, or the
    task awaiting it, cancels the request on its worker.
    """

    __slots__ = ("_call", "_client")

    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(loop=loop)
        self._call: _Call | None = None
        self._client: FabricClient | None = None

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the future and the request behind it."""
        if not super().cancel(msg):
            return False
        call, client = self._call, self._client
        self._call = None
        if call is not None and client is not None:
            client._cancelled(call)
        return True

    # -- the coroutine protocol, as ``async def f(): return await fut`` ------------------
    def send(self, value: Any) -> Any:
        """Step as a coroutine: yield this future until done, then return its result."""
        if not self.done():
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        """An exception thrown in (a task cancelled before it waits): cancel the request
        and raise it."""
        exc = typ if isinstance(typ, BaseException) else (typ() if val is None else val)
        if isinstance(exc, asyncio.CancelledError):
            self.cancel()
        raise exc

    def close(self) -> None:
        """Closing the coroutine abandons the request."""
        self.cancel()


class _Call:
    """One ``agenerate`` call, across re-sends and resumptions."""

    __slots__ = (
        "deadline",
        "done",
        "fut",
        "interrupts",
        "on_chunk",
        "orig",
        "out_lp",
        "out_tok",
        "out_ver",
        "resends",
        "seg_streamed",
        "segment",
        "sub_id",
        "t0",
        "timeout",
        "timer",
        "times",
        "worker",
    )  # fmt: skip

    def __init__(
        self, req: LLMRequest, fut: GenerateFuture, on_chunk: ChunkCallback | None
    ) -> None:
        self.orig = req
        self.segment = req
        self.fut = fut
        self.t0 = time.perf_counter()
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = float("inf")
        self.timeout = float("inf")
        self.worker: _Worker | None = None
        self.sub_id = -1
        self.out_tok: TokenArray | None = None
        self.out_lp: TokenArray | None = None
        self.out_ver: TokenArray | None = None
        self.times: list[float] = []  # arrival time of every accumulated/streamed token
        self.seg_streamed = 0
        self.resends = 0
        self.interrupts = 0
        self.done = False
        self.on_chunk = on_chunk


class _Worker:
    __slots__ = (
        "address",
        "alive",
        "cool_until",
        "draining",
        "incarnation",
        "inflight",
        "last_seen",
        "limit",
        "missed",
        "paused",
        "pump",
        "sticky_queue",
        "version",
        "worker_id",
    )  # fmt: skip

    def __init__(self, address: str) -> None:
        self.address = address
        self.alive = False
        self.draining = False
        self.inflight: dict[int, _Call] = {}
        self.sticky_queue: collections.deque[_Call] = collections.deque()
        self.incarnation = ""
        self.worker_id = ""
        self.version = 0
        self.paused = False
        self.last_seen = 0.0
        self.missed = 0
        self.pump: SocketPump | None = None
        # In-flight bound, lowered to what the worker accepted when it answers
        # OVERLOADED (it serves other clients too), raised again by one per answer.
        self.limit = 0
        self.cool_until = 0.0


class FabricClient:
    """Asyncio client of the fabric: ``await client.agenerate(req)``.

    Parameters
    ----------
    workers:
        Worker addresses (``tcp://host:port``, ``ipc://path``); more can be added and
        removed at run time.
    config:
        :class:`ClientConfig`.

    Examples
    --------
    >>> async def rollout():
    ...     async with FabricClient(["tcp://127.0.0.1:5555"]) as client:
    ...         req = LLMRequest(input_ids=[1, 2, 3])
    ...         resp = await client.agenerate(req)
    ...         return resp.output_tokens
    """

    def __init__(self, workers: Sequence[str] = (), config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._initial = list(workers)
        self._workers: dict[str, _Worker] = {}
        self._order: list[_Worker] = []
        self._queue: collections.deque[_Call] = collections.deque()
        self._sticky: dict[str, str] = {}
        self._ids = itertools.count(1)
        # One routing id per client, on every DEALER: a worker knows this client by it
        # across reconnects, so answers survive a reset connection, and what the worker
        # gave up on while we were away is reported back (Error LOST) to the right peer.
        self._identity = b"fc-" + uuid.uuid4().hex.encode()
        self._rr = 0
        self._enc = Encoder()
        self._dec = Decoder(fm.WORKER_TO_CLIENT, max_message_size=self.config.max_message_size)
        self._ctx: zmq.Context[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hb_timer: asyncio.TimerHandle | None = None
        self._last_tick = 0.0
        self._closed = False
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "submitted", "completed", "failed", "resent", "interrupted", "timeouts", "cancelled",
                "stale", "bad_messages", "overloaded", "workers_died", "workers_joined",
            ),
            0,
        )  # fmt: skip

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> FabricClient:
        """Open the sockets in the running loop (done on first use otherwise)."""
        self._start()
        return self

    def _start(self) -> None:
        if self._loop is not None:
            return
        if self._closed:
            raise ClientClosed("the client is closed")
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        for address in self._initial:
            self.add_worker(address)
        self._hb_timer = self._loop.call_later(0, self._heartbeat)

    async def __aenter__(self) -> FabricClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Fail pending requests with :class:`ClientClosed` and close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._hb_timer is not None:
            self._hb_timer.cancel()
        calls = list(self._queue)
        for w in self._order:
            calls += list(w.inflight.values()) + list(w.sticky_queue)
            if w.pump is not None:
                w.pump.close()
        for call in calls:
            self._finish_error(call, ClientClosed("the client was closed"))
        self._workers.clear()
        self._order.clear()
        self._queue.clear()
        if self._ctx is not None:
            self._ctx.term()

    # -- workers --------------------------------------------------------------------
    def add_worker(self, address: str) -> None:
        """Start using the worker at ``address`` (it joins once it answers a ping)."""
        if self._loop is None:
            self._initial.append(address)
            return
        if address in self._workers:
            w = self._workers[address]
            w.draining = False
            return
        assert self._ctx is not None
        w = _Worker(address)
        w.limit = self.config.max_in_flight_per_worker
        sock = make_dealer(
            self._ctx, address, hwm=self.config.hwm, max_message_size=self.config.max_message_size,
            curve=self.config.curve, routing_id=self._identity,
        )  # fmt: skip
        w.pump = SocketPump(
            sock,
            lambda frames, w=w: self._on_message(w, frames),  # type: ignore[misc]
            batch_frames=True,
        )
        self._workers[address] = w
        self._order.append(w)
        self._probe(w, 0.002)

    def _probe(self, w: _Worker, delay: float) -> None:
        # Until a worker first answers, ping it at growing intervals from a few ms up to
        # a quarter heartbeat interval, so a new client starts sending without waiting a
        # whole interval. (Pings sent before the connection is up are dropped: the
        # DEALER has ZMQ_IMMEDIATE; a busy loop can also make the early ones late.)
        if w.alive or w.last_seen or self._closed or w.address not in self._workers:
            return
        self._ping(w)
        assert self._loop is not None
        cap = self.config.heartbeat_interval / 4
        self._loop.call_later(delay, self._probe, w, min(delay * 2, cap))

    def remove_worker(self, address: str) -> None:
        """Stop sending to ``address``; its in-flight requests finish there first (or are
        re-sent if it dies), then its socket closes."""
        w = self._workers.get(address)
        if w is None:
            return
        w.draining = True
        self._requeue(list(w.sticky_queue))
        w.sticky_queue.clear()
        self._maybe_drop(w)
        self._dispatch()

    def _maybe_drop(self, w: _Worker) -> None:
        if w.draining and not w.inflight:
            self._workers.pop(w.address, None)
            if w in self._order:
                self._order.remove(w)
            if w.pump is not None:
                w.pump.close()

    @property
    def workers(self) -> list[WorkerInfo]:
        """A snapshot of every worker's state as this client sees it."""
        now = time.monotonic()
        return [
            WorkerInfo(
                w.address,
                w.alive,
                w.draining,
                len(w.inflight),
                w.worker_id,
                w.incarnation,
                w.version,
                w.paused,
                now - w.last_seen if w.last_seen else float("inf"),
            )
            for w in self._order
        ]

    @property
    def pending(self) -> int:
        """Requests queued in the client or in flight."""
        return len(self._queue) + sum(len(w.inflight) + len(w.sticky_queue) for w in self._order)

    # -- the call -------------------------------------------------------------------
    def agenerate(
        self,
        req: LLMRequest,
        *,
        timeout: float | None = None,
        on_chunk: ChunkCallback | None = None,
    ) -> GenerateFuture:
        """Generate for ``req`` on some worker; ``await`` the result for the whole
        response.

        Called inside the client's running loop, the request is on its way when this
        returns, and the result is a :class:`GenerateFuture`: a future, so
        ``asyncio.gather`` of thousands of them costs no task each, and a coroutine,
        so ``asyncio.create_task`` and task groups take it too. Called with no running
        loop (``asyncio.run(client.agenerate(req))``), it returns a coroutine that
        submits when it first runs.

        Parameters
        ----------
        req:
            The request (its arrays are sent without a copy: do not mutate them until
            the response arrives).
        timeout:
            Seconds (default ``config.request_timeout``).
        on_chunk:
            Called with ``(tokens, logprobs, versions)`` of every streamed chunk.

        Raises
        ------
        RequestTimeout
            Not done in time (it is cancelled on its worker).
        RemoteError
            The worker rejected or failed the request (:class:`RequestAborted` when a
            controller aborted it).
        NoWorkers
            No worker is configured.

        Cancelling the future (or the task awaiting it) cancels the request on its
        worker. Errors are raised where the result is awaited, never by the call.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._agenerate_in_loop(req, timeout, on_chunk)  # type: ignore[return-value]
        fut = GenerateFuture(loop=loop)
        try:
            self._start()
            if loop is not self._loop:
                raise RuntimeError("this FabricClient belongs to another event loop")
            if not self._workers:
                raise NoWorkers("no generation worker configured; add_worker() first")
        except Exception as exc:
            fut.set_exception(exc)
            return fut
        call = _Call(req, fut, on_chunk)
        fut._call = call
        fut._client = self
        t = self.config.request_timeout if timeout is None else timeout
        call.deadline = time.monotonic() + t
        call.timeout = t
        if t < 30 * self.config.heartbeat_interval:
            call.timer = loop.call_later(t, self._on_timeout, call, t)
        # Longer timeouts are checked on every heartbeat tick (precision: one interval),
        # which spares a timer per request when thousands are in flight.
        self.stats["submitted"] += 1
        self._enqueue(call)
        return fut

    async def _agenerate_in_loop(
        self, req: LLMRequest, timeout: float | None, on_chunk: ChunkCallback | None
    ) -> LLMResponse:
        return await self.agenerate(req, timeout=timeout, on_chunk=on_chunk)

    def _cancelled(self, call: _Call) -> None:
        """The caller cancelled ``call``'s future: stop it here and on its worker."""
        if not call.done:
            self.stats["cancelled"] += 1
            self._abandon(call)

    # -- scheduling -----------------------------------------------------------------
    def _enqueue(self, call: _Call, front: bool = False) -> None:
        w = self._target(call)
        if w is not None and not self._queue:
            self._send_call(w, call)
        else:
            if front:
                self._queue.appendleft(call)
            else:
                self._queue.append(call)
            self._dispatch()

    def _target(self, call: _Call) -> _Worker | None:
        """The worker to send ``call`` to now, or None: its rid's worker while that one
        lives (None when it is full), else the live worker with the fewest requests in
        flight and a free slot."""
        addr = self._sticky.get(call.orig.rid)
        if addr is not None:
            w = self._workers.get(addr)
            if w is not None and w.alive and not w.draining:
                if len(w.inflight) < w.limit and _warm(w):
                    return w
                return None
        best: _Worker | None = None
        order = self._order
        n = len(order)
        if n == 0:
            return None
        self._rr = (self._rr + 1) % n
        for i in range(n):
            w = order[(self._rr + i) % n]
            if (
                w.alive
                and not w.draining
                and len(w.inflight) < w.limit
                and _warm(w)
                and (best is None or len(w.inflight) < len(best.inflight))
            ):
                best = w
        return best

    def _dispatch(self) -> None:
        q = self._queue
        while q:
            call = q[0]
            if call.done:
                q.popleft()
                continue
            addr = self._sticky.get(call.orig.rid)
            if addr is not None:
                w = self._workers.get(addr)
                if w is not None and w.alive and not w.draining and len(w.inflight) >= w.limit:
                    # Its worker is busy: wait there, do not block the others.
                    q.popleft()
                    w.sticky_queue.append(call)
                    continue
            target = self._target(call)
            if target is None:
                return
            q.popleft()
            self._send_call(target, call)

    def _send_call(self, w: _Worker, call: _Call) -> None:
        sub_id = next(self._ids)
        try:
            frames = self._enc.encode(
                fm.Submit(id=sub_id, request=call.segment, stream=self.config.stream)
            )
        except Exception as exc:
            # Encoded before it takes a slot: a request that cannot be sent (an
            # EncodeError, say) fails alone, whether sent by its caller or dispatched
            # from the queue inside a socket callback, and leaks nothing.
            self._finish_error(call, exc)
            return
        call.worker = w
        call.sub_id = sub_id
        call.seg_streamed = 0
        w.inflight[sub_id] = call
        sticky = self._sticky
        rid = call.orig.rid
        if sticky.get(rid) != w.address:
            if len(sticky) >= self.config.sticky_cache_size:
                # Forget the older half at once. (Deleting the oldest entry one at a
                # time costs O(n) per deletion: a dict's iteration skips the dead
                # slots at its front, ~7 us per request at 100k entries.)
                self._sticky = sticky = dict(
                    itertools.islice(sticky.items(), len(sticky) // 2, None)
                )
            sticky[rid] = w.address
        assert w.pump is not None
        w.pump.send(frames)

    def _slot_freed(self, w: _Worker) -> None:
        sq = w.sticky_queue
        while sq and len(w.inflight) < w.limit and w.alive and not w.draining:
            call = sq.popleft()
            if not call.done:
                self._send_call(w, call)
        if w.draining:
            self._maybe_drop(w)
        if self._queue:
            self._dispatch()

    def _requeue(self, calls: list[_Call]) -> None:
        for call in reversed(calls):
            if not call.done:
                call.worker = None
                self._queue.appendleft(call)

    def _detach(self, call: _Call, send_cancel: bool) -> None:
        w = call.worker
        if w is not None and w.inflight.pop(call.sub_id, None) is not None:
            if send_cancel and w.pump is not None:
                w.pump.send(self._enc.encode(fm.Cancel(id=call.sub_id)))
            call.worker = None
            self._slot_freed(w)

    def _abandon(self, call: _Call) -> None:
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        self._detach(call, send_cancel=True)

    def _on_timeout(self, call: _Call, t: float) -> None:
        if call.done:
            return
        self.stats["timeouts"] += 1
        self._abandon(call)
        call.fut._call = None
        if not call.fut.done():
            call.fut.set_exception(RequestTimeout(f"request {call.orig.rid} not done within {t} s"))

    def _finish_error(self, call: _Call, exc: BaseException) -> None:
        if call.done:
            return
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        self.stats["failed"] += 1
        fut = call.fut
        fut._call = None
        if not fut.done():
            fut.set_exception(exc)

    # -- heartbeats and liveness ------------------------------------------------------
    def _ping(self, w: _Worker) -> None:
        self._try_send(w, fm.Heartbeat(sent_at=time.time()))

    def _try_send(self, w: _Worker, msg: Any) -> None:
        # For messages whose loss is harmless (pings, cancels to a worker presumed
        # dead): never queued, so nothing piles up for a worker that is down.
        if w.pump is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            w.pump.sock.send_multipart(self._enc.encode(msg), zmq.NOBLOCK, copy=False)
        # A send can consume the edge of ZeroMQ's FD: look for input at once.
        w.pump.poke()

    def _heartbeat(self) -> None:
        assert self._loop is not None
        cfg = self.config
        now = time.monotonic()
        dead_after = cfg.heartbeat_interval * cfg.heartbeat_liveness
        prev = self._last_tick
        self._sweep_deadlines(now)
        for w in list(self._order):
            if w.pump is not None:
                # Our own loop may lag behind the socket: read what has arrived before
                # judging a worker silent.
                w.pump.drain_now()
            if w.alive:
                # Paranoid Pirate: count silent intervals as *our* ticks, so a busy
                # client loop (late ticks) does not mistake its own lag for a death.
                w.missed = w.missed + 1 if w.last_seen < prev else 0
                if w.missed >= cfg.heartbeat_liveness and now - w.last_seen > dead_after:
                    self._worker_died(w, f"silent for {now - w.last_seen:.2f} s")
            self._ping(w)
        self._last_tick = now
        self._hb_timer = self._loop.call_later(cfg.heartbeat_interval, self._heartbeat)

    def _sweep_deadlines(self, now: float) -> None:
        expired = [c for c in self._queue if c.deadline <= now and c.timer is None]
        for w in self._order:
            for group in (w.inflight.values(), w.sticky_queue):
                expired += [c for c in group if c.deadline <= now and c.timer is None]
        for call in expired:
            self._on_timeout(call, call.timeout)

    def _worker_died(self, w: _Worker, why: str) -> None:
        self.stats["workers_died"] += 1
        w.alive = False
        calls = list(w.inflight.values()) + list(w.sticky_queue)
        if w.pump is not None:
            w.pump.discard_queued()
        for sub_id in w.inflight:
            # In case it is only slow, not dead: stop it working for nobody.
            self._try_send(w, fm.Cancel(id=sub_id))
        w.inflight.clear()
        w.sticky_queue.clear()
        log.warning("worker %s is dead (%s): re-sending %d requests", w.address, why, len(calls))
        live: list[_Call] = []
        for call in calls:
            if not call.done and self._may_resend(call, w, "its worker died"):
                live.append(call)
        self.stats["resent"] += len(live)
        self._requeue(live)
        self._maybe_drop(w)
        self._dispatch()

    def _may_resend(self, call: _Call, w: _Worker, why: str, code: int = 0) -> bool:
        """Count an attempt lost under ``call`` (worker death or a LOST report): forget
        that attempt's tokens and timings, and fail the call past ``max_resends``.
        Returns whether it may be sent again."""
        call.resends += 1
        del call.times[len(call.out_tok) if call.out_tok is not None else 0 :]
        if call.resends <= self.config.max_resends:
            return True
        self._finish_error(
            call,
            RemoteError(
                f"request {call.orig.rid}: attempt {call.resends} lost ({why}); giving up",
                code=code,
                worker=w.address,
            ),
        )
        return False

    def _on_heartbeat(self, w: _Worker, hb: fm.Heartbeat) -> None:
        if w.incarnation and hb.incarnation != w.incarnation and (w.inflight or w.sticky_queue):
            # Restarted faster than the liveness timeout: what it had is lost.
            self._worker_died(w, "restarted")
        w.worker_id = hb.worker_id
        w.incarnation = hb.incarnation
        w.version = hb.version
        w.paused = hb.paused
        w.missed = 0
        if not w.alive:
            w.alive = True
            self.stats["workers_joined"] += 1
            log.info("worker %s (%s) joined", w.address, hb.worker_id)
            self._dispatch()

    # -- receiving --------------------------------------------------------------------
    def _on_message(self, w: _Worker, frames: list[zmq.Frame]) -> None:
        w.last_seen = time.monotonic()
        for msg in fm.split(frames):
            self._on_one(w, msg)

    def _on_one(self, w: _Worker, frames: list[zmq.Frame]) -> None:
        try:
            msg = self._dec.decode(frames)
        except DecodeError as exc:
            self._bad_message(w, frames, exc)
            return
        tp = type(msg)
        if tp is fm.Result:
            call = w.inflight.pop(msg.id, None)
            if call is None:
                self.stats["stale"] += 1
                return
            self._on_result(w, call, msg)
            if w.limit < self.config.max_in_flight_per_worker:
                w.limit += 1
            self._slot_freed(w)
        elif tp is fm.Stream:
            call = w.inflight.get(msg.id)
            if call is None:
                return
            k = len(msg.output_tokens)
            call.seg_streamed += k
            now = time.perf_counter()
            call.times.extend([now] * k)
            if call.on_chunk is not None:
                call.on_chunk(msg.output_tokens, msg.output_logprobs, msg.output_versions)
        elif tp is fm.Heartbeat:
            self._on_heartbeat(w, msg)
        elif tp is fm.Error:
            self._on_error(w, msg)
        else:
            self.stats["bad_messages"] += 1

    def _bad_message(self, w: _Worker, frames: list[zmq.Frame], exc: DecodeError) -> None:
        self.stats["bad_messages"] += 1
        n = self.stats["bad_messages"]
        if n <= 10 or (n & (n - 1)) == 0:
            log.warning("bad message from worker %s: %s (occurrence %d)", w.address, exc, n)
        _, kind, first = fm.peek(frames)
        call = (
            w.inflight.pop(first, None)
            if kind == MsgKind.FABRIC_RESULT and first is not None
            else None
        )
        assert w.pump is not None
        w.pump.send(
            self._enc.encode(
                fm.Error(
                    id=first if call is not None and first is not None else -1,
                    code=int(fm.ErrorCode.BAD_RESPONSE),
                    message=str(exc),
                )
            )
        )
        if call is not None:
            self._finish_error(
                call,
                RemoteError(
                    f"malformed response from {w.address}: {exc}",
                    code=int(fm.ErrorCode.BAD_RESPONSE),
                    worker=w.address,
                ),
            )
            self._slot_freed(w)

    def _on_error(self, w: _Worker, err: fm.Error) -> None:
        call = w.inflight.pop(err.id, None)
        if call is None:
            if err.code != fm.ErrorCode.LOST:  # LOST of a call already ended: stale
                log.warning("worker %s reports error %d: %s", w.address, err.code, err.message)
            return
        call.worker = None
        if err.code == fm.ErrorCode.OVERLOADED:
            self.stats["overloaded"] += 1
            del call.times[len(call.out_tok) if call.out_tok is not None else 0 :]
            w.limit = max(1, len(w.inflight))
            if not w.inflight:
                # Full with other clients' work: back off briefly instead of spinning.
                w.cool_until = time.monotonic() + 0.01
                assert self._loop is not None
                self._loop.call_later(0.011, self._dispatch)
            self._queue.appendleft(call)
        elif err.code == fm.ErrorCode.ABORTED:
            self._finish_error(call, RequestAborted(err.message, code=err.code, worker=w.address))
        elif err.code == fm.ErrorCode.LOST:
            # The worker gave it up by itself (it took this client for dead while our
            # loop stalled, or could not deliver the answer): re-send it, as if that
            # worker had died under it.
            if self._may_resend(call, w, "the worker lost it", code=err.code):
                self.stats["resent"] += 1
                self._queue.appendleft(call)
        else:
            self._finish_error(
                call,
                RemoteError(f"worker {w.address}: {err.message}", code=err.code, worker=w.address),
            )
        self._slot_freed(w)

    def _on_result(self, w: _Worker, call: _Call, res: fm.Result) -> None:
        if call.done:
            return
        now = time.perf_counter()
        n = len(res.output_tokens)
        orig = call.orig
        if not call.times and call.out_tok is None and res.stop_reason != "interrupt":
            # One segment, nothing streamed: every token arrived now. The worker's
            # arrays become the response as they are (views of the received frames).
            latency = now - call.t0
            out = _response(
                orig, res.output_tokens, res.output_logprobs, res.output_versions,
                res.stop_reason, latency, latency, TokenArray._wrap(np.zeros(max(n - 1, 0))),
            )  # fmt: skip
            self._complete(call, out)
            return
        # Tokens the stream did not announce (no streaming, or a final burst) arrive now.
        base = len(call.out_tok) if call.out_tok is not None else 0
        extra = base + n - len(call.times)
        if extra > 0:
            call.times.extend([now] * extra)
        elif extra < 0:
            del call.times[base + n :]
        if call.out_tok is None:
            toks, lps, vers = res.output_tokens, res.output_logprobs, res.output_versions
            if res.stop_reason == "interrupt":
                # Private copies: later segments are appended to them.
                call.out_tok, call.out_lp, call.out_ver = toks.copy(), lps.copy(), vers.copy()
        else:
            assert call.out_lp is not None and call.out_ver is not None
            call.out_tok.extend(res.output_tokens.array)
            call.out_lp.extend(res.output_logprobs.array)
            call.out_ver.extend(res.output_versions.array)
            toks, lps, vers = call.out_tok, call.out_lp, call.out_ver
        stop_reason = res.stop_reason
        if stop_reason == "interrupt":
            assert call.out_tok is not None
            produced = len(call.out_tok)
            remaining = orig.gconfig.max_new_tokens - produced
            if remaining > 0:
                call.interrupts += 1
                self.stats["interrupted"] += 1
                call.segment = _continuation(orig, call.out_tok, produced, remaining)
                self._enqueue(call, front=True)
                return
            stop_reason = "length"
            assert call.out_lp is not None and call.out_ver is not None
            toks, lps, vers = call.out_tok, call.out_lp, call.out_ver
        times = call.times
        out = _response(
            orig, toks, lps, vers, stop_reason, now - call.t0,
            times[0] - call.t0 if times else now - call.t0,
            TokenArray(np.diff(np.asarray(times, dtype=np.float64))) if times else TokenArray(np.zeros(0)),
        )  # fmt: skip
        self._complete(call, out)

    def _complete(self, call: _Call, out: LLMResponse) -> None:
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        self.stats["completed"] += 1
        fut = call.fut
        fut._call = None
        if not fut.done():
            fut.set_result(out)


def _warm(w: _Worker) -> bool:
    return not w.cool_until or w.cool_until <= time.monotonic()


def _response(
    orig: LLMRequest,
    toks: Any,
    lps: Any,
    vers: Any,
    stop_reason: Any,
    latency: float,
    ttft: float,
    itl: TokenArray,
) -> LLMResponse:
    """The caller's response: the worker's output around the caller's own prompt."""
    if isinstance(orig, VLMRequest):
        return VLMResponse(
            input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
            output_versions=vers, stop_reason=stop_reason, latency=latency, ttft=ttft, itl=itl,
            input_images=list(orig.image_data or []),
        )  # fmt: skip
    return LLMResponse(
        input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
        output_versions=vers, stop_reason=stop_reason, latency=latency, ttft=ttft, itl=itl,
    )  # fmt: skip


def _continuation(
    orig: LLMRequest, out_tok: TokenArray, produced: int, remaining: int
) -> LLMRequest:
    """The rest of an interrupted request: prompt plus output so far, fewer new tokens."""
    g = orig.gconfig.new(
        max_new_tokens=remaining, min_new_tokens=max(0, orig.gconfig.min_new_tokens - produced)
    )
    ids = orig.input_ids + out_tok
    if isinstance(orig, VLMRequest):
        return VLMRequest(
            rid=orig.rid,
            input_ids=ids,
            gconfig=g,
            metadata=orig.metadata,
            model_id=orig.model_id,
            image_data=orig.image_data,
        )
    return LLMRequest(
        rid=orig.rid, input_ids=ids, gconfig=g, metadata=orig.metadata, model_id=orig.model_id
    )


class SyncFabricClient:
    """A :class:`FabricClient` driven from synchronous code: its loop runs in a
    background thread.

    Examples
    --------
    >>> with SyncFabricClient(["tcp://127.0.0.1:5555"]) as client:  # doctest: +SKIP
    ...     resp = client.generate(LLMRequest(input_ids=[1, 2, 3]))
    """

    def __init__(self, workers: Sequence[str] = (), config: ClientConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fabric-client", daemon=True
        )
        self._thread.start()
        self.client = FabricClient(workers, config)
        self._run(self.client.start())

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def generate(self, req: LLMRequest, *, timeout: float | None = None) -> LLMResponse:
        """Blocking :meth:`FabricClient.agenerate`."""
        return self._run(self.client._agenerate_in_loop(req, timeout, None))

    def submit(
        self, req: LLMRequest, *, timeout: float | None = None
    ) -> concurrent.futures.Future[LLMResponse]:
        """Start a request; returns a ``concurrent.futures.Future``."""
        # A coroutine that calls agenerate in the client's loop (called here, agenerate
        # would bind to this thread's loop if it has one).
        return asyncio.run_coroutine_threadsafe(
            self.client._agenerate_in_loop(req, timeout, None), self._loop
        )

    def add_worker(self, address: str) -> None:
        """Thread-safe :meth:`FabricClient.add_worker`."""
        self._loop.call_soon_threadsafe(self.client.add_worker, address)

    def remove_worker(self, address: str) -> None:
        """Thread-safe :meth:`FabricClient.remove_worker`."""
        self._loop.call_soon_threadsafe(self.client.remove_worker, address)

    def close(self) -> None:
        """Close the client and stop its thread."""
        if self._thread.is_alive():
            self._run(self.client.close(), timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> SyncFabricClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
