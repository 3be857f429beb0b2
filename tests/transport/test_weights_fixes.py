"""Defects found by driving the weight path as a new user would, each reproduced with
real processes or real sockets: a mixed version through a reused buffer, spoofed Acks,
tied weights on disk, log floods, a worker left paused by a dead trainer, and the
worker plugin's options.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import fastio
from fastio.weight_msgs import WeightAck
from tests.helpers import mp_context
from tests.transport.conftest import wait_for
from tests.transport.weights_helpers import equal, make_state, zeros_like
from transport.weights import WeightPublisher, WeightSubscriber, state_digest
from transport.weights.routes import shm as wshm


# -- 1. a buffer a worker may still read is never overwritten --------------------------
def slow_subscriber_proc(endpoint: str, events: Any) -> None:
    """A worker that says when it verified version 2 and then dawdles before the copy,
    and reports the digest of the weights it stamps with each version."""
    torch.set_num_threads(1)
    target = zeros_like(make_state(0))

    def progress(version: int, bucket: int) -> None:
        if version == 2:
            events.put(("verified", version, os.getpid()))
            time.sleep(1.0)  # the test stops this process in here

    def applied(version: int) -> None:
        events.put(("applied", version, state_digest(target)))

    WeightSubscriber(
        endpoint,
        target,
        worker_id="slow",
        shm=True,
        heartbeat_interval=0.1,
        on_progress=progress,
        on_applied=applied,
    ).start()
    time.sleep(600)


@pytest.mark.slow
def test_a_stopped_worker_never_applies_a_mixed_version(
    procs: Callable[..., Any],
) -> None:
    if not wshm.available():
        pytest.skip("no /dev/shm")
    events = mp_context().Queue()
    with WeightPublisher(shm=True, heartbeat_interval=0.1, worker_timeout=2.0) as pub:
        worker = procs(slow_subscriber_proc, pub.endpoint, events)
        pub.wait_for_workers(1, 60)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).ok
        assert events.get(timeout=30)[:2] == ("applied", 1)
        pub.publish(make_state(2), 2)
        kind, version, pid = events.get(timeout=30)
        assert (kind, version) == ("verified", 2)
        os.kill(pid, signal.SIGSTOP)  # verified v2, not yet copied
        try:
            wait_for(lambda: not pub.workers()["slow"].alive, 30, "the worker to be lost")
            pub.publish(make_state(3), 3)
            pub.publish(make_state(4), 4)  # the old rule reused v2's segment here
        finally:
            os.kill(pid, signal.SIGCONT)
        kind, version, digest = events.get(timeout=30)
        assert (kind, version) == ("applied", 2)
        assert digest == state_digest(make_state(2)), "version 2 stamped on other bytes"
        # v2's segment left the pool (unlinked, never rewritten)
        assert pub.counters["segments_abandoned"] >= 1
        worker.kill()


def _shm_bytes(name: str, nbytes: int) -> bytes:
    seg = wshm.ShmSegment.open(name)
    try:
        return bytes(seg.tensor[:nbytes].numpy())
    finally:
        seg.close()


def test_segments_are_packed_again_only_after_every_reader_answered() -> None:
    """The pool: two segments in turn while workers answer; a version whose reader has
    not answered keeps its segment untouched and the next version gets a fresh one."""
    if not wshm.available():
        pytest.skip("no /dev/shm")
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=True, heartbeat_interval=0.1, worker_timeout=60)
    target = zeros_like(make_state(0))
    gate = threading.Lock()
    verified = threading.Event()

    def progress(version: int, bucket: int) -> None:
        if version == 6:
            verified.set()

    sub = WeightSubscriber(
        pub.endpoint, target, context=ctx, lock=gate, on_progress=progress, atomic=True
    ).start()
    try:
        pub.wait_for_workers(1, 30)
        names = []
        for v in (1, 2, 3, 4):
            names.append(pub.publish(make_state(v), v).shm_name)
            assert pub.wait(v, 30).applied[sub.worker_id].via == "shm"
        assert names[0] == names[2] and names[1] == names[3] and names[0] != names[1]
        assert pub.counters["buffers_created"] == 2 and equal(target, make_state(4))
        assert pub.publish(make_state(5), 5).shm_name == names[0]
        assert pub.wait(5, 30).ok
        with gate:  # the worker verifies version 6, then waits for the lock: no answer
            ann6 = pub.publish(make_state(6), 6)
            assert ann6.shm_name == names[1]
            assert verified.wait(30)
            packed6 = _shm_bytes(ann6.shm_name, ann6.total_bytes)
            # v5 was answered: its segment is packed again; v6's reader has not
            # answered: v8 gets a fresh segment, v6's bytes stay as they were
            assert pub.publish(make_state(7), 7).shm_name == names[0]
            name8 = pub.publish(make_state(8), 8).shm_name
            assert name8 not in names and pub.counters["buffers_created"] == 3
            assert _shm_bytes(ann6.shm_name, ann6.total_bytes) == packed6
        assert pub.wait(6, 30).applied[sub.worker_id].via == "shm"
        assert sub.wait_version(8, 30) and equal(target, make_state(8))
        assert pub.counters.get("segments_abandoned", 0) == 0  # answered in the end
    finally:
        sub.close()
        pub.close()
        ctx.term()
    assert not any((wshm.SHM_DIR / n).exists() for n in [*names, name8])


def test_tcp_pieces_land_in_one_staging_buffer_kept_between_versions() -> None:
    """Over TCP an atomic worker copies each verified piece into a staging buffer it keeps (the
    frames are freed at once); a bigger version gets a bigger one; ``atomic=False``
    keeps none."""
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=False, chunk_bytes=4096, heartbeat_interval=0.1)
    target = zeros_like(make_state(0, scale=4))
    sub = WeightSubscriber(pub.endpoint, target, context=ctx, shm=False, atomic=True).start()
    loose_target = zeros_like(make_state(0, scale=4))
    loose = WeightSubscriber(
        pub.endpoint, loose_target, context=ctx, shm=False, atomic=False
    ).start()
    try:
        pub.wait_for_workers(2, 30)
        ptrs = set()
        for v in (1, 2, 3):
            assert pub.publish_and_wait(make_state(v, scale=4), v, timeout=30).ok
            assert equal(target, make_state(v, scale=4))
            assert equal(loose_target, make_state(v, scale=4))
            assert sub.fetcher._staging is not None
            ptrs.add(sub.fetcher._staging.ctypes.data)
        assert len(ptrs) == 1 and loose.fetcher._staging is None
    finally:
        sub.close()
        loose.close()
        pub.close()
        ctx.term()


def test_a_subscriber_unmaps_the_segments_of_a_silent_publisher() -> None:
    """Mappings are kept between versions, but not those of a publisher gone silent:
    they would pin the memory of segments it unlinked."""
    if not wshm.available():
        pytest.skip("no /dev/shm")
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=True, heartbeat_interval=0.1)
    target = zeros_like(make_state(0))
    # 2 s: a publisher thread late by half a second on a loaded machine is not silent,
    # and its mappings must stay between the versions below.
    sub = WeightSubscriber(
        pub.endpoint, target, context=ctx, heartbeat_interval=0.1, publisher_timeout=2.0
    ).start()
    try:
        pub.wait_for_workers(1, 30)
        for v in (1, 2):
            assert pub.publish_and_wait(make_state(v), v, timeout=30).ok
        assert len(sub.fetcher.shm.segments) == 2  # kept: the next versions reuse them
        pub.close()
        wait_for(lambda: not sub.fetcher.shm.segments, 30, "the mappings to be dropped")
    finally:
        sub.close()
        pub.close()
        ctx.term()


def killed_reader_proc(endpoint: str, events: Any) -> None:
    """A worker that says when it verified version 2 and then never gets to its copy."""
    torch.set_num_threads(1)

    def progress(version: int, bucket: int) -> None:
        if version == 2:
            events.put(("verified", os.getpid()))
            time.sleep(600)  # the test kills this process in here

    WeightSubscriber(
        endpoint, zeros_like(make_state(0)), worker_id="doomed", on_progress=progress
    ).start()
    time.sleep(600)


@pytest.mark.slow
def test_a_killed_reader_frees_its_segment_at_once(
    procs: Callable[..., Any],
) -> None:
    """Killed mid-version, a reader neither blocks the pool nor leaks trainer memory:
    its process is seen gone at the next heartbeat (same host, pid and start time), the
    version reports it lost, and its segment is packed again."""
    if not wshm.available():
        pytest.skip("no /dev/shm")
    events = mp_context().Queue()
    with WeightPublisher(shm=True, heartbeat_interval=0.1, worker_timeout=600) as pub:
        worker = procs(killed_reader_proc, pub.endpoint, events)
        pub.wait_for_workers(1, 60)
        name1 = pub.publish(make_state(1), 1).shm_name
        assert pub.wait(1, 60).ok
        name2 = pub.publish(make_state(2), 2).shm_name
        kind, pid = events.get(timeout=60)
        assert kind == "verified"
        os.kill(pid, signal.SIGKILL)
        worker.join(30)
        res = pub.wait(2, 30)  # long before worker_timeout
        assert res.failed == {"doomed": "worker lost: its process is gone"}
        assert pub.publish(make_state(3), 3).shm_name == name1
        assert pub.publish(make_state(4), 4).shm_name == name2  # the dead reader's
        assert pub.counters["buffers_created"] == 2
        assert pub.counters.get("segments_abandoned", 0) == 0


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


# -- 3. tied weights on disk --------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_save_weights_of_tied_weights(tmp_path: Path) -> None:
    from transport.weights.disk import load_weights, save_weights

    torch.manual_seed(0)
    src = Tied()
    path = save_weights(tmp_path, src, 1)
    dst = Tied()
    torch.nn.init.zeros_(dst.embed.weight)
    assert load_weights(tmp_path, dst) == 1
    assert equal(dict(dst.state_dict()), dict(src.state_dict()))
    # a worker whose model is not tied gets both names
    untied = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    load_weights(tmp_path, untied)
    assert equal(untied, dict(src.state_dict()))
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "mid.bias", "mid.weight"]  # once


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


# -- 6. the worker plugin's options -------------------------------------------------------
class _Server:
    worker_id = "w"
    paused = False
    pause_requests = 0

    def __init__(self) -> None:
        self.on_resume: list[Any] = []
        self.on_pause: list[Any] = []
        self.engine = type("E", (), {"model": torch.nn.Linear(2, 2), "version": 0})()


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "weights_endpoint"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weigths_shm": "0"}, "weigths_shm"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weights_dtype": "float7"}, "float7"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weights_loader": "nomodule"}, "loader"),
    ],
)
def test_the_plugin_refuses_bad_options(opts: dict[str, str], match: str) -> None:
    import asyncio

    from transport.weights.update import subscribe

    with pytest.raises(ValueError, match=match):
        asyncio.run(asyncio.wait_for(subscribe(_Server(), opts), 10))


# -- stale segments: decided by the owner's lock, not by a PID ----------------------------
def segment_owner_proc(names: Any) -> None:
    seg = wshm.ShmSegment.create(4096)
    names.put(seg.name)
    time.sleep(600)


def test_stale_segments_are_the_ones_whose_owner_died(
    procs: Callable[..., Any],
) -> None:
    if not wshm.available():
        pytest.skip("no /dev/shm")
    names = mp_context().Queue()
    owner = procs(segment_owner_proc, names)
    path = wshm.SHM_DIR / names.get(timeout=60)
    old = time.time() - 60
    os.utime(path, (old, old))
    wshm.cleanup_stale()
    assert path.exists(), "a live owner's segment was removed"
    owner.kill()
    owner.join(10)
    wshm.cleanup_stale()
    assert not path.exists(), "a dead owner's segment was kept"


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
