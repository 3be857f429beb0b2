"""What the HTTP server bridges share: options, the streaming ``generate`` loop, server-sent
events, one error mapping and one health probe (``docs/engines.md#writing-a-bridge-of-your-own``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import urllib.request
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Self

import msgspec

from fastio import LLMRequest, LLMResponse
from fastio._optional import require
from transport.engines.api import EngineUnavailable, GenerationContext
from transport.engines.flight import Flight, VersionLabels, request_ids, sampling_common
from transport.engines.registry import engine_options

__all__ = [
    "JSON_HEADERS",
    "BridgeOptions",
    "Flight",
    "HTTPBridge",
    "ServerRejected",
    "VersionLabels",
    "raise_for_status",
    "request_ids",
    "sampling_common",
    "sse_events",
]

log = logging.getLogger("transport.engines")

_DONE = b"[DONE]"
# How long a close waits for the requests it ends to abort theirs on the server.
_CLOSE_WAIT_S = 2.0
#: Headers of a JSON request body.
JSON_HEADERS = {"Content-Type": "application/json"}

Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ServerRejected(RuntimeError):
    """The server refused or failed one request, which fails alone (the worker serves on);
    ``status``: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class BridgeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of every bridge (``--engine-opt`` keys, :class:`HTTPBridge` keywords).

    Attributes
    ----------
    url:
        The server's base URL (``http://127.0.0.1:30000``).
    check:
        Probe ``/health`` when the worker starts (:meth:`HTTPBridge.from_opts`).
    request_timeout, stall_timeout:
        Seconds to connect and get headers; without a byte of a streamed answer.
    health_interval, health_timeout, health_failures:
        ``GET /health`` every ``health_interval`` s (0: off); ``health_failures``
        failures in a row (or no answer in ``health_timeout`` s) close the worker.
    keepalive:
        Seconds an idle connection is kept (below the servers' 5).
    """

    url: str
    check: bool = True
    request_timeout: Seconds = 30.0
    stall_timeout: Seconds = 300.0
    health_interval: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    health_timeout: Seconds = 5.0
    health_failures: Annotated[int, msgspec.Meta(ge=1)] = 3
    keepalive: Seconds = 2.0


async def raise_for_status(resp: Any, what: str) -> None:
    """:class:`ServerRejected` quoting the start of the body when ``resp`` is an HTTP
    error."""
    if resp.status >= 400:
        text = (await resp.read())[:500].decode(errors="replace")
        raise ServerRejected(f"{what} answered {resp.status}: {text}", resp.status)


def stream_error(chunk: Any) -> str | None:
    """The message of an error event in a stream (``{"error": {"message": ...}}``, as
    vLLM sends after a 200 for a request it rejects), else None."""
    err = chunk.get("error") if isinstance(chunk, dict) else None
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def sse_events(content: Any) -> AsyncIterator[Any]:
    """Decoded JSON of each ``data:`` line of a server-sent event stream (``content``:
    an aiohttp StreamReader), until ``data: [DONE]`` or the end of the body."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == _DONE:
            await content.read()  # the body's end: the connection goes back to the pool
            return
        yield msgspec.json.decode(data)


class HTTPBridge(abc.ABC):
    """Base of the server bridges (:meth:`request`, :meth:`take`, :meth:`abort` to write);
    ``url`` and the other fields of :attr:`Options` (``ValueError`` naming a bad one)."""

    #: Weight version stamped on new tokens.
    version: int
    #: The server's version labels (spans, where it sends them) as fastio versions.
    labels: VersionLabels
    #: Name in messages, the extra that installs what it needs, the options Struct.
    name = "http"
    extra = "sglang"
    Options: ClassVar[type[BridgeOptions]] = BridgeOptions
    options: BridgeOptions
    #: An interrupt closes the stream (the server aborts a request whose client left).
    closes_to_interrupt = False
    #: A pause froze the server's requests in place: streams stay open (:class:`EngineHooks`).
    pauses_in_place = False

    def __init__(self, url: str, **options: Any) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http://host:port, got {url!r}")
        self.options = msgspec.convert({"url": url, **options}, self.Options)
        self.aiohttp = ah = require("aiohttp", type(self).extra, f"the {type(self).name} bridge")
        self._broken = (ah.ClientConnectionError, ah.ClientPayloadError, TimeoutError)
        self.url = url.rstrip("/")
        self.version = 0
        self.labels = VersionLabels()
        self.flights: dict[str, Flight] = {}
        self._waiting = 0  # flights without a token (read whole from the socket thread)
        self._rids = request_ids()
        self._session: Any = None
        self._worker: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._aux: set[asyncio.Task[Any]] = set()
        self._failing = False
        self._probed = False
        self._closer: asyncio.Future[Any] | None = None
        self._closed = False
        self._idle: asyncio.Event | None = None  # set when the last flight ends (close)

    @classmethod
    def from_opts(cls, opts: dict[str, str]) -> Self:
        """The bridge the ``--engine-opt`` strings describe (:attr:`Options`); probes
        the server first unless ``check=0``."""
        if not opts.get("url"):
            raise ValueError("needs --engine-opt url=http://host:port")
        engine = cls(**msgspec.structs.asdict(engine_options(opts, cls.Options, cls.name.lower())))
        if engine.options.check:
            engine.check_reachable()
        return engine

    def check_reachable(self, timeout: float = 5.0) -> None:
        """``GET /health`` once, then :meth:`probe`, blocking: a worker pointed at nothing
        fails at start."""
        try:  # an error status raises urllib's HTTPError, an OSError
            urllib.request.urlopen(self.url + "/health", timeout=timeout).close()
        except OSError as exc:
            msg = f"cannot reach the {self.name} server at {self.url}: {exc}"
            raise EngineUnavailable(msg) from exc
        self.probe(timeout)
        self._probed = True

    def probe(self, timeout: float = 5.0) -> None:  # noqa: B027  (optional)
        """Read what the server has, blocking (by the factory, else at :meth:`start`)."""

    def fetch_json(self, path: str, timeout: float = 5.0) -> Any:
        """``GET path`` blocking (before the loop runs), its decoded JSON; ``OSError`` or
        ``ValueError`` when it cannot be read."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return msgspec.json.decode(resp.read())

    async def get_json(self, path: str) -> Any:
        """``GET path`` on the bridge's session, its decoded JSON; :class:`ServerRejected`
        for an error status."""
        async with self.session().get(self.url + path) as resp:
            await raise_for_status(resp, f"{self.name} {path}")
            return msgspec.json.decode(await resp.read())

    def session(self) -> Any:
        """The aiohttp session (made on first use, in the worker's loop)."""
        if self._session is None:
            if self._closed:
                raise EngineUnavailable(f"the {self.name} bridge is closed")
            aiohttp = self.aiohttp
            self._loop = asyncio.get_running_loop()
            o = self.options
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=o.request_timeout, sock_read=o.stall_timeout
                ),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=o.keepalive),
            )
        return self._session

    async def start(self, worker: Any) -> None:
        """:meth:`probe` (when the factory did not), open the session, start the watchdog."""
        if not self._probed:
            await asyncio.to_thread(self.probe)
            self._probed = True
        self._worker = worker
        self.session()
        if self.options.health_interval > 0:
            self._watchdog = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        """Stop the watchdog; close the session once the cancelled requests' aborts are sent."""
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

    def queue_depth(self) -> int:
        """Requests sent to the server that have no token yet (queued or in prefill)."""
        return self._waiting

    def pause_generation(self) -> None:
        """Interrupt every request in flight (each returns its output so far)."""
        for flight in list(self.flights.values()):
            if not flight.interrupted:
                self.interrupt(flight)

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Forward ``req`` to the server and stream the answer through ``ctx``."""
        # The worker runs a handler's first step outside any task (its eager start);
        # aiohttp's timeouts need one: continue in the request's task.
        await asyncio.sleep(0)
        flight = Flight(self.new_rid(), ctx)
        self.flights[flight.rid] = flight
        self._waiting += 1
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
                await self._stream_broke(flight, broken)
        except asyncio.CancelledError:
            if not flight.finish:
                self.abort(flight)  # aborted or cancelled: stop the server's work
            raise
        finally:
            self._end(flight)
        return self.result(req, flight)

    def result(self, req: LLMRequest, flight: Flight) -> LLMResponse:
        """The response of a flight that ended."""
        return flight.result(req, self._stop(flight), self.labels)

    async def _stream_broke(self, flight: Flight, why: str | None) -> None:
        # A stream ended without a finish reason: the server is gone if /health says so.
        what = why or "it ended without a finish_reason"
        if not await self.healthy():
            await self.server_gone(f"the stream of {flight.rid} broke ({what}) and /health fails")
        raise ServerRejected(
            f"the {self.name} server broke the stream of {flight.rid} after "
            f"{len(flight.toks)} tokens ({what}); the server is healthy: this request fails"
        )

    async def healthy(self) -> bool:
        """``GET /health`` answers 200 within ``health_timeout`` s (on a fresh connection)."""
        aiohttp = self.aiohttp
        try:
            async with self.session().get(
                self.url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.options.health_timeout),
                headers={"Connection": "close"},
            ) as resp:
                return bool(resp.status == 200)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _read(self, resp: Any, flight: Flight) -> None:
        ctx = flight.ctx
        if self.closes_to_interrupt and ctx.interrupted and not self.pauses_in_place:
            self.interrupt(flight)  # paused while the request was on its way
        async for chunk in sse_events(resp.content):
            if (err := stream_error(chunk)) is not None:
                raise ServerRejected(f"{self.name} rejected {flight.rid}: {err}")
            if self.take(chunk, flight) and not flight.first:
                flight.first = True
                self._waiting -= 1
            if flight.finish and not self.closes_to_interrupt:
                break
            if (
                ctx.interrupted
                and not self.pauses_in_place
                and (not flight.interrupted or flight.blind_abort)
            ):
                # Paused; or paused while the request was on its way, when the first
                # interrupt may have reached the server before the request did.
                self.interrupt(flight)
                if self.closes_to_interrupt:
                    break

    def _closed_by_us(self, flight: Flight) -> bool:
        return self.closes_to_interrupt and flight.interrupted

    def _stop(self, flight: Flight) -> str:
        finish = flight.finish
        if not finish:  # a stream the bridge closed itself (pause)
            return "interrupt"
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort":
            return "interrupt" if flight.interrupted or flight.ctx.interrupted else "abort"
        return "length" if kind == "length" else "stop"

    def _end(self, flight: Flight) -> None:
        if not flight.first:
            self._waiting -= 1
        self.flights.pop(flight.rid, None)
        if not self.flights and self._idle is not None:
            self._idle.set()

    @abc.abstractmethod
    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """The path and JSON body that ask the server to stream ``req`` as ``rid``."""

    @abc.abstractmethod
    def take(self, chunk: Any, flight: Flight) -> int:
        """Add the new tokens of one streamed chunk to ``flight`` (:meth:`Flight.add`),
        set ``flight.finish`` when it ends the stream; returns how many tokens."""

    def interrupt(self, flight: Flight) -> None:
        """Make the server end ``flight`` soon with its output so far (pause): :meth:`abort`
        it, again at its first chunk when the server may not have known it yet."""
        flight.blind_abort = not flight.first
        flight.interrupted = True
        self.abort(flight)

    @abc.abstractmethod
    def abort(self, flight: Flight) -> None:
        """Stop the server's work on ``flight``, cancelled (an abort, a client gone)."""

    def new_rid(self) -> str:
        """A request id unique to this worker's life (servers key aborts by it)."""
        return next(self._rids)

    async def post_json(self, path: str, body: Any, timeout: float | None = None) -> Any:
        """POST JSON, return the decoded answer; :class:`ServerRejected` for an error status."""
        aiohttp = self.aiohttp
        try:
            async with self.session().post(
                self.url + path,
                data=msgspec.json.encode(body),
                headers=JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout or self.options.request_timeout),
            ) as resp:
                raw = await resp.read()
                try:
                    data = msgspec.json.decode(raw) if raw else None
                except msgspec.DecodeError:  # a plain-text error page
                    data = raw.decode(errors="replace")
                if resp.status >= 400:
                    msg = f"{self.name} {path} answered {resp.status}: {data}"
                    raise ServerRejected(msg, resp.status)
                return data
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.name} server {self.url}{path}: {exc!r}") from exc

    def run_in_loop(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the worker's loop from another thread and wait for its result."""
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
        """The server cannot serve: close the worker and never answer this request (the
        close cancels its task; the clients re-send it elsewhere)."""
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
        while True:
            await asyncio.sleep(o.health_interval)
            misses = 0 if await self.healthy() else misses + 1
            if misses >= o.health_failures:
                self._server_failed(f"/health failed {misses} times in a row")
                return
