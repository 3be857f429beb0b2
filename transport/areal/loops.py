"""A :class:`~transport.FabricClient` per event loop that awaits ``agenerate``, closed
with its loop (``docs/areal.md#use``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any

import msgspec

from transport import metrics
from transport.client import ClientConfig, FabricClient

__all__ = ["LoopClients"]

log = logging.getLogger("transport.areal")

#: A loop's client and the async generator whose shutdown (the loop's) closes it.
_Bound = tuple[FabricClient, AsyncGenerator[None, None]]


class LoopClients:
    """FabricClients by event loop, all to ``addresses`` with ``config``
    (``config.metrics_port`` is served once, from here, until :meth:`close`).

    >>> clients = LoopClients(["tcp://127.0.0.1:5555"], ClientConfig())  # doctest: +SKIP
    >>> resp = await (await clients.get()).agenerate(req)  # doctest: +SKIP
    >>> clients.close()  # doctest: +SKIP
    """

    def __init__(
        self, addresses: Sequence[str], config: ClientConfig, close_timeout: float = 10.0
    ) -> None:
        self.addresses = list(addresses)
        self.close_timeout = close_timeout
        self._observe_latency = config.metrics_port is not None
        self.config = msgspec.structs.replace(config, metrics_port=None)
        FabricClient(self.addresses, self.config)  # a bad address fails here, not later
        self._by_loop: dict[asyncio.AbstractEventLoop, _Bound] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: The port of the metrics endpoint (``config.metrics_port``), or None.
        self.metrics_port: int | None = None
        if config.metrics_port is not None:
            self.metrics_port = metrics.start_http_server(config.metrics_port)

    def snapshot(self) -> dict[asyncio.AbstractEventLoop, FabricClient]:
        """The clients now open, by loop."""
        with self._lock:
            return {loop: client for loop, (client, _) in self._by_loop.items()}

    async def get(self) -> FabricClient:
        """The running loop's client (made on its first request); ``RuntimeError``
        after :meth:`close`."""
        loop = asyncio.get_running_loop()
        bound = self._by_loop.get(loop)  # one dict read per request: no lock
        if bound is not None:
            return bound[0]
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is not initialized (call initialize first)")
            stale = [(old, b) for old, b in self._by_loop.items() if old.is_closed()]
            for old, _ in stale:
                del self._by_loop[old]
            client = FabricClient(self.addresses, self.config)
            client.counters.observe_latency = self._observe_latency
            watch = self._watch(loop, client)
            self._by_loop[loop] = (client, watch)
        for old, (_, old_watch) in stale:
            self._end(old, old_watch)
        # The first step registers the generator with this loop (its shutdown of async
        # generators closes the client) and stops at its yield: nothing is awaited.
        await watch.__anext__()
        return await client.start()  # its sockets open now, on this loop

    async def _watch(
        self, loop: asyncio.AbstractEventLoop, client: FabricClient
    ) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:  # close the client here and now
            with self._lock:
                if self._by_loop.get(loop, (None,))[0] is client:
                    del self._by_loop[loop]
            _drive(client.close(), "closing a fabric client")

    def _end(self, loop: asyncio.AbstractEventLoop, watch: AsyncGenerator[None, None]) -> None:
        """Close ``watch`` (so its client): on its loop if that runs elsewhere."""
        if loop.is_running() and not _runs_here(loop):
            with contextlib.suppress(RuntimeError):  # closed meanwhile: finished here below
                fut = asyncio.run_coroutine_threadsafe(_aclose(watch), loop)
                try:
                    return fut.result(self.close_timeout)
                except Exception:  # timed out, or the loop stopped first
                    fut.cancel()
                if loop.is_running():
                    log.warning(
                        "the loop of a fabric client did not close it within %.0f s; "
                        "its sockets stay open until that loop ends",
                        self.close_timeout,
                    )
                    return
        _drive(watch.aclose(), "closing a fabric client's loop watch")

    def close(self) -> None:
        """Close every client (requests still pending fail with ``ClientClosed``); no
        client is made after this."""
        with self._lock:
            self._closed = True
            bound = list(self._by_loop.items())
        for loop, (_, watch) in bound:
            self._end(loop, watch)
        if self.metrics_port is not None:
            metrics.stop_http_server(self.metrics_port)
            self.metrics_port = None


def _runs_here(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def _aclose(agen: AsyncGenerator[None, None]) -> None:
    await agen.aclose()


def _drive(aw: Awaitable[Any], what: str) -> None:
    """Run ``aw`` to its end without a loop: the closes driven here never suspend."""
    step = aw.__await__()
    try:
        step.send(None)
    except StopIteration:
        return
    except Exception:
        log.warning("%s failed", what, exc_info=True)
        return
    step.close()
    log.warning("%s did not complete at once: left unfinished", what)
