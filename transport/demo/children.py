"""The demo's child processes: starting, watching and stopping them, and the generation
workers under supervision (restarted on their address when they die)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transport.demo.config import REFERENCE_SIZES, DemoConfig
from transport.demo.reports import WorkerEvent

__all__ = ["MAX_RESTARTS", "Child", "WorkerPool", "hf_worker_args", "watch_parent"]

#: Restarts of one worker before it is left down (one that keeps dying as it starts is
#: broken, not unlucky).
MAX_RESTARTS = 3
#: Seconds a (re)started worker has to say it is ready (a model to load, on busy cores).
READY_TIMEOUT = 300.0


def watch_parent(grace: float = 10.0) -> None:
    """In a child: SIGTERM this process when the demo process is gone, SIGKILL ``grace``
    seconds later. Its stdin is a pipe whose only writer is the demo process (which never
    writes): a read returns end-of-file exactly when that process exits, however it does."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)  # the orderly stop's allowance
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def stop_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM (a blocking role looks at it between steps)."""
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    return stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
        return next(ln for ln in reversed(lines) if ln)
    return "(no output)"


@dataclasses.dataclass(eq=False)
class Child:
    """One child process: ``python ARGS`` logging to ``log``, in its own session (a
    terminal's Ctrl-C reaches only the demo process, which stops the children in order)."""

    name: str
    log: Path
    args: list[str]
    proc: subprocess.Popen[bytes] = dataclasses.field(init=False)
    buf: bytes = b""

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        """Start the process (again)."""
        self.buf = b""
        # The run's directory marks every child's environment: grep FASTIO_DEMO_RUN.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "FASTIO_DEMO_RUN": str(self.log.parent), "PYTHONPATH": path}
        with open(self.log, "wb") as log:
            # stdin: the parent-death pipe (watch_parent), whose write end only we hold.
            self.proc = subprocess.Popen(
                [sys.executable, *self.args], env=env, stdout=subprocess.PIPE, stderr=log,
                stdin=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip

    def ready(self, timeout: float) -> Any:
        """The child's one-line JSON ``{"ready": ...}`` on stdout, waiting up to
        ``timeout`` s. With ``timeout`` 0: None if not there yet (or the child is dead);
        otherwise a ``RuntimeError`` if it is not there in time or the child exited."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if timeout:
                    raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s")
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                if not timeout:
                    return None  # the caller sees it dead
                code, tail = self.proc.wait(), log_tail(self.log)
                raise RuntimeError(f"{self.name} exited ({code}) before it was ready: {tail}")
            self.buf += chunk
        return json.loads(self.buf.split(b"\n", 1)[0])


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM each, SIGKILL what is left after ``timeout`` s, close our pipe ends."""
    for p in procs:
        p.send_signal(signal.SIGTERM)  # nothing if it has exited
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()


def hf_worker_args(
    model_size: str = "small",
    model_path: str | None = None,
    device: str | None = None,
    seed: int = 0,
    **opts: Any,
) -> list[str]:
    """Worker command-line arguments that serve :mod:`transport.hf_engine` (``opts``:
    further :func:`transport.hf_engine.create_engine` options)."""
    args = ["--engine", "hf", "--model-size", model_size, "--seed", str(seed)]
    args += ["--model-path", model_path] if model_path else []
    args += ["--device", device] if device else []
    for k, v in opts.items():
        args += ["--engine-opt", f"{k}={v}"]
    return args


def worker_cmd(c: DemoConfig, i: int, bind: str) -> list[str]:
    """The command of the demo's worker ``i`` bound at ``bind``."""
    cmd = ["-m", "transport.demo", "--role", "run", "transport.worker", "--bind", bind,
           "--worker-id", f"worker{i}", "--plugin", "transport.weights.update:subscribe",
           "--plugin-opt", f"weights_endpoint={c.publisher}", "--plugin-opt", "weights_digest=1"]  # fmt: skip
    if c.engine == "reference":
        vocab, hidden, layers = REFERENCE_SIZES[c.model_size]
        cmd += ["--engine", "reference", "--seed", str(c.seed), "--vocab-size", str(vocab),
                "--hidden", str(hidden), "--layers", str(layers),
                "--token-interval", str(c.token_interval)]  # fmt: skip
    else:
        opts = {"token_interval": c.token_interval} if c.token_interval else {}
        cmd += hf_worker_args(c.model_size, c.model_path, c.device, c.seed, **opts)
    if importlib.util.find_spec("prometheus_client"):
        cmd += ["--metrics-port", "0"]
    if c.keys:
        cmd += ["--plugin-opt", f"weights_curve_secret={c.keys}/worker.key_secret",
                "--plugin-opt", f"weights_curve_server={c.keys}/trainer.key",
                "--curve-secret", f"{c.keys}/worker.key_secret",
                "--curve-clients", f"{c.keys}/clients"]  # fmt: skip
    return cmd


@dataclasses.dataclass(eq=False)
class _Worker(Child):
    address: str = ""
    restarts: int = 0
    since: float | None = None  # starting again since (seconds into the run)
    down: bool = False  # left down for good
    chaos: bool = False  # killed by --chaos

    def up(self, ready: dict[str, Any]) -> str:
        """Take the address of a ``ready`` line; the words that announce it."""
        self.address, port = ready["ready"][0], ready.get("metrics")
        return self.address + (f", metrics http://127.0.0.1:{port}/metrics" if port else "")


class WorkerPool:
    """The workers of one demo run: ``say`` prints a line for the person watching;
    :attr:`events` records each death and return (for the summary); :attr:`crashed`
    names the workers that failed by themselves (a nonzero exit status, not a signal),
    which fails the run."""

    def __init__(self, c: DemoConfig, tmp: Path, say: Callable[[str], None]) -> None:
        self._config, self._tmp, self._say = c, tmp, say
        self.workers: list[_Worker] = []
        self.events: list[WorkerEvent] = []
        self.crashed: list[str] = []

    def start(self) -> list[str]:
        """Start every worker, wait for each to be ready (``RuntimeError`` if one is not);
        their addresses."""
        c, tmp = self._config, self._tmp
        for i in range(c.workers):
            bind = f"ipc://{tmp}/worker{i}" if c.transport == "ipc" else "tcp://127.0.0.1:0"
            log = tmp / f"worker{i}.log"
            self.workers.append(_Worker(f"worker{i}", log, worker_cmd(c, i, bind)))
        for w in self.workers:
            self._say(f"{w.name}: {w.up(w.ready(READY_TIMEOUT))}")
        return [w.address for w in self.workers]

    def kill(self, i: int, at: float) -> None:
        """``--chaos``: SIGKILL worker ``i`` (no goodbye: its sockets just vanish)."""
        w = self.workers[i]
        w.chaos = True
        self._say(f"[{at:5.1f} s] chaos: killing {w.name} (pid {w.proc.pid}) with SIGKILL")
        w.proc.kill()

    def check(self, at: float) -> None:
        """Note deaths and returns ``at`` seconds into the run (call it often; it never
        blocks)."""
        for i, w in enumerate(self.workers):
            code = None if w.down else w.proc.poll()
            if code is None and w.since is not None:
                if (ready := w.ready(0)) is not None:
                    w.since = None
                    self.events.append(WorkerEvent(w.name, at, "back", f"restart {w.restarts}"))
                    self._say(f"[{at:5.1f} s] {w.name} is back on {w.up(ready)}")
                elif at - w.since > READY_TIMEOUT:
                    self.crashed.append(
                        f"{w.name} (not ready {READY_TIMEOUT:.0f} s after a restart)"
                    )
                    w.restarts = MAX_RESTARTS
                    w.proc.kill()  # seen dead at the next check, and left down
            if code is None:
                continue
            how = f"exit status {code}" if code > 0 else _signal_name(-code)
            said = f"[{at:5.1f} s] {w.name} died ({how})"
            said += "" if w.since is None else " while starting again"
            self.events.append(WorkerEvent(w.name, at, "died", how, w.chaos))
            w.chaos = False
            if code > 0:
                self.crashed.append(f"{w.name} ({how}: {log_tail(w.log)})")
            if w.restarts >= MAX_RESTARTS:
                w.down, w.since = True, None
                self._say(f"{said}; left down, see {w.log}")
                continue
            w.restarts += 1
            w.log = self._tmp / f"worker{i}.restart{w.restarts}.log"
            self._say(f"{said}; its clients re-send its requests; restarting it on "
                      f"{w.address} (log {w.log.name})")  # fmt: skip
            stop_all([w.proc], 0)  # closes our ends of its pipes
            w.args, w.since = worker_cmd(self._config, i, w.address), at
            w.start()

    def starting(self) -> list[str]:
        """The workers starting again now."""
        return [w.name for w in self.workers if w.since is not None]

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [w.proc for w in self.workers]


def _signal_name(num: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(num).name
    return f"signal {num}"
