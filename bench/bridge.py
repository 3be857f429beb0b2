"""What the SGLang bridge costs per request: the fabric in front of a server vs the
server called directly over HTTP.

Same process layout both ways: this process is the client; one fake SGLang server
(``tests/transport/fakes/sglang_server.py``, a process, no model: tokens are hashes, so
the figures are the transport's alone) answers. *direct*: this process posts
``/generate`` (streamed, the same body the bridge sends) and reads the server-sent
events itself. *bridge*: this process calls a :class:`~transport.FabricClient` (streaming
on), whose worker process (``--engine sglang``) does the same HTTP call. Reported:
median and p90 latency of sequential requests, and requests/s with many in flight.

Run from a checkout: ``python -m bench.bridge [--requests 200] [--tokens 16]
[--concurrency 32] [--total 1000] [--json out.json]`` (needs aiohttp: ``fastio[sglang]``).
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
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.common import FASTIO, Measurement, machine_info

ROOT = Path(__file__).resolve().parents[1]


def _spawn(args: list[str], key: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, cwd=ROOT, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args} exited with {proc.returncode}")
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = json.loads(proc.stdout.readline())
            if key in line:
                return proc, line
    proc.kill()
    raise TimeoutError(f"{args} did not start")


def _body(i: int, tokens: int) -> bytes:
    return msgspec.json.encode(
        {
            "input_ids": [1 + i % 97, 2, 3, 4, 5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "top_p": 1.0,
                                "top_k": -1, "skip_special_tokens": False, "no_stop_trim": True},
            "return_logprob": True,
            "stream": True,
            "rid": f"direct-{i}",
        }
    )  # fmt: skip


async def _direct(url: str, n: int, tokens: int, concurrency: int) -> list[float]:
    import aiohttp

    from transport.engines.http import sse_events

    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                got = 0
                async with session.post(
                    url + "/generate", data=_body(i, tokens),
                    headers={"Content-Type": "application/json"},
                ) as resp:  # fmt: skip
                    async for chunk in sse_events(resp.content):
                        meta = chunk["meta_info"]
                        got = meta["completion_tokens"]
                        if meta["finish_reason"]:
                            break
                assert got == tokens
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def _bridge(address: str, n: int, tokens: int, concurrency: int) -> list[float]:
    from fastio import GenerationHyperparameters, LLMRequest
    from transport import ClientConfig, FabricClient

    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    g = GenerationHyperparameters(max_new_tokens=tokens)

    def on_chunk(t: Any, lp: Any, v: Any) -> None:
        pass

    async with FabricClient([address], ClientConfig(request_timeout=120)) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                req = LLMRequest(input_ids=[1 + i % 97, 2, 3, 4, 5, 6, 7, 8], gconfig=g)
                r = await client.agenerate(req, on_chunk=on_chunk)
                assert r.output_len == tokens
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


def run(
    requests: int = 200, tokens: int = 16, concurrency: int = 32, total: int = 1000
) -> list[Measurement]:
    """Measure both ways; returns one Measurement per (case, impl)."""
    server, sready = _spawn(["-m", "tests.transport.fakes.sglang_server"], "port")
    url = f"http://127.0.0.1:{sready['port']}"
    worker = None
    try:
        worker, wready = _spawn(
            ["-m", "transport.worker", "--bind", "tcp://127.0.0.1:0", "--engine", "sglang",
             "--engine-opt", f"url={url}", "--engine-opt", "health_interval=0"],
            "ready",
        )  # fmt: skip
        address = wready["ready"][0]
        out: list[Measurement] = []
        warm = min(20, requests)
        asyncio.run(_direct(url, warm, tokens, 1))
        asyncio.run(_bridge(address, warm, tokens, 1))
        for impl, fn, target in (("direct-http", _direct, url), (FASTIO, _bridge, address)):
            seq = asyncio.run(fn(target, requests, tokens, 1))  # type: ignore[operator]
            t0 = time.perf_counter()
            conc = asyncio.run(fn(target, total, tokens, concurrency))  # type: ignore[operator]
            wall = time.perf_counter() - t0
            seq.sort()
            out.append(
                Measurement.from_samples(
                    "bridge", f"sequential {tokens} tokens", impl, tokens, seq,
                    p90_s=seq[int(0.9 * (len(seq) - 1))],
                )
            )  # fmt: skip
            out.append(
                Measurement.from_samples(
                    "bridge", f"{concurrency} in flight", impl, tokens, [wall / total],
                    requests_per_s=total / wall, median_latency_s=statistics.median(conc),
                )
            )  # fmt: skip
        return out
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.bridge``: print a table (and write JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m bench.bridge", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="sequential requests")
    p.add_argument("--tokens", type=int, default=16, help="tokens per request")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--total", type=int, default=1000, help="requests of the concurrent run")
    p.add_argument("--json", type=Path, help="write the measurements here")
    args = p.parse_args(argv)
    ms = run(args.requests, args.tokens, args.concurrency, args.total)
    by = {(m.case, m.impl): m for m in ms}
    seq_case = f"sequential {args.tokens} tokens"
    conc_case = f"{args.concurrency} in flight"
    d, b = by[(seq_case, "direct-http")], by[(seq_case, FASTIO)]
    print(f"SGLang bridge vs direct HTTP ({args.tokens} streamed tokens per request)")
    print(f"{'':24}{'direct HTTP':>14}{'via fabric':>14}{'difference':>14}")
    print(
        f"{'sequential median ms':24}{d.median_s * 1e3:14.2f}{b.median_s * 1e3:14.2f}"
        f"{(b.median_s - d.median_s) * 1e3:+14.2f}"
    )
    dp, bp = d.extra["p90_s"], b.extra["p90_s"]
    print(f"{'sequential p90 ms':24}{dp * 1e3:14.2f}{bp * 1e3:14.2f}{(bp - dp) * 1e3:+14.2f}")
    dc, bc = by[(conc_case, "direct-http")], by[(conc_case, FASTIO)]
    dr, br = dc.extra["requests_per_s"], bc.extra["requests_per_s"]
    print(f"{conc_case + ' req/s':24}{dr:14.0f}{br:14.0f}{br / dr:13.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine_info(), "results": [m.to_dict() for m in ms]}, indent=1)
        )


if __name__ == "__main__":
    main()
