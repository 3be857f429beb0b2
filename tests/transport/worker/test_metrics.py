"""The worker's latency histograms are recorded only when asked for
(``WorkerConfig.latency_metrics``; the CLI's ``--metrics-port`` sets it, see
worker/test_cli.py), request outcomes always."""

from __future__ import annotations

import asyncio

import pytest

from fastio import LLMRequest
from tests.transport.conftest import await_for
from transport import ClientConfig, FabricClient, WorkerConfig, WorkerServer, echo_handler

prom = pytest.importorskip("prometheus_client")


def _sample(name: str, **labels: str) -> float:
    value = prom.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


async def _serve_three(latency_metrics: bool) -> None:
    server = WorkerServer(
        echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0", latency_metrics=latency_metrics)
    )
    endpoints = await server.start()
    try:
        async with FabricClient(endpoints, ClientConfig(stream=False)) as client:
            for i in range(3):
                resp = await asyncio.wait_for(client.agenerate(LLMRequest(input_ids=[i, 1])), 30)
                assert resp.output_tokens.tolist() == [i, 1]
    finally:
        await server.close()


@pytest.mark.parametrize("latency_metrics", [False, True])
def test_latency_histograms_only_when_asked(latency_metrics: bool) -> None:
    e2e = _sample("fastio_worker_e2e_seconds_count")
    ttft = _sample("fastio_worker_ttft_seconds_count")
    ok = _sample("fastio_worker_requests_total", outcome="ok")
    asyncio.run(_serve_three(latency_metrics))
    expected = 3.0 if latency_metrics else 0.0
    assert _sample("fastio_worker_e2e_seconds_count") - e2e == expected
    assert _sample("fastio_worker_ttft_seconds_count") - ttft == expected
    assert _sample("fastio_worker_requests_total", outcome="ok") - ok == 3.0


def test_ok_answers_are_counted_while_serving() -> None:
    # Without latency metrics the ok count is added in batches: it still shows up
    # within a fraction of a second, not only when the worker closes.
    ok = _sample("fastio_worker_requests_total", outcome="ok")

    async def main() -> None:
        server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
        endpoints = await server.start()
        try:
            async with FabricClient(endpoints, ClientConfig(stream=False)) as client:
                for i in range(3):
                    await asyncio.wait_for(client.agenerate(LLMRequest(input_ids=[i])), 30)
                await await_for(
                    lambda: _sample("fastio_worker_requests_total", outcome="ok") - ok == 3.0,
                    timeout=5,
                    what="the ok count",
                )
        finally:
            await server.close()

    asyncio.run(main())
    assert _sample("fastio_worker_requests_total", outcome="ok") - ok == 3.0


def test_status_and_a_scrape_read_the_same_counts() -> None:
    # One Counters object per worker: what status() says and what a scrape shows agree,
    # and a scrape sees every answer at once (no count waits for a later report).
    names = ("fastio_worker_prompt_tokens_total", "fastio_worker_generation_tokens_total")
    before = [_sample(n) for n in names]
    ok, stop = (
        _sample("fastio_worker_requests_total", outcome="ok"),
        _sample("fastio_worker_finished_requests_total", finished_reason="stop"),
    )

    async def main() -> dict[str, int]:
        server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
        endpoints = await server.start()
        try:
            async with FabricClient(endpoints, ClientConfig(stream=False)) as client:
                for i in range(4):
                    await asyncio.wait_for(client.agenerate(LLMRequest(input_ids=[i, 1, 2])), 30)
            counts = server.status().counters
            assert _sample("fastio_worker_requests_total", outcome="ok") - ok == 4
            assert dict(server.counters) == counts
            return counts
        finally:
            await server.close()

    counts = asyncio.run(main())
    assert counts["received"] == counts["completed"] == 4 and counts["errors"] == 0
    assert [_sample(n) - b for n, b in zip(names, before, strict=True)] == [12.0, 12.0]
    assert _sample("fastio_worker_finished_requests_total", finished_reason="stop") - stop == 4
