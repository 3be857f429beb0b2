"""The transport suite's samples time the same work for every implementation: what a
sample received is released inside its timing."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import zmq

import bench.transport as bt
from bench.raw import RawClient


class _Sentinel:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __del__(self) -> None:
        self.events.append("freed")


def _timed_events(monkeypatch: pytest.MonkeyPatch, fn: Any) -> list[str]:
    """Events of one ``_sample`` of ``fn``, with "timing-end" where its clock stopped."""
    events: list[str] = []
    clock = time.perf_counter
    reads = [0]

    def perf_counter() -> float:
        reads[0] += 1
        if reads[0] == 2:  # _sample reads the clock at the start and at the end
            events.append("timing-end")
        return clock()

    async def main() -> None:
        monkeypatch.setattr(time, "perf_counter", perf_counter)
        await bt._sample(bt._Case(16, 1, 1, 1), "k", [], 3, lambda: fn(events))
        monkeypatch.setattr(time, "perf_counter", clock)
        events.append("returned")

    asyncio.run(main())
    return events


def test_a_gathered_sample_releases_its_responses_inside_the_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def one(events: list[str]) -> _Sentinel:
        return _Sentinel(events)

    events = _timed_events(monkeypatch, lambda ev: asyncio.gather(*(one(ev) for _ in range(3))))
    assert events == ["freed"] * 3 + ["timing-end", "returned"]


def test_a_blocking_sample_releases_its_result_inside_the_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = _timed_events(monkeypatch, _Sentinel)
    assert events == ["freed", "timing-end", "returned"]


def test_raw_pipelined_holds_every_reply_until_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hold=True`` keeps every reply until the last is in; ``hold=False`` none."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = RawClient([f"tcp://127.0.0.1:{port}"])
    kept_sizes: list[int] = []

    class _Kept(list):  # type: ignore[type-arg]
        def clear(self) -> None:
            kept_sizes.append(len(self))
            super().clear()

    try:
        stop = threading.Event()

        def echo() -> None:
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            while not stop.is_set():
                if poller.poll(50):
                    router.send_multipart(router.recv_multipart())

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        monkeypatch.setattr("bench.raw._new_list", _Kept)
        client.pipelined([b"x" * 16], 20, 4, hold=True)
        client.pipelined([b"x" * 16], 20, 4, hold=False)
        stop.set()
        t.join(5)
    finally:
        client.close()
        router.close(0)
        ctx.term()
    assert kept_sizes == [20, 0]
