"""The SGLang bridge in-process: a version written once per weights directory, a load
that another worker in front of the same server already did, a pause on a server
without ``/pause_generation``, a kept connection the server closed."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("torch")

import torch
from aiohttp import web

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import await_for
from tests.transport.engines_helpers import fake
from tests.transport.fakes.common import FakeProc
from transport.engines.sglang import DONE, SGLangEngine, write_version

__all__ = ["fake"]  # the fixture, imported for pytest


def pairs(scale: float = 1.0) -> list[tuple[str, Any]]:
    return [
        ("w", torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale),
        ("b", torch.ones(5, dtype=torch.bfloat16) * scale),
    ]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The versions actually written (save_weights calls), in order."""
    import transport.weights.disk as disk

    done: list[int] = []
    real = disk.save_weights

    def counted(where: Any, state: Any, version: int, **kw: Any) -> Path:
        done.append(version)
        return real(where, state, version, **kw)

    monkeypatch.setattr(disk, "save_weights", counted)
    return done


def test_workers_sharing_a_weights_dir_write_each_version_once(
    tmp_path: Path, writes: list[int]
) -> None:
    got: list[Path] = []
    start = threading.Barrier(4)

    def one() -> None:
        start.wait()
        got.append(write_version(tmp_path, pairs(), 3, timeout=30))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert writes == [3], "written more than once"
    assert len(set(got)) == 1 and len(got) == 4
    d = got[0]
    assert d.name.startswith("v00000003-") and (d / "model.safetensors").is_file()
    done = json.loads((d / DONE).read_text())
    assert done["version"] == 3 and done["size"] == (d / "model.safetensors").stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_version_left_by_another_run_or_damaged_is_written_again(
    tmp_path: Path, writes: list[int]
) -> None:
    first = write_version(tmp_path, pairs(), 3)
    # Same version number, other weights (another run's leftover): not taken for these.
    other = write_version(tmp_path, pairs(2.0), 3)
    assert other != first and writes == [3, 3]
    # Same weights again: reused after checking size and checksum.
    assert write_version(tmp_path, pairs(), 3) == first and writes == [3, 3]
    f = first / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # one byte flipped: same size, another checksum
    f.write_bytes(bytes(data))
    assert write_version(tmp_path, pairs(), 3) == first and writes == [3, 3, 3]
    assert f.read_bytes() != bytes(data)


def test_versions_older_than_the_previous_one_are_removed(tmp_path: Path) -> None:
    for v in (1, 2, 3, 4):
        write_version(tmp_path, pairs(float(v)), v)
    left = sorted(p.name[:9] for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert left == ["v00000003", "v00000004"]
    locks = sorted(p.name[:10] for p in tmp_path.iterdir() if p.name.endswith(".lock"))
    assert locks == [".v00000003", ".v00000004"]


def test_two_workers_in_front_of_one_server_write_and_load_a_version_once(
    fake: Callable[..., FakeProc], tmp_path: Path, writes: list[int]
) -> None:
    server = fake("sglang")
    a = SGLangEngine(server.url, health_interval=0, weights_dir=str(tmp_path))
    b = SGLangEngine(server.url, health_interval=0, weights_dir=str(tmp_path))

    async def main() -> None:
        for eng in (a, b):
            eng.session()  # in this loop: load_weights runs its calls here
        try:
            await asyncio.to_thread(a.load_weights, pairs(), version=3)
            await asyncio.to_thread(b.load_weights, pairs(), version=3)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
    assert writes == [3] and a.version == b.version == 3
    stats = server.stats()
    assert stats["reloads"] == 1, stats  # b found the server serving it already


# -- against tiny in-process servers -------------------------------------------------------


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
