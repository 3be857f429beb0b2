"""Transport suite: the fabric (client + worker processes, echo handler) against raw
pyzmq DEALER/ROUTER moving the same bytes, measured in the same run.

Baselines (``raw-pyzmq``)
-------------------------
Every baseline moves *the same bytes* as fastio, over the *same socket types* and the
*same process layout*: the exact frames fastio puts on the wire for the request
(``fastio.encode(Submit(...))``: header, plus one zero-copy buffer frame when the token
array is at least the inline threshold) go from DEALERs in this process to ROUTER echo
processes (one per fabric worker, ``recv_multipart``/``send_multipart`` with
``copy=False``, no decoding). The fabric's echo answers with a ``Result`` holding the
tokens, their logprobs and versions (about 3x the request's payload), so the raw echo
sends the request back plus one pre-built frame of the difference
(``extra["reply_bytes"]``): both carry the same data both ways. The raw client is plain
blocking pyzmq (no asyncio, no bookkeeping): what the fabric would cost if it were
free.

The echo worker serves its socket on the handler's loop (``WorkerConfig.inline``: the echo
never blocks). Engines that may block run on a loop of their own behind the worker's
socket thread and pay two thread hand-offs per request on top of these figures.

Cases
-----
``rtt-small``
    One small request (16 int32 tokens) at a time, client and one echo worker in two
    processes. fastio: ``await client.agenerate(req)``; raw-pyzmq: blocking
    ``send_multipart`` / ``recv_multipart`` of the same encoded bytes to a ROUTER that
    sends them back. Median seconds per round trip. Target: fastio within 2x.
``throughput-2w``
    One client process, two echo worker processes, many requests in flight. fastio:
    ``asyncio.gather`` of N ``agenerate`` calls (the client keeps at most
    ``max_in_flight_per_worker`` = 1024 per worker, so 2048 in flight); raw-pyzmq: the
    same bytes pipelined over two DEALERs with the same window of 2048 (a reply frees a
    slot; replies are drained non-blocking). Median seconds per request
    (``extra["req_per_s"]``). Target: fastio at least 50% of raw.
``rtt@<size>``, ``throughput@<size>``
    The same two measurements for requests whose token array is ``<size>`` bytes
    (int32 tokens; ``size`` is that payload, ``extra["wire_bytes"]`` the whole message):
    64 B, 64 KiB and 1 MiB in quick mode, plus 4 KiB in full mode. ``rtt@64`` and
    ``throughput@64`` are the samples of ``rtt-small`` and ``throughput-2w``.
    Throughput of large requests uses fewer requests, all in flight at once on both
    sides (the raw window equals the request count, below the fabric's in-flight bound).
``inflight-10k``
    10,000 requests submitted at once by one client to two echo workers (run in a
    fresh process so its peak RSS is its own), three rounds: ``extra`` holds the peak
    RSS during the rounds, the RSS before and after each round, and the peak growth per
    in-flight request, to show memory stays bounded. (The client's rid -> worker cache
    keeps up to ``sticky_cache_size`` = 100,000 entries, so RSS creeps up a few MiB per
    round of fresh rids until it is full.)
``pong-idle``, ``pong-busy-4000``
    Pong latency (median is reported; ``extra`` has p50/p99/max and the number of
    pings) of a worker measured by a DEALER pinging every 10 ms: idle, and while two
    reference-engine workers hold 4,000 requests in flight (a load process keeps the
    count up), so the engines keep both cores busy. Target: p99 at most 50 ms.
``pong-stopped-reader``
    An echo worker (on ipc, ``--hwm 1000``) with one peer that sends pings (5,000/s) and never
    reads them, for 30 s (8 s in quick mode): its pongs fill its pipe and then the
    worker's queue for it. ``extra`` holds the other peer's p99 during that window and
    without that peer (same duration, just before), and their ratio. Target: at most 2.

Samples of fastio and raw are interleaved (the machine is shared and noisy: both see
the same noise) and the cyclic GC is paused inside each sample for both.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from bench.common import FASTIO, Measurement
from fastio.tokens import TokenArray

SUITE = "transport"
RAW = "raw-pyzmq"
ROOT = Path(__file__).resolve().parents[1]

# A raw echo ROUTER: what a worker does with no fabric on top.
# A raw echo ROUTER: what a worker does with no fabric on top. It sends each request
# back, plus one frame that makes the reply as large as the fabric's (a Result carries
# tokens, logprobs and versions: about 3x the request's payload). argv[1] maps a
# request's size in bytes (frames after the identity) to that extra size.
_RAW_ECHO = """
import sys, json, zmq
pads = {int(k): zmq.Frame(bytes(v)) for k, v in json.loads(sys.argv[1]).items() if v > 0}
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.SNDHWM, 100000); s.setsockopt(zmq.RCVHWM, 100000)
s.bind("tcp://127.0.0.1:*")
print(json.dumps({"ready": [s.getsockopt_string(zmq.LAST_ENDPOINT)]}), flush=True)
recv, send = s.recv_multipart, s.send_multipart
while True:
    m = recv(copy=False)
    pad = pads.get(sum(len(f) for f in m[1:]))
    if pad is not None:
        m.append(pad)
    send(m, copy=False)
