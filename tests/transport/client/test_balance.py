"""Balancing from the first request: a burst sent right after connecting is spread over
the workers that are up, Cancels are not counted as load, and two clients' bursts do not
pile onto one worker (real worker processes, real sockets)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import zmq

import fastio
from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from tests.helpers import WorkerProc, await_for, dealer, ping, wait_for
from transport import ClientConfig, FabricClient, FabricController

ENGINES = "tests.transport.plugins"
# The default heartbeat (1 s): the first calls wait up to that long for both first pongs,
# plenty for a worker on a loaded machine.
CFG = ClientConfig(request_timeout=30)


def received(addresses: list[str]) -> list[int]:
    with FabricController(addresses) as ctl:
        health = ctl.health(timeout=5)
    return [health[a].counters["received"] for a in addresses]


def two_workers(spawn: Callable[..., WorkerProc], *args: str) -> list[str]:
    w1 = spawn("--bind", "tcp://127.0.0.1:0", *args, wait=False)
    w2 = spawn("--bind", "tcp://127.0.0.1:0", *args, wait=False)
    return [w1.wait_ready(), w2.wait_ready()]


def test_burst_right_after_connect_is_spread(spawn: Callable[..., WorkerProc]) -> None:
    # The README's rollout: gather at once after connecting. Nothing has answered a ping
    # yet when the 40 are submitted; the first pong must not take them all.
    addresses = two_workers(spawn, "--engine", "echo")

    async def main() -> None:
        async with FabricClient(addresses, CFG) as client:
            outs = await asyncio.gather(
                *(client.agenerate(LLMRequest(input_ids=[i])) for i in range(40))
            )
            assert [o.output_tokens.tolist() for o in outs] == [[i] for i in range(40)]

    for _ in range(2):
        before = received(addresses)
        asyncio.run(main())
        counts = [b - a for a, b in zip(before, received(addresses), strict=True)]
        assert sum(counts) == 40 and min(counts) >= 0.3 * 40, counts


def test_two_clients_bursting_at_once_are_each_spread(
    spawn: Callable[..., WorkerProc],
) -> None:
    # Two rollout clients start together, each gathering 40 long requests: each client
    # spreads its burst, so neither worker ends up holding both.
    addresses = two_workers(
        spawn, "--engine", f"{ENGINES}:slow_engine", "--engine-opt", "seconds=0.5"
    )
    split: list[list[int]] = []

    async def one_client() -> None:
        async with FabricClient(addresses, CFG) as client:
            futs = [client.agenerate(LLMRequest(input_ids=[i])) for i in range(40)]
            # Where each went, read once all are in flight (each is held 0.5 s there).
            await await_for(lambda: sum(i.in_flight for i in client.workers) == 40)
            split.append([i.in_flight for i in client.workers])
            await asyncio.gather(*futs)

    async def main() -> None:
        await asyncio.gather(one_client(), one_client())

    asyncio.run(main())
    # A client counts the other's requests a worker reported: seeing 20 of them on one
    # worker but not yet on the other, it evens the totals with 30/10. Never 40/0.
    assert all(min(s) >= 0.2 * 40 for s in split), split
    counts = received(addresses)
    assert sum(counts) == 80 and min(counts) >= 0.3 * 80, (counts, split)


def parking_engine(opts: dict[str, str]) -> Any:
    """``--engine tests.transport.client.test_balance:parking_engine``: a prompt starting
    with 0 blocks the engine's loop for ``block`` seconds (a forward pass run inline);
    any other waits there (yielding) for a minute."""
    block = float(opts.get("block", "20"))

    async def generate(req: Any, ctx: Any) -> Any:
        if req.input_ids[0] == 0:
            time.sleep(block)  # blocks the engine's loop, on purpose
        else:
            await asyncio.sleep(60)
        n = len(req.input_ids)
        return LLMResponse(
            output_tokens=req.input_ids, output_logprobs=[0.0] * n, output_versions=[0] * n
        )

    return generate


def submit(s: zmq.Socket[Any], id: int, first: int) -> None:
    s.send_multipart(fastio.encode(fm.Submit(id=id, request=LLMRequest(input_ids=[first]))))


def test_cancels_on_their_way_are_not_reported_as_load(
    spawn: Callable[..., WorkerProc],
) -> None:
    # What a client sends a worker after a partition heals: Cancels of requests the
    # worker still holds, and of others, in one batch. They wait in the socket thread's
    # inbox while the engine's loop is blocked; the pong must count neither the
    # Cancels nor the held requests they are about to end, only real work: the
    # blocked handler and one new Submit.
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine",
        "tests.transport.client.test_balance:parking_engine", wait=False,
    )  # fmt: skip
    other = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", wait=False)
    addresses = [w.wait_ready(), other.wait_ready()]
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        s = dealer(ctx, w.address)
        submit(s, 1, 1)
        submit(s, 2, 2)
        wait_for(lambda: ping(s).running == 2, what="two parked requests")
        submit(s, 3, 0)  # blocks the engine's loop
        wait_for(lambda: ping(s).running == 3, what="the engine blocked in its handler")
        for i in (1, 2, *range(1000, 1200)):
            s.send_multipart(fastio.encode(fm.Cancel(id=i)))
        submit(s, 4, 4)
        hb = ping(s)
        assert (hb.running, hb.waiting) == (1, 1) and hb.in_flight <= 2, hb
        assert hb.engine_lag > 0  # the engine's loop is behind: that much is true

        # A client that joins now sees two requests ahead on w, none on the other, and
        # spreads a burst accordingly (it routed all away from w when the Cancels
        # counted).
        async def burst() -> list[int]:
            async with FabricClient(addresses, CFG) as client:
                await await_for(
                    lambda: all(i.alive and i.load_current for i in client.workers),
                    what="both joined",
                )
                futs = [client.agenerate(LLMRequest(input_ids=[5])) for _ in range(10)]
                split = [i.in_flight for i in client.workers]  # as dispatched
                for f in futs:
                    f.cancel()
                return split

        split = asyncio.run(burst())
        assert split[0] >= 3 and sum(split) == 10, split
    finally:
        ctx.destroy(linger=0)
