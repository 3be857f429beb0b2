"""A worker process's ``/metrics`` scraped over HTTP after real requests: its own series
only (no client or publisher series, no ``*_created`` twins), the weight version and
paused gauges, token counters and the finish reason of each request (stop, length,
interrupt, abort)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.helpers import WorkerProc, parse, value
from transport import ClientConfig, FabricClient, FabricController, RequestAborted

pytest.importorskip("prometheus_client")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def req(ids: list[int], n: int, **gconfig: Any) -> LLMRequest:
    return LLMRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=n, **gconfig))


async def _until_running(ctl: FabricController, address: str) -> None:
    """Poll the worker's status until a handler runs (bounded)."""
    for _ in range(200):
        status = (await ctl.ahealth(timeout=10))[address]
        if status.running:
            return
        await asyncio.sleep(0.025)  # polling a condition, bounded above
    raise AssertionError("the long request never started")


async def _scenario(address: str, port: int) -> dict[str, Any]:
    """stop, length, interrupt (then resumed to length) and abort, with scrapes while
    paused and after."""
    out: dict[str, Any] = {}
    cfg = ClientConfig(stream=False, heartbeat_interval=0.2)
    ctl = FabricController([address], timeout=30)
    try:
        async with FabricClient([address], cfg) as client:
            # A stop token on every id: the first token stops it.
            out["stop"] = await client.agenerate(req([4, 5], 8, stop_token_ids=list(range(256))))
            out["length"] = await client.agenerate(req([1, 2, 3], 3))
            # 200 tokens at 20 ms each: running when paused, interrupted there.
            long = asyncio.ensure_future(client.agenerate(req([6, 7, 8, 9], 200)))
            await _until_running(ctl, address)
            await ctl.apause()
            out["paused_text"] = await asyncio.to_thread(scrape_text, port)
            await ctl.aresume()
            out["resumed"] = await asyncio.wait_for(long, 60)
            aborted = asyncio.ensure_future(client.agenerate(req([10, 11], 200)))
            await _until_running(ctl, address)
            await ctl.aabort()
            with pytest.raises(RequestAborted):
                await asyncio.wait_for(aborted, 30)
    finally:
        ctl.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_serves_its_own_series(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval",
              "0.02", "--metrics-port", "0")  # fmt: skip
    port = w.ready["metrics"]
    res = asyncio.run(_scenario(w.address, port))
    paused = parse(res["paused_text"])
    assert value(paused, "fastio_worker_paused") == 1
    text = scrape_text(port)
    s: Samples = parse(text)

    assert value(s, "fastio_worker_paused") == 0
    assert ("fastio_worker_weight_version", frozenset()) in s
    assert value(s, "fastio_worker_weight_version") == 0  # the reference engine's start

    assert res["stop"].stop_reason == "stop" and res["length"].stop_reason == "length"
    assert res["resumed"].stop_reason == "length" and res["resumed"].output_len == 200

    def finished(reason: str) -> float:
        return value(s, "fastio_worker_finished_requests_total", finished_reason=reason)

    # The resumed request: an interrupt Result, then its rest ran to its length.
    assert finished("stop") == 1
    assert finished("length") == 2
    assert finished("interrupt") == 1
    assert finished("abort") == 1
    assert value(s, "fastio_worker_requests_total", outcome="cancelled") == 1
    assert value(s, "fastio_worker_requests_total", outcome="ok") == 4
    # Tokens of every Result: the interrupted one's part plus the rest sum to 200.
    generated = sum(res[k].output_len for k in ("stop", "length", "resumed"))
    assert value(s, "fastio_worker_generation_tokens_total") == generated
    # Prompts: 2 + 3 + 4, and the re-sent rest's prompt (4 + what was generated before
    # the pause, at least one token, fewer than 200).
    prompt = value(s, "fastio_worker_prompt_tokens_total")
    assert 2 + 3 + 4 + 4 + 1 <= prompt < 2 + 3 + 4 + 4 + 200
    assert value(s, "fastio_worker_pauses_total") == 1

    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types["fastio_worker_prompt_tokens_total"] == "counter"
    assert types["fastio_worker_generation_tokens_total"] == "counter"
    assert types["fastio_worker_finished_requests_total"] == "counter"
    assert types["fastio_worker_weight_version"] == "gauge"
    assert types["fastio_worker_paused"] == "gauge"
    # This process runs a worker only: no other side's series, no *_created twin.
    names = {name for name, _ in s}
    assert not [n for n in names if n.startswith(("fastio_client_", "fastio_publisher_"))]
    assert not [n for n in names if n.startswith("fastio_subscriber_")]  # no subscriber
    assert not [n for n in names if n.endswith("_created")], text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_with_a_subscriber_shows_subscriber_series(
    spawn: Callable[..., WorkerProc],
) -> None:
    # The subscriber connects in the background: no publisher is needed to start.
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--metrics-port", "0",
              "--plugin", "transport.weights.update:subscribe",
              "--plugin-opt", "weights_endpoint=tcp://127.0.0.1:9")  # fmt: skip
    text = scrape_text(w.ready["metrics"])
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types.get("fastio_subscriber_failures_total") == "counter", text
    assert types.get("fastio_worker_requests_total") == "counter", text
    assert not [n for n in types if n.startswith(("fastio_client_", "fastio_publisher_"))]
    assert "_created" not in text
