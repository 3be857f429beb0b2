"""The client's fast path for the usual call (one segment, nothing streamed) gives the
same responses as the general path, and what it shares between responses cannot leak
from one to another."""

from __future__ import annotations

import asyncio

from fastio import LLMRequest, LLMResponse
from transport import ClientConfig, FabricClient, GenerateFuture, WorkerConfig, WorkerServer
from transport.client.calls import ChunkCallback
from transport.worker import echo_handler


async def _two_echoes(on_chunk: ChunkCallback | None = None) -> tuple[LLMResponse, LLMResponse]:
    server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
    endpoints = await server.start()
    try:
        async with FabricClient(endpoints, ClientConfig(stream=False)) as client:
            a = await asyncio.wait_for(
                client.agenerate(LLMRequest(input_ids=[1, 2, 3, 4]), on_chunk=on_chunk), 30
            )
            b = await asyncio.wait_for(
                client.agenerate(LLMRequest(input_ids=[5, 6, 7, 8]), on_chunk=on_chunk), 30
            )
            return a, b
    finally:
        await server.close()


def test_responses_share_no_writable_state() -> None:
    a, b = asyncio.run(_two_echoes())
    assert a.output_tokens.tolist() == [1, 2, 3, 4] and b.output_tokens.tolist() == [5, 6, 7, 8]
    # Tokens that arrived together: zero inter-token latencies, one fewer than tokens.
    assert a.itl.tolist() == [0.0, 0.0, 0.0] and b.itl.tolist() == [0.0, 0.0, 0.0]
    # Changing one response's itl (in place, or growing it) leaves the other's alone.
    a.itl[0] = 5.0
    a.itl.append(7.0)
    assert a.itl.tolist() == [5.0, 0.0, 0.0, 7.0]
    assert b.itl.tolist() == [0.0, 0.0, 0.0]
    assert a.latency > 0 and a.ttft == a.latency


def test_fast_path_gives_what_the_general_path_gives() -> None:
    chunks: list[list[int]] = []
    fast, _ = asyncio.run(_two_echoes())
    # With on_chunk: the general path.
    general, _ = asyncio.run(_two_echoes(lambda tok, lp, ver: chunks.append(tok.tolist())))
    assert chunks == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for f in ("input_tokens", "output_tokens", "output_logprobs", "output_versions", "itl"):
        assert getattr(fast, f).tolist() == getattr(general, f).tolist(), f
    assert fast.stop_reason == general.stop_reason == "stop"


def test_a_bare_generate_future_cancels() -> None:
    # No __init__ of its own: a future the client never filled in (one failed at once,
    # or made by hand) still cancels.
    async def main() -> None:
        fut = GenerateFuture(loop=asyncio.get_running_loop())
        assert fut.cancel()
        assert fut.cancelled()
        failed = GenerateFuture(loop=asyncio.get_running_loop())
        failed.set_exception(RuntimeError("x"))
        assert not failed.cancel()
        assert isinstance(failed.exception(), RuntimeError)

    asyncio.run(main())
