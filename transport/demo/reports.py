"""What the demo's children report to it (msgspec msgpack over PUSH/PULL, no pickle),
and what it makes of them: the run's state, the display, the summary and the verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from transport.sockets import make_socket


class ClientReport(msgspec.Struct, tag="client"):
    """Figures of one rollout client process: counters are cumulative, the sample lists
    (latencies, ttfts, itls) hold only what is new since the previous report.
    ``unfinished``: in flight when the client was told to stop (cut, not failed);
    ``stale``: late answers dropped (a re-sent request answered twice)."""

    client: int
    sent: int = 0
    done: int = 0
    failed: int = 0
    unfinished: int = 0
    tokens: int = 0
    latencies: list[float] = msgspec.field(default_factory=list)
    ttfts: list[float] = msgspec.field(default_factory=list)
    itls: list[float] = msgspec.field(default_factory=list)
    interrupted: int = 0
    multi_version: int = 0
    resent: int = 0
    died: int = 0
    stale: int = 0
    final: bool = False


class UpdateReport(msgspec.Struct, tag="update"):
    """One weight update by the trainer. ``failed``: workers up that did not apply it
    (what the run promised); ``skipped``: down when it began (they catch up when back);
    ``lost``: died during it (gone, or another incarnation after it)."""

    version: int
    seconds: float
    ok: bool = True
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    loss: float = 0.0
    nbytes: int = 0
    skipped: list[str] = msgspec.field(default_factory=list)
    lost: list[str] = msgspec.field(default_factory=list)


class FinalCheck(msgspec.Struct, tag="final"):
    """The trainer's end-of-run check: ``workers``, worker id -> its weights' digest for
    each that answered; ``equal``: every one holds the trainer's (and there is one at
    least); ``down``: the workers that did not answer (dead, or restarting)."""

    version: int
    trainer_digest: str
    workers: dict[str, str]
    equal: bool
    down: list[str] = msgspec.field(default_factory=list)


class WorkerEvent(msgspec.Struct):
    """A worker's death or return ``at`` seconds into the run (``kind`` "died" or "back";
    ``detail``: how it died or which restart it is; ``chaos``: killed by --chaos)."""

    worker: str
    at: float
    kind: str
    detail: str = ""
    chaos: bool = False


Report = ClientReport | UpdateReport | FinalCheck
REPORT_DECODER = msgspec.msgpack.Decoder(Report)
_SAMPLES = ("latencies", "ttfts", "itls")


@dataclass
class RunState:
    clients: dict[int, ClientReport] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in _SAMPLES})
    updates: list[UpdateReport] = field(default_factory=list)
    final: FinalCheck | None = None
    started: float = field(default_factory=time.perf_counter)
    events: list[WorkerEvent] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(int(getattr(r, name)) for r in self.clients.values())

    def take(self, msg: Report) -> None:
        """Fold one child's report into the run's state."""
        if isinstance(msg, ClientReport):
            self.clients[msg.client] = msg
            for k in _SAMPLES:
                self.samples[k] += getattr(msg, k)
        elif isinstance(msg, UpdateReport):
            self.updates.append(msg)
        else:
            self.final = msg

    @property
    def version(self) -> int:
        return self.updates[-1].version if self.updates else 0


class ReportSender:
    """A child's PUSH socket to the demo process's report socket at ``address``."""

    def __init__(self, address: str) -> None:
        self.zctx = zmq.Context()
        self.push = make_socket(self.zctx, zmq.PUSH, hwm=None, max_message_size=None)
        self.push.connect(address)

    def send(self, rep: Report) -> None:
        self.push.send(msgspec.msgpack.encode(rep))
        if isinstance(rep, ClientReport):  # the sample lists carry only what is new
            for k in _SAMPLES:
                getattr(rep, k).clear()

    def close(self) -> None:
        self.zctx.destroy(linger=2000)  # the last report still reaches the demo process


def _ms(values: list[float], *qs: float, digits: int = 0) -> str:
    pct = [float(np.percentile(values, q)) if values else float("nan") for q in qs]
    return " / ".join(f"{p * 1e3:.{digits}f}" for p in pct) + " ms"


def summary_rows(st: RunState, elapsed: float) -> list[tuple[str, str]]:
    done, secs, s = st.total("done"), max(elapsed, 1e-9), st.samples
    rows = [
        ("elapsed", f"{elapsed:.1f} s"),
        ("requests done / failed", f"{done} / {st.total('failed')}"),
        ("requests sent / cut at stop", f"{st.total('sent')} / {st.total('unfinished')}"),
        ("requests/s", f"{done / secs:.1f}"),
        ("tokens/s", f"{st.total('tokens') / secs:.0f}"),
        ("latency p50 / p90 / p99", _ms(s["latencies"], 50, 90, 99)),
        ("ttft p50 / p99", _ms(s["ttfts"], 50, 99, digits=1)),
        ("itl mean p50", _ms(s["itls"], 50, digits=2)),
        ("interrupted (resumed) chunks", str(st.total("interrupted"))),
        ("responses spanning >1 weight version", str(st.total("multi_version"))),
        ("re-sent after worker loss", str(st.total("resent"))),
        ("late duplicate answers dropped", str(st.total("stale"))),
        ("workers declared dead (sum over clients)", str(st.total("died"))),
    ]
    deaths = sum(e.kind == "died" for e in st.events)
    rows.append(("workers lost / restarted", f"{deaths} / {len(st.events) - deaths}"))
    for e in st.events:
        how = f"{e.detail}{' (--chaos)' if e.chaos else ''}"
        rows.append((f"  {e.worker} {e.kind}", f"at {e.at:.1f} s: {how}"))
    rows.append(("weight version", str(st.version)))
    if st.updates:
        mib = st.updates[-1].nbytes / 2**20
        rows.append(("weight update (pause+publish+apply+resume)", f"{mib:.1f} MiB per version"))
    for u in st.updates[-8:]:
        notes = [f"FAILED {u.failed}"] if u.failed else []
        notes += [f"lost {', '.join(u.lost)}"] if u.lost else []
        notes += [f"without {', '.join(u.skipped)} (down)"] if u.skipped else []
        rows.append((f"  v{u.version}", "; ".join([f"{u.seconds * 1e3:.0f} ms", *notes])))
    if (f := st.final) is not None:
        down = f", down: {', '.join(f.down)}" if f.down else ""
        alive = f" (v{f.version}, {len(f.workers)} workers alive{down})"
        rows.append(("workers' weights == trainer's", ("yes" if f.equal else "NO") + alive))
    return rows


def verdict(st: RunState, early: bool) -> str:
    """Why the run failed ("" when it did not): a request not answered exactly once, an
    update not applied by a worker up through it, the weights of the workers alive at
    the end not the trainer's, or a worker that failed by itself (one killed by a signal
    breaks no promise: its requests are re-sent and it catches up when restarted)."""
    failed, unreported = st.total("failed"), sorted(c for c, r in st.clients.items() if not r.final)
    unaccounted = st.total("sent") - st.total("done") - st.total("unfinished")
    bad_updates, f = [u.version for u in st.updates if not u.ok], st.final
    reasons = [
        (early, "a client or the trainer exited early"),
        (st.crashed, f"worker(s) failed by themselves: {', '.join(st.crashed)}"),
        (st.total("done") == 0, "no request completed"),
        (unreported, f"client(s) {unreported} sent no final report"),
        (failed, f"{failed} request(s) failed"),
        (unaccounted, f"{unaccounted} request(s) neither answered nor in flight at the stop"),
        (bad_updates, f"weight update(s) failed: versions {bad_updates}"),
        (f is None, "the trainer did not report its final weight check"),
        (f and not f.equal and not f.workers, "no worker was alive at the end"),
        (f and not f.equal, "the workers' weights differ from the trainer's"),
    ]
    return next((why for bad, why in reasons if bad), "")


class Display:
    """A live table on a terminal, a progress line every ``interval`` seconds elsewhere
    (a log, CI)."""

    def __init__(self, live: bool, interval: float = 5.0) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self.live = Live(console=self.console, refresh_per_second=4, transient=True)
        self.live_on, self.interval, self._next = live, interval, 0.0

    def print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def table(rows: list[tuple[str, str]], title: str) -> Any:
        from rich.table import Table

        t = Table("metric", title=title)
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(k, v)
        return t

    def __enter__(self) -> Display:
        self._next = time.monotonic() + self.interval
        if self.live_on:
            self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.stop()

    def update(self, st: RunState) -> None:
        elapsed = time.perf_counter() - st.started
        if self.live_on:
            self.live.update(self.table(summary_rows(st, elapsed), "running (Ctrl-C stops)"))
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        done, secs = st.total("done"), max(elapsed, 1e-9)
        # Each client declares a dead worker on its own: count the workers instead.
        dead = len({e.worker for e in st.events if e.kind == "died"})
        self.print(
            f"[{elapsed:5.0f} s] done {done} ({done / secs:.1f}/s), "
            f"failed {st.total('failed')}, {st.total('tokens') / secs:.0f} tok/s, "
            f"version {st.version}, re-sent {st.total('resent')}, workers dead {dead}, "
            f"restarted {sum(e.kind == 'back' for e in st.events)}"
        )

    def summary(self, st: RunState, elapsed: float) -> None:
        self.console.print(self.table(summary_rows(st, elapsed), "fastio demo summary"))
