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
    hold only what is new since the previous report (so reports stay small)."""

    client: int
    #: Requests handed to the client (``agenerate`` calls started).
    sent: int = 0
    done: int = 0
    failed: int = 0
    #: Requests still in flight when the client was told to stop (cut, not failed).
    unfinished: int = 0
    tokens: int = 0
    latencies: list[float] = msgspec.field(default_factory=list)
    ttfts: list[float] = msgspec.field(default_factory=list)
    itls: list[float] = msgspec.field(default_factory=list)
    interrupted: int = 0
    multi_version: int = 0
    resent: int = 0
    died: int = 0
    #: Late answers the client dropped (a re-sent request answered twice).
    stale: int = 0
    final: bool = False


class UpdateReport(msgspec.Struct, tag="update"):
    """One weight update done by the trainer."""

    version: int
    seconds: float
    ok: bool = True
    #: Workers that were up and did not apply the version: what the run promised.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    loss: float = 0.0
    nbytes: int = 0
    #: Workers down when the update began: left out (they catch up when back).
    skipped: list[str] = msgspec.field(default_factory=list)
    #: Workers that died during the update (gone or another incarnation after it).
    lost: list[str] = msgspec.field(default_factory=list)


class FinalCheck(msgspec.Struct, tag="final"):
    """The trainer's end-of-run check of the weights of every worker alive then."""

    version: int
    trainer_digest: str
    #: Worker id -> its weights' digest, for each worker that answered at the end.
    workers: dict[str, str]
    #: Every answering worker holds the trainer's weights (and there is one at least).
    equal: bool
    #: Worker addresses that did not answer at the end (dead, or restarting).
    down: list[str] = msgspec.field(default_factory=list)


class WorkerEvent(msgspec.Struct):
    """A worker's death or return ``at`` seconds into the run, as the demo process saw it
    (``kind`` "died" or "back"; ``detail``: how it died or which restart it is)."""

    worker: str
    at: float
    kind: str
    detail: str = ""
    chaos: bool = False  # killed by --chaos


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
    events: list[WorkerEvent] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(int(getattr(r, name)) for r in self.clients.values())

    def take(self, msg: Report) -> None:
        """Fold one child's report into the run's state."""
        if isinstance(msg, ClientReport):
            self.clients[msg.client] = msg
            self.latencies += msg.latencies
            self.ttfts += msg.ttfts
            self.itls += msg.itls
        elif isinstance(msg, UpdateReport):
            self.updates.append(msg)
        else:
            self.final = msg


class ReportSender:
    """A child's PUSH socket to the demo process's report socket at ``address``."""

    def __init__(self, address: str) -> None:
        self.zctx = zmq.Context()
        # Linger: the last report still reaches the demo process after close().
        self.push = make_socket(
            self.zctx, zmq.PUSH, hwm=None, max_message_size=None, options={zmq.LINGER: 2000}
        )
        self.push.connect(address)

    def send(self, rep: Report) -> None:
        self.push.send(REPORT_ENCODER.encode(rep))
        if isinstance(rep, ClientReport):  # the sample lists carry only what is new
            rep.latencies.clear()
            rep.ttfts.clear()
            rep.itls.clear()

    def close(self) -> None:
        self.push.close()
        self.zctx.term()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary_rows(st: RunState, elapsed: float) -> list[tuple[str, str]]:
    done, toks = st.total("done"), st.total("tokens")
    lat, ttft, itl = st.latencies, st.ttfts, st.itls
    rows = [
        ("elapsed", f"{elapsed:.1f} s"),
        ("requests done / failed", f"{done} / {st.total('failed')}"),
        ("requests sent / cut at stop", f"{st.total('sent')} / {st.total('unfinished')}"),
        ("requests/s", f"{done / max(elapsed, 1e-9):.1f}"),
        ("tokens/s", f"{toks / max(elapsed, 1e-9):.0f}"),
        (
            "latency p50 / p90 / p99",
            f"{_pct(lat, 50) * 1e3:.0f} / {_pct(lat, 90) * 1e3:.0f} / {_pct(lat, 99) * 1e3:.0f} ms",
        ),
        ("ttft p50 / p99", f"{_pct(ttft, 50) * 1e3:.1f} / {_pct(ttft, 99) * 1e3:.1f} ms"),
        ("itl mean p50", f"{_pct(itl, 50) * 1e3:.2f} ms"),
        ("interrupted (resumed) chunks", str(st.total("interrupted"))),
        ("responses spanning >1 weight version", str(st.total("multi_version"))),
        ("re-sent after worker loss", str(st.total("resent"))),
        ("late duplicate answers dropped", str(st.total("stale"))),
        ("workers declared dead (sum over clients)", str(st.total("died"))),
    ]
    deaths = [e for e in st.events if e.kind == "died"]
    backs = [e for e in st.events if e.kind == "back"]
    rows.append(("workers lost / restarted", f"{len(deaths)} / {len(backs)}"))
    for e in st.events:
        how = f"{e.detail}{' (--chaos)' if e.chaos else ''}"
        rows.append((f"  {e.worker} {e.kind}", f"at {e.at:.1f} s: {how}"))
    rows.append(("weight version", str(st.updates[-1].version if st.updates else 0)))
    if st.updates:
        mib = st.updates[-1].nbytes / 2**20
        rows.append(("weight update (pause+publish+apply+resume)", f"{mib:.1f} MiB per version"))
    for u in st.updates[-8:]:
        notes = [f"FAILED {u.failed}"] if u.failed else []
        notes += [f"lost {', '.join(u.lost)}"] if u.lost else []
        notes += [f"without {', '.join(u.skipped)} (down)"] if u.skipped else []
        rows.append(
            (f"  v{u.version}", f"{u.seconds * 1e3:.0f} ms" + "".join(f"; {n}" for n in notes))
        )
    if st.final is not None:
        down = f", down: {', '.join(st.final.down)}" if st.final.down else ""
        rows.append(
            (
                "workers' weights == trainer's",
                ("yes" if st.final.equal else "NO")
                + f" (v{st.final.version}, {len(st.final.workers)} workers alive{down})",
            )
        )
    return rows


