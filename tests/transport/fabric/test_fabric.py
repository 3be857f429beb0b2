"""The fabric with real worker processes and real sockets (tcp on 127.0.0.1, ipc)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import ROOT, WorkerProc, await_for, wait_for
from transport import (
    ClientConfig,
    FabricClient,
    FabricController,
    RequestAborted,
    RequestTimeout,
    SyncFabricClient,
)

# Tight heartbeats where death detection is tested: a dead worker is found within
# 0.05 * (3 + 1) = 0.2 s. Elsewhere a long liveness (10 s): those tests count requests
# exactly, and a loaded machine (other suites running) must not starve a worker into a
# false death, after which the client re-sends.
# connect_timeout: a worker restarted on a loaded machine may take longer than the
# default 10 s to answer again; these tests wait for it rather than fail fast.
FAST = ClientConfig(
    heartbeat_interval=0.05, heartbeat_liveness=10, request_timeout=30, connect_timeout=60
)
STEADY = ClientConfig(
    heartbeat_interval=0.1, heartbeat_liveness=100, request_timeout=30, connect_timeout=60
)


def req(ids: list[int], n: int = 8, rid: str | None = None, **g: Any) -> LLMRequest:
    gconfig = GenerationHyperparameters(max_new_tokens=n, **g)
    if rid is None:
        return LLMRequest(input_ids=ids, gconfig=gconfig)
    return LLMRequest(rid=rid, input_ids=ids, gconfig=gconfig)


def received(ctl: FabricController) -> dict[str, int]:
    return {a: s.counters["received"] for a, s in ctl.health(timeout=5).items()}


def test_many_concurrent_requests(
    spawn: Callable[..., WorkerProc], bind: Callable[[str], str]
) -> None:
    w1 = spawn("--bind", bind("a"), "--engine", "echo", wait=False)
    w2 = spawn("--bind", bind("b"), "--engine", "echo", wait=False)
    addrs = [w1.wait_ready(), w2.wait_ready()]
    rng = np.random.default_rng(0)
    inputs = [
        rng.integers(0, 50_000, size=int(rng.integers(1, 300))).astype(np.int32)
        for _ in range(3000)
    ]

    async def main() -> None:
        async with FabricClient(addrs, STEADY) as client:
            # Spreading is among live workers: start once both have joined (else a fast
            # first worker can finish everything before the second's first pong).
            await await_for(lambda: all(w.alive for w in client.workers), what="both joined")
            resps = await asyncio.gather(
                *(client.agenerate(LLMRequest(input_ids=x)) for x in inputs)
            )
            for x, r in zip(inputs, resps, strict=True):
                assert r.output_tokens == x.tolist()
                assert r.input_tokens == x.tolist()
                assert r.latency > 0 and r.ttft > 0
            assert client.stats["completed"] == len(inputs)
            assert client.pending == 0

    asyncio.run(main())
    with FabricController(addrs) as ctl:
        counts = received(ctl)
    # Least outstanding requests spreads the load over both workers (a worker falsely
    # presumed dead on an overloaded machine would add re-sends, hence >=).
    assert sum(counts.values()) >= len(inputs), counts
    assert min(counts.values()) > len(inputs) // 10


def test_reference_engine_generates_streams_and_is_deterministic(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--seed", "3")
    chunks: list[int] = []

    async def main() -> None:
        async with FabricClient([w.address], STEADY) as client:
            r = req([5, 6, 7], n=24, rid="fixed")
            r.metadata["seed"] = 11
            a = await client.agenerate(r, on_chunk=lambda t, lp, v: chunks.append(len(t)))
            r2 = req([5, 6, 7], n=24, rid="fixed")
            r2.metadata["seed"] = 11
            b = await client.agenerate(r2)
            c = await client.agenerate(req([5, 6, 8], n=24, rid="fixed", greedy=True))
            assert a.output_len == 24 and a.stop_reason == "length"
            assert a.output_tokens == b.output_tokens  # same seed, prompt, weights
            assert a.output_tokens != c.output_tokens
            # Without a seed, the n_samples of one rid differ (a GRPO group has variance).
            group = await asyncio.gather(
                *(client.agenerate(req([5, 6, 7], n=24, rid="group")) for _ in range(4))
            )
            assert len({tuple(g.output_tokens) for g in group}) > 1
            assert list(a.output_versions) == [0] * 24
            assert all(lp <= 0 for lp in a.output_logprobs)
            assert len(a.itl) == 23 and 0 < a.ttft <= a.latency
            stop = int(a.output_tokens[3])
            rs = req([5, 6, 7], n=24, rid="fixed", stop_token_ids=[stop])
            rs.metadata["seed"] = 11
            s = await client.agenerate(rs)
            assert s.stop_reason == "stop" and int(s.output_tokens[-1]) == stop

    asyncio.run(main())
    assert sum(chunks) == 24 and len(chunks) >= 2  # really streamed


def test_rid_stickiness_and_runtime_membership(spawn: Callable[..., WorkerProc]) -> None:
    w1 = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", wait=False)
    w2 = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()
    ctl = FabricController([a1, a2])

    async def main() -> None:
        async with FabricClient([a1], STEADY) as client:
            await client.agenerate(req([1]))
            client.add_worker(a2)
            await await_for(lambda: all(i.alive for i in client.workers), what="w2 joins")
            before = received(ctl)
            for _ in range(3):  # n_samples of one rid, concurrently, several rounds
                await asyncio.gather(
                    *(client.agenerate(req([1, 2], rid="same")) for _ in range(20))
                )
            after = received(ctl)
            delta = {a: after[a] - before[a] for a in after}
            assert sorted(delta.values()) == [0, 60]
            await asyncio.gather(*(client.agenerate(req([3])) for _ in range(200)))
            assert all(v > before[a] for a, v in received(ctl).items())
            client.remove_worker(a1)
            before = received(ctl)
            await asyncio.gather(*(client.agenerate(req([4])) for _ in range(50)))
            after = received(ctl)
            assert after[a1] == before[a1] and after[a2] == before[a2] + 50

    try:
        asyncio.run(main())
    finally:
        ctl.close()


def test_sticky_cache_stays_bounded_and_keeps_recent_rids(
    spawn: Callable[..., WorkerProc],
) -> None:
    ws = [spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo") for _ in range(2)]
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=100, sticky_cache_size=10)

    async def main() -> None:
        async with (
            FabricClient([w.address for w in ws], cfg) as client,
            FabricController([w.address for w in ws]) as ctl,
        ):
            await await_for(lambda: all(w.alive for w in client.workers), what="workers joined")
            for i in range(35):
                await client.agenerate(LLMRequest(rid=f"r{i}", input_ids=[i]))
                assert len(client._sched.sticky) <= 10
            assert "r34" in client._sched.sticky and "r0" not in client._sched.sticky
            # A rid still remembered keeps going to its worker.
            home = client._sched.sticky["r34"]
            before = received(ctl)
            for _ in range(6):
                await client.agenerate(LLMRequest(rid="r34", input_ids=[1]))
            after = received(ctl)
            assert {a: after[a] - before[a] for a in after} == {
                w.address: 6 if w.address == home else 0 for w in ws
            }

    asyncio.run(main())


def test_worker_sigkilled_midflight_requests_resent(
    spawn: Callable[..., WorkerProc], bind: Callable[[str], str]
) -> None:
    args = ("--engine", "reference", "--token-interval", "0.01")
    w1 = spawn("--bind", bind("a"), *args, wait=False)
    w2 = spawn("--bind", bind("b"), *args, wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()

    async def main() -> None:
        async with FabricClient([a1, a2], FAST) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="workers alive")
            tasks = [
                asyncio.ensure_future(client.agenerate(req([i % 200], n=30))) for i in range(16)
            ]
            await await_for(lambda: all(i.in_flight > 0 for i in client.workers), what="both busy")
            w1.kill()
            t_kill = time.monotonic()
            await await_for(
                lambda: client.stats["workers_died"] == 1, timeout=5, what="death detected"
            )
            detected = time.monotonic() - t_kill
            # Bound: interval * (liveness + 1) plus scheduling slack.
            assert detected < FAST.heartbeat_interval * (FAST.heartbeat_liveness + 1) + 0.3
            resps = await asyncio.gather(*tasks)
            assert all(r.output_len == 30 and r.stop_reason == "length" for r in resps)
            assert client.stats["resent"] > 0
            assert client.stats["completed"] == 16 and client.stats["failed"] == 0

    asyncio.run(main())


def test_worker_restarted_rejoins(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")
    address = w.address

    async def main() -> None:
        # A 1 s liveness: a false death before the kill would count a third join.
        cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, connect_timeout=60)
        async with FabricClient([address], cfg) as client:
            assert (await client.agenerate(req([1, 2]))).output_tokens == [1, 2]
            inc = client.workers[0].incarnation
            w.kill()
            await await_for(lambda: not client.workers[0].alive, what="death detected")
            pending = asyncio.ensure_future(client.agenerate(req([3, 4])))  # queued meanwhile
            spawn("--bind", address, "--engine", "echo")  # same address
            assert (await pending).output_tokens == [3, 4]
            assert client.workers[0].alive and client.workers[0].incarnation != inc
            assert client.stats["workers_joined"] == 2

    asyncio.run(main())


def test_pause_interrupt_resume_accumulates_versions(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.004",
        "--plugin", "tests.transport.plugins:bump_version_on_resume",
    )  # fmt: skip
    streamed = [0]

    def on_chunk(t: Any, lp: Any, v: Any) -> None:
        streamed[0] += len(t)

    async def main() -> None:
        async with (
            FabricClient([w.address], STEADY) as client,
            FabricController([w.address]) as ctl,
        ):
            inputs = [[i, i + 1, i + 2] for i in range(8)]
            tasks = [
                asyncio.ensure_future(client.agenerate(req(x, n=60), on_chunk=on_chunk))
                for x in inputs
            ]
            await await_for(lambda: streamed[0] >= 40, what="generation under way")
            statuses = await ctl.apause()
            st = statuses[w.address]
            assert st.paused and st.running == 0  # nothing generates once pause returns
            await await_for(lambda: client.stats["interrupted"] >= 1, what="interrupts seen")
            frozen = streamed[0]
            hs = await ctl.ahealth()
            assert hs[w.address].counters["interrupted"] >= 1
            assert streamed[0] == frozen  # no token while paused
            await ctl.aresume()
            resps = await asyncio.gather(*tasks)
            for x, r in zip(inputs, resps, strict=True):
                assert r.output_len == 60 and r.stop_reason == "length"
                assert r.input_tokens == x  # the original prompt, not the continuation
                assert len(r.output_logprobs) == 60 and len(r.itl) == 59
                v = list(r.output_versions)
                assert v == sorted(v) and set(v) <= {0, 1}
            assert any(0 in r.output_versions for r in resps)
            assert all(r.output_versions[-1] == 1 for r in resps)

    asyncio.run(main())


def test_cancel_and_timeout_abort_on_worker(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01")

    async def main() -> None:
        async with (
            FabricClient([w.address], STEADY) as client,
            FabricController([w.address]) as ctl,
        ):

            def running() -> int:
                return ctl.health()[w.address].running

            task = asyncio.ensure_future(client.agenerate(req([1], n=100_000)))
            await await_for(lambda: running() == 1, what="request running")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await await_for(lambda: running() == 0, what="worker aborted the request")
            assert ctl.health()[w.address].counters["cancelled"] == 1

            with pytest.raises(RequestTimeout):
                await client.agenerate(req([2], n=100_000), timeout=0.2)
            await await_for(
                lambda: ctl.health()[w.address].counters["cancelled"] == 2, what="timeout cancel"
            )
            assert client.stats["timeouts"] == 1 and client.stats["cancelled"] == 1

            task = asyncio.ensure_future(client.agenerate(req([3], n=100_000)))
            await await_for(lambda: running() == 1, what="request running")
            await ctl.aabort()
            with pytest.raises(RequestAborted):
                await task
            r = await client.agenerate(req([4], n=5))  # still serving
            assert r.output_len == 5

    asyncio.run(main())


def test_custom_engine_factory_from_the_command_line(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "tests.transport.plugins:reversing_engine",
        "--engine-opt", "version=7",
    )  # fmt: skip
    with SyncFabricClient([w.address], STEADY) as client:
        r = client.generate(req([1, 2, 3]))
    assert r.output_tokens == [3, 2, 1] and r.output_versions == [7, 7, 7]


def test_sync_client(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")
    with SyncFabricClient([w.address], STEADY) as client:
        assert client.generate(req([7, 8, 9])).output_tokens == [7, 8, 9]
        futs = [client.submit(req([i])) for i in range(100)]
        assert [f.result(10).output_tokens[0] for f in futs] == list(range(100))

        async def from_a_loop() -> list[int]:
            # Called from a thread that runs a loop of its own: still the client's loop.
            return list(client.submit(req([4, 2])).result(10).output_tokens)

        assert asyncio.run(from_a_loop()) == [4, 2]
    wait_for(lambda: True)


CLIENT_SCRIPT = """
import asyncio, sys
from fastio import GenerationHyperparameters, LLMRequest
from transport import ClientConfig, FabricClient

