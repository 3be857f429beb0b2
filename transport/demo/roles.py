"""The demo's child roles: a rollout client process and the trainer process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import zmq

from transport.demo.children import stop_event
from transport.demo.reports import REPORT_ENCODER, ClientReport
from transport.demo.sizes import REFERENCE_SIZES


def curve_for_client(keys: str | None) -> Any:
    if not keys:
        return None
    from transport import CurveConfig

    return CurveConfig(
        secret_key_file=os.path.join(keys, "client.key_secret"),
        server_public_key_file=os.path.join(keys, "worker.key"),
    )


def vocab_of(a: argparse.Namespace) -> int:
    if a.engine == "reference":
        return REFERENCE_SIZES[a.model_size][0]
    if a.model_path:
        with open(os.path.join(a.model_path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    from transport.hf_engine import MODEL_SIZES

    return MODEL_SIZES[a.model_size]["vocab_size"]


async def client_role(a: argparse.Namespace) -> None:
    from fastio import GenerationHyperparameters, LLMRequest, TokenArray
    from transport import ClientConfig, FabricClient

    stop = stop_event()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(a.report)
    rep = ClientReport(client=a.index)
    rng = random.Random(a.index)
    vocab = vocab_of(a)
    # Failover within about two seconds of a worker's death (pongs every 0.5 s, four
    # missed): its requests are re-sent while the run is still watching.
    config = ClientConfig(
        curve=curve_for_client(a.keys), heartbeat_interval=0.5, heartbeat_liveness=4
    )
    print(json.dumps({"ready": True}), flush=True)

    async with FabricClient(a.workers, config) as client:

        async def one_loop() -> None:
            while not stop.is_set():
                n = rng.randint(8, a.prompt_len)
                req = LLMRequest(
                    input_ids=TokenArray(
                        np.asarray([rng.randrange(vocab) for _ in range(n)], np.int32)
                    ),
                    gconfig=GenerationHyperparameters(
                        max_new_tokens=rng.randint(min(8, a.max_new_tokens), a.max_new_tokens),
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

        tasks = [asyncio.ensure_future(one_loop()) for _ in range(a.concurrency)]
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            counters()
            send_report(push, rep)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        counters()
    rep.final = True
    send_report(push, rep)
    push.close()
    ctx.term()


def send_report(push: zmq.Socket[Any], rep: ClientReport) -> None:
    push.send(REPORT_ENCODER.encode(rep))
    rep.latencies.clear()
    rep.ttfts.clear()
    rep.itls.clear()
