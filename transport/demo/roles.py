"""The demo's child roles: a rollout client process and the trainer process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from typing import Any

import numpy as np
import zmq

from transport.demo.children import StopSignals, stop_event
from transport.demo.reports import REPORT_ENCODER, ClientReport, FinalCheck, UpdateReport
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
    config = ClientConfig(curve=curve_for_client(a.keys))
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
                try:
                    resp = await client.agenerate(req, timeout=300)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rep.failed += 1
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


def trainer_model(a: argparse.Namespace) -> tuple[Any, int, Any]:
    """The trainer's copy of the workers' model, its vocabulary and a loss function."""
    import torch

    if a.engine == "reference":
        from transport.engine import TinyLM

        vocab, hidden, layers = REFERENCE_SIZES[a.model_size]
        tiny = TinyLM(vocab, hidden, layers, seed=a.seed)

        def tiny_logits(x: torch.Tensor) -> torch.Tensor:
            return tiny(x)[0]  # type: ignore[no-any-return]

        return tiny, vocab, tiny_logits
    from transport import hf_engine

    if a.model_path:
        model: Any = hf_engine.load_pretrained(a.model_path)
    else:
        model = hf_engine.build_model(a.model_size, seed=a.seed)

    def hf_logits(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x).logits  # type: ignore[no-any-return]

    return model, int(model.config.vocab_size), hf_logits


def trainer_role(a: argparse.Namespace) -> None:
    import torch

    from transport import FabricController
    from transport.weights import WeightPublisher, state_digest, update_weights

    stop = StopSignals()
    torch.manual_seed(1234)
    model, vocab, logits_of = trainer_model(a)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(a.report)
    ctl = FabricController(a.workers, curve=curve_for_client(a.keys), timeout=60)
    pub_curve = None
    if a.keys:
        from transport import CurveConfig

        pub_curve = CurveConfig(
            secret_key_file=os.path.join(a.keys, "trainer.key_secret"),
            authorized_clients_dir=os.path.join(a.keys, "workers"),
        )
    pub = WeightPublisher(a.publisher, curve=pub_curve)
    print(json.dumps({"ready": pub.endpoint}), flush=True)
    # Wait for every worker's subscriber, but stay responsive to a stop meanwhile.
    joined_by = time.monotonic() + 120
    while not stop.seen:
        try:
            pub.wait_for_workers(len(a.workers), timeout=0.25)
            break
        except TimeoutError:
            if time.monotonic() > joined_by:
                raise
    version = 0
    next_update = time.monotonic() + a.update_every
    while not stop.seen:
        while not stop.seen and time.monotonic() < next_update:
            time.sleep(min(0.05, max(0.0, next_update - time.monotonic())))
        if stop.seen:
            break
        # A real optimizer step on a small synthetic next-token batch: the weights
        # really change, and the step stays cheap next to the workers' generation.
        x = torch.randint(0, vocab, (2, 17))
        logits = logits_of(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        version += 1
        t0 = time.perf_counter()
        res = update_weights(ctl, pub, model, version, timeout=60, strict=False)
        rep = UpdateReport(
            version=version,
            seconds=time.perf_counter() - t0,
            ok=res.ok,
            failed={**res.failed, **dict.fromkeys(res.missing, "no answer")},
            loss=float(loss),
            nbytes=nbytes,
        )
        push.send(REPORT_ENCODER.encode(rep))
        next_update = time.monotonic() + a.update_every
    # Final check: every worker's reported digest equals the trainer's weights.
    want = state_digest(model.state_dict())
    seen = {w: info.digest for w, info in pub.workers().items() if info.alive}
    final = FinalCheck(
        version=version,
        trainer_digest=f"{want:016x}",
        workers={w: f"{d:016x}" if d is not None else "unknown" for w, d in seen.items()},
        equal=len(seen) == len(a.workers) and all(d == want for d in seen.values()),
    )
    push.send(REPORT_ENCODER.encode(final))
    ctl.close()
    pub.close()
    push.close()
    ctx.term()