"""


class _Proc:
    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=ROOT, env=env)
        self.address = ""

    def ready(self, timeout: float = 60) -> str:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.p.stdout], [], [], 0.1)[0]:
                self.address = json.loads(self.p.stdout.readline())["ready"][0]
                return self.address
            if self.p.poll() is not None:
                break
        raise RuntimeError("benchmark worker did not start")

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)


def _echo_worker() -> _Proc:
    return _Proc(
        [
            sys.executable,
            "-m",
            "transport.worker",
            "--bind",
            "tcp://127.0.0.1:0",
            "--engine",
            "echo",
        ]
    )


def _raw_worker(pads: dict[int, int] | None = None) -> _Proc:
    return _Proc([sys.executable, "-c", _RAW_ECHO, json.dumps(pads or {})])


def _reply_bytes(n_tokens: int) -> int:
    """Bytes of the fabric's answer to an echo of ``n_tokens`` (a Result as the echo
    handler builds it: the tokens, float32 logprobs and int32 versions)."""
    import fastio
    from fastio import fabric_msgs as fm

    res = fm.Result(
        id=1,
        output_tokens=TokenArray(np.arange(n_tokens, dtype=np.int32)),
        output_logprobs=TokenArray(np.zeros(n_tokens, dtype=np.float32)),
        output_versions=TokenArray(np.zeros(n_tokens, dtype=np.int32)),
    )
    # memoryview: len() of a numpy frame counts its elements, not its bytes.
    return sum(memoryview(f).nbytes for f in fastio.encode(res))


def _request(n_tokens: int, rid: str) -> Any:
    from fastio import LLMRequest

    return LLMRequest(rid=rid, input_ids=TokenArray(np.arange(n_tokens, dtype=np.int32)))


def _wire_bytes(n_tokens: int) -> list[bytes]:
    """The bytes fastio puts on the wire for one small request (what raw pyzmq sends)."""
    import fastio
    from fastio import fabric_msgs as fm

    frames = fastio.encode(fm.Submit(id=1, request=_request(n_tokens, "r" * 32)))
    return [bytes(f) for f in frames]


# -- the two cases, fastio and raw samples interleaved ------------------------------------
# The machine is shared and noisy: alternating a fastio sample with a raw one exposes both
# to the same noise, and medians are compared.


class _RawClient:
    """Blocking DEALERs to raw echo workers: the baseline's client side."""

    def __init__(self, addresses: list[str]) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100000)
            s.setsockopt(zmq.RCVHWM, 100000)
            s.connect(a)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)

    def rtt(self, frames: list[bytes], number: int) -> float:
        s = self.socks[0]
        t0 = time.perf_counter()
        for _ in range(number):
            s.send_multipart(frames, copy=False)
            s.recv_multipart(copy=False)
        return (time.perf_counter() - t0) / number

    def pipelined(self, frames: list[bytes], number: int, window: int) -> float:
        socks = self.socks
        sent = done = k = 0
        t0 = time.perf_counter()
        while sent < min(window, number):
            socks[k % len(socks)].send_multipart(frames, copy=False)
            k += 1
            sent += 1
        while done < number:
            for s, _ in self.poller.poll():
                while True:
                    try:
                        s.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    done += 1
                    if sent < number:
                        s.send_multipart(frames, copy=False)
                        sent += 1
        return (time.perf_counter() - t0) / number

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


