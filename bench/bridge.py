"""What the SGLang bridge costs per request: the fabric in front of a server vs the
server called directly over HTTP.

Same process layout both ways: this process is the client; one fake SGLang server
(``tests/transport/fakes/sglang_server.py``, a process, no model: tokens are hashes, so
the figures are the transport's alone) answers. *direct*: this process posts
``/generate`` (streamed, the same body the bridge sends) and reads the server-sent
events itself. *bridge*: this process calls a :class:`~transport.FabricClient` (streaming
on), whose worker process (``--engine sglang``) does the same HTTP call. Reported:
median and p90 latency of sequential requests (direct and bridged requests interleaved
one by one, so the machine's load drifts alike for both; the median of the per-pair
differences is the bridge's overhead), and requests/s with many in flight.

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


class _Direct:
    """This process calls the server over HTTP itself."""

    def __init__(self, url: str, tokens: int) -> None:
        import aiohttp

        self.url, self.tokens = url, tokens
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def one(self, i: int) -> None:
        from transport.engines.http import sse_events

        got = 0
        async with self.session.post(
            self.url + "/generate", data=_body(i, self.tokens),
            headers={"Content-Type": "application/json"},
        ) as resp:  # fmt: skip
            async for chunk in sse_events(resp.content):
                meta = chunk["meta_info"]
                got = meta["completion_tokens"]
                if meta["finish_reason"]:
                    break
        assert got == self.tokens

    async def close(self) -> None:
        await self.session.close()


class _Bridge:
    """This process calls a FabricClient whose worker calls the server."""

    def __init__(self, address: str, tokens: int) -> None:
        from fastio import GenerationHyperparameters
        from transport import ClientConfig, FabricClient

        self.client = FabricClient([address], ClientConfig(request_timeout=120))
        self.g = GenerationHyperparameters(max_new_tokens=tokens)
        self.tokens = tokens

    async def one(self, i: int) -> None:
        from fastio import LLMRequest

        req = LLMRequest(input_ids=[1 + i % 97, 2, 3, 4, 5, 6, 7, 8], gconfig=self.g)
        r = await self.client.agenerate(req, on_chunk=_ignore)
        assert r.output_len == self.tokens

    async def close(self) -> None:
        await self.client.close()


def _ignore(t: Any, lp: Any, v: Any) -> None:
    pass


async def _measure(
    url: str, address: str, requests: int, tokens: int, concurrency: int, total: int
) -> dict[str, Any]:
    direct, bridge = _Direct(url, tokens), _Bridge(address, tokens)
    try:
        for i in range(min(20, requests)):  # warm-up: connections, caches
            await direct.one(i)
            await bridge.one(i)
        # Sequential, interleaved one by one: the machine's load drifts alike for both.
        seq: dict[str, list[float]] = {"direct-http": [], FASTIO: []}
        for i in range(requests):
            for impl, side in (("direct-http", direct), (FASTIO, bridge)):
                t0 = time.perf_counter()
                await side.one(i)
                seq[impl].append(time.perf_counter() - t0)
        rate: dict[str, float] = {}
        for impl, side in (("direct-http", direct), (FASTIO, bridge)):
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int, side: Any = side, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await side.one(i)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(total)))
            rate[impl] = total / (time.perf_counter() - t0)
        return {"seq": seq, "rate": rate}
    finally:
        await direct.close()
        await bridge.close()


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
        res = asyncio.run(_measure(url, wready["ready"][0], requests, tokens, concurrency, total))
        d, b = res["seq"]["direct-http"], res["seq"][FASTIO]
        paired = sorted(y - x for x, y in zip(d, b, strict=True))
        out: list[Measurement] = []
        for impl, seq in res["seq"].items():
            s = sorted(seq)
            extra: dict[str, Any] = {"p90_s": s[int(0.9 * (len(s) - 1))]}
            if impl == FASTIO:
                extra["paired_overhead_median_s"] = statistics.median(paired)
            out.append(
                Measurement.from_samples(
                    "bridge", f"sequential {tokens} tokens", impl, tokens, seq, **extra
                )
            )
            rate = res["rate"][impl]
            out.append(
                Measurement.from_samples(
                    "bridge", f"{concurrency} in flight", impl, tokens, [1 / rate],
                    requests_per_s=rate,
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
    paired = b.extra["paired_overhead_median_s"] * 1e3
    print(
        f"{'paired overhead ms':24}{'':14}{'':14}{paired:+14.2f}  (median of per-pair differences)"
    )
    dc, bc = by[(conc_case, "direct-http")], by[(conc_case, FASTIO)]
    dr, br = dc.extra["requests_per_s"], bc.extra["requests_per_s"]
    print(f"{conc_case + ' req/s':24}{dr:14.0f}{br:14.0f}{br / dr:13.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine_info(), "results": [m.to_dict() for m in ms]}, indent=1)
        )


if __name__ == "__main__":
    main()
