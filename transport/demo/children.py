"""Starting, watching and stopping the demo's child processes, and the worker command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transport.demo.config import REFERENCE_SIZES

if TYPE_CHECKING:
    from transport.demo.config import DemoConfig


def watch_parent(grace: float = 10.0) -> None:
    """In a child: end this process when the demo process is gone.

    Its stdin is a pipe whose only writer is the demo process (which never writes), so
    a read returns end-of-file exactly when that process exits, however it exits. The
    watchdog then sends this process SIGTERM (an orderly stop) and, if it is still
    alive ``grace`` seconds later, SIGKILL.
    """

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)  # the orderly stop's allowance, then no more waiting
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    # The run's directory marks every child's environment, so a test (or a person) can
    # find them all: grep FASTIO_DEMO_RUN /proc/*/environ.
    env = {**os.environ, "FASTIO_DEMO_RUN": str(log_path.parent)}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        # The parent-death pipe (see watch_parent): we hold the only write end.
        stdin=subprocess.PIPE,
        # Own session: a terminal Ctrl-C reaches only this process, which then stops
        # the children in order (clients, trainer, workers).
        start_new_session=True,
    )
    log.close()  # the child has its own copy
    return proc


def log_tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()
    return "(no output)"


def read_ready(proc: subprocess.Popen[bytes], name: str, log: Path, timeout: float) -> Any:
    """Wait for the child's one-line JSON ``{"ready": ...}`` on stdout."""
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"{name} was not ready after {timeout:.0f} s")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                code = proc.wait()
                raise RuntimeError(f"{name} exited ({code}) before it was ready: {log_tail(log)}")
            buf += chunk
    finally:
        sel.close()
    return json.loads(buf.split(b"\n", 1)[0])


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in procs:
        for f in (p.stdin, p.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StopSignals:
    """Notes SIGINT and SIGTERM (a blocking role polls ``seen`` between steps)."""

    def __init__(self) -> None:
        self.seen = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, *_: Any) -> None:
        self.seen = True


def stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


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
    if model_path:
        args += ["--model-path", model_path]
    if device:
        args += ["--device", device]
    for k, v in opts.items():
        args += ["--engine-opt", f"{k}={v}"]
    return args


def worker_cmd(c: DemoConfig, i: int, bind: str) -> list[str]:
    """The command of the demo's worker ``i`` bound at ``bind``."""
    cmd = ["-m", "transport.demo", "--role", "run", "transport.worker", "--bind", bind,
           "--worker-id", f"worker{i}",
           "--plugin", "transport.weights.update:subscribe",
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
        cmd += [
            "--plugin-opt", f"weights_curve_secret={c.keys}/worker.key_secret",
            "--plugin-opt", f"weights_curve_server={c.keys}/trainer.key",
            "--curve-secret", f"{c.keys}/worker.key_secret", "--curve-clients", f"{c.keys}/clients",
        ]  # fmt: skip
    return cmd
