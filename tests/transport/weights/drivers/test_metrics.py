"""The weight path's Prometheus metrics move with real updates, and the subscriber
leaves the process's allocator alone unless asked."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zmq

from tests.transport.weights.helpers import make_state, zeros_like
from transport.weights import WeightPublisher, WeightSubscriber


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_updates_are_counted_in_the_metrics(shm: bool) -> None:
    prom = pytest.importorskip("prometheus_client")
    reg = prom.REGISTRY
    path = "shm" if shm else "tcp"

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return float(reg.get_sample_value(name, labels or {}) or 0.0)

    before = {
        "pub": value("fastio_publisher_bytes_total", {"path": path}),
        "sub": value("fastio_subscriber_bytes_total", {"path": path}),
        "apply": value("fastio_subscriber_phase_seconds_count", {"phase": "apply"}),
        "pack": value("fastio_publisher_phase_seconds_count", {"phase": "pack"}),
        "fail": value("fastio_subscriber_failures_total"),
    }
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=shm, heartbeat_interval=0.1)
    good = WeightSubscriber(pub.endpoint, zeros_like(make_state(0)), context=ctx, shm=shm)
    bad_target = zeros_like(make_state(0))
    bad_target.pop("mask")
    bad = WeightSubscriber(pub.endpoint, bad_target, context=ctx, shm=shm)
    try:
        good.start()
        bad.start()
        pub.wait_for_workers(2, 30)
        res = pub.wait(pub.publish(make_state(1), 1).version, 30)
        assert list(res.applied) == [good.worker_id]
        nbytes = good.last_stats.bytes
    finally:
        good.close()
        bad.close()
        pub.close()
        ctx.term()
    assert value("fastio_publisher_bytes_total", {"path": path}) - before["pub"] == nbytes
    assert value("fastio_subscriber_bytes_total", {"path": path}) - before["sub"] == nbytes
    assert value("fastio_subscriber_phase_seconds_count", {"phase": "apply"}) > before["apply"]
    assert value("fastio_publisher_phase_seconds_count", {"phase": "pack"}) > before["pack"]
    assert value("fastio_subscriber_failures_total") - before["fail"] == 1


def test_the_allocator_is_tuned_only_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    import transport.zmqio

    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(transport.zmqio, "tune_malloc", lambda *a: calls.append(a) or True)
    WeightSubscriber("tcp://127.0.0.1:1", {"w": torch.zeros(2)})
    assert calls == []
    WeightSubscriber("tcp://127.0.0.1:1", {"w": torch.zeros(2)}, tune_malloc=True)
    assert calls == [(32 << 20, 1 << 30)]
