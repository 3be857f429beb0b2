"""What the HTTP server bridges share: the session, the server's health, the requests in
flight, server-sent events.

A bridge is an :class:`~transport.Engine` whose ``generate`` forwards each request to a
server running in its own process (SGLang, vLLM) and streams the answer back through the
fabric. The worker keeps its sockets, heartbeats, pause and failover; the server keeps
the model.

A server that is gone takes its worker with it: a request that finds it unreachable,
or a health watchdog that sees ``/health`` fail ``health_failures`` times in a row
(a server that died or hangs), closes the worker. Its clients then see it die and
re-send its requests to the other workers, so each request is still answered once; the
failed attempt is never answered with an error. Run the worker under a supervisor that
restarts it with its server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from fastio import LLMRequest, LLMResponse, TokenArray
from fastio._optional import require
from transport.engines.api import EngineUnavailable

__all__ = [
    "JSON_HEADERS",
    "Flight",
    "HTTPBridge",
    "bridge_kwargs",
    "parse_bool",
    "raise_for_status",
    "response",
    "sampling_common",
    "sse_events",
]

log = logging.getLogger("transport.engines")

_DONE = b"[DONE]"
# How long a close waits for the requests it ends to abort theirs on the server.
_CLOSE_WAIT_S = 2.0
# GenerationHyperparameters.top_k at or above this means "no top-k" (the servers' -1).
_NO_TOP_K = 1 << 30
#: Headers of a JSON request body.
JSON_HEADERS = {"Content-Type": "application/json"}


def sampling_common(g: Any, max_key: str, min_key: str) -> dict[str, Any]:
    """The sampling parameters both servers take, from a
    :class:`~fastio.GenerationHyperparameters` (the token limits under the server's
    names ``max_key`` and ``min_key``; special tokens kept in the output)."""
    sp: dict[str, Any] = {
        max_key: g.max_new_tokens,
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": g.top_p,
        "top_k": -1 if g.top_k >= _NO_TOP_K else g.top_k,
        "skip_special_tokens": False,
    }
    if g.min_new_tokens:
        sp[min_key] = g.min_new_tokens
    if g.stop_token_ids:
        sp["stop_token_ids"] = list(g.stop_token_ids)
    return sp


async def raise_for_status(resp: Any, what: str) -> None:
    """``RuntimeError`` quoting the start of the body when ``resp`` is an HTTP error."""
    if resp.status >= 400:
        text = (await resp.read())[:500].decode(errors="replace")
        raise RuntimeError(f"{what} answered {resp.status}: {text}")


def parse_bool(v: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` -> bool (``ValueError`` otherwise)."""
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {v!r}")


async def sse_events(content: Any) -> AsyncIterator[Any]:
    """Decoded JSON of each ``data:`` line of a server-sent event stream, until
    ``data: [DONE]`` or the end of the body (``content``: an aiohttp StreamReader)."""
    decode = msgspec.json.decode
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == _DONE:
            return
        yield decode(data)


_FLOATS = ("request_timeout", "stall_timeout", "health_interval", "health_timeout")


