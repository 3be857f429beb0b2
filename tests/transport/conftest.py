"""Fixtures of the fabric tests: worker processes started with the CLI, killed in
teardown, and addresses on tcp (random loopback ports) or ipc (a temporary dir)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, WorkerProc, await_for, mp_context, wait_for

# Test modules import these from here too; tests/helpers.py is their home.
__all__ = ["ROOT", "WorkerProc", "await_for", "wait_for"]


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


@pytest.fixture
def procs() -> Iterator[Callable[..., Any]]:
    """Start ``target(*args)`` in daemon child processes (:func:`tests.helpers.mp_context`);
    the test's end kills those still alive."""
    ctx = mp_context()
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
