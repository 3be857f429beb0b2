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


def inflight(echo_addrs: list[str], n: int) -> Measurement:
    """The in-flight case: ``n`` requests submitted at once, in a fresh process."""
    child = subprocess.run(
        [sys.executable, "-c", f"import json, bench.inflight as t; print(json.dumps(t._inflight_child({echo_addrs!r}, {n}, 3)))"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300, check=True,
    )  # fmt: skip
    res = json.loads(child.stdout.strip().splitlines()[-1])
    m = Measurement.from_samples(
        SUITE, f"inflight-{n // 1000}k", FASTIO, n, [t / n for t in res["times"]],
        size_unit="requests",
    )  # fmt: skip
    m.extra.update(
        peak_rss_mib=round(res["peak_rss_kib"] / 1024, 1),
        rss_base_mib=round(res["rss_base_kib"] / 1024, 1),
        rss_after_rounds_mib=[round(x / 1024, 1) for x in res["rss_after_round_kib"]],
        peak_kib_per_request=round((res["peak_rss_kib"] - res["rss_base_kib"]) / n, 2),
        in_flight_observed=res["in_flight_observed"],
    )
    return m
