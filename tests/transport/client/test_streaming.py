"""Streaming across re-sends: ``on_chunk`` sees every output position once, in order,
and the final output is the chunks concatenated, when a worker is killed mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for
from transport import ClientConfig, FabricClient

# The killed worker is found within 1 s; the other one, whose pongs may come late on a
# loaded machine, must not be taken for dead as well (the test counts one death).
FAST = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=20, request_timeout=60)


@pytest.mark.slow
def test_failover_mid_stream_repeats_no_token(spawn: Callable[..., WorkerProc]) -> None:
    args = ("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.02")
    w1, w2 = spawn(*args, wait=False), spawn(*args, wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()
    n, calls = 60, 8
    streamed: list[list[tuple[list[int], list[float], list[int]]]] = [[] for _ in range(calls)]

    def collector(i: int) -> Any:
        def on_chunk(t: Any, lp: Any, v: Any) -> None:
            streamed[i].append((t.tolist(), lp.tolist(), v.tolist()))

        return on_chunk

    def got(i: int) -> int:
        return sum(len(c[0]) for c in streamed[i])

    async def main() -> None:
        async with FabricClient([a1, a2], FAST) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="workers alive")
            g = GenerationHyperparameters(max_new_tokens=n)
            futs = [
                client.agenerate(LLMRequest(input_ids=[i, i + 1], gconfig=g), on_chunk=collector(i))
                for i in range(calls)
            ]
            await await_for(lambda: all(got(i) >= 5 for i in range(calls)), what="streaming")
            assert all(i.in_flight > 0 for i in client.workers)
            w1.kill()
            resps = await asyncio.gather(*futs)
            assert client.stats["workers_died"] == 1 and client.stats["resent"] > 0
        for i, r in enumerate(resps):
            toks = [t for c in streamed[i] for t in c[0]]
            lps = [x for c in streamed[i] for x in c[1]]
            vers = [x for c in streamed[i] for x in c[2]]
            assert toks == r.output_tokens.tolist() and len(toks) == n
            assert lps == pytest.approx(r.output_logprobs.tolist())
            assert vers == r.output_versions.tolist()
            assert r.stop_reason == "length" and len(r.itl) == n - 1
            assert r.input_tokens == [i, i + 1]  # the caller's prompt, not a continuation

    asyncio.run(main())
