"""``python -m transport.demo``: the entry point, the orchestrator, and its child
processes (started, watched, stopped; the generation workers restarted on their address
when they die)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from transport.demo.config import REFERENCE_SIZES, DemoConfig, UserError, parse_config
from transport.demo.reports import REPORT_DECODER, Display, RunState, WorkerEvent, verdict
from transport.demo.roles import client_role, stop_signals, trainer_role, watch_parent
from transport.sockets import bind_all, make_socket

__all__ = ["MAX_RESTARTS", "Child", "DemoConfig", "UserError", "WorkerPool", "hf_worker_args",
           "main", "watch_parent"]  # fmt: skip

#: Restarts of one worker before it is left down (one that keeps dying as it starts is
#: broken, not unlucky).
MAX_RESTARTS = 3
#: Seconds a (re)started worker has to say it is ready (a model to load, on busy cores).
READY_TIMEOUT = 300.0
_SIGNALS = {s.value: s.name for s in signal.Signals}  # 9 -> "SIGKILL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "(no output)")


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
        for f in filter(None, (p.stdin, p.stdout)):
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
            how = f"exit status {code}" if code > 0 else _SIGNALS.get(-code, f"signal {-code}")
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


def _make_keys(tmp: Path) -> str:
    from zmq.auth import create_certificates

    keys = tmp / "keys"
    keys.mkdir()
    for name in ("worker", "client", "trainer"):
        create_certificates(keys, name)
    # Workers admit the client keys in clients/, the trainer's publisher the worker keys.
    for who, sub in (("client", "clients"), ("worker", "workers")):
        (keys / sub).mkdir()
        shutil.copy(keys / f"{who}.key", keys / sub)
    return str(keys)


def _child(role: str, c: DemoConfig, tmp: Path, name: str, index: int = 0) -> Child:
    config = msgspec.json.encode(msgspec.structs.replace(c, index=index)).decode()
    args = ["-m", "transport.demo", "--role", role, "--config", config]
    return Child(name, tmp / f"{name}.log", args)


def _run(c: DemoConfig, tmp: Path) -> bool:
    display = Display(live=sys.stdout.isatty(), interval=c.progress_every)
    zctx = zmq.Context()
    pull = make_socket(zctx, zmq.PULL, hwm=None, max_message_size=None)
    bind_all(pull, f"ipc://{tmp}/report")
    # Known before anything starts: the workers connect to it before the trainer binds.
    publisher = f"ipc://{tmp}/weights" if c.transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    keys = _make_keys(tmp) if c.auth else None
    c = msgspec.structs.replace(c, report=f"ipc://{tmp}/report", publisher=publisher, keys=keys)
    stop, pool = stop_signals(), WorkerPool(c, tmp, display.print)
    st = RunState(events=pool.events, crashed=pool.crashed)  # the pool's lists, shared
    children: list[Child] = []
    try:
        display.print(
            f"fastio demo: {c.workers} workers, {c.clients} clients x {c.concurrency} in flight, "
            f"model {c.model_path or f'{c.engine} {c.model_size}'}, {c.transport}, "
            f"auth {'on' if c.auth else 'off'}; logs in {tmp} "
        )
        c = msgspec.structs.replace(c, addresses=pool.start())
        children.append(_child("trainer", c, tmp, "trainer"))
        c = msgspec.structs.replace(c, vocab=children[0].ready(300)["vocab"])
        children += [_child("client", c, tmp, f"client{i}", index=i) for i in range(c.clients)]
        for ch in children[1:]:
            ch.ready(120)
        st.started = time.perf_counter()
        # --chaos: one worker killed (and restarted) once the run is well under way.
        chaos_at = 0.4 * c.duration if c.chaos else None
        victim = random.Random(c.seed).randrange(c.workers)

        def drain(wait_ms: int) -> None:
            while pull.poll(wait_ms):
                wait_ms = 0
                st.take(REPORT_DECODER.decode(pull.recv()))

        def step() -> float:
            drain(250)
            pool.check(at := time.perf_counter() - st.started)
            display.update(st)
            return at

        dead: list[str] = []
        with display:
            while not stop.is_set() and not dead and (at := step()) < c.duration:
                if chaos_at is not None and at >= chaos_at:
                    chaos_at = None
                    pool.kill(victim, at)
                dead = [ch.name for ch in children if ch.proc.poll() is not None]
            if dead:
                display.print(f"{dead[0]} exited early; see {tmp}/{dead[0]}.log")
            elif not stop.is_set() and pool.starting():
                # The final check is over every worker: wait for one restarting now.
                display.print(f"[{at:5.1f} s] waiting for {', '.join(pool.starting())} to be back")
                while not stop.is_set() and pool.starting():
                    step()
        elapsed = time.perf_counter() - st.started
        # Orderly stop: clients (final reports), then the trainer (final weight check).
        stop_all([ch.proc for ch in children[1:]], 30)
        drain(100)
        stop_all([children[0].proc], 60)
        drain(500)
        display.summary(st, elapsed)
        problem = verdict(st, early=bool(dead))
        if problem:
            print(f"FAILED: {problem}", file=sys.stderr, flush=True)
        return not problem
    except RuntimeError as exc:  # a child that could not start
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        stop_all([*(ch.proc for ch in children), *(w.proc for w in pool.workers)], 15)
        zctx.destroy()  # and the report socket


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transport.demo``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["--role", "run"]:
        # A child that runs a module (the worker) under the parent-death watchdog.
        watch_parent()
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        return 0
    try:
        role, c = parse_config(args)
    except UserError as exc:
        print(f"python -m transport.demo: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if role != "orchestrator":
        watch_parent()
        if role == "client":
            asyncio.run(client_role(c))
        else:
            trainer_role(c)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fastio-demo-"))
    ok = False
    try:
        ok = _run(c, tmp)
    finally:
        if ok and not c.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr, flush=True)
    return 0 if ok else 1
