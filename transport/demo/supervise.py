"""The demo's generation workers under supervision: a worker that dies is reported and
started again on its address (its clients reconnect, its subscriber catches up), and
``--chaos`` kills one on purpose."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transport.demo.children import log_tail, read_ready, spawn, stop_all, worker_cmd
from transport.demo.config import DemoConfig
from transport.demo.reports import WorkerEvent

__all__ = ["MAX_RESTARTS", "WorkerPool"]

#: Restarts of one worker before it is left down (a worker that keeps dying as it
#: starts is broken, not unlucky).
MAX_RESTARTS = 3
#: Seconds a restarted worker has to say it is ready (a model to load, on busy cores).
RESTART_TIMEOUT = 300.0


@dataclass
class _Worker:
    name: str
    log: Path
    proc: subprocess.Popen[bytes]
    address: str = ""
    restarts: int = 0
    #: Since when it is starting again (None: up, or down for good).
    starting_since: float | None = None
    ready_buf: bytes = b""
    chaos: bool = False
    down: bool = False


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    return f"exit status {code}"


class WorkerPool:
    """The workers of one demo run.

    ``say`` prints a line for the person watching; :attr:`events` records each death and
    return (for the summary); :attr:`crashed` names the workers that failed by
    themselves (a nonzero exit status, not a signal): that fails the run.
    """

    def __init__(self, c: DemoConfig, tmp: Path, say: Callable[[str], None]) -> None:
        self._config, self._tmp, self._say = c, tmp, say
        self.workers: list[_Worker] = []
        self.events: list[WorkerEvent] = []
        self.crashed: list[str] = []

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def _spawn(self, i: int, bind: str, log: Path) -> subprocess.Popen[bytes]:
        return spawn(worker_cmd(self._config, i, bind), log)

    def start(self) -> None:
        """Start every worker and wait for each to be ready (a child that cannot start
        raises RuntimeError)."""
        c, tmp = self._config, self._tmp
        for i in range(c.workers):
            bind = f"ipc://{tmp}/worker{i}" if c.transport == "ipc" else "tcp://127.0.0.1:0"
            log = tmp / f"worker{i}.log"
            self.workers.append(_Worker(f"worker{i}", log, self._spawn(i, bind, log)))
        for w in self.workers:
            ready = read_ready(w.proc, w.name, w.log, 300)
            w.address = ready["ready"][0]
            self._say(f"{w.name}: {w.address}{_metrics(ready)}")

    def kill(self, i: int, at: float) -> None:
        """``--chaos``: SIGKILL worker ``i`` (no goodbye: its sockets just vanish)."""
        w = self.workers[i]
        w.chaos = True
        self._say(f"[{at:5.1f} s] chaos: killing {w.name} (pid {w.proc.pid}) with SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGKILL)

    def check(self, at: float, now: float) -> None:
        """Note deaths and returns (call it often; it never blocks)."""
        for i, w in enumerate(self.workers):
            if w.down:
                continue
            code = w.proc.poll()
            if w.starting_since is not None and code is None:
                self._read_ready(w, at, now)
                continue
            if code is None:
                continue
            starting = w.starting_since is not None
            how = _how(code)
            self.events.append(WorkerEvent(w.name, at, "died", how, w.chaos))
            w.chaos = False
            if code > 0:
                self.crashed.append(f"{w.name} ({how}: {log_tail(w.log)})")
            tail = " while starting again" if starting else ""
            if w.restarts >= MAX_RESTARTS:
                w.down = True
                w.starting_since = None
                self._say(f"[{at:5.1f} s] {w.name} died ({how}){tail}; left down, see {w.log}")
                continue
            w.restarts += 1
            w.log = self._tmp / f"worker{i}.restart{w.restarts}.log"
            self._say(
                f"[{at:5.1f} s] {w.name} died ({how}){tail}; its clients re-send its requests;"
                f" restarting it on {w.address} (log {w.log.name})"
            )
            stop_all([w.proc], 0)  # closes our ends of its pipes
            w.proc = self._spawn(i, w.address, w.log)
            os.set_blocking(w.proc.stdout.fileno(), False)  # type: ignore[union-attr]
            w.starting_since, w.ready_buf = now, b""

    def _read_ready(self, w: _Worker, at: float, now: float) -> None:
        assert w.proc.stdout is not None and w.starting_since is not None
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(w.proc.stdout.fileno(), 4096)
            w.ready_buf += chunk
        if b"\n" in w.ready_buf:
            ready = json.loads(w.ready_buf.split(b"\n", 1)[0])
            w.starting_since = None
            self.events.append(WorkerEvent(w.name, at, "back", f"restart {w.restarts}"))
            self._say(f"[{at:5.1f} s] {w.name} is back on {ready['ready'][0]}{_metrics(ready)}")
        elif now - w.starting_since > RESTART_TIMEOUT:
            self.crashed.append(f"{w.name} (not ready {RESTART_TIMEOUT:.0f} s after a restart)")
            w.restarts = MAX_RESTARTS
            w.proc.kill()  # seen dead at the next check, and left down

    def starting(self) -> list[str]:
        """The workers starting again now."""
        return [w.name for w in self.workers if w.starting_since is not None and not w.down]

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [w.proc for w in self.workers]


def _metrics(ready: dict[str, object]) -> str:
    port = ready.get("metrics")
    return f", metrics http://127.0.0.1:{port}/metrics" if port else ""
