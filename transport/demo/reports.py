"""What the demo's children report to it (msgspec msgpack over PUSH/PULL, no pickle),
and what it makes of them: the run's state, the summary rows and the verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import numpy as np


class ClientReport(msgspec.Struct, tag="client"):
    """Figures of one rollout client process: counters are cumulative, the sample lists
    hold only what is new since the previous report (so reports stay small)."""

    client: int
    done: int = 0
    failed: int = 0
    tokens: int = 0
    latencies: list[float] = msgspec.field(default_factory=list)
    ttfts: list[float] = msgspec.field(default_factory=list)
    itls: list[float] = msgspec.field(default_factory=list)
    interrupted: int = 0
    multi_version: int = 0
    resent: int = 0
    died: int = 0
    final: bool = False


class UpdateReport(msgspec.Struct, tag="update"):
    """One weight update done by the trainer."""

    version: int
    seconds: float
    ok: bool = True
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    loss: float = 0.0
    nbytes: int = 0


class FinalCheck(msgspec.Struct, tag="final"):
    """The trainer's end-of-run check of every worker's weights."""

    version: int
    trainer_digest: str
    workers: dict[str, str]
    equal: bool


Report = ClientReport | UpdateReport | FinalCheck
REPORT_ENCODER = msgspec.msgpack.Encoder()
REPORT_DECODER = msgspec.msgpack.Decoder(Report)


@dataclass
class RunState:
    clients: dict[int, ClientReport] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    updates: list[UpdateReport] = field(default_factory=list)
    final: FinalCheck | None = None
    started: float = field(default_factory=time.perf_counter)

    def total(self, name: str) -> int:
        return sum(int(getattr(r, name)) for r in self.clients.values())


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary_rows(st: RunState, elapsed: float) -> list[tuple[str, str]]:
    done, toks = st.total("done"), st.total("tokens")
    lat, ttft, itl = st.latencies, st.ttfts, st.itls
    rows = [
        ("elapsed", f"{elapsed:.1f} s"),
        ("requests done / failed", f"{done} / {st.total('failed')}"),
        ("requests/s", f"{done / max(elapsed, 1e-9):.1f}"),
        ("tokens/s", f"{toks / max(elapsed, 1e-9):.0f}"),
        (
            "latency p50 / p90 / p99",
            f"{pct(lat, 50) * 1e3:.0f} / {pct(lat, 90) * 1e3:.0f} / {pct(lat, 99) * 1e3:.0f} ms",
        ),
        ("ttft p50 / p99", f"{pct(ttft, 50) * 1e3:.1f} / {pct(ttft, 99) * 1e3:.1f} ms"),
        ("itl mean p50", f"{pct(itl, 50) * 1e3:.2f} ms"),
        ("interrupted (resumed) chunks", str(st.total("interrupted"))),
        ("responses spanning >1 weight version", str(st.total("multi_version"))),
        ("re-sent after worker loss", str(st.total("resent"))),
        ("workers declared dead", str(st.total("died"))),
        ("weight version", str(st.updates[-1].version if st.updates else 0)),
    ]
    if st.updates:
        mib = st.updates[-1].nbytes / 2**20
        rows.append(("weight update (pause+publish+apply+resume)", f"{mib:.1f} MiB per version"))
    for u in st.updates[-8:]:
        rows.append(
            (
                f"  v{u.version}",
                f"{u.seconds * 1e3:.0f} ms" + ("" if u.ok else f" FAILED {u.failed}"),
            )
        )
    if st.final is not None:
        rows.append(
            (
                "workers' weights == trainer's",
                ("yes" if st.final.equal else "NO")
                + f" (v{st.final.version}, {len(st.final.workers)} workers)",
            )
        )
    return rows


def verdict(st: RunState, early: bool) -> str:
    """Why the run failed ("" when it did not)."""
    if early:
        return "a process exited early"
    if st.total("done") == 0:
        return "no request completed"
    failed = [u.version for u in st.updates if not u.ok]
    if failed:
        return f"weight update(s) failed: versions {failed}"
    if st.final is None:
        return "the trainer did not report its final weight check"
    if not st.final.equal:
        return "the workers' weights differ from the trainer's"
    return ""
