"""AReaL's RLVR episode time: AReaL's own ``RemoteSGLangEngine`` over HTTP+JSON against
``FabricInferenceEngine`` over the fabric, with the same deterministic fake model.

Setups (each an AReaL ``RLVRWorkflow`` run by AReaL's executor, ``rollout_batch``):

* ``sglang-http``: ``RemoteSGLangEngine`` -> a fake SGLang server (``/generate``);
* ``fabric-bridge``: ``FabricInferenceEngine`` -> a fastio worker ``--engine sglang``
  -> the same fake SGLang server (needs the SGLang bridge);
* ``fabric-native``: ``FabricInferenceEngine`` -> a fastio worker serving the fake's
  model in-process (:class:`FakeEngine`: same tokens, no HTTP).

Run (the ``areal`` venv of ``.ci/areal.sh``, with the fake servers of
``tests/transport/fakes``)::

    python -m bench.areal_episode [--episodes 50] [--batch 64] [--new-tokens 32]

Prints one JSON line per setup: the median of sequential episodes (``arun_episode``
awaited one after another), the wall time of a batch of concurrent ones, and the same
batch through AReaL's executor (``rollout_batch``). The outputs of every setup are checked to be the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse, TokenArray

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256


def context_hash(ids: list[int], h: int = 0) -> int:
    """The fake SGLang server's context hash (tests/transport/fakes/common.py)."""
    for t in ids:
        h = zlib.crc32(struct.pack("<i", t), h)
    return h


def next_token(seed: int, h: int) -> tuple[int, float]:
    """The fake server's next token under weights ``seed`` (same function)."""
    x = zlib.crc32(struct.pack("<qI", seed, h))
    return x % VOCAB, -round(((x >> 8) % 1000) / 1000 + 0.001, 6)


class FakeEngine:
    """The fake server's model as a fastio engine, in the worker's process."""

    def __init__(self, seed: int = 1) -> None:
        self.seed = seed
        self.version = 0

    async def generate(self, req: LLMRequest, ctx: Any) -> LLMResponse:
        ids = req.input_ids.tolist()
        h = context_hash(ids)
        stop = set(req.gconfig.stop_token_ids)
        out: list[int] = []
        lps: list[float] = []
        reason = "length"
        for _ in range(req.gconfig.max_new_tokens):
            if ctx.interrupted:
                reason = "interrupt"
                break
            tok, lp = next_token(self.seed, h)
            h = context_hash([tok], h)
            out.append(tok)
            lps.append(lp)
            ctx.emit(tok, lp, self.version)
            if tok in stop:
                reason = "stop"
                break
        n = len(out)
        return LLMResponse(
            input_tokens=req.input_ids,
            output_tokens=TokenArray(np.array(out, np.int32)),
            output_logprobs=TokenArray(np.array(lps, np.float32)),
            output_versions=TokenArray(np.full(n, self.version, np.int32)),
            stop_reason=reason,  # type: ignore[arg-type]
        )


def fake_factory(opts: dict[str, str]) -> FakeEngine:
    """``--engine bench.areal_episode:fake_factory`` (``--plugin-opt seed=N``)."""
    return FakeEngine(int(opts.get("seed", 1)))


def _proc(args: list[str], cwd: Path) -> Any:
    import select
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(cwd))
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, cwd=cwd, env=env)
    assert p.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{args} exited with {p.returncode}")
        if select.select([p.stdout], [], [], 0.1)[0]:
            return p, json.loads(p.stdout.readline())
    p.kill()
    raise TimeoutError(f"{args} did not start")


def _measure(engine: Any, wf: Any, data: list[dict[str, Any]], episodes: int, batch: int) -> Any:
    """Episodes awaited one after another and ``batch`` at once in one loop (the
    episode itself), then ``batch`` through AReaL's executor (``rollout_batch``, whose
    polling threads add their own delays)."""
    import asyncio

    async def run() -> tuple[list[float], float, list[list[int]]]:
        seq, outs = [], []
        for i in range(episodes):
            t0 = time.perf_counter()
            traj = await wf.arun_episode(engine, data[i % len(data)])
            seq.append(time.perf_counter() - t0)
            if i < len(data):
                outs.append(traj["input_ids"][0].tolist())
        t0 = time.perf_counter()
        await asyncio.gather(*(wf.arun_episode(engine, data[i % len(data)]) for i in range(batch)))
        return seq, time.perf_counter() - t0, outs

    seq, concurrent, outs = asyncio.run(run())
    items = [data[i % len(data)] for i in range(batch)]
    t0 = time.perf_counter()
    got = engine.rollout_batch(items, workflow=wf)
    executor = time.perf_counter() - t0
    assert len(got) == batch
    return seq, concurrent, executor, outs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--setups", default="sglang-http,fabric-bridge,fabric-native")
    p.add_argument("--bridge-root", default=str(ROOT), help="checkout with --engine sglang")
    a = p.parse_args(argv)

    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.workflow.rlvr import RLVRWorkflow

    from tests.transport.test_areal import DATA, make_tokenizer, reward
    from transport.areal import FabricInferenceEngine

    tok = make_tokenizer()
    wf = RLVRWorkflow(
        reward_fn=reward,
        gconfig=GenerationHyperparameters(max_new_tokens=a.new_tokens, greedy=True),
        tokenizer=tok,
    )

    def config(backend: str) -> Any:
        return InferenceEngineConfig(
            backend=backend, max_concurrent_rollouts=a.batch, consumer_batch_size=a.batch,
            max_head_offpolicyness=1000, setup_timeout=60, request_timeout=60,
        )  # fmt: skip

    fake, info = _proc(["-m", "tests.transport.fakes.sglang_server", "--port", "0"], ROOT)
    url = f"127.0.0.1:{info['port']}"
    procs = [fake]
    results: dict[str, Any] = {}
    try:
        for setup in a.setups.split(","):
            if setup == "sglang-http":
                engine: Any = RemoteSGLangEngine(config("sglang:d1"))
                engine.initialize(addr=[url], train_data_parallel_size=1)
            else:
                cli = ["-m", "transport.worker", "--bind", "tcp://127.0.0.1:0"]
                if setup == "fabric-bridge":
                    cwd = Path(a.bridge_root)
                    cli += ["--engine", "sglang", "--engine-opt", f"url=http://{url}"]
                else:
                    cwd = ROOT
                    cli += ["--engine", "bench.areal_episode:fake_factory"]
                w, ready = _proc(cli, cwd)
                procs.append(w)
                engine = FabricInferenceEngine(config("fastio:d1"))
                engine.initialize(addr=ready["ready"], train_data_parallel_size=1)
            try:
                seq, conc, ex, outs = _measure(engine, wf, DATA, a.episodes, a.batch)
            finally:
                engine.destroy()
            results[setup] = outs
            print(json.dumps({
                "setup": setup, "episodes": a.episodes, "new_tokens": a.new_tokens,
                "episode_median_ms": round(1e3 * statistics.median(seq), 3),
                "episode_p10_ms": round(1e3 * sorted(seq)[len(seq) // 10], 3),
                "batch": a.batch, "batch_concurrent_ms": round(1e3 * conc, 1),
                "batch_rollout_batch_ms": round(1e3 * ex, 1),
            }), flush=True)  # fmt: skip
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    first = next(iter(results.values()), None)
    for setup, outs in results.items():
        assert outs == first, f"{setup} generated other tokens"


if __name__ == "__main__":
    main()
