"""``--engine sglang`` against a fake SGLang server (tests/transport/fakes): real worker
processes, a real FabricClient and controller, the server in its own process."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for, wait_for
from tests.transport.engines_helpers import (
    FAST,
    Streams,
    abort_from_the_controller,
    bridge_args,
    fake,
    generate_all,
    pause_when_streaming,
)
from tests.transport.fakes.common import FakeProc, reference_output, seed_of_path
from transport import FabricClient, FabricController

__all__ = ["fake"]  # the fixture, imported for pytest

SEED = 1  # the fakes' default weights seed


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
def test_streams_every_token_once_with_its_version(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc], mode: str
) -> None:
    server = fake(
        "sglang", "--token-interval", "0.002", *(["--incremental"] if mode == "incremental" else [])
    )
    w = spawn(*bridge_args("sglang", server.url))
    n, calls = 24, 6
    streams = Streams(calls)
    resps = generate_all(w.address, [[i, 7, i] for i in range(calls)], n, streams)
    for i, r in enumerate(resps):
        want = reference_output(SEED, [i, 7, i], n)
        assert r.output_tokens.tolist() == want  # type: ignore[attr-defined]
        assert streams.tokens(i) == want, "a streamed chunk was dropped or repeated"
        assert streams.logprobs(i) == pytest.approx(r.output_logprobs.tolist())  # type: ignore[attr-defined]
        assert streams.versions(i) == [0] * n == r.output_versions.tolist()  # type: ignore[attr-defined]
        assert r.stop_reason == "length"  # type: ignore[attr-defined]
        assert len(streams.chunks[i]) > 1, "answered in one piece: not streamed"
        assert len(r.itl) == n - 1  # type: ignore[attr-defined]
    stats = server.stats()
    assert stats["generate"] == calls and stats["tokens"] == n * calls


def test_stop_token_and_sampling_reach_the_server(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("sglang")
    w = spawn(*bridge_args("sglang", server.url))
    prompt = [3, 4, 5]
    full = reference_output(SEED, prompt, 40)
    stop = full[5]
    g = GenerationHyperparameters(max_new_tokens=40, stop_token_ids=[stop])

    async def main() -> object:
        async with FabricClient([w.address], FAST) as client:
            return await client.agenerate(LLMRequest(input_ids=prompt, gconfig=g))

    r = asyncio.run(main())
    want = reference_output(SEED, prompt, 40, stop=(stop,))
    assert r.output_tokens.tolist() == want and want[-1] == stop  # type: ignore[attr-defined]
    assert r.stop_reason == "stop"  # type: ignore[attr-defined]


@pytest.mark.slow
def test_pause_mode_abort_interrupts_on_the_server_and_resume_continues_after_the_partial(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("sglang", "--token-interval", "0.02")
    w = spawn(*bridge_args("sglang", server.url, "--engine-opt", "pause_mode=abort"))
    n, calls = 40, 4
    streams = Streams(calls)

    async def while_paused() -> None:
        # Paused: the server aborted every request; nothing runs there.
        assert server.stats()["running"] == 0
        assert server.stats().get("aborted", 0) == calls
        held = [streams.got(i) for i in range(calls)]
        assert all(0 < h < n for h in held)

    pause = pause_when_streaming(w.address, streams, calls, while_paused)
    resps = generate_all(w.address, [[i, 1] for i in range(calls)], n, streams, while_running=pause)
    for i, r in enumerate(resps):
        want = reference_output(SEED, [i, 1], n)
        assert r.output_tokens.tolist() == want and streams.tokens(i) == want  # type: ignore[attr-defined]
        assert r.stop_reason == "length"  # type: ignore[attr-defined]
    # The partial outputs came back: the resumed requests went on after them, so no
    # token was generated twice on the server.
    stats = server.stats()
    assert stats["tokens"] == n * calls, stats
    assert stats["generate"] == 2 * calls


def test_pause_mode_abort_before_the_server_knows_the_request_still_interrupts_it(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    # The abort sent at the pause finds no such rid on the server (still queued); the
    # bridge aborts again once the server streams, instead of waiting for the end.
    server = fake("sglang", "--token-interval", "0.02", "--register-delay", "0.5")
    w = spawn(*bridge_args("sglang", server.url, "--engine-opt", "pause_mode=abort"))
    n = 400

    async def main() -> object:
        async with FabricClient([w.address], FAST) as client:
            g = GenerationHyperparameters(max_new_tokens=n)
            fut = client.agenerate(LLMRequest(input_ids=[2, 2], gconfig=g))
            await await_for(lambda: server.stats().get("generate") == 1, what="the request queued")
            with FabricController([w.address]) as ctl:
                await asyncio.to_thread(ctl.pause, 10)
                stats = server.stats()
                assert stats.get("aborted") == 1 and stats["tokens"] < n // 4, stats
                await asyncio.to_thread(ctl.resume, 10)
            return await fut

    r = asyncio.run(main())
    assert r.output_tokens.tolist() == reference_output(SEED, [2, 2], n)  # type: ignore[attr-defined]


def test_controller_abort_reaches_the_server(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("sglang", "--token-interval", "0.05")
    w = spawn(*bridge_args("sglang", server.url))
    abort_from_the_controller(w.address)
    wait_for(lambda: server.stats()["running"] == 0, what="the server's request aborted")
    assert server.stats()["abort_requests"] >= 1 and server.stats()["aborted"] == 1


@pytest.mark.slow
def test_weight_version_lands_on_the_server_through_disk(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc], tmp_path: Path
) -> None:
    import torch

    from transport.weights import WeightPublisher, update_weights

    server = fake("sglang")
    pub = WeightPublisher(
        "tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1, worker_timeout=5.0
    )
    wdir = tmp_path / "weights"
    w = spawn(
        *bridge_args("sglang", server.url, "--engine-opt", f"weights_dir={wdir}"),
        "--worker-id", "sg", "--plugin", "transport.weights.update:subscribe",
        "--plugin-opt", f"weights_endpoint={pub.endpoint}", "--plugin-opt", "weights_shm=0",
    )  # fmt: skip
    prompt = [9, 8, 7]
    g = GenerationHyperparameters(max_new_tokens=12)
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}

    async def ask() -> object:
        async with FabricClient([w.address], FAST) as client:
            return await client.agenerate(LLMRequest(input_ids=prompt, gconfig=g))

    try:
        before = asyncio.run(ask())
        assert before.output_tokens.tolist() == reference_output(SEED, prompt, 12)  # type: ignore[attr-defined]
        pub.wait_for_workers(1, timeout=20)
        with FabricController([w.address]) as ctl:
            res = update_weights(ctl, pub, state, version=3, timeout=30)
            assert res.ok and "sg" in res.applied
            assert ctl.health()[w.address].version == 3
        written = sorted(wdir.glob("v*/model.safetensors"))
        assert len(written) == 1, "written once"
        assert server.stats()["reloads"] == 1
        new_seed = seed_of_path(str(written[0].parent))
        after = asyncio.run(ask())
        assert after.output_tokens.tolist() == reference_output(new_seed, prompt, 12)  # type: ignore[attr-defined]
        assert after.output_tokens.tolist() != before.output_tokens.tolist()  # type: ignore[attr-defined]
        assert after.output_versions.tolist() == [3] * 12  # type: ignore[attr-defined]
    finally:
        pub.close()


@pytest.mark.slow
def test_closing_the_worker_aborts_on_the_server_and_leaks_no_session(
    fake: Callable[..., FakeProc],
) -> None:
    # The worker's close cancels its requests (each asks the server to abort) and closes
    # the bridge at the same time: the aborts must go out on the open session, and none
    # may open a new session after the close (never closed: a leaked connection pool).
    from transport import WorkerServer
    from transport.engines.sglang import SGLangEngine
    from transport.worker import WorkerConfig

    server = fake("sglang", "--token-interval", "0.05")
    eng = SGLangEngine(server.url, health_interval=0)
    streams = Streams(2)

    async def main() -> None:
        worker = WorkerServer(eng, WorkerConfig(bind="tcp://127.0.0.1:0"))
        [addr] = await worker.start()
        async with FabricClient([addr], FAST) as client:
            g = GenerationHyperparameters(max_new_tokens=1000)
            for i in range(2):
                client.agenerate(LLMRequest(input_ids=[i], gconfig=g), on_chunk=streams.on_chunk(i))
            await await_for(lambda: min(streams.got(0), streams.got(1)) >= 2, what="tokens")
            await worker.close()
            for _ in range(20):  # let whatever the close left behind run
                await asyncio.sleep(0)
            assert eng._session is None, "a session was opened after the close"
            assert not eng._aux, "tasks of the bridge outlived its close"

    asyncio.run(main())
    wait_for(lambda: server.stats()["running"] == 0, what="the server's requests aborted")
    assert server.stats()["abort_requests"] == 2


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_keeping_pause_freezes_the_streams_and_they_go_on_after_the_resume(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc], mode: str
) -> None:
    # SGLang holds the requests (no abort, nothing re-sent): the worker's pause completes
    # with them frozen, and each stream continues on the same request after the resume.
    server = fake("sglang", "--token-interval", "0.01")
    w = spawn(*bridge_args("sglang", server.url, "--engine-opt", f"pause_mode={mode}"))
    n, calls = 40, 3
    streams = Streams(calls)

    async def while_paused() -> None:
        stats = server.stats()
        assert stats["running"] == calls and stats.get("aborted", 0) == 0, stats
        assert stats[f"pauses_{mode}"] == 1 and stats.get("abort_requests", 0) == 0
        assert all(0 < streams.got(i) < n for i in range(calls))

    pause = pause_when_streaming(w.address, streams, calls, while_paused)
    resps = generate_all(w.address, [[i, 5] for i in range(calls)], n, streams, while_running=pause)
    for i, r in enumerate(resps):
        want = reference_output(SEED, [i, 5], n)
        assert r.output_tokens.tolist() == want and streams.tokens(i) == want  # type: ignore[attr-defined]
        assert r.stop_reason == "length"  # type: ignore[attr-defined]
    stats = server.stats()
    # One request per call, every token generated once; a retracted request is
    # prefilled again inside SGLang, one kept in place is not.
    assert stats["generate"] == calls and stats["tokens"] == n * calls, stats
    assert stats["prefills"] == calls * (2 if mode == "retract" else 1), stats
    assert stats["continues"] == 1


@pytest.mark.slow
def test_versions_move_from_old_to_new_across_a_load_under_frozen_requests(
    fake: Callable[..., FakeProc], tmp_path: Path
) -> None:
    # A weight version loaded while the requests are frozen in place: the tokens before
    # carry the old version, those after the new one (SGLang's meta_info label), and the
    # rest of each output is the new weights' continuation of the same context.
    import torch

    from transport import WorkerServer
    from transport.engines.sglang import SGLangEngine
    from transport.worker import WorkerConfig

    server = fake("sglang", "--token-interval", "0.01")
    eng = SGLangEngine(server.url, health_interval=0, weights_dir=str(tmp_path / "w"))
    n, calls = 40, 3
    streams = Streams(calls)
    state = [("w", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2))]

    async def main() -> list[object]:
        worker = WorkerServer(eng, WorkerConfig(bind="tcp://127.0.0.1:0"))
        [addr] = await worker.start()
        try:
            async with FabricClient([addr], FAST) as client:
                g = GenerationHyperparameters(max_new_tokens=n)
                futs = [
                    client.agenerate(
                        LLMRequest(input_ids=[i, 9], gconfig=g), on_chunk=streams.on_chunk(i)
                    )
                    for i in range(calls)
                ]
                await await_for(
                    lambda: all(streams.got(i) >= 3 for i in range(calls)), what="tokens"
                )
                with FabricController([addr]) as ctl:
                    await asyncio.to_thread(ctl.pause, 10)
                    assert eng.pauses_in_place and server.stats()["running"] == calls
                    await asyncio.to_thread(eng.load_weights, state, version=3)
                    assert ctl.health()[addr].version == 3
                    await asyncio.to_thread(ctl.resume, 10)
                return list(await asyncio.gather(*futs))
        finally:
            await worker.close()

    resps = asyncio.run(main())
    [written] = (tmp_path / "w").glob("v0*")
    new_seed = seed_of_path(str(written))
    for i, r in enumerate(resps):
        out, vers = r.output_tokens.tolist(), r.output_versions.tolist()  # type: ignore[attr-defined]
        j = vers.index(3)
        assert 0 < j < n and vers == [0] * j + [3] * (n - j), vers
        assert out[:j] == reference_output(SEED, [i, 9], j)
        assert out[j:] == reference_output(new_seed, [i, 9, *out[:j]], n - j)
        assert streams.tokens(i) == out and streams.versions(i) == vers
    stats = server.stats()
    assert stats["reloads"] == 1 and stats.get("flush_failures", 0) == 0, stats
    assert stats["generate"] == calls and stats["prefills"] == calls, stats
    # Loaded without a flush (requests were held): asked once none of them was left.
    wait_for(lambda: server.stats().get("flushes") == 1, what="the deferred cache flush")


def test_a_rejected_request_fails_alone_and_the_worker_serves_the_next(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    from transport import RemoteError

    server = fake("sglang")
    w = spawn(*bridge_args("sglang", server.url))
    g = GenerationHyperparameters(max_new_tokens=8)

    async def main() -> list[object]:
        async with FabricClient([w.address], FAST) as client:
            bad = client.agenerate(LLMRequest(input_ids=[1, 300], gconfig=g))  # 300: no such id
            good = client.agenerate(LLMRequest(input_ids=[1, 2], gconfig=g))
            with pytest.raises(RemoteError, match="greater than the vocab size"):
                await bad
            return [await good, await client.agenerate(LLMRequest(input_ids=[3], gconfig=g))]

    first, second = asyncio.run(main())
    assert first.output_tokens.tolist() == reference_output(SEED, [1, 2], 8)  # type: ignore[attr-defined]
    assert second.output_tokens.tolist() == reference_output(SEED, [3], 8)  # type: ignore[attr-defined]
    assert server.stats()["rejected"] == 1


@pytest.mark.slow
def test_a_worker_idle_longer_than_the_servers_keepalive_serves_the_next_request(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    # The server closes idle connections after 0.2 s, before the bridge's 2 s: the next
    # request finds its kept connection closed, or gone, and is sent (once) on a new one.
    server = fake("sglang", "--keepalive", "0.2")
    w = spawn(*bridge_args("sglang", server.url))
    g = GenerationHyperparameters(max_new_tokens=6)

    async def main() -> list[object]:
        async with FabricClient([w.address], FAST) as client:
            first = await client.agenerate(LLMRequest(input_ids=[1], gconfig=g))
            await asyncio.sleep(0.5)  # idle past the server's keep-alive: what is tested
            return [first, await client.agenerate(LLMRequest(input_ids=[2], gconfig=g))]

    resps = asyncio.run(main())
    for prompt, r in zip(([1], [2]), resps, strict=True):
        assert r.output_tokens.tolist() == reference_output(SEED, prompt, 6)  # type: ignore[attr-defined]
    assert server.stats()["generate"] == 2


def test_a_deferred_flush_to_a_server_gone_is_logged_and_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In the background (after the last held request): no unretrieved task error, the
    # flush stays due for the next idle moment.
    from transport.engines.sglang import SGLangEngine

    with socket.socket() as s:  # a port no one listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = SGLangEngine(f"http://127.0.0.1:{port}", health_interval=0, request_timeout=2.0)
    unhandled: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _l, c: unhandled.append(c))
        eng._flush_due = True
        eng._flush_when_idle()
        await await_for(lambda: not eng._aux, what="the background flush")
        await eng.close()

    with caplog.at_level(logging.WARNING, logger="transport.engines"):
        asyncio.run(main())
    assert eng._flush_due and not unhandled
    assert "/flush_cache failed (asked again when idle)" in caplog.text


def test_a_version_links_the_model_config_s_files_but_no_weights(tmp_path: Path) -> None:
    from transport.engines.sglang import SGLangEngine

    config = tmp_path / "model"
    config.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "old.bin"):
        (config / name).write_text(name)
    (config / "sub").mkdir()
    version = tmp_path / "v1"
    version.mkdir()
    (version / "tokenizer.json").write_text("its own")
    eng = SGLangEngine("http://127.0.0.1:1", model_config=str(config), weights_dir=str(tmp_path))
    eng._link_config(version)
    assert sorted(p.name for p in version.iterdir()) == ["config.json", "tokenizer.json"]
    assert (version / "config.json").is_symlink()
    assert (version / "tokenizer.json").read_text() == "its own"  # an existing file stays
