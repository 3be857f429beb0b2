"""Failover between two bridge workers, each fronting its own fake server: a worker
killed, a server that dies, a server that hangs. Every request is answered exactly once,
with the output the servers' model gives, and no streamed token is repeated or lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for
from tests.transport.engines_helpers import FAILOVER, Streams, bridge_args, fake
from tests.transport.fakes.common import FakeProc, reference_output
from transport import FabricClient

__all__ = ["fake"]

SEED = 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "fault"),
    [
        ("sglang", "worker killed"),
        ("sglang", "server dies"),
        ("sglang", "server hangs"),
        # The vLLM bridge's own path: a stream cut by a dead server (the rest is shared).
        ("vllm", "server dies"),
    ],
)
def test_every_request_answered_once_across_a_failure(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc], kind: str, fault: str
) -> None:
    n, calls = 30, 8
    interval = ("--token-interval", "0.02")
    # The first server fails once it has generated a few tokens for each request.
    faulty = {"server dies": ["--die-after", "40"], "server hangs": ["--hang-after", "40"]}
    s1 = fake(kind, *interval, *faulty.get(fault, []))
    s2 = fake(kind, *interval)
    w1 = spawn(*bridge_args(kind, s1.url), wait=False)
    w2 = spawn(*bridge_args(kind, s2.url), wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()
    streams = Streams(calls)

    async def main() -> tuple[list[object], dict[str, int]]:
        async with FabricClient([a1, a2], FAILOVER) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="workers alive")
            g = GenerationHyperparameters(max_new_tokens=n)
            futs = [
                client.agenerate(
                    LLMRequest(input_ids=[i, 4, i], gconfig=g), on_chunk=streams.on_chunk(i)
                )
                for i in range(calls)
            ]
            await await_for(lambda: all(streams.got(i) >= 2 for i in range(calls)), what="streams")
            assert all(w.in_flight > 0 for w in client.workers), "both workers serve"
            if fault == "worker killed":
                w1.kill()
            resps = await asyncio.wait_for(asyncio.gather(*futs), 60)
            return list(resps), dict(client.stats)

    resps, stats = asyncio.run(main())
    assert stats["workers_died"] == 1 and stats["resent"] > 0, stats
    for i, r in enumerate(resps):
        want = reference_output(SEED, [i, 4, i], n)
        assert r.output_tokens.tolist() == want  # type: ignore[attr-defined]
        assert streams.tokens(i) == want, "a streamed token was repeated or lost"
        assert r.stop_reason == "length"  # type: ignore[attr-defined]
    if fault != "worker killed":
        # The worker whose server failed closed itself: its clients failed over.
        assert w1.proc.wait(30) is not None
