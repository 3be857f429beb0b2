"""Fixtures of the fabric tests: worker processes started with the CLI, killed in
teardown, and addresses on tcp (random loopback ports) or ipc (a temporary dir)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


class WorkerProc:
    """A ``python -m transport.worker`` subprocess."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        pp = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transport.worker", *args],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        self.address = ""
        #: The ready line, parsed.
        self.ready: dict[str, Any] = {}
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Block until the worker prints its ready line (poll with a deadline)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                self.ready = json.loads(line)
                self.address = self.ready["ready"][0]
                return self.address
        raise TimeoutError("worker did not become ready")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProc]]:
    """``spawn(*cli_args, wait=True)`` starts a worker; all are killed at teardown."""
    procs: list[WorkerProc] = []

    def _spawn(*args: str, wait: bool = True) -> WorkerProc:
        w = WorkerProc(list(args))
        procs.append(w)
        if wait:
            w.wait_ready()
        return w

    yield _spawn
    for w in procs:
        w.kill()


@pytest.fixture(params=["tcp", "ipc"])
def bind(request: Any, tmp_path: Path) -> Callable[[str], str]:
    """``bind(name)`` -> an address to bind: tcp on a random loopback port or ipc."""
    kind = request.param

    def _bind(name: str) -> str:
        if kind == "tcp":
            return "tcp://127.0.0.1:0"
        return f"ipc://{tmp_path}/{name}.sock"

    return _bind


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until truthy (bounded; no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        select.select([], [], [], 0.01)  # a 10 ms poll tick between checks
    raise AssertionError(f"timed out waiting for {what}")


async def await_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Async :func:`wait_for`: yields to the loop between checks."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        await asyncio.sleep(0.005)  # poll tick; the loop keeps serving meanwhile
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def procs() -> Iterator[Callable[..., Any]]:
    """Start ``target(*args)`` in spawned daemon processes; the test's end kills those
    still alive."""
    ctx = mp.get_context("spawn")
    started: list[Any] = []

    def start(target: Callable[..., None], *args: Any) -> Any:
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)
