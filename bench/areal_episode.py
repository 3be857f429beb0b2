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

    python -m bench.areal_episode [--episodes 50] [--batch 64] [--new-tokens 32] [--rounds 3]
        [--workflow rlvr|minimal] [--incremental]

Each round runs every setup once (a fresh engine; the order rotates from round to
round, the server and workers stay up) and prints one JSON line per setup: the median
of sequential episodes (``arun_episode`` awaited one after another), the wall time of a
batch of concurrent ones, and the same batch through AReaL's executor
(``rollout_batch``, ``--batches`` times: median and each), with the CPU time each
process spent per ``rollout_batch`` (this one, the worker, the server). Then one
summary line per setup: each figure's median and range over the rounds, and its ratio
to ``sglang-http`` measured in the same round (on a loaded machine the ratios hold
better than the times). The outputs of every setup are checked to be the same tokens.
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


def minimal_workflow(gconfig: Any, tokenizer: Any) -> Any:
    """A ``RolloutWorkflow`` whose episode is one ``agenerate`` of the item's message
    (tokenized once per message) and nothing else: what the engine itself costs."""
    import uuid

    import torch
    from areal.api import ModelRequest, RolloutWorkflow

    prompts: dict[str, list[int]] = {}

    class Minimal(RolloutWorkflow):  # type: ignore[misc]
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
            text = data["messages"][0]["content"]
            ids = prompts.get(text) or prompts.setdefault(text, tokenizer.encode(text))
            req = ModelRequest(
                rid=uuid.uuid4().hex, input_ids=list(ids), gconfig=gconfig.new(n_samples=1),
                tokenizer=tokenizer,
            )  # fmt: skip
            resp = await engine.agenerate(req)
            return {"input_ids": torch.tensor([ids + resp.output_tokens])}

    return Minimal()


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


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None where /proc is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(
    engine: Any,
    wf: Any,
    data: list[dict[str, Any]],
    episodes: int,
    batch: int,
    batches: int,
    pids: dict[str, int],
) -> Any:
    """Episodes awaited one after another and ``batch`` at once in one loop (the
    episode itself), then ``batch`` through AReaL's executor (``rollout_batch``, whose
    polling threads add their own delays) ``batches`` times, with the CPU seconds each
    process of ``pids`` spent per ``rollout_batch``."""
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
    walls: list[float] = []
    cpu: dict[str, list[float]] = {k: [] for k in pids}
    for _ in range(batches):
        c0 = {k: _cpu_s(pid) for k, pid in pids.items()}
        t0 = time.perf_counter()
        got = engine.rollout_batch(items, workflow=wf)
        walls.append(time.perf_counter() - t0)
        assert len(got) == batch
        for k, pid in pids.items():
            a, b = c0[k], _cpu_s(pid)
            if a is not None and b is not None:
                cpu[k].append(b - a)
    return seq, concurrent, walls, cpu, outs


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Median and range of each figure over the rounds; with ``base`` (sglang-http's
    rows, round by round), the ratio of each to the base's in the same round."""
    out: dict[str, Any] = {"setup": rows[0]["setup"], "rounds": len(rows)}
    keys = ("episode_median_ms", "batch_concurrent_ms", "batch_rollout_batch_ms")
    for k in keys:
        v = [r[k] for r in rows]
        out[k] = {"median": round(statistics.median(v), 1), "min": min(v), "max": max(v)}
        if base is not None:
            q = [r[k] / b[k] for r, b in zip(rows, base, strict=True)]
            out[k]["ratio_vs_sglang_http"] = {
                "median": round(statistics.median(q), 3),
                "min": round(min(q), 3),
                "max": round(max(q), 3),
            }
    for k in rows[0]["cpu_ms_per_rollout_batch"]:
        v = [r["cpu_ms_per_rollout_batch"][k] for r in rows]
        out.setdefault("cpu_ms_per_rollout_batch", {})[k] = round(statistics.median(v), 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--setups", default="sglang-http,fabric-bridge,fabric-native")
    p.add_argument("--rounds", type=int, default=3, help="each setup once per round")
    p.add_argument("--batches", type=int, default=3, help="rollout_batch calls per round")
    p.add_argument("--bridge-root", default=str(ROOT), help="checkout with --engine sglang")
    p.add_argument(
        "--workflow", choices=("rlvr", "minimal"), default="rlvr",
        help="rlvr: AReaL's RLVRWorkflow; minimal: one agenerate per episode and nothing "
        "else (the engine's own cost, without the chat template, tokenizer and reward)",
    )  # fmt: skip
    p.add_argument(
        "--incremental", action="store_true",
        help="the fake SGLang streams incremental chunks (SGLang's "
        "--incremental-streaming-output); by default cumulative, as SGLang's default",
    )  # fmt: skip
    a = p.parse_args(argv)

    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.workflow.rlvr import RLVRWorkflow

    from tests.transport.areal.test_areal import DATA, make_tokenizer, reward
    from transport.areal import FabricInferenceEngine

    tok = make_tokenizer()
    gconfig = GenerationHyperparameters(max_new_tokens=a.new_tokens, greedy=True)
    wf: Any = (
        RLVRWorkflow(reward_fn=reward, gconfig=gconfig, tokenizer=tok)
        if a.workflow == "rlvr"
        else minimal_workflow(gconfig, tok)
    )

    def config(backend: str) -> Any:
        return InferenceEngineConfig(
            backend=backend, max_concurrent_rollouts=a.batch, consumer_batch_size=a.batch,
            max_head_offpolicyness=1000, setup_timeout=60, request_timeout=60,
        )  # fmt: skip

    server = ["-m", "tests.transport.fakes.sglang_server", "--port", "0"]
    fake, info = _proc(server + ["--incremental"] * a.incremental, ROOT)
    url = f"127.0.0.1:{info['port']}"
    procs = [fake]
    setups = a.setups.split(",")
    addrs: dict[str, list[str]] = {}
    pids: dict[str, dict[str, int]] = {}
    results: dict[str, Any] = {}
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in setups}
    try:
        for setup in setups:  # the workers stay up through every round
            pids[setup] = {"areal": os.getpid(), "server": fake.pid}
            if setup == "sglang-http":
                continue
            cli = ["-m", "transport.worker", "--bind", "tcp://127.0.0.1:0"]
            if setup == "fabric-bridge":
                cwd = Path(a.bridge_root)
                cli += ["--engine", "sglang", "--engine-opt", f"url=http://{url}"]
            else:
                cwd = ROOT
                cli += ["--engine", "bench.areal_episode:fake_factory"]
            w, ready = _proc(cli, cwd)
            procs.append(w)
            addrs[setup] = ready["ready"]
            pids[setup]["worker"] = w.pid
            if setup == "fabric-native":
                del pids[setup]["server"]
        for rnd in range(a.rounds):
            for setup in setups[rnd % len(setups) :] + setups[: rnd % len(setups)]:
                if setup == "sglang-http":
                    engine: Any = RemoteSGLangEngine(config("sglang:d1"))
                    engine.initialize(addr=[url], train_data_parallel_size=1)
                else:
                    engine = FabricInferenceEngine(config("fastio:d1"))
                    engine.initialize(addr=addrs[setup], train_data_parallel_size=1)
                try:
                    seq, conc, walls, cpu, outs = _measure(
                        engine, wf, DATA, a.episodes, a.batch, a.batches, pids[setup]
                    )
                finally:
                    engine.destroy()
                results.setdefault(setup, outs)
                assert outs == results[setup], f"{setup} generated other tokens"
                row = {
                    "setup": setup, "round": rnd, "episodes": a.episodes,
                    "new_tokens": a.new_tokens,
                    "episode_median_ms": round(1e3 * statistics.median(seq), 3),
                    "episode_p10_ms": round(1e3 * sorted(seq)[len(seq) // 10], 3),
                    "batch": a.batch, "batch_concurrent_ms": round(1e3 * conc, 1),
                    "batch_rollout_batch_ms": round(1e3 * statistics.median(walls), 1),
                    "rollout_batch_ms": [round(1e3 * t, 1) for t in walls],
                    "cpu_ms_per_rollout_batch": {
                        k: round(1e3 * statistics.median(v), 1) for k, v in cpu.items() if v
                    },
                }  # fmt: skip
                rows[setup].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    first = next(iter(results.values()), None)
    for setup, outs in results.items():
        assert outs == first, f"{setup} generated other tokens"
    base = rows.get("sglang-http")
    for setup in setups:
        if rows[setup]:
            ref = base if setup != "sglang-http" and base else None
            print(json.dumps({"summary": _summary(rows[setup], ref)}), flush=True)


if __name__ == "__main__":
    main()
