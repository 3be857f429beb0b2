"""Pong cases of the transport suite (see :mod:`bench.transport`'s docstring): pong
latency of an idle worker, of one whose engines are busy, and next to a peer that
stopped reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

from bench.common import FASTIO, Measurement
from bench.transport import ROOT, SUITE, _Proc

__all__ = ["run_pongs"]


# -- pong latency: idle, busy engines, a peer that stopped reading ------------------------
def _ping_latencies(address: str, seconds: float, interval: float = 0.01) -> list[float]:
    """Round trips of pings from a fresh DEALER, one every ``interval`` s."""
    import fastio
    from fastio import fabric_msgs as fm

    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    out: list[float] = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            s.send_multipart(fastio.encode(fm.Heartbeat(sent_at=t0)))
            got = False
            while not got:
                if not s.poll(10_000):
                    out.append(10.0)  # no pong in 10 s: counted as 10 s
                    break
                for part in fm.split(s.recv_multipart()):
                    msg = fastio.decode(part, type=fm.WORKER_TO_CLIENT)
                    got = got or (isinstance(msg, fm.Heartbeat) and msg.sent_at == t0)
            if got:
                out.append(time.perf_counter() - t0)
            time.sleep(interval)  # pacing of the probe, not synchronisation
    finally:
        s.close(0)
        ctx.term()
    return out


def _pong_measurement(case: str, samples: list[float], **extra: Any) -> Measurement:
    q = np.quantile(np.array(samples), [0.5, 0.99])
    return Measurement.from_samples(
        SUITE, case, FASTIO, len(samples), samples, size_unit="pings",
        p50_ms=round(float(q[0]) * 1e3, 2), p99_ms=round(float(q[1]) * 1e3, 2),
        max_ms=round(max(samples) * 1e3, 2), **extra,
    )  # fmt: skip


_LOAD = """
import asyncio, json, sys
from fastio import GenerationHyperparameters, LLMRequest
from transport import ClientConfig, FabricClient
addrs, n = json.loads(sys.argv[1]), int(sys.argv[2])
async def main():
    cfg = ClientConfig(stream=False, max_in_flight_per_worker=n, request_timeout=600)
    async with FabricClient(addrs, cfg) as client:
        while not all(w.alive for w in client.workers):
            await asyncio.sleep(0.01)
        g = GenerationHyperparameters(max_new_tokens=32)
        async def gen(i):
            return await client.agenerate(LLMRequest(input_ids=[1 + i % 200, 2, 3], gconfig=g))
        def one(i):
            return asyncio.ensure_future(gen(i))
        pending = {one(i) for i in range(n)}
        print(json.dumps({"ready": ["loaded"]}), flush=True)
        i = n
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for _ in done:
                i += 1
                pending.add(one(i))
asyncio.run(main())
"""

_STOPPED_READER = """
import sys, time, zmq, fastio
from fastio import fabric_msgs as fm
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.RCVHWM, 100); s.connect(sys.argv[1])
hb = fastio.encode(fm.Heartbeat(sent_at=1.0)); rate = float(sys.argv[3])
end = time.monotonic() + float(sys.argv[2]); t0 = time.monotonic(); sent = 0
while time.monotonic() < end:
    while sent < (time.monotonic() - t0) * rate:
        s.send_multipart(hb); sent += 1
    time.sleep(0.001)
print(sent, flush=True)
"""


def run_pongs(quick: bool) -> list[Measurement]:
    """The pong cases (see the module docstring)."""
    out: list[Measurement] = []
    window = 5.0 if quick else 20.0
    ref = [
        _Proc([sys.executable, "-m", "transport.worker", "--bind", "tcp://127.0.0.1:0"])
        for _ in range(2)
    ]
    load: _Proc | None = None
    try:
        addrs = [p.ready() for p in ref]
        out.append(_pong_measurement("pong-idle", _ping_latencies(addrs[0], window)))
        n = 4000
        load = _Proc([sys.executable, "-c", _LOAD, json.dumps(addrs), str(n)])
        load.ready(120)
        time.sleep(2.0)  # let the engines reach their steady state
        busy = _ping_latencies(addrs[0], window)
        out.append(_pong_measurement("pong-busy-4000", busy, in_flight=n, workers=2))
    finally:
        for p in [*ref, *([load] if load else [])]:
            p.kill()

    stop_s = 8.0 if quick else 30.0
    # ipc and a small HWM: the stopped reader's pongs overflow libzmq's pipe and the
    # kernel's buffers within a second, so the worker's own queue for it is exercised.
    sock = ROOT / "bench" / f".pong-{os.getpid()}.sock"
    echo = _Proc(
        [sys.executable, "-m", "transport.worker", "--bind", f"ipc://{sock}", "--engine", "echo",
         "--hwm", "1000"]
    )  # fmt: skip
    try:
        addr = echo.ready()
        _ping_latencies(addr, 1.0)  # warm-up
        without = _ping_latencies(addr, stop_s)
        bad = subprocess.Popen(
            [sys.executable, "-c", _STOPPED_READER, addr, str(stop_s), "5000"],
            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        try:
            during = _ping_latencies(addr, stop_s)
        finally:
            sent, _ = bad.communicate(timeout=stop_s + 60)
        p99_without = float(np.quantile(np.array(without), 0.99))
        p99_during = float(np.quantile(np.array(during), 0.99))
        out.append(
            _pong_measurement(
                "pong-stopped-reader", during,
                stopped_reader_s=stop_s, stopped_reader_pings=int(sent.strip() or 0),
                p99_without_ms=round(p99_without * 1e3, 2),
                p99_ratio_vs_without=round(p99_during / p99_without, 2),
            )
        )  # fmt: skip
    finally:
        echo.kill()
        sock.unlink(missing_ok=True)
    return out
