"""The bridges' shared HTTP layer against a tiny in-process aiohttp server on loopback:
the engine-load counter, and which error a failed SGLang weight load reports."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import await_for
from transport.engines.sglang import SGLangEngine

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Ctx:
    """A :class:`~transport.GenerationContext` that records what is emitted."""

    def __init__(self, i: int) -> None:
        self.id, self.deadline, self.interrupted, self.version = i, float("inf"), False, 0
        self.tokens: list[int] = []

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        self.tokens.append(token)


async def serve(routes: dict[str, Handler]) -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_queue_depth_counts_requests_without_a_token_from_any_thread() -> None:
    release: dict[str, asyncio.Event] = {}

    async def generate(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await release.setdefault(rid, asyncio.Event()).wait()  # queued: no token yet
        for n in (1, 2):
            meta: dict[str, Any] = {
                "output_token_logprobs": [[-0.5, 7 + k, None] for k in range(n)],
                "completion_tokens": n,
                "finish_reason": {"type": "length"} if n == 2 else None,
            }
            await resp.write(b"data: " + json.dumps({"meta_info": meta}).encode() + b"\n\n")
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        server = serve({"/generate": generate})
        url = await server.__anext__()
        eng = SGLangEngine(url, health_interval=0)
        seen: list[int] = []
        stop = threading.Event()

        def read() -> None:  # the worker's socket thread reads it while flights change
            while not stop.is_set():
                seen.append(eng.queue_depth())

        reader = threading.Thread(target=read)
        reader.start()
        try:
            g = GenerationHyperparameters(max_new_tokens=2)
            ctxs = [Ctx(i) for i in range(3)]
            tasks = [
                asyncio.ensure_future(eng.generate(LLMRequest(input_ids=[1], gconfig=g), c))
                for c in ctxs
            ]
            await await_for(lambda: len(release) == 3, what="three requests queued")
            assert await asyncio.to_thread(eng.queue_depth) == 3
            first = sorted(release)[0]
            release[first].set()
            await await_for(lambda: eng.queue_depth() == 2, what="one streams")
            tasks[2].cancel()  # one ends without a token
            await asyncio.gather(tasks[2], return_exceptions=True)
            await await_for(lambda: eng.queue_depth() == 1, what="the cancelled one gone")
            for ev in release.values():
                ev.set()
            resps = await asyncio.gather(*tasks[:2])
            assert [r.output_tokens.tolist() for r in resps] == [[7, 8], [7, 8]]
            assert eng.queue_depth() == 0
        finally:
            stop.set()
            reader.join()
            await eng.close()
            await server.aclose()
        assert seen and all(0 <= d <= 3 for d in seen)

    asyncio.run(main())


def test_a_failed_load_reports_its_own_error_not_the_resume(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from transport.weights.errors import WeightUpdateError

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def load_fails(request: web.Request) -> web.Response:
        return web.json_response({"error": "the checkpoint is corrupt"}, status=500)

    async def continue_fails(request: web.Request) -> web.Response:
        return web.json_response({"error": "scheduler gone"}, status=500)

    async def main(continue_: Handler) -> None:
        server = serve(
            {
                "/pause_generation": ok,
                "/update_weights_from_disk": load_fails,
                "/continue_generation": continue_,
            }
        )
        url = await server.__anext__()
        eng = SGLangEngine(url, health_interval=0)
        try:
            await eng.load_weights_from_disk("/ckpt/v3", version=3)
        finally:
            await eng.close()
            await server.aclose()

    for continue_ in (ok, continue_fails):
        with (
            caplog.at_level(logging.ERROR, "transport.engines"),
            pytest.raises(WeightUpdateError, match="the checkpoint is corrupt"),
        ):
            asyncio.run(main(continue_))
    assert "scheduler gone" in caplog.text  # the resume's failure is logged


def test_constructor_keywords_are_checked_by_the_options_struct() -> None:
    from transport.engines.vllm import VLLMEngine

    eng = SGLangEngine("http://127.0.0.1:1/", health_interval=0, reload_timeout=5)
    assert (eng.url, eng.options.health_interval, eng.options.reload_timeout) == (
        "http://127.0.0.1:1", 0.0, 5.0,
    )  # fmt: skip
    assert VLLMEngine("http://127.0.0.1:1", model="m").served_model == "m"
    with pytest.raises(ValueError, match="health_failures"):
        SGLangEngine("http://127.0.0.1:1", health_failures=0)
    with pytest.raises(ValueError, match="colour"):
        SGLangEngine("http://127.0.0.1:1", colour="red")
    with pytest.raises(ValueError, match="url must be"):
        SGLangEngine("127.0.0.1:1")


def test_one_error_mapping_carries_the_status_and_the_servers_text() -> None:
    """No socket: an error status is a ServerRejected (a RuntimeError) with the status."""
    from transport.engines.http import ServerRejected, raise_for_status, stream_error

    class Resp:
        def __init__(self, status: int, body: bytes) -> None:
            self.status, self.body = status, body

        async def read(self) -> bytes:
            return self.body

    asyncio.run(raise_for_status(Resp(200, b"{}"), "x"))  # no error
    with pytest.raises(ServerRejected, match="SGLang /generate answered 404: no such") as info:
        asyncio.run(raise_for_status(Resp(404, b"no such route"), "SGLang /generate"))
    assert info.value.status == 404 and isinstance(info.value, RuntimeError)
    assert ServerRejected("broken stream").status is None
    assert stream_error({"error": {"message": "too long"}}) == "too long"
    assert stream_error({"error": "bad"}) == "bad" and stream_error({"choices": []}) is None


def test_a_failed_abort_by_id_warns_once_then_counts(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While paused in place, a frozen request vLLM could not drop keeps its slot: a
    # warning, but one per kind and interval however many flights were aborted.
    from transport.engines import vllm
    from transport.ratelog import RateLimitedLog

    monkeypatch.setattr(vllm, "_warn", RateLimitedLog(vllm.log))  # none logged before
    eng = vllm.VLLMEngine("http://127.0.0.1:1", request_timeout=2.0)

    async def main() -> None:
        for rid in ("r1", "r2", "r3"):
            await eng._abort_by_id(rid)
        await eng.close()

    with caplog.at_level(logging.WARNING, logger="transport.engines"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "abort_requests" in r.getMessage()]
    assert len(lines) == 1 and "for r1 failed" in lines[0], lines
