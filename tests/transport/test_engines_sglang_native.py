"""The SGLang bridge in-process: a pause on a server without ``/pause_generation``, a
stream frozen by a pause, a kept connection the server closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import await_for
from tests.transport.engines_helpers import fake
from tests.transport.fakes.common import FakeProc
from transport.engines.sglang import SGLangEngine

__all__ = ["fake"]  # the fixture, imported for pytest


class Ctx:
    def __init__(self) -> None:
        self.id, self.deadline, self.interrupted, self.version = 0, float("inf"), False, 0
        self.tokens: list[int] = []

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        self.tokens.append(token)


def chunk(n: int, finish: Any = None) -> bytes:
    meta = {
        "output_token_logprobs": [[-0.5, 10 + k, None] for k in range(n)],
        "completion_tokens": n,
        "finish_reason": finish,
        "weight_version": "default",
    }
    return b"data: " + json.dumps({"meta_info": meta}).encode() + b"\n\n"


async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_a_server_without_pause_generation_is_paused_by_aborting_its_requests() -> None:
    aborted: list[str] = []
    calls: list[str] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 0
        while rid not in aborted:
            n += 1
            await resp.write(chunk(n))
            await asyncio.sleep(0.01)
        await resp.write(chunk(n, {"type": "abort"}) + b"data: [DONE]\n\n")
        return resp

    async def abort(request: web.Request) -> web.Response:
        aborted.append((await request.json())["rid"])
        return web.json_response({})

    async def pause(request: web.Request) -> web.Response:
        calls.append("pause")
        return web.Response(status=404)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        app.router.add_post("/pause_generation", pause)
        server = serve(app)
        url = await server.__anext__()
        eng = SGLangEngine(url, health_interval=0)
        ctx = Ctx()
        try:
            g = GenerationHyperparameters(max_new_tokens=1000)
            task = asyncio.ensure_future(eng.generate(LLMRequest(input_ids=[1], gconfig=g), ctx))
            await await_for(lambda: len(ctx.tokens) >= 3, what="tokens")
            ctx.interrupted = True
            await eng.pause_generation()
            assert eng.has_pause is False and not eng.pauses_in_place
            r = await asyncio.wait_for(task, 10)
            assert r.stop_reason == "interrupt" and r.output_tokens.tolist() == ctx.tokens
            assert len(aborted) == 1 and calls == ["pause"]
            ctx.interrupted = False
            await eng.continue_generation()
            await eng.pause_generation()  # known now: not asked again
            assert calls == ["pause"]
        finally:
            await eng.close()
            await server.aclose()

    asyncio.run(main())


def test_a_request_whose_kept_connection_the_server_closed_is_sent_once_more() -> None:
    # A raw HTTP/1.1 server: it answers the first request of a connection and keeps it
    # open, then closes it on the next request without a byte (an idle close that
    # crossed the request): the bridge sends that request again, once, on a new one.
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            seen.append(served)
            if served:
                writer.close()
                return
            body = chunk(2, {"type": "length"}) + b"data: [DONE]\n\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            await writer.drain()
            served += 1

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        eng = SGLangEngine(f"http://127.0.0.1:{port}", health_interval=0, keepalive=30)
        try:
            g = GenerationHyperparameters(max_new_tokens=2)
            for _ in range(2):
                r = await eng.generate(LLMRequest(input_ids=[1], gconfig=g), Ctx())
                assert r.output_tokens.tolist() == [10, 11] and r.stop_reason == "length"
        finally:
            await eng.close()
            srv.close()

    asyncio.run(main())
    # Connection 1: request 1 answered, request 2 closed unanswered; connection 2:
    # request 2 again, answered.
    assert seen == [0, 1, 0]


@pytest.mark.slow
def test_a_stream_frozen_by_the_pause_is_not_taken_for_a_stalled_one(
    fake: Callable[..., FakeProc],
) -> None:
    # stall_timeout 0.3 s, a pause in place of 1 s: the frozen stream has no read
    # timeout meanwhile, and the request completes after the resume.
    server = fake("sglang", "--token-interval", "0.01")
    eng = SGLangEngine(server.url, health_interval=0, stall_timeout=0.3)
    ctx = Ctx()

    async def main() -> Any:
        try:
            g = GenerationHyperparameters(max_new_tokens=30)
            task = asyncio.ensure_future(eng.generate(LLMRequest(input_ids=[4], gconfig=g), ctx))
            await await_for(lambda: len(ctx.tokens) >= 3, what="tokens")
            ctx.interrupted = True
            await eng.pause_generation()
            assert eng.pauses_in_place
            held = len(ctx.tokens)
            await asyncio.sleep(1.0)  # the pause outlasting stall_timeout: what is tested
            assert not task.done() and len(ctx.tokens) == held
            ctx.interrupted = False
            await eng.continue_generation()
            return await asyncio.wait_for(task, 10)
        finally:
            await eng.close()

    r = asyncio.run(main())
    assert r.stop_reason == "length" and len(r.output_tokens) == 30
    assert server.stats()["generate"] == 1
