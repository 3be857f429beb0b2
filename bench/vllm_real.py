"""fastio in front of vLLM and vLLM inside fastio's worker, against vLLM's own server.

One vLLM 0.32 server (CPU build, a tiny random Llama from a ``config.json``, fp32, greedy)
and two fastio workers: *bridge* (``--engine vllm --engine-opt url=...``, in front of that
server, on its native route) and *in-worker* (``--engine vllm --engine-opt model=...``:
vLLM's ``AsyncLLM`` in the worker, the same engine settings). *direct*: this process posts
the streamed body the bridge sends to the server and reads the server-sent events itself
(aiohttp); the fastio paths are a :class:`~transport.FabricClient` (streaming on).
Requests: 16-token prompts, 32 new tokens. Round trips at concurrency 1 interleave the
paths request by request; throughput rounds (32, 128 and 512 concurrent) alternate the
paths, twice each (the best of two); at 128 also unstreamed (one answer per request:
``stream: false`` to the server, ``ClientConfig(stream=False)`` in vLLM's worker). CPU per
request: user+system seconds of each process tree (server: API server + engine core;
worker; this client) over the 128 rounds.

Run where vLLM is installed (``.ci/vllm.sh`` does): ``python -m bench.vllm_real [--out
file.json] [--requests 60] [--total 512]``.
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
from collections.abc import Awaitable, Callable
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


def start_worker(*engine_opts: str) -> tuple[subprocess.Popen[bytes], str]:
    """A worker ``--engine vllm`` with these ``key=value`` options; its address."""
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
    args = [
        sys.executable,
        "-m",
        "transport.worker",
        "--bind",
        "tcp://127.0.0.1:0",
        "--engine",
        "vllm",
    ]
    for o in engine_opts:
        args += ["--engine-opt", o]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}")
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc, str(json.loads(proc.stdout.readline())["ready"][0])
    proc.kill()
    raise TimeoutError("worker did not start")


def cpu_seconds(pid: int) -> float:
    """User + system seconds of ``pid`` and its descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return total


def _prompt(i: int) -> list[int]:
    return [(7 * i + k) % 1000 + 3 for k in range(PROMPT_LEN)]


async def _direct(session: Any, url: str, i: int, stream: bool = True) -> int:
    body = {
        "request_id": f"direct-{i}-{os.urandom(3).hex()}", "token_ids": _prompt(i),
        "sampling_params": {"max_tokens": NEW, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                            "skip_special_tokens": False, "logprobs": 0},
        "stream": stream,
    }  # fmt: skip
    n = 0
    async with session.post(
        url + "/inference/v1/generate", data=msgspec.json.encode(body),
        headers={"Content-Type": "application/json"},
    ) as resp:  # fmt: skip
        if not stream:
            return len(msgspec.json.decode(await resp.read())["choices"][0]["token_ids"])
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                for c in msgspec.json.decode(line[5:])["choices"]:
                    n += len(c.get("token_ids") or ())
    return n


async def _fabric(client: Any, i: int, stream: bool = True) -> int:
    from fastio import GenerationHyperparameters, LLMRequest

    g = GenerationHyperparameters(max_new_tokens=NEW, greedy=True)
    req = LLMRequest(input_ids=_prompt(i), gconfig=g)
    r = await client.agenerate(req, on_chunk=_ignore if stream else None)
    return len(r.output_tokens)