def bridge_kwargs(
    opts: dict[str, str], strings: tuple[str, ...] = (), floats: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Keyword arguments of a bridge from ``--engine-opt`` strings (``url`` and
    ``check`` excluded); ``ValueError`` naming an unknown or malformed option."""
    known = {"url", "check", "health_failures", *_FLOATS, *strings, *floats}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known)}")
    if not opts.get("url"):
        raise ValueError("needs --engine-opt url=http://host:port")
    kw: dict[str, Any] = {k: opts[k] for k in strings if opts.get(k)}
    for key in (*_FLOATS, *floats):
        if key in opts:
            try:
                kw[key] = float(opts[key])
            except ValueError:
                raise ValueError(f"{key}: expected seconds, got {opts[key]!r}") from None
    if "health_failures" in opts:
        try:
            kw["health_failures"] = int(opts["health_failures"])
        except ValueError:
            bad = opts["health_failures"]
            raise ValueError(f"health_failures: expected an integer, got {bad!r}") from None
    return kw


class Flight:
    """One request in flight on the server."""

    __slots__ = ("blind_abort", "ctx", "first", "interrupted", "response", "rid")

    def __init__(self, rid: str, ctx: Any) -> None:
        self.rid = rid
        self.ctx = ctx
        self.first = False  # a token arrived
        self.interrupted = False  # the bridge asked the server to stop it (pause)
        #: The abort left before the server streamed anything: it may have arrived
        #: before the request did (then it is sent again at the first chunk).
        self.blind_abort = False
        self.response: Any = None  # the open HTTP response (vLLM: closed to abort)


class HTTPBridge:
    """Base of the server bridges (see the module docstring).

    Parameters
    ----------
    url:
        The server's base URL (``http://127.0.0.1:30000``).
    request_timeout:
        Seconds to connect and get response headers.
    stall_timeout:
        Seconds without a byte of a streamed answer before the server is taken as hung.
    health_interval, health_timeout, health_failures:
        The watchdog: ``GET /health`` every ``health_interval`` s; after
        ``health_failures`` failures (errors or no answer in ``health_timeout`` s) in a
        row the worker closes. ``health_interval=0`` turns it off.
    """

    #: Weight version stamped on new tokens.
    version: int

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float = 30.0,
        stall_timeout: float = 300.0,
        health_interval: float = 2.0,
        health_timeout: float = 5.0,
        health_failures: int = 3,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http://host:port, got {url!r}")
        self.aiohttp = require("aiohttp", type(self).extra, f"the {type(self).name} bridge")
        self.url = url.rstrip("/")
        self.version = 0
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures = health_failures
        self.flights: dict[str, Flight] = {}
        self._rids = itertools.count()
        self._prefix = f"fastio-{os.getpid()}-{os.urandom(3).hex()}"
        self._session: Any = None
        self._worker: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._aux: set[asyncio.Task[Any]] = set()
        self._failing = False
        self._closer: asyncio.Future[Any] | None = None
        self._closed = False
        self._idle: asyncio.Event | None = None  # set when the last flight ends (close)

    #: Name in messages, and the extra that installs what it needs.
    name = "http"
    extra = "sglang"

    # -- lifecycle (EngineHooks) ----------------------------------------------------------
    def check_reachable(self, timeout: float = 5.0) -> None:
        """``GET /health`` once, blocking (the factory calls it so that a worker pointed
        at nothing fails at start with one clear line)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise EngineUnavailable(f"{self.url}/health answered {resp.status}")
        except (urllib.error.URLError, OSError) as exc:
            raise EngineUnavailable(
                f"cannot reach the {self.name} server at {self.url}: {exc}"
            ) from exc

    def session(self) -> Any:
        """The aiohttp session (made on first use, in the worker's loop);
        ``EngineUnavailable`` once the bridge is closed."""
        if self._session is None:
            if self._closed:
                raise EngineUnavailable(f"the {self.name} bridge is closed")
            aiohttp = self.aiohttp
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.request_timeout, sock_read=self.stall_timeout
                ),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def start(self, worker: Any) -> None:
        """Open the session and start the health watchdog."""
        self._worker = worker
        self.session()
        if self.health_interval > 0:
            self._watchdog = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        """Stop the watchdog, close the session.

        The worker cancels its requests as it closes the bridge: the session stays open
        until they have ended and their aborts reached the server (a few seconds at
        most), so that the server stops their work."""
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
        return sum(1 for f in list(self.flights.values()) if not f.first)

    @classmethod
    def from_opts(
        cls, opts: dict[str, str], strings: tuple[str, ...] = (), floats: tuple[str, ...] = ()
    ) -> Any:
        """The bridge ``--engine-opt`` strings describe (see :func:`bridge_kwargs`);
        probes the server first unless ``check=0``."""
        kw = bridge_kwargs(opts, strings, floats)
        engine = cls(opts["url"], **kw)
        if parse_bool(opts.get("check", "1")):
            engine.check_reachable()
        return engine

    # -- helpers for the subclasses ---------------------------------------------------------
    def new_rid(self) -> str:
        """A request id unique to this worker's life (servers key aborts by it)."""
        return f"{self._prefix}-{next(self._rids)}"

    def new_flight(self, ctx: Any) -> Flight:
        """Register a request about to be sent, under a new rid (the caller pops it from
        :attr:`flights` when it ends)."""
        flight = Flight(self.new_rid(), ctx)
        self.flights[flight.rid] = flight
        return flight

    def end_flight(self, rid: str) -> None:
        """Forget a request that ended (however it ended)."""
        self.flights.pop(rid, None)
        if not self.flights and self._idle is not None:
            self._idle.set()

    async def post_json(self, path: str, body: Any, timeout: float | None = None) -> Any:
        """POST JSON, return the decoded JSON answer; ``EngineUnavailable`` for an
        unreachable server, ``RuntimeError`` for an error status."""
        aiohttp = self.aiohttp
        try:
            async with self.session().post(
                self.url + path,
                data=msgspec.json.encode(body),
                headers=JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout),
            ) as resp:
                raw = await resp.read()
                try:
                    data = msgspec.json.decode(raw) if raw else None
                except msgspec.DecodeError:
                    data = raw.decode(errors="replace")
                if resp.status >= 400:
                    raise RuntimeError(f"{self.name} {path} answered {resp.status}: {data}")
                return data
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.name} server {self.url}{path}: {exc!r}") from exc

    def run_in_loop(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the worker's loop from another thread (the weight
        subscriber's) and wait for its result."""
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
        """The server cannot serve: close the worker (its clients re-send its requests
        elsewhere) and never answer this request (its task is cancelled by the close)."""
        self._server_failed(why)
        await asyncio.Event().wait()

    def _server_failed(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            log.error("%s server %s is gone (%s): closing this worker", self.name, self.url, why)
            if self._worker is not None:
                # Not one of _aux: the close it starts waits for those (and closes us).
                self._closer = asyncio.ensure_future(self._worker.close())

    async def _watch(self) -> None:
        aiohttp = self.aiohttp
        misses = 0
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                async with self.session().get(
                    self.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.health_timeout),
                ) as resp:
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                ok = False
            misses = 0 if ok else misses + 1
            if misses >= self.health_failures:
                self._server_failed(f"/health failed {misses} times in a row")
                return


def response(
    req: LLMRequest, toks: list[int], lps: list[float], vers: list[int], stop: str
) -> LLMResponse:
    """The :class:`~fastio.LLMResponse` of a bridged generation."""
    import numpy as np

    return LLMResponse(
        input_tokens=req.input_ids,
        output_tokens=TokenArray(np.array(toks, dtype=np.int32)),
        output_logprobs=TokenArray(np.array(lps, dtype=np.float32)),
        output_versions=TokenArray(np.array(vers, dtype=np.int32)),
        stop_reason=stop,  # type: ignore[arg-type]  # the caller's one of four
    )


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it, whatever it raises."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
