"""Helpers of the bridge tests: fake servers as fixtures, workers fronting them, streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import await_for
from tests.transport.fakes.common import FakeProc
from transport import ClientConfig, FabricClient, FabricController, RequestAborted

# Quick pings (first answers and load reports come soon), but a long liveness (10 s): these
# tests count the requests a server saw, and a pong late on a loaded machine would make the
# client take its worker for dead and re-send. FAILOVER is for the tests of a death.
FAST = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=200, request_timeout=60)
FAILOVER = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=20, request_timeout=60)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeProc]]:
    """``fake(kind, *args)`` starts a fake server process; all are killed at teardown."""
    procs: list[FakeProc] = []

    def start(kind: str, *args: str) -> FakeProc:
        p = FakeProc(kind, *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def bridge_args(kind: str, url: str, *extra: str) -> list[str]:
    """CLI arguments of a worker fronting the server at ``url``: fast health checks, but
    1 s to answer each, so a fake server slow on a loaded machine is not taken for hung."""
    return [
        "--bind", "tcp://127.0.0.1:0", "--engine", kind, "--engine-opt", f"url={url}",
        "--engine-opt", "health_interval=0.1", "--engine-opt", "health_timeout=1",
        "--engine-opt", "health_failures=3", "--engine-opt", "stall_timeout=30", *extra,
    ]  # fmt: skip


class Streams:
    """``on_chunk`` collectors, one per request: tokens, logprobs, versions streamed."""

    def __init__(self, n: int) -> None:
        self.chunks: list[list[tuple[list[int], list[float], list[int]]]] = [[] for _ in range(n)]

    def on_chunk(self, i: int) -> Callable[[Any, Any, Any], None]:
        def cb(t: Any, lp: Any, v: Any) -> None:
            self.chunks[i].append((t.tolist(), lp.tolist(), v.tolist()))

        return cb

    def got(self, i: int) -> int:
        return sum(len(c[0]) for c in self.chunks[i])

    def tokens(self, i: int) -> list[int]:
        return [t for c in self.chunks[i] for t in c[0]]

    def logprobs(self, i: int) -> list[float]:
        return [x for c in self.chunks[i] for x in c[1]]

    def versions(self, i: int) -> list[int]:
        return [x for c in self.chunks[i] for x in c[2]]


def generate_all(
    address: str,
    prompts: list[list[int]],
    n: int,
    streams: Streams,
    *,
    extra: Sequence[LLMRequest] = (),
    while_running: Callable[[], Awaitable[None]] | None = None,
) -> list[Any]:
    """Ask the worker at ``address`` for ``n`` tokens after each prompt (streamed into
    ``streams``, one per prompt) and for ``extra`` (not streamed); run ``while_running``
    meanwhile; return the responses in that order."""

    async def main() -> list[Any]:
        async with FabricClient([address], FAST) as client:
            g = GenerationHyperparameters(max_new_tokens=n)
            futs = [
                client.agenerate(LLMRequest(input_ids=p, gconfig=g), on_chunk=streams.on_chunk(i))
                for i, p in enumerate(prompts)
            ]
            futs += [client.agenerate(req) for req in extra]
            if while_running is not None:
                await while_running()
            return list(await asyncio.gather(*futs))

    return asyncio.run(main())


def pause_when_streaming(
    address: str, streams: Streams, calls: int, while_paused: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """A ``while_running`` for :func:`generate_all`: once every request has streamed 3
    tokens, pause the worker, run ``while_paused``, resume."""

    async def run() -> None:
        await await_for(lambda: all(streams.got(i) >= 3 for i in range(calls)), what="tokens")
        with FabricController([address]) as ctl:
            await asyncio.to_thread(ctl.pause, 10)
            await while_paused()
            await asyncio.to_thread(ctl.resume, 10)

    return run


def abort_from_the_controller(address: str) -> None:
    """Start a long request on the worker at ``address``; once it streams, abort it with
    a controller: the client must see RequestAborted."""
    streams = Streams(1)

    async def main() -> None:
        async with FabricClient([address], FAST) as client:
            g = GenerationHyperparameters(max_new_tokens=1000)
            fut = client.agenerate(
                LLMRequest(input_ids=[1], gconfig=g), on_chunk=streams.on_chunk(0)
            )
            await await_for(lambda: streams.got(0) >= 2, what="tokens")
            with FabricController([address]) as ctl:
                await asyncio.to_thread(ctl.abort)
            with pytest.raises(RequestAborted):
                await fut

    asyncio.run(main())
