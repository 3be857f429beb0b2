"""The worker's start and close: a start cancelled part-way still closes cleanly."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import transport.worker.iothread as iothread
from tests.helpers import await_for
from transport import WorkerConfig, WorkerServer, echo_handler


def test_a_start_cancelled_while_binding_closes_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    binding, go = threading.Event(), threading.Event()
    real = iothread.make_router

    def held_bind(*args: Any, **kwargs: Any) -> Any:
        binding.set()
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(iothread, "make_router", held_bind)
    out: dict[str, Any] = {}

    async def main() -> None:
        server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0", inline=False))
        start = asyncio.ensure_future(server.start())
        await await_for(binding.is_set, 10, "the socket thread binding")
        start.cancel()  # as Ctrl-C or a wait_for around start() would
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await start
        await server.close()
        out["thread alive"] = server.io._thread is not None and server.io._thread.is_alive()

    # In a thread: a close() that wedges in zmq's term() fails the test instead of hanging it.
    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "close() after a cancelled start() hung"
    assert out == {"thread alive": False}