def _ignore(t: Any, lp: Any, v: Any) -> None:
    return None


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(
    url: str, bridge: str, inworker: str, pids: dict[str, int], requests: int, total: int
) -> dict[str, Any]:
    """Round trips at 1 (interleaved) and throughput at 32, 128, 512 (alternating)."""
    import aiohttp

    from transport import ClientConfig, FabricClient

    out: dict[str, Any] = {}
    cfg = ClientConfig(request_timeout=900, max_in_flight_per_worker=1024)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2)) as s,
        FabricClient([bridge], cfg) as cb,
        FabricClient([inworker], cfg) as ci,
        FabricClient([inworker], msgspec.structs.replace(cfg, stream=False)) as cu,
    ):
        paths: dict[str, Callable[[int], Awaitable[int]]] = {
            "direct": lambda i: _direct(s, url, i),
            "bridge": lambda i: _fabric(cb, i),
            "in_worker": lambda i: _fabric(ci, i),
        }
        for i in range(8):  # warm every path
            for call in paths.values():
                await call(i)
        rtt: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for i in range(requests):
            for name in names[i % 3 :] + names[: i % 3]:
                t0 = time.perf_counter()
                await paths[name](i)
                rtt[name].append((time.perf_counter() - t0) * 1e3)
        for name, xs in rtt.items():
            out[f"rtt_{name}_p50_ms"] = round(statistics.median(xs), 2)
            out[f"rtt_{name}_p99_ms"] = round(_pct(xs, 0.99), 2)
        for conc in (32, 128, 512):
            rates: dict[str, list[float]] = {name: [] for name in paths}
            cpu: dict[str, dict[str, float]] = {name: {} for name in paths}
            for _ in range(2):
                for name, call in paths.items():
                    sem = asyncio.Semaphore(conc)

                    async def one(i: int, call: Any = call, sem: Any = sem) -> int:
                        async with sem:
                            return int(await call(i))

                    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
                    t0 = time.perf_counter()
                    await asyncio.gather(*(one(i) for i in range(total)))
                    rates[name].append(total / (time.perf_counter() - t0))
                    for k, p in pids.items():
                        ms = (cpu_seconds(p) - c0[k]) / total * 1e3
                        cpu[name][k] = round(min(cpu[name].get(k, ms), ms), 3)
            for name, xs in rates.items():
                out[f"c{conc}_{name}_req_per_s"] = round(max(xs), 1)
                if conc == 128:
                    out[f"c128_{name}_cpu_ms_per_req"] = {k: v for k, v in cpu[name].items() if v}
            for name in ("bridge", "in_worker"):
                out[f"c{conc}_{name}_vs_direct"] = round(
                    out[f"c{conc}_{name}_req_per_s"] / out[f"c{conc}_direct_req_per_s"], 3
                )
        # Unstreamed (one answer per request, as RL rollouts mostly ask), at 128.
        plain: dict[str, Callable[[int], Awaitable[int]]] = {
            "direct": lambda i: _direct(s, url, i, stream=False),
            "in_worker": lambda i: _fabric(cu, i, stream=False),
        }
        best: dict[str, float] = {}
        for _ in range(2):
            for name, call in plain.items():
                sem = asyncio.Semaphore(128)

                async def one_plain(i: int, call: Any = call, sem: Any = sem) -> int:
                    async with sem:
                        return int(await call(i))

                t0 = time.perf_counter()
                await asyncio.gather(*(one_plain(i) for i in range(total)))
                best[name] = max(best.get(name, 0.0), total / (time.perf_counter() - t0))
        out["c128_unstreamed_direct_req_per_s"] = round(best["direct"], 1)
        out["c128_unstreamed_in_worker_req_per_s"] = round(best["in_worker"], 1)
        out["c128_unstreamed_in_worker_vs_direct"] = round(best["in_worker"] / best["direct"], 3)
        for name in ("bridge", "in_worker"):
            out[f"rtt_p50_{name}_vs_direct"] = round(
                out[f"rtt_{name}_p50_ms"] / out["rtt_direct_p50_ms"], 3
            )
    return out


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """The ratios ``bench/reference.json`` guards, named as the other suites' (above 1:
    the fastio path is faster than vLLM's own server)."""
    out = {}
    for name, key in (("bridge", "bridge"), ("in_worker", "in-worker")):
        for conc in (32, 128, 512):
            out[f"vllm/throughput@c{conc} {key} vs vllm-server"] = res[f"c{conc}_{name}_vs_direct"]
        out[f"vllm/rtt-p50 {key} vs vllm-server"] = round(1 / res[f"rtt_p50_{name}_vs_direct"], 3)
    out["vllm/throughput@c128-unstreamed in-worker vs vllm-server"] = res[
        "c128_unstreamed_in_worker_vs_direct"
    ]
    return out


def main(argv: list[str] | None = None) -> None:
    """Start a server and two workers, measure, print (and write) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60, help="round trips per path")
    ap.add_argument("--total", type=int, default=512, help="requests per throughput round")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--check", type=Path, default=None, help="fail below bench/reference.json's vllm/ ratios"
    )
    ap.add_argument("--tolerance", type=float, default=0.3, help="allowed relative drop (0.3)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="fastio-bench-vllm-"))
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = [start_server(tmp, port, tmp / "server.log")]
    try:
        url = f"http://127.0.0.1:{port}"
        bridge, b_addr = start_worker(f"url={url}")
        procs.append(bridge)
        inworker, i_addr = start_worker(
            f"model={tmp}", "skip_tokenizer_init=1", "load_format=dummy", "dtype=float32",
            "enforce_eager=1", "max_model_len=1024", "gpu_memory_utilization=0.1",
            "max_num_seqs=256",
        )  # fmt: skip
        procs.append(inworker)
        pids = {"server": procs[0].pid, "bridge_worker": bridge.pid,
                "in_worker_worker": inworker.pid, "client": os.getpid()}  # fmt: skip
        res = asyncio.run(measure(url, b_addr, i_addr, pids, a.requests, a.total))
        res["what"] = f"{PROMPT_LEN}-token prompts, {NEW} new, greedy; vLLM 0.32 CPU, tiny Llama"
        res["ratios"] = ratios(res)
        print(json.dumps(res, indent=1))
        if a.out is not None:
            a.out.write_text(json.dumps(res, indent=1))
        if a.check is not None:
            from bench.report import check

            ref = {
                k: v for k, v in json.loads(a.check.read_text()).items() if k.startswith("vllm/")
            }
            problems = check(res["ratios"], ref, a.tolerance)
            for p in problems:
                print("REGRESSION", p)
            if problems:
                raise SystemExit(1)
            print(
                f"vllm benchmark check: {len(ref)} ratios within {a.tolerance:.0%} of the reference"
            )
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