def verdict(st: RunState, early: bool) -> str:
    """Why the run failed ("" when it did not): a request not answered exactly once, an
    update not applied by a worker up through it, the weights of the workers alive at
    the end not the trainer's, or a worker that failed by itself (one killed by a signal
    breaks no promise: its requests are re-sent and it catches up when restarted)."""
    if early:
        return "a client or the trainer exited early"
    if st.crashed:
        return f"worker(s) failed by themselves: {', '.join(st.crashed)}"
    if st.total("done") == 0:
        return "no request completed"
    unreported = sorted(c for c, r in st.clients.items() if not r.final)
    if unreported:
        return f"client(s) {unreported} sent no final report"
    if st.total("failed"):
        return f"{st.total('failed')} request(s) failed"
    unaccounted = st.total("sent") - st.total("done") - st.total("unfinished")
    if unaccounted:
        return f"{unaccounted} request(s) neither answered nor in flight at the stop"
    failed = [u.version for u in st.updates if not u.ok]
    if failed:
        return f"weight update(s) failed: versions {failed}"
    if st.final is None:
        return "the trainer did not report its final weight check"
    if not st.final.equal:
        if not st.final.workers:
            return "no worker was alive at the end"
        return "the workers' weights differ from the trainer's"
    return ""


class Display:
    """rich when it is installed, plain lines otherwise; a live table on a terminal, a
    progress line every few seconds elsewhere (a log, CI)."""

    def __init__(self, live: bool, interval: float = 5.0) -> None:
        try:
            import rich.console
            import rich.live
            import rich.table

            self.console: Any = rich.console.Console()
        except ImportError:
            self.console = None
        self.live = live and self.console is not None
        self.interval = interval
        self._next = time.monotonic() + interval
        self._live: Any = None

    def print(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def table(self, rows: list[tuple[str, str]], title: str) -> Any:
        if self.console is None:
            width = max(len(k) for k, _ in rows)
            return "\n".join([title, *(f"{k:<{width}} │ {v}" for k, v in rows)])
        from rich.table import Table

        t = Table(title=title, show_header=True)
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(k, v)
        return t

    def __enter__(self) -> Display:
        self._next = time.monotonic() + self.interval
        if self.live:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, st: RunState) -> None:
        elapsed = time.perf_counter() - st.started
        if self._live is not None:
            self._live.update(self.table(summary_rows(st, elapsed), "running (Ctrl-C stops)"))
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        done = st.total("done")
        # Each client declares a dead worker on its own: count the workers instead.
        dead = len({e.worker for e in st.events if e.kind == "died"})
        self.print(
            f"[{elapsed:5.0f} s] done {done} ({done / max(elapsed, 1e-9):.1f}/s), "
            f"failed {st.total('failed')}, {st.total('tokens') / max(elapsed, 1e-9):.0f} tok/s, "
            f"version {st.updates[-1].version if st.updates else 0}, "
            f"re-sent {st.total('resent')}, workers dead {dead}, "
            f"restarted {sum(e.kind == 'back' for e in st.events)}"
        )

    def summary(self, st: RunState, elapsed: float) -> None:
        t = self.table(summary_rows(st, elapsed), "fastio demo summary")
        if self.console is not None:
            self.console.print(t)
        else:
            print(t, flush=True)
