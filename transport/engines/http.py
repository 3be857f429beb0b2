"""What the HTTP server bridges share: options, the streaming ``generate`` loop, server-sent
events, one error mapping, one health probe (``docs/engines.md#writing-a-bridge-of-your-own``)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import urllib.request
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Self

import msgspec

from fastio import LLMRequest, LLMResponse
from fastio._optional import require
from transport.engines.api import EngineUnavailable, GenerationContext
from transport.engines.flight import Flight, Flights, VersionLabels, request_ids, sampling_common
from transport.engines.registry import engine_options
from transport.options import NonNegativeSeconds, Positive, Seconds

__all__ = [
    "JSON_HEADERS", "BridgeOptions", "Flight", "HTTPBridge", "ServerRejected", "VersionLabels",
    "raise_for_status", "request_ids", "sampling_common", "sse_events",
]  # fmt: skip

log = logging.getLogger("transport.engines")

_CLOSE_WAIT_S = 2.0  # how long a close waits for the aborts of the requests it ends
JSON_HEADERS = {"Content-Type": "application/json"}


class ServerRejected(RuntimeError):
    """The server refused or failed one request, which fails alone (the worker serves on);
    ``status``: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class BridgeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of every bridge (``--engine-opt`` keys, :class:`HTTPBridge` keywords)."""

    url: str
    """The server's base URL (``http://127.0.0.1:30000``)."""
    check: bool = True
    """Probe ``/health`` when the worker starts (:meth:`HTTPBridge.from_opts`)."""
    request_timeout: Seconds = 30.0
    """Seconds to connect and get headers."""
    stall_timeout: Seconds = 300.0
    """Seconds without a byte of a streamed answer."""
    health_interval: NonNegativeSeconds = 2.0
    """``GET /health`` every so many seconds (0: off)."""
    health_timeout: Seconds = 5.0
    health_failures: Positive = 3
    """Failed probes in a row (or none answered in ``health_timeout`` s) that close the worker."""
    keepalive: Seconds = 2.0
    """Seconds an idle connection is kept (below the servers' 5)."""


async def raise_for_status(resp: Any, what: str) -> None:
    """:class:`ServerRejected` quoting the start of the body if ``resp`` is an HTTP error."""
    if resp.status >= 400:
        text = (await resp.read())[:500].decode(errors="replace")
        raise ServerRejected(f"{what} answered {resp.status}: {text}", resp.status)


