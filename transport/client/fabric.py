"""The asyncio rollout client: its public API, its lifecycle, and what it receives."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

import zmq

from fastio import DecodeError, IncompatiblePeer, LLMRequest, LLMResponse, versions
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from transport import metrics
from transport.addresses import resolve_problem, tcp_host
from transport.client.calls import Call, absorb_result, on_stream
from transport.client.config import ChunkCallback, ClientConfig
from transport.client.future import GenerateFuture, install_task_factory
from transport.client.liveness import Liveness, log
from transport.client.workers import MONITOR_EVENTS, Worker, WorkerInfo, check_address
from transport.errors import (
    EMPTY_PROMPT,
    BadAddress,
    ClientClosed,
    IncompatibleWorkers,
    NoWorkers,
    RemoteError,
    RequestAborted,
)
from transport.sockets import SocketPump, make_dealer

__all__ = ["FabricClient"]


class FabricClient(Liveness):
    """Asyncio client of the fabric: ``await client.agenerate(req)``.

    Parameters
    ----------
    workers:
        Worker addresses (``tcp://host:port``, ``ipc://path``, ``inproc://name``); more
        can be added and removed at run time. A malformed one raises
        :class:`~transport.BadAddress` here.
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
        super().__init__(config)
        self._initial = [check_address(a) for a in workers]
        #: Port of the metrics endpoint once started (``config.metrics_port``).
        self.metrics_port: int | None = None

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
        install_task_factory(self._loop)
        self._ctx = zmq.Context()
        self._alive_at = time.monotonic()
        metrics.expose("client")
        if self.config.metrics_port is not None:
            self.metrics_port = metrics.start_http_server(self.config.metrics_port)
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
        for timer in (self._hb_timer, self._nw_timer, self._gate_timer):
            if timer is not None:
                timer.cancel()
        calls = list(self._queue) + list(self._backing_off)
        for w in self._order:
            calls += list(w.inflight.values()) + list(w.sticky_queue)
            w.close()
        for call in calls:
            self._finish_error(call, ClientClosed("the client was closed"))
        self._workers.clear()
        self._order.clear()
        self._queue.clear()
        if self._ctx is not None:
            self._ctx.term()

    # -- workers --------------------------------------------------------------------
    def add_worker(self, address: str) -> None:
        """Start using the worker at ``address`` (it joins once it answers a ping).

        Raises :class:`~transport.BadAddress` when ``address`` is malformed."""
        check_address(address)
        if self._loop is None:
            self._initial.append(address)
            return
        if address in self._workers:
            self._workers[address].draining = False
            return
        assert self._ctx is not None
        w = Worker(address)
        w.limit = self.config.max_in_flight_per_worker
        w.added_at = time.monotonic()
        try:
            sock = make_dealer(
                self._ctx, address, hwm=self.config.hwm,
                max_message_size=self.config.max_message_size, curve=self.config.curve,
                routing_id=self._identity,
            )  # fmt: skip
        except zmq.ZMQError as exc:
            raise BadAddress(f"cannot connect to worker address {address!r}: {exc}") from exc
        # Watched so that NoWorkerAvailable can say why a worker was never heard from.
        w.monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        w.pump = SocketPump(
            sock,
            functools.partial(self._on_message, w),
            batch_frames=True,
            defer_check=True,
        )
        self._workers[address] = w
        self._order.append(w)
        if tcp_host(address) is not None:  # a host name: say so if it does not resolve
            lookup = self._loop.run_in_executor(None, resolve_problem, address)
            lookup.add_done_callback(functools.partial(_resolved, w))
        if not self._n_alive:
            self._alive_at = time.monotonic()  # a new worker gets its connect_timeout
            # Calls made before any worker answers wait for every one that is up, so
            # that the first to answer does not take them all.
            self._gating = True
        self._probe(w, 0.002)

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
        if self._gating:
            self._gate_check()  # no longer waited for
        self._dispatch()

    @property
    def workers(self) -> list[WorkerInfo]:
        """A snapshot of every worker's state as this client sees it."""
        now = time.monotonic()
        curve = self.config.curve is not None
        for w in self._order:
            if not w.alive:
                w.poll_monitor()
        return [w.info(now, curve) for w in self._order]

    @property
    def pending(self) -> int:
        """Requests queued in the client, waiting to be re-sent, or in flight."""
        return (
            len(self._queue)
            + len(self._backing_off)
            + sum(len(w.inflight) + len(w.sticky_queue) for w in self._order)
        )

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
        returns, and the result is a :class:`GenerateFuture`: an ``asyncio.Future``
        (not a coroutine), so ``gather``, ``wait``, ``as_completed``, ``wait_for`` and
        ``shield`` take it with no task per request; ``create_task`` and
        ``TaskGroup.create_task`` take it through the client's task factory. Called
        with no running loop (``asyncio.run(client.agenerate(req))``), it returns a
        coroutine that submits when it first runs.

        Parameters
        ----------
        req:
            The request (its arrays are sent without a copy: do not mutate them until
            the response arrives).
        timeout:
            Seconds (default ``config.request_timeout``).
        on_chunk:
            Called with ``(tokens, logprobs, versions)`` as output arrives: every output
            position exactly once and in order, also across re-sends and interrupts
            (a re-send continues after the tokens already delivered), so the final
            ``output_tokens`` are the chunks concatenated.

        Raises
        ------
        RequestTimeout
            Not done in time (it is cancelled on its worker).
        RemoteError
            The worker rejected or failed the request (:class:`RequestAborted` when a
            controller aborted it).
        NoWorkerAvailable
            No worker has been alive for ``config.connect_timeout``; the error names
            each address and what was seen there.
        NoWorkers
            No worker is configured.
        ValueError
            ``req.input_ids`` is empty.

        Cancelling the future (or a task awaiting it) cancels the request on its
        worker. Errors are raised where the result is awaited, never by the call.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._agenerate_in_loop(req, timeout, on_chunk)  # type: ignore[return-value]
        fut = GenerateFuture(loop=loop)
        if not len(req.input_ids):  # refused here rather than by a worker, a round trip later
            fut.set_exception(ValueError(EMPTY_PROMPT))
            return fut
        if loop is not self._loop or not self._n_alive or not self._workers:
            try:
                self._start()
                if loop is not self._loop:
                    raise RuntimeError("this FabricClient belongs to another event loop")
                if not self._workers:
                    raise NoWorkers("no generation worker configured; add_worker() first")
                if not self._n_alive and self._no_worker_expired():
                    self.stats["no_worker"] += 1
                    raise self._no_worker_error()
                if not self._n_alive and self._all_incompatible():
                    self.stats["no_worker"] += 1
                    raise self._incompatible_error()
            except Exception as exc:
                fut.set_exception(exc)
                return fut
        call = Call(req, fut, on_chunk)
        fut._call = call
        fut._canceller = self._cancelled
        config = self.config
        t = config.request_timeout if timeout is None else timeout
        call.deadline = time.monotonic() + t
        call.timeout = t
        if t < 30 * config.heartbeat_interval:
            call.timer = loop.call_later(t, self._on_timeout, call, t)
        # Longer timeouts are checked on every heartbeat tick (precision: one interval),
        # which spares a timer per request when thousands are in flight.
        self.stats["submitted"] += 1
        self._enqueue(call)
        if not self._n_alive:
            self._watch_for_none()
        return fut

    async def _agenerate_in_loop(
        self, req: LLMRequest, timeout: float | None, on_chunk: ChunkCallback | None
    ) -> LLMResponse:
        return await self.agenerate(req, timeout=timeout, on_chunk=on_chunk)

    # -- receiving --------------------------------------------------------------------
    def _on_message(self, w: Worker, frames: list[zmq.Frame]) -> None:
        w.last_seen = time.monotonic()
        for msg in fm.split(frames):
            self._on_one(w, msg)

    def _on_one(self, w: Worker, frames: list[zmq.Frame]) -> None:
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
            self._on_result(call, msg)
            if w.limit < self.config.max_in_flight_per_worker:
                w.limit += 1
            if w.sticky_queue or w.draining or self._queue:
                self._slot_freed(w)
        elif tp is fm.Stream:
            call = w.inflight.get(msg.id)
            if call is not None:
                on_stream(call, msg)
        elif tp is fm.Heartbeat:
            self._on_pong(w, msg)
        elif tp is fm.Error:
            if msg.code == fm.ErrorCode.UNSUPPORTED_VERSION and msg.id == -1 and not w.alive:
                # The worker refuses to speak with this client (its versions).
                self._refused_by(w, f"worker {w.address} refused this client: {msg.message}")
                return
            self._on_error(w, msg)
        else:
            self.stats["bad_messages"] += 1

    def _on_result(self, call: Call, res: fm.Result) -> None:
        if call.done:
            return
        out = absorb_result(call, res)
        if out is not None:
            self._complete(call, out)
            return
        self.stats["interrupted"] += 1
        self._enqueue(call, front=True)

    def _bad_message(self, w: Worker, frames: list[zmq.Frame], exc: DecodeError) -> None:
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
            w.enc.encode(
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

    def _on_error(self, w: Worker, err: fm.Error) -> None:
        call = w.inflight.pop(err.id, None)
        if call is None:
            if err.code != fm.ErrorCode.LOST:  # LOST of a call already ended: stale
                log.warning("worker %s reports error %d: %s", w.address, err.code, err.message)
            return
        call.worker = None
        if err.code == fm.ErrorCode.OVERLOADED:
            self.stats["overloaded"] += 1
            call.chunks = []
            del call.times[call.base :]
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
            self._lose_attempt(call, w, "the worker lost it", code=err.code)
        else:
            self._finish_error(
                call,
                RemoteError(f"worker {w.address}: {err.message}", code=err.code, worker=w.address),
            )
        self._slot_freed(w)

    # -- versions: what each worker reads ------------------------------------------------
    def _on_pong(self, w: Worker, hb: fm.Heartbeat) -> None:
        """A pong states what the worker reads: write to it in that, or refuse it."""
        try:
            w.enc = versions.encoder_for(hb)
        except IncompatiblePeer as exc:
            name = f" ({hb.worker_id})" if hb.worker_id else ""
            self._refused_by(w, f"worker {w.address}{name}: {exc}")
            return
        if w.incompatible:
            log.info("worker %s now speaks a version this client reads", w.address)
            w.incompatible = ""
        self._on_heartbeat(w, hb)

    def _refused_by(self, w: Worker, why: str) -> None:
        """``w`` answers, in versions this client cannot use: say so once, send it
        nothing (its requests go elsewhere), and fail what waits if no worker is left."""
        if w.incompatible != why:
            log.error("%s", why)
            w.incompatible = why
        if w.alive or w.inflight or w.sticky_queue:
            self._worker_died(w, "it speaks an incompatible protocol version")
        if self._n_alive or not self._all_incompatible():
            return
        err = self._incompatible_error()
        calls = list(self._queue) + list(self._backing_off)
        self._queue.clear()
        for call in calls:
            if not call.done:
                self.stats["no_worker"] += 1
                self._finish_error(call, IncompatibleWorkers(str(err), err.seen))

    def _all_incompatible(self) -> bool:
        order = self._order
        return bool(order) and all(w.incompatible for w in order)

    def _incompatible_error(self) -> IncompatibleWorkers:
        seen = {w.address: w.seen(time.monotonic(), False) for w in self._order}
        where = "; ".join(f"{a}: {s}" for a, s in seen.items())
        return IncompatibleWorkers(f"no generation worker this client can use ({where})", seen)


def _resolved(w: Worker, lookup: asyncio.Future[str]) -> None:
    if lookup.cancelled() or lookup.exception() is not None:
        return
    w.unresolved = lookup.result()
    if w.unresolved:
        log.warning("worker %s: %s; retrying until it does", w.address, w.unresolved)
