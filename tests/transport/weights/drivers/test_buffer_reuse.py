"""A buffer a worker may still read is never overwritten (a stopped worker never applies a
mixed version, segments packed again only after every reader answered, one TCP staging
buffer kept between versions, segments of a silent publisher or a killed reader freed),
and a stale segment is the one whose owner died. Real processes and real sockets."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from tests.helpers import mp_context
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import equal, make_state, zeros_like
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
