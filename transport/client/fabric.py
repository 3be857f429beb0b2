"""The rollout client: :class:`FabricClient`, on the caller's loop, routes what the workers
send to its ``Scheduler``; :class:`SyncFabricClient` runs one in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import zmq

from fastio import DecodeError, Decoder, LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from transport import metrics
from transport.addresses import resolve_problem, tcp_host
from transport.client.calls import (
    Call,
    ChunkCallback,
    Counters,
    GenerateFuture,
    install_task_factory,
)
from transport.client.scheduling import Scheduler
from transport.client.workers import ClientConfig, Worker, WorkerInfo, check_address, log
from transport.errors import EMPTY_PROMPT, ClientClosed, RemoteError
from transport.options import configure
from transport.ratelog import RateLimitedLog

__all__ = ["FabricClient", "SyncFabricClient"]

T = TypeVar("T")

_rlog = RateLimitedLog(log)


class FabricClient:
    """Asyncio client of the fabric: ``await client.agenerate(req)``.

    Parameters
    ----------
    workers:
        Worker addresses (``tcp://host:port``, ``ipc://path``, ``inproc://name``); a
        malformed one raises :class:`~transport.BadAddress`.
    config, **options:
        A :class:`ClientConfig`, and its fields as keywords applied over it.

    Examples
    --------
    >>> async def rollout():
    ...     async with FabricClient(["tcp://127.0.0.1:5555"]) as client:
    ...         resp = await client.agenerate(LLMRequest(input_ids=[1, 2, 3]))
    ...         return resp.output_tokens
    """

    def __init__(
        self, workers: Sequence[str] = (), config: ClientConfig | None = None, **options: Any
    ) -> None:
        self.config = config = configure(ClientConfig, config, options, "client option")
        self._initial = [check_address(a) for a in workers]
        self.counters = Counters(observe_latency=config.metrics_port is not None)
        self._sched = Scheduler(config, self.counters)
        self._cancelled = functools.partial(self._sched.timed_out, t=None)  # bound once
        self._dec = Decoder(fm.WORKER_TO_CLIENT, max_message_size=config.max_message_size)
        # One routing id on every DEALER: answers and LOST reports reach it after a reconnect.
        self._identity = b"fc-" + uuid.uuid4().hex.encode()
        self._zctx: zmq.Context[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Port of the metrics endpoint once started (``config.metrics_port``).
        self.metrics_port: int | None = None

    @property
    def stats(self) -> dict[str, int]:
        """Counts of what happened to calls and workers (see :class:`Counters`)."""
        return self.counters.stats

    async def start(self) -> FabricClient:
        """Open the sockets in the running loop (done on first use otherwise)."""
        self._start()
        return self

    def _start(self) -> None:
        if self._loop is not None:
            return
        if self._sched.closed:
            raise ClientClosed("the client is closed")
        self._loop = asyncio.get_running_loop()
        install_task_factory(self._loop)
        self._zctx = zmq.Context()
        metrics.expose("client")
        if self.config.metrics_port is not None:
            self.metrics_port = metrics.start_http_server(self.config.metrics_port)
        self._sched.start(self._loop)
        for address in self._initial:
            self.add_worker(address)

    async def __aenter__(self) -> FabricClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Fail pending requests with :class:`ClientClosed` and close the sockets."""
        if self._sched.closed:
            return
        self._sched.close()
        if self._zctx is not None:
            self._zctx.term()

    def add_worker(self, address: str) -> None:
        """Start using the worker at ``address`` once it answers a ping
        (:class:`~transport.BadAddress` if malformed)."""
        check_address(address)
        if self._loop is None:
            self._initial.append(address)
            return
        w = self._sched.workers.get(address)
        if w is not None:
            w.drain(False)
            return
        assert self._zctx is not None
        w = Worker(address, self._zctx, self.config, self._identity, self._on_message)
        self._sched.add(w)
        if tcp_host(address) is not None:  # a host name: say so if it does not resolve
            lookup = self._loop.run_in_executor(None, resolve_problem, address)
            lookup.add_done_callback(w.resolved)

    def remove_worker(self, address: str) -> None:
        """Stop sending to ``address``; its in-flight requests finish there first (or are
        re-sent if it dies), then its socket closes."""
        self._sched.drain(address)

    @property
    def workers(self) -> list[WorkerInfo]:
        """A snapshot of every worker's state as this client sees it."""
        now = time.monotonic()
        return [w.info(now) for w in self._sched.order]

    @property
    def pending(self) -> int:
        """Requests queued in the client, waiting to be re-sent, or in flight."""
        return sum(1 for _ in self._sched.unfinished())

    def agenerate(
        self,
        req: LLMRequest,
        *,
        timeout: float | None = None,
        on_chunk: ChunkCallback | None = None,
    ) -> GenerateFuture:
        """Generate for ``req`` on some worker: a :class:`GenerateFuture`, the request
        already on its way (with no running loop, a coroutine that submits when it runs).

        Parameters
        ----------
        req:
            The request (sent without a copy: leave its arrays unchanged until answered).
        timeout:
            Seconds (default ``config.request_timeout``).
        on_chunk:
            ``(tokens, logprobs, versions)`` as output arrives: each position once, in
            order, also across re-sends and interrupts.

        Errors are raised where the result is awaited, never by the call (all of them:
        docs/troubleshooting.md): :class:`~transport.errors.RequestTimeout` (then cancelled
        on its worker, as when the future is), :class:`RemoteError` and its kinds (never
        re-sent), :class:`~transport.errors.NoWorkerAvailable`, ``ValueError`` (no prompt).
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return _in_loop(self, req, timeout, on_chunk)  # type: ignore[return-value]
        fut = GenerateFuture(loop=loop)
        if not len(req.input_ids):
            fut.set_exception(ValueError(EMPTY_PROMPT))
            return fut
        sched = self._sched
        if loop is not self._loop or not sched.n_alive or not sched.workers:
            try:
                self._start()
                if loop is not self._loop:
                    raise RuntimeError("this FabricClient belongs to another event loop")
                sched.check_ready()
            except Exception as exc:
                fut.set_exception(exc)
                return fut
        call = Call(req, fut, on_chunk, self.config.request_timeout if timeout is None else timeout)
        fut.bind(call, self._cancelled)
        sched.submit(call)
        return fut

    def _on_message(self, w: Worker, frames: list[zmq.Frame]) -> None:
        sched = self._sched
        for one in fm.split(frames):
            try:
                msg = self._dec.decode(one)
            except DecodeError as exc:
                self._bad_message(w, one, exc)
                continue
            tp = type(msg)
            if tp is fm.Result:
                call = w.answered(msg.id)
                if call is None:
                    self.counters.add("stale")
                    continue
                if not call.done:
                    out = call.absorb(msg)
                    if out is not None:
                        sched.complete(call, out)
                    else:
                        self.counters.add("interrupted")
                        sched.enqueue(call, front=True)
                if w.sticky_queue or w.draining or sched.queue:
                    sched.slot_freed(w)
            elif tp is fm.Stream:
                if (call := w.inflight.get(msg.id)) is not None:
                    call.on_stream(msg)
            elif tp is fm.Heartbeat:
                sched.on_pong(w, msg)
            elif tp is fm.Error:
                sched.on_error(w, msg)
            else:
                self.counters.add("bad_messages")

    def _bad_message(self, w: Worker, frames: list[zmq.Frame], exc: DecodeError) -> None:
        _rlog.counted(
            self.counters.add("bad_messages"), "bad message from worker %s: %s", w.address, exc
        )
        _, kind, first = fm.peek(frames)
        sub_id = first if kind == MsgKind.FABRIC_RESULT and first is not None else -1
        call = w.end(sub_id)
        code = int(fm.ErrorCode.BAD_RESPONSE)
        w.send(fm.Error(id=sub_id if call is not None else -1, code=code, message=str(exc)))
        if call is not None:
            why = f"malformed response from {w.address}: {exc}"
            self._sched.fail(call, RemoteError(why, code=code, worker=w.address))
            self._sched.slot_freed(w)


async def _in_loop(
    client: FabricClient, req: LLMRequest, timeout: float | None, on_chunk: ChunkCallback | None
) -> LLMResponse:
    """``agenerate`` from inside the loop that runs this coroutine."""
    return await client.agenerate(req, timeout=timeout, on_chunk=on_chunk)


class SyncFabricClient:
    """A :class:`FabricClient` (``client``) driven from synchronous code: its loop runs
    in a background thread. Takes the arguments of :class:`FabricClient`.

    Examples
    --------
    >>> with SyncFabricClient(["tcp://127.0.0.1:5555"]) as client:  # doctest: +SKIP
    ...     resp = client.generate(LLMRequest(input_ids=[1, 2, 3]))
    """

    def __init__(
        self, workers: Sequence[str] = (), config: ClientConfig | None = None, **options: Any
    ) -> None:
        self.client = FabricClient(workers, config, **options)  # checks the arguments first
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fabric-client", daemon=True
        )
        self._thread.start()
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
        return self.submit(req, timeout=timeout).result()

    def submit(
        self, req: LLMRequest, *, timeout: float | None = None
    ) -> concurrent.futures.Future[LLMResponse]:
        """Start a request; returns a ``concurrent.futures.Future``."""
        coro = _in_loop(self.client, req, timeout, None)  # agenerate in the client's loop
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def add_worker(self, address: str) -> None:
        """Thread-safe :meth:`FabricClient.add_worker` (a bad address raises here)."""
        check_address(address)
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
