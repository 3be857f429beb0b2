"""Recovery paths of the fabric found by review: requests that cannot be encoded, handler
output that does not validate, and submissions a worker gives up on by itself (a client
whose loop stalled, a connection reset) must end with an answer, never with silence."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from fastio import EncodeError, GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for
from transport import ClientConfig, FabricClient

STEADY = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, request_timeout=30)


def req(ids: list[int], n: int = 8, **meta: Any) -> LLMRequest:
    return LLMRequest(
        input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=n), metadata=meta
    )


def test_unencodable_request_fails_alone_and_frees_its_slot(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01")
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, max_in_flight_per_worker=1)

    async def main() -> None:
        async with FabricClient([w.address], cfg) as client:
            await await_for(lambda: client.workers[0].alive, what="worker alive")
            # Sent at once by its caller: the caller gets the error, no slot is taken.
            with pytest.raises(EncodeError):
                await client.agenerate(req([1], obj=object()), timeout=10)
            assert client.pending == 0 and client.workers[0].in_flight == 0
            # Dispatched from the queue (inside the pump's receive callback, when the
            # slow request ahead of it ends): it fails alone, the next one still runs.
            slow = asyncio.ensure_future(client.agenerate(req([1, 2], n=20), timeout=10))
            await await_for(lambda: client.workers[0].in_flight == 1, what="slot taken")
            bad = asyncio.ensure_future(client.agenerate(req([3], obj=object()), timeout=10))
            good = asyncio.ensure_future(client.agenerate(req([4, 5], n=4), timeout=10))
            assert (await slow).output_len == 20
            with pytest.raises(EncodeError):
                await bad
            assert (await good).output_len == 4
            assert client.pending == 0 and client.stats["failed"] == 2

    asyncio.run(main())