def stream_error(chunk: Any) -> str | None:
    """A stream's error event's message (vLLM's ``{"error": {"message": ...}}``), or None."""
    err = chunk.get("error") if isinstance(chunk, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return None if err is None else str(err)


async def sse_events(content: Any) -> AsyncIterator[Any]:
    """The decoded ``data:`` lines of an aiohttp StreamReader's SSE, until ``[DONE]``."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            await content.read()  # the body's end: the connection goes back to the pool
            return
        yield msgspec.json.decode(data)


class HTTPBridge(Flights, abc.ABC):
    """Base of the server bridges (:meth:`request`, :meth:`take`, :meth:`abort` to write);
    ``url`` and the other fields of :attr:`Options` (``ValueError`` naming a bad one)."""

    name = "http"
    extra = "sglang"
    Options: ClassVar[type[BridgeOptions]] = BridgeOptions
    options: BridgeOptions
    closes_to_interrupt = False  # the server aborts a request whose stream is closed
    pauses_in_place = False  # a pause froze the server's requests: streams stay open

    def __init__(self, url: str, **options: Any) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http://host:port, got {url!r}")
        super().__init__()
        self.options = msgspec.convert({"url": url, **options}, self.Options)
        self.aiohttp = ah = require("aiohttp", type(self).extra, f"the {type(self).name} bridge")
        self._broken = (ah.ClientConnectionError, ah.ClientPayloadError, TimeoutError)
        self.url = url.rstrip("/")
        self._session: Any = None
        self._worker: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._aux: set[asyncio.Task[Any]] = set()
        self._closer: asyncio.Future[Any] | None = None  # the worker's close, once failing
        self._probed = self._closed = self._failing = False
        self._idle: asyncio.Event | None = None  # set when the last flight ends (close)

    @classmethod
    def from_opts(cls, opts: dict[str, str]) -> Self:
        """The bridge of the ``--engine-opt`` strings; probes the server unless ``check=0``."""
        if not opts.get("url"):
            raise ValueError("needs --engine-opt url=http://host:port")
        engine = cls(**msgspec.structs.asdict(engine_options(opts, cls.Options, cls.name.lower())))
        if engine.options.check:
            engine.check_reachable()
        return engine

    def check_reachable(self, timeout: float = 5.0) -> None:
        """``GET /health`` then :meth:`probe`, blocking: :class:`EngineUnavailable` if not."""
        try:  # an error status raises urllib's HTTPError, an OSError
            urllib.request.urlopen(self.url + "/health", timeout=timeout).close()
        except OSError as exc:
            msg = f"cannot reach the {self.name} server at {self.url}: {exc}"
            raise EngineUnavailable(msg) from exc
        self.probe(timeout)
        self._probed = True

    def probe(self, timeout: float = 5.0) -> None:
        """Read what the server has, blocking (by the factory, else at :meth:`start`)."""

    def fetch_json(self, path: str, timeout: float = 5.0) -> Any:
        """``GET path``'s JSON, blocking (before the loop runs); ``OSError``/``ValueError``."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return msgspec.json.decode(resp.read())

    async def get_json(self, path: str) -> Any:
        """``GET path``'s decoded JSON (errors as :meth:`post_json`)."""
        return await self._call("GET", path, None, None)

    async def post_json(self, path: str, body: Any, timeout: float | None = None) -> Any:
        """POST JSON, return the decoded answer; :class:`ServerRejected` for an error status,
        :class:`EngineUnavailable` for a server that cannot be reached."""
        return await self._call("POST", path, msgspec.json.encode(body), timeout)

    async def _post_quietly(
        self, path: str, body: Any, timeout: float | None = None
    ) -> Exception | None:
        # The error instead of raising it (the server may be gone: the watchdog sees it).
        try:
            await self.post_json(path, body, timeout=timeout)
        except Exception as exc:
            log.debug("%s %s %s failed: %r", self.name, path, body, exc)
            return exc
        return None

    async def _call(self, method: str, path: str, data: Any, timeout: float | None) -> Any:
        aiohttp = self.aiohttp
        total = aiohttp.ClientTimeout(total=timeout or self.options.request_timeout)
        try:
            async with self.session().request(
                method, self.url + path, data=data, headers=JSON_HEADERS, timeout=total
            ) as resp:
                await raise_for_status(resp, f"{self.name} {path}")
                raw = await resp.read()
                try:
                    return msgspec.json.decode(raw) if raw else None
                except msgspec.DecodeError:  # a plain-text answer
                    return raw.decode(errors="replace")
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.name} server {self.url}{path}: {exc!r}") from exc

    def session(self) -> Any:
        """The aiohttp session (made on first use, in the worker's loop)."""
        if self._session is None:
            if self._closed:
                raise EngineUnavailable(f"the {self.name} bridge is closed")
            ah, o = self.aiohttp, self.options
            self._loop = asyncio.get_running_loop()
            self._session = ah.ClientSession(
                timeout=ah.ClientTimeout(
                    total=None, sock_connect=o.request_timeout, sock_read=o.stall_timeout
                ),
                connector=ah.TCPConnector(limit=0, keepalive_timeout=o.keepalive),
            )
        return self._session

    async def start(self, worker: Any) -> None:
        """:meth:`probe` (unless the factory did), open the session, start the watchdog."""
        if not self._probed:
            await asyncio.to_thread(self.probe)
            self._probed = True
        self._worker = worker
        self.session()
        if self.options.health_interval > 0:
            self._watchdog = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        """Close the session once the ended requests' aborts are sent."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.flights:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), _CLOSE_WAIT_S)
        if self._aux:
            await asyncio.wait(list(self._aux), timeout=_CLOSE_WAIT_S)
            for task in list(self._aux):
                task.cancel()
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def pause_generation(self) -> None:
        """Interrupt every request in flight (each returns its output so far)."""
        for flight in list(self.flights.values()):
            if not flight.interrupted:
                self.interrupt(flight)

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Forward ``req`` to the server and stream the answer through ``ctx``."""
        await asyncio.sleep(0)  # out of the worker's eager start: aiohttp's timeouts need a task
        flight = self.begin(ctx)
        try:
            path, body = await self.request(req, flight.rid)
            data = msgspec.json.encode(body)
            broken = None
            for fresh in (False, True):
                try:
                    async with self.session().post(
                        self.url + path, data=data, headers=JSON_HEADERS
                    ) as resp:
                        flight.response = resp
                        await raise_for_status(resp, f"{self.name} {path}")
                        await self._read(resp, flight)
                    break
                except self._broken as exc:
                    broken = repr(exc)
                    # A kept-alive connection the server closed while idle fails before
                    # any answer: the server never saw the request; once more, fresh.
                    if fresh or flight.response is not None or self._closed_by_us(flight):
                        break
            if not flight.finish and not self._closed_by_us(flight):
                what = f"the stream of {flight.rid} broke ({broken or 'no finish_reason'})"
                if not await self.healthy():
                    await self.server_gone(f"{what} and /health fails")
                raise ServerRejected(
                    f"{self.name}: {what} after {len(flight.toks)} tokens; the server is "
                    "healthy: this request fails"
                )
        except asyncio.CancelledError:
            if not flight.finish:
                self.abort(flight)  # aborted or cancelled: stop the server's work
            raise
        finally:
            self.end(flight)
        return self.result(req, flight)

    def result(self, req: LLMRequest, flight: Flight) -> LLMResponse:
        """The response of a flight that ended."""
        finish, stop = flight.finish, "interrupt"  # no finish: the bridge closed it (pause)
        if finish:
            kind = finish.get("type") if isinstance(finish, dict) else str(finish)
            stop = "length" if kind == "length" else "stop"
            if kind == "abort":
                stop = "interrupt" if flight.interrupted or flight.ctx.interrupted else "abort"
        return flight.result(req, stop, self.labels)

    def end(self, flight: Flight) -> None:
        super().end(flight)
        if not self.flights and self._idle is not None:
            self._idle.set()

    async def healthy(self) -> bool:
        """``GET /health`` answers 200 within ``health_timeout`` s (a fresh connection)."""
        ah = self.aiohttp
        try:
            async with self.session().get(
                self.url + "/health",
                timeout=ah.ClientTimeout(total=self.options.health_timeout),
                headers={"Connection": "close"},
            ) as resp:
                return bool(resp.status == 200)
        except (ah.ClientError, TimeoutError, OSError):
            return False

    async def _read(self, resp: Any, flight: Flight) -> None:
        ctx, closes = flight.ctx, self.closes_to_interrupt
        if closes and ctx.interrupted and not self.pauses_in_place:
            self.interrupt(flight)  # paused while the request was on its way
        async for chunk in sse_events(resp.content):
            if (err := stream_error(chunk)) is not None:
                raise ServerRejected(f"{self.name} rejected {flight.rid}: {err}")
            self.got(flight, self.take(chunk, flight))
            if flight.finish and not closes:
                break
            # Paused; or paused while the request was on its way, when the first
            # interrupt may have reached the server before the request did.
            again = not flight.interrupted or flight.blind_abort
            if ctx.interrupted and not self.pauses_in_place and again:
                self.interrupt(flight)
                if closes:
                    break

    def _closed_by_us(self, flight: Flight) -> bool:
        return self.closes_to_interrupt and flight.interrupted

    @abc.abstractmethod
    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """The path and JSON body that ask the server to stream ``req`` as ``rid``."""

    @abc.abstractmethod
    def take(self, chunk: Any, flight: Flight) -> int:
        """Add one chunk's new tokens (:meth:`Flight.add`), set ``flight.finish``; how many."""

    def interrupt(self, flight: Flight) -> None:
        """End ``flight`` soon with its output so far (:meth:`abort`; again at its first chunk)."""
        flight.blind_abort = not flight.first
        flight.interrupted = True
        self.abort(flight)

    @abc.abstractmethod
    def abort(self, flight: Flight) -> None:
        """Stop the server's work on ``flight``, cancelled (an abort, a client gone)."""

    def run_in_loop(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the worker's loop from another thread; its result."""
        if self._loop is None:
            coro.close()
            raise EngineUnavailable(f"the {self.name} bridge has not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def spawn(self, coro: Any) -> None:
        """A fire-and-forget task kept alive until it ends (or the bridge closes)."""
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    async def server_gone(self, why: str) -> None:
        """Close the worker and never answer (the clients re-send the request elsewhere)."""
        self._server_failed(why)
        await asyncio.Event().wait()

    def _server_failed(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            log.error("%s server %s is gone (%s): closing this worker", self.name, self.url, why)
            if self._worker is not None:  # not one of _aux: its close waits for those
                self._closer = asyncio.ensure_future(self._worker.close())

    async def _watch(self) -> None:
        o, misses = self.options, 0
        while misses < o.health_failures:
            await asyncio.sleep(o.health_interval)
            misses = 0 if await self.healthy() else misses + 1
        self._server_failed(f"/health failed {misses} times in a row")
