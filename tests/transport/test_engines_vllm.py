"""``--engine vllm`` against a fake vLLM OpenAI-compatible server (tests/transport/fakes)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for, wait_for
from tests.transport.engines_helpers import (
    Streams,
    abort_from_the_controller,
    bridge_args,
    fake,
    generate_all,
    pause_when_streaming,
)
from tests.transport.fakes.common import FakeProc, reference_output

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
    assert "documents no endpoint that reloads them" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
