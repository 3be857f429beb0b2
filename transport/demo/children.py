"""Starting, watching and stopping the demo's child processes, and the worker command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
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
from typing import Any

from transport.demo.sizes import REFERENCE_SIZES


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


@functools.lru_cache(maxsize=1)
def worker_help() -> str:
    """``python -m transport.worker --help``: which flags this worker CLI has."""
    out = subprocess.run(
        [sys.executable, "-m", "transport.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    return out.stdout


def hf_worker_args(
    model_size: str = "small",
    model_path: str | None = None,
    device: str | None = None,
    seed: int = 0,
    **opts: Any,
) -> list[str]:
    """Worker command-line arguments that serve :mod:`transport.hf_engine`.

    With a worker CLI that has ``--engine hf`` that is used; otherwise the same engine
    through ``--engine transport.hf_engine:factory``, whose options then travel as
    ``--plugin-opt``. ``opts`` are further :func:`transport.hf_engine.create_engine`
    options.
    """
    if "--engine-opt" in worker_help():
        args = ["--engine", "hf", "--model-size", model_size, "--seed", str(seed)]
        if model_path:
            args += ["--model-path", model_path]
        if device:
            args += ["--device", device]
        for k, v in opts.items():
            args += ["--engine-opt", f"{k}={v}"]
        return args
    every = {"model_size": model_size, "seed": seed, **opts}
    if model_path:
        every["model_path"] = model_path
    if device:
        every["device"] = device
    args = ["--engine", "transport.hf_engine:factory"]
    for k, v in every.items():
        args += ["--plugin-opt", f"{k}={v}"]
    return args


def worker_cmd(
    a: argparse.Namespace, i: int, bind: str, pub_addr: str, keys: str | None
) -> list[str]:
    cmd = ["-m", "transport.demo", "--role", "run", "transport.worker", "--bind", bind,
           "--worker-id", f"worker{i}",
           "--plugin", "transport.weights.update:subscribe",
           "--plugin-opt", f"weights_endpoint={pub_addr}", "--plugin-opt", "weights_digest=1"]  # fmt: skip
    if a.engine == "reference":
        vocab, hidden, layers = REFERENCE_SIZES[a.model_size]
        cmd += ["--engine", "reference", "--seed", str(a.seed), "--vocab-size", str(vocab),
                "--hidden", str(hidden), "--layers", str(layers),
                "--token-interval", str(a.token_interval)]  # fmt: skip
    else:
        opts = {"token_interval": a.token_interval} if a.token_interval else {}
        cmd += hf_worker_args(a.model_size, a.model_path, a.device, a.seed, **opts)
    if "--metrics-port" in worker_help() and importlib.util.find_spec("prometheus_client"):
        cmd += ["--metrics-port", "0"]
    if keys:
        cmd += [
            "--plugin-opt", f"weights_curve_secret={keys}/worker.key_secret",
            "--plugin-opt", f"weights_curve_server={keys}/trainer.key",
            "--curve-secret", f"{keys}/worker.key_secret", "--curve-clients", f"{keys}/clients",
        ]  # fmt: skip
    return cmd
