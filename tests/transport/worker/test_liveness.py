"""A worker stays alive whatever its handlers and its peers do: pings are answered by
the socket thread while handlers block, and a peer that stops reading is dropped
without holding up anyone else."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import zmq

import fastio
from fastio import LLMRequest
from fastio import fabric_msgs as fm
from tests.helpers import WorkerProc, dealer, ping, wait_for
from transport import ClientConfig, FabricClient, FabricController

ENGINES = "tests.transport.plugins"


def health(address: str) -> fm.WorkerStatus:
    with FabricController([address]) as ctl:
        return ctl.health(timeout=5)[address]


def test_a_peer_that_stops_reading_is_dropped_and_holds_up_no_one(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--hwm", "200",
        "--peer-queue-limit", "50000",
    )  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        bad = dealer(ctx, w.address, rcvhwm=10)
        good = dealer(ctx, w.address)
        ping(good)
        hb = fastio.encode(fm.Heartbeat(sent_at=1.0))
        # The bad peer pings and never reads: its pongs fill libzmq's pipe and the
        # kernel's buffers, then the worker's queue for it, until it is dropped.
        sent = 0
        while health(w.address).counters.get("dropped_peers", 0) == 0:
            for _ in range(5000):
                bad.send_multipart(hb)
            sent += 5000
            ping(good)  # meanwhile the good peer is answered at once
            assert sent < 2_000_000, "the non-reading peer was never dropped"
        for _ in range(20):
            ping(good)
        st = health(w.address)
        assert st.counters["dropped_peers"] >= 1
        assert st.counters["discarded"] >= 1
        # It keeps pinging without reading: the worker still answers others, and holds
        # nothing more for it (its replies are discarded, not queued).
        for _ in range(20_000):
            bad.send_multipart(hb)
        for _ in range(20):
            ping(good)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["blocking_engine", "torch_loop_engine"])
def test_handlers_blocking_4_s_on_two_workers_keep_pings_answered(
    spawn: Callable[..., WorkerProc], engine: str
) -> None:
    args = ["--bind", "tcp://127.0.0.1:0", "--engine", f"{ENGINES}:{engine}"]
    workers = [spawn(*args, "--engine-opt", "seconds=4") for _ in range(2)]
    addresses = [w.address for w in workers]
    # Declared dead after 1 s without a pong: a blocked worker that did not answer
    # pings would be declared dead and its requests re-sent.
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, request_timeout=60)
    ctx: zmq.Context[Any] = zmq.Context()
    probes = [dealer(ctx, a) for a in addresses]

    async def main() -> tuple[list[Any], dict[str, int], list[fm.Heartbeat]]:
        async with FabricClient(addresses, cfg) as client:
            while not all(x.alive for x in client.workers):
                await asyncio.sleep(0.01)
            calls = [
                asyncio.ensure_future(client.agenerate(LLMRequest(input_ids=[i, 1, 2])))
                for i in range(4)
            ]
            pongs: list[fm.Heartbeat] = []
            while not all(c.done() for c in calls):
                for p in probes:  # each answered within the bound while handlers block
                    pongs.append(await asyncio.to_thread(ping, p))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*calls), dict(client.stats), pongs

    try:
        results, stats, pongs = asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
    assert sorted(r.output_tokens.tolist()[0] for r in results) == [0, 1, 2, 3]
    assert stats.get("workers_died", 0) == 0 and stats.get("resent", 0) == 0
    # The pongs said the workers were busy, not dead.
    assert any(p.running >= 1 for p in pongs)
    assert any(p.engine_lag > 0 or p.waiting > 0 for p in pongs)


def test_pong_reports_load(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", f"{ENGINES}:slow_engine",
        "--engine-opt", "seconds=30", "--max-concurrency", "2",
    )  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        s = dealer(ctx, w.address)
        for i in range(1, 6):
            s.send_multipart(fastio.encode(fm.Submit(id=i, request=LLMRequest(input_ids=[i]))))
        hb = wait_for(lambda: (p := ping(s)).running == 2 and p, what="two running")
        assert (hb.running, hb.waiting, hb.in_flight) == (2, 3, 5)
        assert hb.engine_lag >= 0.0
    finally:
        ctx.destroy(linger=0)