class _Case:
    """One payload size: how many round trips and requests, and the raw window."""

    def __init__(self, n_tokens: int, rtt_number: int, tp_number: int, window: int) -> None:
        self.n_tokens = n_tokens
        self.rtt_number = rtt_number
        self.tp_number = tp_number
        self.window = window
        self.frames = _wire_bytes(n_tokens)
        self.request_bytes = sum(len(f) for f in self.frames)
        self.reply_bytes = _reply_bytes(n_tokens)
        # One prompt shared by every request of the case: requests only read it.
        self.ids = TokenArray(np.arange(n_tokens, dtype=np.int32))
        self.samples: dict[str, list[float]] = {
            "rtt-fastio": [], "rtt-raw": [], "tp-fastio": [], "tp-raw": []
        }  # fmt: skip

    def request(self, rid: str) -> Any:
        from fastio import LLMRequest

        return LLMRequest(rid=rid, input_ids=self.ids)


def _interleaved(
    echo_addrs: list[str], raw_addrs: list[str], cases: list[_Case], repeat: int
) -> None:
    from transport import ClientConfig, FabricClient

    raw = _RawClient(raw_addrs)

    async def main() -> None:
        # No streaming: an echo has nothing to stream, and raw pyzmq sends one reply.
        cfg = ClientConfig(stream=False)
        async with FabricClient(echo_addrs[:1], cfg) as one, FabricClient(echo_addrs, cfg) as two:
            req = cases[0].request("rtt")
            for _ in range(200):  # warm-up (and the join)
                await one.agenerate(req)
            while not all(w.alive for w in two.workers):
                await one.agenerate(req)
            raw.rtt(cases[0].frames, 200)
            raw.pipelined(cases[0].frames, 2000, 2048)
            for r in range(repeat):
                for c in cases:
                    out = c.samples
                    req = c.request("rtt")
                    reqs = [c.request(f"{r}-{i}") for i in range(c.tp_number)]
                    # As bench.common.timeit: the cyclic GC is paused inside each sample,
                    # for both implementations (thousands of live tasks make its passes
                    # costly).
                    gc.collect()
                    gc.disable()
                    try:
                        t0 = time.perf_counter()
                        for _ in range(c.rtt_number):
                            await one.agenerate(req)
                        out["rtt-fastio"].append((time.perf_counter() - t0) / c.rtt_number)
                        out["rtt-raw"].append(raw.rtt(c.frames, c.rtt_number))

                        t0 = time.perf_counter()
                        await asyncio.gather(*(two.agenerate(q) for q in reqs))
                        out["tp-fastio"].append((time.perf_counter() - t0) / c.tp_number)
                        out["tp-raw"].append(raw.pipelined(c.frames, c.tp_number, c.window))
                        del reqs
                    finally:
                        gc.enable()

    try:
        asyncio.run(main())
    finally:
        raw.close()


# -- 10k in flight, in its own process -------------------------------------------------
def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets VmHWM (Linux): the peak then covers the rounds only,
    # not the imports before them.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inflight_child(addresses: list[str], n: int, rounds: int) -> dict[str, Any]:
    import resource

    from transport import ClientConfig, FabricClient

    async def main() -> dict[str, Any]:
        async with FabricClient(addresses, ClientConfig(stream=False)) as client:
            while not all(w.alive for w in client.workers):
                await asyncio.sleep(0.01)
            base = _rss_kib()
            reset = _reset_peak_rss()
            after, times, peak_pending = [], [], 0
            for r in range(rounds):
                reqs = [_request(16, f"{r}-{i}") for i in range(n)]
                t0 = time.perf_counter()
                # agenerate submits at once: all n are queued or in flight now.
                tasks = [client.agenerate(q) for q in reqs]
                peak_pending = max(peak_pending, client.pending)
                await asyncio.gather(*tasks)
                times.append(time.perf_counter() - t0)
                del reqs, tasks
                after.append(_rss_kib())
            return {
                "times": times,
                "rss_base_kib": base,
                "rss_after_round_kib": after,
                "peak_rss_kib": _rss_kib("VmHWM")
                if reset
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "in_flight_observed": peak_pending,
            }

    return asyncio.run(main())


