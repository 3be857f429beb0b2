"""What the ``--engine vllm`` bridge costs in front of a real vLLM server.

One vLLM 0.32 server (CPU build, a tiny random Llama from a ``config.json``, fp32, greedy)
and one fastio worker in front of it (``--engine vllm``: the native route,
``/inference/v1/generate``). *direct*: this process posts the same streamed body the
bridge sends and reads the server-sent events itself (aiohttp). *fabric*: this process
calls a :class:`~transport.FabricClient` (streaming on). Requests: 16-token prompts, 32
new tokens. Round trips at concurrency 1 interleave direct and fabric requests one by
one; throughput rounds at 32 and 128 concurrent alternate direct and fabric, twice each.

Run where vLLM is installed (``.ci/vllm.sh`` does): ``python -m bench.vllm_real [--out
file.json] [--requests 100] [--total 256]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
PROMPT_LEN, NEW = 16, 32


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """A vLLM server as the bridge expects it (dev mode, native route, fastio backend)."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init",
            "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "1024", "--gpu-memory-utilization", "0.1", "--enable-scale-out",
            "--max-num-seqs", "256", "--weight-transfer-config", '{"backend": "fastio"}',
        ],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("vLLM did not start")


def start_worker(url: str) -> tuple[subprocess.Popen[bytes], str]:
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "transport.worker", "--bind", "tcp://127.0.0.1:0",
         "--engine", "vllm", "--engine-opt", f"url={url}"],
        stdout=subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}")
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc, str(json.loads(proc.stdout.readline())["ready"][0])
    proc.kill()
    raise TimeoutError("worker did not start")


def _prompt(i: int) -> list[int]:
    return [(7 * i + k) % 1000 + 3 for k in range(PROMPT_LEN)]


async def _direct(session: Any, url: str, i: int) -> int:
    body = {
        "request_id": f"direct-{i}-{os.urandom(3).hex()}", "token_ids": _prompt(i),
        "sampling_params": {"max_tokens": NEW, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                            "skip_special_tokens": False, "logprobs": 0},
        "stream": True,
    }  # fmt: skip
    n = 0
    async with session.post(
        url + "/inference/v1/generate", data=msgspec.json.encode(body),
        headers={"Content-Type": "application/json"},
    ) as resp:  # fmt: skip
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                for c in msgspec.json.decode(line[5:])["choices"]:
                    n += len(c.get("token_ids") or ())
    return n


async def _fabric(client: Any, i: int) -> int:
    from fastio import GenerationHyperparameters, LLMRequest

    g = GenerationHyperparameters(max_new_tokens=NEW, greedy=True)
    r = await client.agenerate(LLMRequest(input_ids=_prompt(i), gconfig=g), on_chunk=_ignore)
    return len(r.output_tokens)


def _ignore(t: Any, lp: Any, v: Any) -> None:
    return None


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(url: str, address: str, requests: int, total: int) -> dict[str, Any]:
    """Round trips at 1 (interleaved) and throughput at 32 and 128 (alternating rounds)."""
    import aiohttp

    from transport import ClientConfig, FabricClient

    out: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2)) as s,
        FabricClient([address], ClientConfig(request_timeout=600)) as client,
    ):
        for i in range(8):  # warm both paths
            await _direct(s, url, i)
            await _fabric(client, i)
        rtt: dict[str, list[float]] = {"direct": [], "fabric": []}
        for i in range(requests):
            for name in ("direct", "fabric") if i % 2 else ("fabric", "direct"):
                t0 = time.perf_counter()
                await (_direct(s, url, i) if name == "direct" else _fabric(client, i))
                rtt[name].append((time.perf_counter() - t0) * 1e3)
        for name, xs in rtt.items():
            out[f"rtt_{name}_p50_ms"] = round(statistics.median(xs), 2)
            out[f"rtt_{name}_p99_ms"] = round(_pct(xs, 0.99), 2)
        out["rtt_p50_ratio"] = round(out["rtt_fabric_p50_ms"] / out["rtt_direct_p50_ms"], 3)
        for conc in (32, 128):
            rates: dict[str, list[float]] = {"direct": [], "fabric": []}
            for _ in range(2):
                for name in ("direct", "fabric"):
                    sem = asyncio.Semaphore(conc)

                    async def one(i: int, name: str = name, sem: Any = sem) -> int:
                        async with sem:
                            if name == "direct":
                                return await _direct(s, url, i)
                            return await _fabric(client, i)

                    t0 = time.perf_counter()
                    await asyncio.gather(*(one(i) for i in range(total)))
                    rates[name].append(total / (time.perf_counter() - t0))
            for name, xs in rates.items():
                out[f"c{conc}_{name}_req_per_s"] = round(max(xs), 1)
            out[f"c{conc}_ratio"] = round(
                out[f"c{conc}_fabric_req_per_s"] / out[f"c{conc}_direct_req_per_s"], 3
            )
    return out


def main(argv: list[str] | None = None) -> None:
    """Start a server and a worker, measure, print (and write) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="round trips per path")
    ap.add_argument("--total", type=int, default=256, help="requests per throughput round")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="fastio-bench-vllm-"))
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    port = _free_port()
    server = start_server(tmp, port, tmp / "server.log")
    worker = None
    try:
        url = f"http://127.0.0.1:{port}"
        worker, address = start_worker(url)
        res = asyncio.run(measure(url, address, a.requests, a.total))
        res["what"] = f"{PROMPT_LEN}-token prompts, {NEW} new, greedy; vLLM 0.32 CPU, tiny Llama"
        print(json.dumps(res, indent=1))
        if a.out is not None:
            a.out.write_text(json.dumps(res, indent=1))
    finally:
        for p in (worker, server):
            if p is not None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    main()
