"""Helpers of the bridge tests: fake servers as fixtures, workers fronting them, streams."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.transport.fakes.common import FakeProc
from transport import ClientConfig

FAST = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=4, request_timeout=60)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeProc]]:
    """``fake(kind, *args)`` starts a fake server process; all are killed at teardown."""
    procs: list[FakeProc] = []

    def start(kind: str, *args: str) -> FakeProc:
        p = FakeProc(kind, *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def bridge_args(kind: str, url: str, *extra: str) -> list[str]:
    """CLI arguments of a worker fronting the server at ``url`` (fast health checks)."""
    return [
        "--bind", "tcp://127.0.0.1:0", "--engine", kind, "--engine-opt", f"url={url}",
        "--engine-opt", "health_interval=0.1", "--engine-opt", "health_timeout=0.5",
        "--engine-opt", "health_failures=3", "--engine-opt", "stall_timeout=30", *extra,
    ]  # fmt: skip


class Streams:
    """``on_chunk`` collectors, one per request: tokens, logprobs, versions streamed."""

    def __init__(self, n: int) -> None:
        self.chunks: list[list[tuple[list[int], list[float], list[int]]]] = [[] for _ in range(n)]

    def on_chunk(self, i: int) -> Callable[[Any, Any, Any], None]:
        def cb(t: Any, lp: Any, v: Any) -> None:
            self.chunks[i].append((t.tolist(), lp.tolist(), v.tolist()))

        return cb

    def got(self, i: int) -> int:
        return sum(len(c[0]) for c in self.chunks[i])

    def tokens(self, i: int) -> list[int]:
        return [t for c in self.chunks[i] for t in c[0]]

    def logprobs(self, i: int) -> list[float]:
        return [x for c in self.chunks[i] for x in c[1]]

    def versions(self, i: int) -> list[int]:
        return [x for c in self.chunks[i] for x in c[2]]