async def main():
    # No streaming: nothing is sent to the client until its requests end, so only the
    # missing heartbeats can tell the worker that it died. A long liveness: a pong late
    # on a loaded machine must not make this client re-send (the worker would then hold
    # and cancel 6 requests instead of 3).
    cfg = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=200, stream=False)
    async with FabricClient([sys.argv[1]], cfg) as c:
        g = GenerationHyperparameters(max_new_tokens=100_000)
        await asyncio.gather(*(c.agenerate(LLMRequest(input_ids=[i], gconfig=g)) for i in range(3)))

asyncio.run(main())
"""


def test_worker_cancels_requests_of_a_killed_client(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01",
        # Not shorter: a client process stalled half a second on a loaded machine would
        # be taken for dead before the kill, and re-send (6 cancelled, 2 dead peers).
        "--client-timeout", "2",
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    client = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, w.address], env=env, cwd=ROOT)
    try:
        with FabricController([w.address]) as ctl:

            def status() -> Any:
                return ctl.health(timeout=5)[w.address]

            wait_for(lambda: status().running == 3, timeout=30, what="client's requests running")
            client.kill()
            client.wait(10)
            st = wait_for(
                lambda: (s := status()).running == 0 and s, timeout=10, what="requests cancelled"
            )
            assert st.counters["dead_peers"] == 1 and st.counters["cancelled"] == 3
    finally:
        client.kill()
        client.wait(10)


def test_overloaded_worker_pushes_back_without_loss(spawn: Callable[..., WorkerProc]) -> None:
    # The worker holds at most 4 submissions; the client would send 64: the rest are
    # answered OVERLOADED, re-queued by the client, and all complete.
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.002",
        "--max-pending", "4",
    )  # fmt: skip
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=100, max_in_flight_per_worker=64)

    async def main() -> None:
        async with FabricClient([w.address], cfg) as client:
            resps = await asyncio.gather(*(client.agenerate(req([i], n=10)) for i in range(40)))
            assert all(r.output_len == 10 for r in resps)
            assert client.stats["overloaded"] >= 1 and client.stats["failed"] == 0
            assert client.workers[0].in_flight == 0

    asyncio.run(main())
    with FabricController([w.address]) as ctl:
        st = ctl.health(timeout=5)[w.address]
    assert st.counters["completed"] == 40 and st.counters["overloaded"] >= 1


def test_vlm_request_round_trip(spawn: Callable[..., WorkerProc]) -> None:
    from PIL import Image

    from fastio import VLMRequest, VLMResponse

    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")
    img = Image.new("RGB", (32, 16), (10, 20, 30))
    with SyncFabricClient([w.address], STEADY) as client:
        r = client.generate(VLMRequest(input_ids=[1, 2], image_data=[img, "https://x/y.png"]))
    assert isinstance(r, VLMResponse) and r.output_tokens == [1, 2]
    assert r.input_images[1] == "https://x/y.png" and r.input_images[0].size == (32, 16)


def test_stalled_worker_is_replaced_then_rejoins(spawn: Callable[..., WorkerProc]) -> None:
    # SIGSTOP looks like death to the client; after SIGCONT the worker's late answers
    # for the re-sent requests must not reach the callers twice.
    args = ("--engine", "reference", "--token-interval", "0.01")
    w1 = spawn("--bind", "tcp://127.0.0.1:0", *args, wait=False)
    w2 = spawn("--bind", "tcp://127.0.0.1:0", *args, wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()

    async def main() -> None:
        async with FabricClient([a1, a2], FAST) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="workers alive")
            tasks = [asyncio.ensure_future(client.agenerate(req([i], n=20))) for i in range(12)]
            await await_for(lambda: all(i.in_flight > 0 for i in client.workers), what="busy")
            w1.proc.send_signal(signal.SIGSTOP)
            try:
                await await_for(lambda: client.stats["workers_died"] >= 1, what="stall detected")
            finally:
                w1.proc.send_signal(signal.SIGCONT)
            resps = await asyncio.gather(*tasks)
            assert all(r.output_len == 20 for r in resps)
            assert client.stats["completed"] == 12 and client.stats["failed"] == 0
            await await_for(lambda: all(i.alive for i in client.workers), what="w1 rejoins")
            assert (await client.agenerate(req([1], n=3))).output_len == 3

    asyncio.run(main())
