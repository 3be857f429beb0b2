"""The asyncio rollout client: its public API, its lifecycle, and what it receives."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

import zmq

from fastio import DecodeError, LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from transport import metrics
from transport.client.calls import Call, absorb_result, on_stream
from transport.client.config import ChunkCallback, ClientConfig
from transport.client.future import GenerateFuture, install_task_factory
from transport.client.liveness import Liveness, log
from transport.client.workers import MONITOR_EVENTS, Worker, WorkerInfo, check_address
from transport.errors import BadAddress, ClientClosed, NoWorkers, RemoteError, RequestAborted
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

        Cancelling the future (or a task awaiting it) cancels the request on its
        worker. Errors are raised where the result is awaited, never by the call.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._agenerate_in_loop(req, timeout, on_chunk)  # type: ignore[return-value]
        fut = GenerateFuture(loop=loop)
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
            self._on_heartbeat(w, msg)
        elif tp is fm.Error:
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
