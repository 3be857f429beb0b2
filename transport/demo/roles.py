"""The demo's child roles: a rollout client process and the trainer process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

from transport.demo.children import stop_event
from transport.demo.config import REFERENCE_SIZES, DemoConfig
from transport.demo.reports import ClientReport, ReportSender


def curve_for_client(keys: str | None) -> Any:
    if not keys:
        return None
    from transport import CurveConfig

    return CurveConfig(
        secret_key_file=os.path.join(keys, "client.key_secret"),
        server_public_key_file=os.path.join(keys, "worker.key"),
    )


def vocab_of(c: DemoConfig) -> int:
    if c.engine == "reference":
        return REFERENCE_SIZES[c.model_size][0]
    if c.model_path:
        with open(os.path.join(c.model_path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    from transport.hf_engine import MODEL_SIZES

    return MODEL_SIZES[c.model_size]["vocab_size"]


async def client_role(c: DemoConfig) -> None:
    """A rollout client process: ``concurrency`` request loops, reports every 0.5 s."""
    from fastio import GenerationHyperparameters, LLMRequest, TokenArray
    from transport import ClientConfig, FabricClient

    stop = stop_event()
    reports = ReportSender(c.report)
    rep = ClientReport(client=c.index)
    rng = random.Random(c.index)
    vocab = vocab_of(c)
    # Failover within about two seconds of a worker's death (pongs every 0.5 s, four
    # missed): its requests are re-sent while the run is still watching.
    config = ClientConfig(
        curve=curve_for_client(c.keys), heartbeat_interval=0.5, heartbeat_liveness=4
    )
    print(json.dumps({"ready": True}), flush=True)

    async with FabricClient(c.addresses, config) as client:

        async def one_loop() -> None:
            while not stop.is_set():
                n = rng.randint(8, c.prompt_len)
                req = LLMRequest(
                    input_ids=TokenArray(
                        np.asarray([rng.randrange(vocab) for _ in range(n)], np.int32)
                    ),
                    gconfig=GenerationHyperparameters(
                        max_new_tokens=rng.randint(min(8, c.max_new_tokens), c.max_new_tokens),
                        temperature=1.0,
                    ),
                )
                t0 = time.perf_counter()
                rep.sent += 1
                try:
                    resp = await client.agenerate(req, timeout=300)
                except asyncio.CancelledError:
                    rep.unfinished += 1  # cut by the stop: neither answered nor failed
                    raise
                except Exception as exc:
                    rep.failed += 1
                    print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    # No worker alive (NoWorkerAvailable) fails at once: wait before the
                    # next try instead of spinning.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                    continue
                rep.done += 1
                rep.tokens += resp.output_len
                rep.latencies.append(time.perf_counter() - t0)
                rep.ttfts.append(resp.ttft)
                if len(resp.itl):
                    rep.itls.append(float(resp.itl.array.mean()))
                if len(set(resp.output_versions.array.tolist())) > 1:
                    rep.multi_version += 1

        def counters() -> None:
            rep.interrupted = client.stats.get("interrupted", 0)
            rep.resent = client.stats.get("resent", 0)
            rep.died = client.stats.get("workers_died", 0)
            rep.stale = client.stats.get("stale", 0)

        tasks = [asyncio.ensure_future(one_loop()) for _ in range(c.concurrency)]
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            counters()
            reports.send(rep)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        counters()
    rep.final = True
    reports.send(rep)
    reports.close()