def _cases(quick: bool) -> list[_Case]:
    # The first case is the small request of rtt-small / throughput-2w.
    if quick:
        return [
            _Case(16, 300, 3000, 2048),
            _Case(16 * 1024, 100, 400, 400),
            _Case(256 * 1024, 20, 32, 32),
        ]
    return [
        _Case(16, 2000, 20000, 2048),
        _Case(1024, 1000, 10000, 2048),
        _Case(16 * 1024, 500, 2000, 2000),
        _Case(256 * 1024, 100, 128, 128),
    ]


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


def run(quick: bool) -> list[Measurement]:
    """Measure every case (quick: fewer sizes, round trips and requests)."""
    repeat = 7 if quick else 9
    out: list[Measurement] = []

    cases = _cases(quick)
    pads = {c.request_bytes: c.reply_bytes - c.request_bytes for c in cases}
    echo = [_echo_worker(), _echo_worker()]
    raws = [_raw_worker(pads), _raw_worker(pads)]
    try:
        echo_addrs = [p.ready() for p in echo]
        raw_addrs = [p.ready() for p in raws]

        _interleaved(echo_addrs, raw_addrs, cases, repeat)
        for i, c in enumerate(cases):
            payload = c.n_tokens * 4
            unit = {
                "size_unit": "bytes",
                "wire_bytes": c.request_bytes,
                "reply_bytes": c.reply_bytes,
            }
            names = [(f"rtt@{payload}", f"throughput@{payload}")]
            if i == 0:
                names.insert(0, ("rtt-small", "throughput-2w"))
            for rtt_name, tp_name in names:
                for impl, key in ((FASTIO, "rtt-fastio"), (RAW, "rtt-raw")):
                    out.append(
                        Measurement.from_samples(
                            SUITE, rtt_name, impl, payload, c.samples[key], **unit
                        )
                    )
                for impl, key in ((FASTIO, "tp-fastio"), (RAW, "tp-raw")):
                    m = Measurement.from_samples(
                        SUITE, tp_name, impl, payload, c.samples[key], **unit
                    )
                    m.extra["req_per_s"] = round(1 / m.median_s)
                    m.extra["MiB_per_s"] = round(payload / m.median_s / 2**20, 1)
                    out.append(m)

        n = 10_000
        child = subprocess.run(
            [sys.executable, "-c", f"import json, bench.transport as t; print(json.dumps(t._inflight_child({echo_addrs!r}, {n}, 3)))"],
            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300, check=True,
        )  # fmt: skip
        res = json.loads(child.stdout.strip().splitlines()[-1])
        m = Measurement.from_samples(
            SUITE, "inflight-10k", FASTIO, n, [t / n for t in res["times"]], size_unit="requests"
        )
        m.extra.update(
            peak_rss_mib=round(res["peak_rss_kib"] / 1024, 1),
            rss_base_mib=round(res["rss_base_kib"] / 1024, 1),
            rss_after_rounds_mib=[round(x / 1024, 1) for x in res["rss_after_round_kib"]],
            peak_kib_per_request=round((res["peak_rss_kib"] - res["rss_base_kib"]) / n, 2),
            in_flight_observed=res["in_flight_observed"],
        )
        out.append(m)
    finally:
        for p in echo + raws:
            p.kill()
    out += run_pongs(quick)
    return out


if __name__ == "__main__":
    runner = run_pongs if "--pongs" in sys.argv else run
    for m in runner(quick="--full" not in sys.argv):
        print(m.case, m.impl, f"{m.median_s * 1e6:.1f} us", m.extra)
