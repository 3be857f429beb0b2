"""``--engine vllm`` against a fake vLLM OpenAI-compatible server (tests/transport/fakes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

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
from tests.transport.fakes.common import FakeProc, reference_output
from transport import FabricClient

__all__ = ["fake"]

SEED = 1


def test_streams_every_token_once_and_stop_tokens(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("vllm", "--token-interval", "0.002")
    w = spawn(*bridge_args("vllm", server.url))
    n, calls = 20, 5
    streams = Streams(calls + 1)
    stop_prompt = [5, 5]
    stop = reference_output(SEED, stop_prompt, 30)[4]
    gs = GenerationHyperparameters(max_new_tokens=30, stop_token_ids=[stop])
    extra = [LLMRequest(input_ids=stop_prompt, gconfig=gs)]
    resps = generate_all(w.address, [[i, 2] for i in range(calls)], n, streams, extra=extra)
    for i, r in enumerate(resps[:calls]):
        want = reference_output(SEED, [i, 2], n)
        assert r.output_tokens.tolist() == want == streams.tokens(i)  # type: ignore[attr-defined]
        assert streams.logprobs(i) == pytest.approx(r.output_logprobs.tolist())  # type: ignore[attr-defined]
        assert streams.versions(i) == [0] * n
        assert r.stop_reason == "length" and len(streams.chunks[i]) > 1  # type: ignore[attr-defined]
    last = resps[-1]
    assert last.output_tokens.tolist() == reference_output(SEED, stop_prompt, 30, stop=(stop,))  # type: ignore[attr-defined]
    assert last.stop_reason == "stop"  # type: ignore[attr-defined]
    assert server.stats()["completions"] == calls + 1


@pytest.mark.slow
def test_pause_closes_streams_and_resume_continues_after_the_partial(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("vllm", "--token-interval", "0.02")
    w = spawn(*bridge_args("vllm", server.url))
    n, calls = 40, 4
    streams = Streams(calls)
    at_pause: dict[str, int] = {}

    async def while_paused() -> None:
        await await_for(lambda: server.stats()["running"] == 0, what="server idle")
        assert server.stats().get("disconnected", 0) == calls
        at_pause["generated"] = server.stats()["tokens"]
        at_pause["received"] = sum(streams.got(i) for i in range(calls))

    pause = pause_when_streaming(w.address, streams, calls, while_paused)
    resps = generate_all(w.address, [[i, 3] for i in range(calls)], n, streams, while_running=pause)
    for i, r in enumerate(resps):
        want = reference_output(SEED, [i, 3], n)
        assert r.output_tokens.tolist() == want == streams.tokens(i)  # type: ignore[attr-defined]
    # Every token received before the pause was kept: after the resume the server
    # generated only the rest. (Not a bound on the total: how many tokens the server
    # wrote into a stream already closing depends on how soon its loop saw the close.)
    after_resume = server.stats()["tokens"] - at_pause["generated"]
    assert after_resume <= n * calls - at_pause["received"], (after_resume, at_pause)


def test_controller_abort_closes_the_stream(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    server = fake("vllm", "--token-interval", "0.05")
    w = spawn(*bridge_args("vllm", server.url))
    abort_from_the_controller(w.address)
    wait_for(lambda: server.stats()["running"] == 0, what="the server's request ended")
    assert server.stats()["disconnected"] == 1


@pytest.mark.slow
def test_weights_are_refused_at_start_with_a_clear_message(fake: Callable[..., FakeProc]) -> None:
    server = fake("vllm")
    r = subprocess.run(
        [sys.executable, "-m", "transport.worker", *bridge_args("vllm", server.url),
         "--plugin", "transport.weights.update:subscribe",
         "--plugin-opt", "weights_endpoint=tcp://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "ready" not in r.stdout
    assert "has no weight-transfer routes" in r.stderr and "VLLM_SERVER_DEV_MODE" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_error_event_in_the_stream_fails_that_request_alone(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    """vLLM answers 200 and then an error event for an out-of-vocabulary stop token: that
    request fails with vLLM's message; the worker serves the next ones."""
    server = fake("vllm")
    w = spawn(*bridge_args("vllm", server.url))
    bad = LLMRequest(
        input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=4, stop_token_ids=[5000])
    )

    async def main() -> tuple[BaseException | None, list[int]]:
        async with FabricClient([w.address], FAST) as client:
            try:
                await client.agenerate(bad)
                err = None
            except Exception as exc:  # the error reply
                err = exc
            ok = await client.agenerate(
                LLMRequest(input_ids=[3, 4], gconfig=GenerationHyperparameters(max_new_tokens=5))
            )
            return err, ok.output_tokens.tolist()  # type: ignore[attr-defined]

    err, toks = asyncio.run(main())
    assert err is not None and "out-of-vocab" in str(err) and "5000" in str(err), err
    assert toks == reference_output(SEED, [3, 4], 5)
    assert server.stats()["rejected"] == 1 and server.stats()["completions"] == 2
    assert w.proc.poll() is None


@pytest.mark.slow
def test_a_connection_the_server_closed_while_idle_is_not_a_death(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc]
) -> None:
    """The server closes idle kept connections after 0.2 s, the bridge would keep them
    30 s, and the server drops a reused connection unanswered once (the race of a close
    as it is reused): requests after idle spells are served, the worker never closes."""
    server = fake("vllm", "--keepalive", "0.3", "--drop-reused")
    w = spawn(*bridge_args("vllm", server.url, "--engine-opt", "keepalive=30"))

    async def main() -> list[list[int]]:
        out = []
        async with FabricClient([w.address], FAST) as client:
            for i in range(4):
                g = GenerationHyperparameters(max_new_tokens=3)
                r = await client.agenerate(LLMRequest(input_ids=[i, 9], gconfig=g))
                out.append(r.output_tokens.tolist())  # type: ignore[attr-defined]
                if i % 2:  # idle past the server's keep-alive (the behaviour under test)
                    await asyncio.sleep(0.5)
        return out

    for i, toks in enumerate(asyncio.run(main())):
        assert toks == reference_output(SEED, [i, 9], 3)
    assert w.proc.poll() is None and server.stats()["completions"] == 4
    assert server.stats()["dropped"] >= 1  # the race happened, and was survived
