"""The demo's display: a live table on a terminal, progress lines elsewhere."""

from __future__ import annotations

import time
from typing import Any

from transport.demo.reports import RunState, summary_rows


class Display:
    """rich when it is installed, plain lines otherwise; a live table on a terminal, a
    progress line every few seconds elsewhere (a log, CI)."""

    def __init__(self, live: bool, interval: float = 5.0) -> None:
        try:
            from fastio._optional import require

            self.rich: Any = require("rich.console", "demo", "the demo's tables")
            require("rich.table", "demo")
            require("rich.live", "demo")
        except ImportError:
            self.rich = None
        self.console = self.rich.Console() if self.rich is not None else None
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
        if self.rich is None:
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
