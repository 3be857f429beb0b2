"""The in-flight case of the transport suite: ``n`` requests submitted at once by one
client to the echo workers, in a fresh process so that its peak RSS is its own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import FASTIO, Measurement
from bench.transport import ROOT, SUITE, _request

__all__ = ["inflight"]


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
            after, times, held, peak_pending, errors = [], [], [], 0, 0
            for r in range(rounds):
                reqs = [_request(16, f"{r}-{i}") for i in range(n)]
                built = _rss_kib()
                t0 = time.perf_counter()
                # agenerate submits at once: all n are queued or in flight now.
                tasks = [client.agenerate(q) for q in reqs]
                # What the client holds for them (the caller's requests not counted).
                held.append(_rss_kib() - built)
                peak_pending = max(peak_pending, client.pending)
                got = await asyncio.gather(*tasks, return_exceptions=True)
                times.append(time.perf_counter() - t0)
                errors += sum(isinstance(x, BaseException) for x in got)
                del reqs, tasks, got
                after.append(_rss_kib())
            return {
                "times": times,
                "rss_base_kib": base,
                "rss_after_round_kib": after,
                "held_kib": held,
                "peak_rss_kib": _rss_kib("VmHWM")
                if reset
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "in_flight_observed": peak_pending,
                "errors": errors,
            }

    return asyncio.run(main())


def inflight(echo_addrs: list[str], n: int, rounds: int = 3) -> Measurement:
    """The in-flight case: ``n`` requests submitted at once, in a fresh process.

    ``extra``: ``client_kib_per_request``, what the client holds per request in flight
    (its RSS growth as it submits them, the caller's requests already built; the
    largest over the rounds); ``peak_kib_per_request``, the peak RSS growth over the
    rounds per request, the caller's requests and the responses included; errors.
    """
    child = subprocess.run(
        [sys.executable, "-c", f"import json, bench.inflight as t; print(json.dumps(t._inflight_child({echo_addrs!r}, {n}, {rounds})))"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600, check=True,
    )  # fmt: skip
    res = json.loads(child.stdout.strip().splitlines()[-1])
    m = Measurement.from_samples(
        SUITE, f"inflight-{n // 1000}k", FASTIO, n, [t / n for t in res["times"]],
        size_unit="requests",
    )  # fmt: skip
    m.extra.update(
        client_kib_per_request=round(max(res["held_kib"]) / n, 2),
        peak_kib_per_request=round((res["peak_rss_kib"] - res["rss_base_kib"]) / n, 2),
        peak_rss_mib=round(res["peak_rss_kib"] / 1024, 1),
        rss_base_mib=round(res["rss_base_kib"] / 1024, 1),
        rss_after_rounds_mib=[round(x / 1024, 1) for x in res["rss_after_round_kib"]],
        in_flight_observed=res["in_flight_observed"],
        errors=res["errors"],
    )
    return m
