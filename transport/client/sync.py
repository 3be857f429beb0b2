"""The client driven from synchronous code: its loop runs in a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from fastio import LLMRequest, LLMResponse
from transport.client.config import ClientConfig
from transport.client.fabric import FabricClient, _in_loop
from transport.client.workers import check_address

__all__ = ["SyncFabricClient"]

T = TypeVar("T")


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
        return self._run(_in_loop(self.client, req, timeout, None))

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
