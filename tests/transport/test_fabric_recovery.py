"""Recovery paths of the fabric found by review: requests that cannot be encoded, handler
output that does not validate, and submissions a worker gives up on by itself (a client
whose loop stalled, a connection reset) must end with an answer, never with silence."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from fastio import EncodeError, GenerationHyperparameters, LLMRequest
from fastio import fabric_msgs as fm
from tests.transport.conftest import WorkerProc, await_for
from tests.transport.recovery_plugins import (
    BAD_STOP,
    GOOD,
    NO_LOGPROBS,
    NOT_A_RESPONSE,
    SHORT_VERSIONS,
)
from transport import ClientConfig, FabricClient, RemoteError

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


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        (NO_LOGPROBS, r"equal lengths, got 3, 0 and 3"),
        (SHORT_VERSIONS, r"equal lengths, got 3, 3 and 1"),
        (BAD_STOP, r"stop_reason must be one of .*'finished'"),
        (NOT_A_RESPONSE, r"returned dict, not an LLMResponse"),
    ],
)
def test_invalid_handler_output_is_a_handler_error(
    spawn: Callable[..., WorkerProc], mode: int, match: str
) -> None:
    engine = "tests.transport.recovery_plugins:faulty_engine"
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", engine)

    async def main() -> None:
        async with FabricClient([w.address], STEADY) as client:
            with pytest.raises(RemoteError, match=match) as info:
                await client.agenerate(req([mode]), timeout=10)
            assert info.value.code == fm.ErrorCode.HANDLER_ERROR
            # The worker keeps serving.
            ok = await client.agenerate(req([GOOD]), timeout=10)
            assert ok.output_tokens == [7, 8, 9] and ok.stop_reason == "stop"
            assert client.stats["bad_messages"] == 0

    asyncio.run(main())


def test_echo_handler_output_is_consistent(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")

    async def main() -> None:
        async with FabricClient([w.address], STEADY) as client:
            r = await client.agenerate(req([4, 5, 6]), timeout=10)
            assert r.output_tokens == [4, 5, 6]
            assert r.output_logprobs.tolist() == [0.0] * 3
            assert r.output_versions.tolist() == [0] * 3

    asyncio.run(main())
