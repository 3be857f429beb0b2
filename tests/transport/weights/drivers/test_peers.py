"""Peers a publisher or a subscriber must not trust or wait for: an Ack from a peer that
never said Hello, garbage (one warning per kind, then a count), and a dead trainer's pause
(a lease that ends). Real sockets and processes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

import fastio
from fastio.weight_msgs import WeightAck
from tests.helpers import mp_context
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import make_state, zeros_like
from transport.weights import WeightPublisher, WeightSubscriber


# -- 2. only a Hello makes a peer a worker ------------------------------------------------
def test_an_ack_from_a_peer_that_never_said_hello_is_ignored() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=False, heartbeat_interval=0.1)
    target = zeros_like(make_state(0))
    sub = WeightSubscriber(pub.endpoint, target, context=ctx, worker_id="real").start()
    spoof = ctx.socket(zmq.DEALER)
    spoof.setsockopt(zmq.LINGER, 0)
    spoof.setsockopt(zmq.ROUTING_ID, b"stranger")
    spoof.connect(pub.endpoint)
    try:
        pub.wait_for_workers(1, 30)
        pub.publish(make_state(1), 1)
        spoof.send_multipart(fastio.encode(WeightAck("stranger", 1, False, 0, "spoofed")))
        wait_for(lambda: pub.counters.get("acks_from_strangers"), 10, "the spoofed Ack")
        res = pub.wait(1, 30, workers=["real"])
        assert res.ok and "stranger" not in res.failed, res
        assert pub.publish_and_wait(make_state(2), 2, timeout=30).ok
        assert "stranger" not in pub.workers()
    finally:
        spoof.close(linger=0)
        sub.close()
        pub.close()
        ctx.term()


# -- 5. one warning per kind of bad message, then a count ---------------------------------
def test_garbage_does_not_flood_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=False, heartbeat_interval=0.1)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(pub.endpoint)
    caplog.set_level(logging.WARNING, logger="transport.weights")
    try:
        for _ in range(1500):
            s.send_multipart([b"\xff\x00garbage"])
        wait_for(lambda: pub.counters.get("bad_messages", 0) >= 1500, 30, "1500 bad messages")
    finally:
        s.close(linger=0)
        pub.close()
        ctx.term()
    lines = [r for r in caplog.records if r.name.startswith("transport.weights")]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]


def test_garbage_to_a_subscriber_does_not_flood_the_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    # No high-water mark: a ROUTER at its HWM (1000 by default) drops silently, and on a
    # busy host the burst below outran the I/O thread (fewer than 1500 arrived).
    rogue.setsockopt(zmq.SNDHWM, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    caplog.set_level(logging.WARNING, logger="transport.weights")
    sub = WeightSubscriber(f"tcp://127.0.0.1:{port}", zeros_like(make_state(0)), context=ctx)
    sub.start()
    try:
        assert rogue.poll(5000)
        ident = rogue.recv_multipart()[0]
        for _ in range(1500):
            rogue.send_multipart([ident, b"\x00garbage"])
        wait_for(lambda: sub.counters.get("bad_messages", 0) >= 1500, 30, "1500 bad messages")
    finally:
        sub.close()
        rogue.close(linger=0)
        ctx.term()
    lines = [r for r in caplog.records if r.name.startswith("transport.weights")]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]


# -- 4. a pause is a lease: a dead trainer's pause ends -----------------------------------
def pausing_trainer_proc(endpoint: str, worker: str, events: Any) -> None:
    """A trainer that pauses the worker as update_weights does, then hangs (killed)."""
    from transport import FabricController

    pub = WeightPublisher(endpoint, shm=False, heartbeat_interval=0.1)
    pub.wait_for_workers(1, 60)
    ctl = FabricController([worker], timeout=30)
    ctl.pause(30)
    events.put("paused")
    time.sleep(600)
    pub.close()


@pytest.mark.slow
def test_workers_paused_by_a_dead_trainer_resume(
    spawn: Callable[..., Any],
    procs: Callable[..., Any],
    capfd: pytest.CaptureFixture[str],
) -> None:
    import socket

    from transport import FabricController

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--worker-id", "gen",
        "--plugin", "transport.weights.update:subscribe",
        "--plugin-opt", f"weights_endpoint={endpoint}",
        "--plugin-opt", "weights_shm=0",
        "--plugin-opt", "weights_pause_lease=2.5",
    )  # fmt: skip
    events = mp_context().Queue()
    trainer = procs(pausing_trainer_proc, endpoint, w.address, events)
    assert events.get(timeout=60) == "paused"
    with FabricController([w.address], timeout=10) as ctl:

        def paused() -> bool:
            return all(s.paused for s in ctl.health(timeout=5).values())

        # While the trainer lives (its publisher beats), the pause holds past the lease.
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            assert paused(), "a live trainer's pause was cut short"
        trainer.kill()
        trainer.join(10)
        wait_for(lambda: not paused(), 30, "the worker to resume after the lease")
    assert "resuming on version" in capfd.readouterr().err
