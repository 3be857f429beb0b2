"""A worker whose engine blocks for seconds is busy, not dead: the client waits for it
and re-sends nothing (real worker processes; the engine is loaded with ``--engine``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from fastio import LLMRequest, LLMResponse
from tests.transport.conftest import WorkerProc
from transport import ClientConfig, FabricClient


def blocking_engine(opts: dict[str, str]) -> Any:
    """``--engine tests.transport.client.test_busy:blocking_engine``: each request
    holds the engine for ``block`` seconds (an engine option; default 2) in a blocking call,
    as a torch forward pass does, then echoes the prompt."""
    seconds = float(opts.get("block", "2"))

    async def generate(req: Any, ctx: Any) -> Any:
        time.sleep(seconds)  # blocks whatever runs the engine, on purpose
        n = len(req.input_ids)
        return LLMResponse(
            output_tokens=req.input_ids, output_logprobs=[0.0] * n, output_versions=[0] * n
        )

    return generate


@pytest.mark.slow
def test_worker_blocked_in_its_engine_is_not_dead(spawn: Callable[..., WorkerProc]) -> None:
    # Silence for 0.5 s would kill a worker here; each request blocks its engine for
    # 2.5 s, 5x that. Pongs come from the worker's socket side, so nothing dies. (Not
    # shorter: a pong can come 0.15 s late on a loaded machine, and that is no death.)
    args = (
        "--bind", "tcp://127.0.0.1:0", "--engine",
        "tests.transport.client.test_busy:blocking_engine", "--engine-opt", "block=2.5",
    )  # fmt: skip
    w1, w2 = spawn(*args, wait=False), spawn(*args, wait=False)
    addresses = [w1.wait_ready(), w2.wait_ready()]
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=5, request_timeout=60)

    async def main() -> None:
        async with FabricClient(addresses, cfg) as client:
            outs = await asyncio.gather(
                *(client.agenerate(LLMRequest(input_ids=[i])) for i in range(4))
            )
            assert [o.output_tokens.tolist() for o in outs] == [[i] for i in range(4)]
            assert client.stats["workers_died"] == 0, client.stats
            assert client.stats["resent"] == 0, client.stats

    asyncio.run(main())
