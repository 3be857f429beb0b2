"""Transport suite: the fabric (client + worker processes, echo handler) against raw
pyzmq DEALER/ROUTER moving the same bytes and a vLLM-style asyncio client, measured in
the same run.

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

Peer (``vllm-style``)
---------------------
:mod:`bench.vllm_style`: an asyncio client in the technique of vLLM V1's
``AsyncMPClient`` (a ``zmq.asyncio`` DEALER per engine, an output-handler task resolving
futures, msgspec with numpy token frames) and a blocking echo engine answering the same
bytes as the fabric's echo. Measured at 1k- and 32k-token prompts (``rtt@4096``,
``rtt@131072`` and their throughputs).

Every round trip and throughput measurement also reports ``extra["cpu_us_per_req"]``:
CPU microseconds per request of the client process and its workers together, over all
samples (less sensitive to a loaded machine than wall time).

Every process of the suite (fastio's, raw pyzmq's and the vLLM-style echo) runs with the
same allocator settings (each opts in with :func:`transport.zmqio.tune_malloc`;
``FASTIO_TUNE_MALLOC=0`` runs all of them on glibc's defaults), so the ratios compare the
fabrics, not malloc.

The echo worker (``--engine bench.echo:engine``: :func:`transport.echo_handler`'s answer,
its fillers shared frames) serves its socket on the handler's loop
(``WorkerConfig.inline``: the echo never blocks). Engines that may block run on a loop of their own behind the worker's
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
    Both hold every reply until the sample's last is in (fastio: ``gather``'s list of
    responses; raw: a list of the received frames), then release it, inside the timing.
    A client that drops each reply at once receives the next into the same cache-hot
    buffer: up to 25% faster at 64 KiB-4 MiB on these machines (it varies by run and
    size), a speed no caller that keeps its replies gets. That figure is still measured, in the same rounds, as raw's
    ``extra["req_per_s_dropping_replies"]``.
``rtt@<size>``, ``throughput@<size>``
    The same two measurements for requests whose token array is ``<size>`` bytes
    (int32 tokens; ``size`` is that payload, ``extra["wire_bytes"]`` the whole message):
    64 B, 4 KiB, 64 KiB, 128 KiB, 256 KiB, 1 MiB and 4 MiB. ``rtt@64`` and
    ``throughput@64`` are the samples of ``rtt-small`` and ``throughput-2w``.
    Throughput of large requests uses fewer requests, all in flight at once on both
    sides (the raw window equals the request count, below the fabric's in-flight bound).
``throughput-2w-gc``
    ``throughput-2w`` with the client's cyclic GC on (every other case pauses it), at
    Python's default thresholds (``fastio-default-gc``) and after
    :func:`transport.tune_gc` (``fastio``), in alternating order; a sample is 4 bursts
    of the ``throughput-2w`` requests, one after another, starting after a full
    collection: what the README's advice to call ``tune_gc`` in a rollout process gains.
``inflight-100k``
    100,000 requests submitted at once by one client to two echo workers
    (:mod:`bench.inflight`; a fresh process so its RSS is its own), two rounds:
    ``extra["client_kib_per_request"]`` is what the client holds per request (its RSS
    growth as it takes them, the caller's requests already built; target at most 2),
    ``peak_kib_per_request`` the peak growth with the caller's requests and the
    responses, ``errors`` the requests that failed (target 0). (The client's rid ->
    worker cache keeps up to ``sticky_cache_size`` = 100,000 entries.)
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

Samples of every implementation are interleaved (the machine is shared and noisy: all
see the same noise; round trips alternate in chunks of 20, a sample being a chunk's
median) and the cyclic GC is paused inside each sample for all.
``python -m bench.transport [--full] [--fabric-only] [--uvloop] [--pongs]`` runs the
suite alone (``--uvloop``: clients and fabric workers on uvloop).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import json
import os
import select
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.codec import VRequest
from bench.common import FASTIO, Measurement
from bench.raw import RAW_ECHO, RawClient
from bench.vllm_style import VLLM
from fastio.tokens import TokenArray
from transport.zmqio import tune_malloc

SUITE = "transport"
RAW = "raw-pyzmq"
ROOT = Path(__file__).resolve().parents[1]


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


def _echo_worker(loop: str = "asyncio") -> _Proc:
    argv = [sys.executable, "-m", "transport.worker", "--bind", "tcp://127.0.0.1:0"]
    engine = ["--engine", "bench.echo:engine"]
    return _Proc([*argv, *engine, *(["--loop", loop] if loop != "asyncio" else [])])


def _raw_worker(pads: dict[int, int] | None = None) -> _Proc:
    return _Proc([sys.executable, "-c", RAW_ECHO, json.dumps(pads or {})])


def _vllm_worker() -> _Proc:
    return _Proc([sys.executable, "-m", "bench.vllm_style"])


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


class _Case:
    """One payload size: how many round trips and requests, the raw window, and whether
    the vLLM-style peer is measured too."""

    def __init__(
        self, n_tokens: int, rtt_number: int, tp_number: int, window: int, peer: bool = False
    ) -> None:
        self.n_tokens = n_tokens
        self.rtt_number = rtt_number
        self.tp_number = tp_number
        self.window = window
        self.peer = peer
        self.frames = _wire_bytes(n_tokens)
        self.request_bytes = sum(len(f) for f in self.frames)
        self.reply_bytes = _reply_bytes(n_tokens)
        # One prompt shared by every request of the case: requests only read it.
        self.ids = TokenArray(np.arange(n_tokens, dtype=np.int32))
        #: Seconds per request of each sample, by "<rtt|tp>-<impl>".
        self.samples: dict[str, list[float]] = defaultdict(list)
        #: CPU seconds of the client and its workers, and requests, over all samples.
        self.cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def request(self, rid: str) -> Any:
        from fastio import LLMRequest

        return LLMRequest(rid=rid, input_ids=self.ids)

    def cpu_us(self, key: str) -> float:
        """CPU microseconds per request, client and workers together."""
        total, n = self.cpu[key]
        return round(total / n * 1e6, 1) if n else float("nan")


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK")


async def _sample(c: _Case, key: str, pids: list[int], n: int, fn: Callable[[], Any]) -> None:
    """Run ``fn`` (``n`` requests; its result awaited if awaitable) as one sample of
    ``key``: seconds per request, and CPU of this process and the workers ``pids``."""
    cpu0 = time.process_time() + sum(_proc_cpu(p) for p in pids)
    t0 = time.perf_counter()
    r = fn()
    if inspect.isawaitable(r):
        await r
        # Released inside the timing, as raw releases the replies it held: what we
        # awaited (for a gather: every response) is held by our name and by the loop
        # callback that resumed us, until that callback ends.
        del r
        await asyncio.sleep(0)
    else:
        del r
    dt = time.perf_counter() - t0
    cpu = time.process_time() + sum(_proc_cpu(p) for p in pids) - cpu0
    c.samples[key].append(dt / n)
    acc = c.cpu[key]
    acc[0] += cpu
    acc[1] += n


def _interleaved(
    workers: dict[str, list[_Proc]], cases: list[_Case], repeat: int, peer: bool, loop: str,
    gc_case: _Case | None = None,
) -> None:  # fmt: skip
    """Samples of every implementation, one after the other, round after round."""
    from bench.vllm_style import VllmStyleClient
    from transport import ClientConfig, FabricClient

    echo_addrs = [p.address for p in workers[FASTIO]]
    raw = RawClient([p.address for p in workers[RAW]])
    pids = {impl: [p.p.pid for p in procs] for impl, procs in workers.items()}

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
            v_one = v_two = None
            if peer:
                v_addrs = [p.address for p in workers[VLLM]]
                v_one, v_two = VllmStyleClient(v_addrs[:1]), VllmStyleClient(v_addrs)
                v_one.start()
                v_two.start()
                vreq = VRequest(rid="rtt", input_ids=cases[0].ids.array)
                for _ in range(200):
                    await v_one.generate(vreq)
                await asyncio.gather(*(v_two.generate(vreq) for _ in range(2000)))
            try:
                for r in range(repeat):
                    for c in cases:
                        await _round(c, r, one, two, raw, v_one, v_two, pids)
                if gc_case is not None:
                    await _gc_rounds(gc_case, repeat, two, pids[FASTIO])
            finally:
                for v in (v_one, v_two):
                    if v is not None:
                        v.close()

    try:
        if loop == "uvloop":
            import uvloop

            uvloop.run(main())
        else:
            asyncio.run(main())
    finally:
        raw.close()


async def _rtt_chunks(c: _Case, rtts: list[tuple[str, list[int], Callable[[], Any]]]) -> None:
    """Round trips of each implementation in alternating chunks of 20; a sample is
    the median round trip of a chunk. Load on a shared machine comes in bursts of
    milliseconds: fine alternation exposes every implementation to the same bursts,
    and medians keep a burst from deciding a sample."""
    done = 0
    while done < c.rtt_number:
        m = min(_RTT_CHUNK, c.rtt_number - done)
        done += m
        for key, pids, one_rtt in rtts:
            cpu0 = time.process_time() + sum(_proc_cpu(p) for p in pids)
            times = []
            for _ in range(m):
                t0 = time.perf_counter()
                r = one_rtt()
                if r is not None:
                    await r
                    r = None  # the reply is released in the next timing, as raw's is in its own
                times.append(time.perf_counter() - t0)
            cpu = time.process_time() + sum(_proc_cpu(p) for p in pids) - cpu0
            c.samples[key].append(float(np.median(times)))
            acc = c.cpu[key]
            acc[0] += cpu
            acc[1] += m


_RTT_CHUNK = 20
# raw pyzmq's throughput when it drops each reply at once (reported, not compared).
_DROPPING = "tp-raw-dropping"


async def _round(
    c: _Case, r: int, one: Any, two: Any, raw: RawClient, v_one: Any, v_two: Any,
    pids: dict[str, list[int]],
) -> None:  # fmt: skip
    """One sample of each implementation, round trip and throughput, for case ``c``."""
    req = c.request("rtt")
    reqs = [c.request(f"{r}-{i}") for i in range(c.tp_number)]
    peer = c.peer and v_one is not None
    if peer:
        vreq = VRequest(rid="rtt", input_ids=c.ids.array)
        vreqs = [VRequest(rid=f"{r}-{i}", input_ids=c.ids.array) for i in range(c.tp_number)]

    rtts: list[tuple[str, list[int], Callable[[], Any]]] = [
        ("rtt-" + FASTIO, pids[FASTIO][:1], lambda: one.agenerate(req)),
        ("rtt-" + RAW, pids[RAW][:1], functools.partial(raw.rtt_once, c.frames)),
    ]
    if peer:
        rtts.append(("rtt-" + VLLM, pids[VLLM][:1], lambda: v_one.generate(vreq)))

    # As bench.common.timeit: the cyclic GC is paused inside each sample, for every
    # implementation (thousands of live tasks make its passes costly).
    gc.collect()
    gc.disable()
    try:
        await _rtt_chunks(c, rtts)
        n = c.tp_number
        await _sample(
            c, "tp-" + FASTIO, pids[FASTIO], n,
            lambda: asyncio.gather(*(two.agenerate(q) for q in reqs)),
        )  # fmt: skip
        await _sample(c, "tp-" + RAW, pids[RAW], n, lambda: raw.pipelined(c.frames, n, c.window))
        await _sample(
            c, _DROPPING, pids[RAW], n, lambda: raw.pipelined(c.frames, n, c.window, hold=False)
        )  # fmt: skip
        if peer:
            await _sample(
                c, "tp-" + VLLM, pids[VLLM], n,
                lambda: asyncio.gather(*(v_two.generate(q) for q in vreqs)),
            )  # fmt: skip
    finally:
        gc.enable()


async def _gc_rounds(c: _Case, repeat: int, two: Any, pids: list[int]) -> None:
    """``throughput-2w-gc``: the small throughput with the client's cyclic GC on, at
    Python's default thresholds (``fastio-default-gc``) and after
    :func:`transport.tune_gc` (``fastio``), alternated."""
    from transport.collector import GC_THRESHOLD

    reqs = [c.request(f"gc-{i}") for i in range(c.tp_number)]
    before = gc.get_threshold()
    try:
        for r in range(repeat):
            for key in (_DEFAULT_GC, FASTIO)[:: 1 if r % 2 else -1]:
                # tune_gc's setting (set here: FASTIO_TUNE_GC=0 must not change the
                # case), or CPython 3.11-3.13's defaults.
                gc.set_threshold(GC_THRESHOLD if key == FASTIO else 700, 10, 10)
                gc.collect()  # both start from empty generations
                await _sample(c, key, pids, _GC_BURSTS * c.tp_number, lambda: _bursts(two, reqs))
    finally:
        gc.set_threshold(*before)


_DEFAULT_GC = "fastio-default-gc"
# Bursts per sample: a rollout process sends one after another, and the full passes
# come once enough survivors of earlier bursts have piled up.
_GC_BURSTS = 4


async def _bursts(two: Any, reqs: list[Any]) -> None:
    for _ in range(_GC_BURSTS):
        await asyncio.gather(*(two.agenerate(q) for q in reqs))
        await asyncio.sleep(0)  # release the responses, as a caller done with them


def _gc_measurements(c: _Case) -> list[Measurement]:
    unit = {"size_unit": "bytes", "wire_bytes": c.request_bytes, "reply_bytes": c.reply_bytes}
    out = []
    for impl in (FASTIO, _DEFAULT_GC):
        m = Measurement.from_samples(
            SUITE, "throughput-2w-gc", impl, c.n_tokens * 4, c.samples[impl], **unit
        )
        m.extra["req_per_s"] = round(1 / m.median_s)
        m.extra["cpu_us_per_req"] = c.cpu_us(impl)
        out.append(m)
    return out


def _cases(quick: bool) -> list[_Case]:
    # The first case is the small request of rtt-small / throughput-2w. The vLLM-style
    # peer is measured at 1k- and 32k-token prompts.
    if quick:
        return [
            _Case(16, 300, 3000, 2048),
            _Case(1024, 200, 1000, 1000, peer=True),
            _Case(16 * 1024, 100, 400, 400),
            _Case(32 * 1024, 60, 200, 200, peer=True),
            _Case(64 * 1024, 40, 100, 100),
            _Case(256 * 1024, 20, 32, 32),
            _Case(1024 * 1024, 6, 12, 12),
        ]
    return [
        _Case(16, 2000, 20000, 2048),
        _Case(1024, 1000, 10000, 2048, peer=True),
        _Case(16 * 1024, 500, 2000, 2000),
        _Case(32 * 1024, 300, 1000, 1000, peer=True),
        _Case(64 * 1024, 200, 500, 500),
        _Case(256 * 1024, 100, 128, 128),
        _Case(1024 * 1024, 20, 32, 32),
    ]


def _measurements(cases: list[_Case]) -> list[Measurement]:
    out = []
    for i, c in enumerate(cases):
        payload = c.n_tokens * 4
        unit = {"size_unit": "bytes", "wire_bytes": c.request_bytes, "reply_bytes": c.reply_bytes}
        names = [(f"rtt@{payload}", f"throughput@{payload}")]
        if i == 0:
            names.insert(0, ("rtt-small", "throughput-2w"))
        impls = [FASTIO, RAW, *([VLLM] if c.samples.get("rtt-" + VLLM) else [])]
        for rtt_name, tp_name in names:
            for impl in impls:
                m = Measurement.from_samples(
                    SUITE, rtt_name, impl, payload, c.samples["rtt-" + impl], **unit
                )
                m.extra["cpu_us_per_req"] = c.cpu_us("rtt-" + impl)
                out.append(m)
            for impl in impls:
                m = Measurement.from_samples(
                    SUITE, tp_name, impl, payload, c.samples["tp-" + impl], **unit
                )
                m.extra["req_per_s"] = round(1 / m.median_s)
                m.extra["MiB_per_s"] = round(payload / m.median_s / 2**20, 1)
                m.extra["cpu_us_per_req"] = c.cpu_us("tp-" + impl)
                if impl == RAW and c.samples.get(_DROPPING):
                    drop = float(np.median(c.samples[_DROPPING]))
                    m.extra["req_per_s_dropping_replies"] = round(1 / drop)
                out.append(m)
    return out


def run(quick: bool, fabric_only: bool = False, loop: str = "asyncio") -> list[Measurement]:
    """Measure every case (quick: fewer sizes, round trips and requests;
    ``fabric_only``: the round trips and throughputs, not in-flight memory or pongs;
    ``loop``: the event loop of the clients and the fabric's workers, asyncio or
    uvloop)."""
    tune_malloc()  # the client's process, as the workers' (bench.echo, bench.raw)
    repeat = 7 if quick else 9
    out: list[Measurement] = []

    cases = _cases(quick)
    pads = {c.request_bytes: c.reply_bytes - c.request_bytes for c in cases}
    workers = {
        FASTIO: [_echo_worker(loop), _echo_worker(loop)],
        RAW: [_raw_worker(pads), _raw_worker(pads)],
        VLLM: [_vllm_worker(), _vllm_worker()],
    }
    procs = [p for ps in workers.values() for p in ps]
    try:
        for p in procs:
            p.ready()
        gc_case = None if fabric_only else _Case(16, 0, cases[0].tp_number, cases[0].window)
        _interleaved(workers, cases, repeat, peer=True, loop=loop, gc_case=gc_case)
        out += _measurements(cases)
        if gc_case is not None:
            out += _gc_measurements(gc_case)
        if not fabric_only:
            from bench.inflight import inflight

            out.append(inflight([p.address for p in workers[FASTIO]], 100_000, 2))
    finally:
        for p in procs:
            p.kill()
    if not fabric_only:
        from bench.pongs import run_pongs

        out += run_pongs(quick)
    return out


if __name__ == "__main__":
    from bench.pongs import run_pongs

    quick = "--full" not in sys.argv
    if "--pongs" in sys.argv:
        ms = run_pongs(quick)
    else:
        loop = "uvloop" if "--uvloop" in sys.argv else "asyncio"
        ms = run(quick, fabric_only="--fabric-only" in sys.argv, loop=loop)
    for m in ms:
        print(m.case, m.impl, f"{m.median_s * 1e6:.1f} us", m.extra)
