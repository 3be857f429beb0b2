"""Who may still read a staged shared-memory segment: a process, not a worker id.

Each defect here was reproduced with real processes and real sockets: a replacement
process under the same worker id answered for its stopped predecessor, and a Fetch
registered its reader on a version whose segment publish() had just recycled. In both,
a worker stamped a version on another version's bytes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

import fastio
from fastio.weight_msgs import WeightBucket, WeightError, WeightFetch
from tests.helpers import mp_context
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import make_state, zeros_like
from transport.weights import WeightPublisher, WeightSubscriber, serving, state_digest
from transport.weights.routes import shm as wshm


def same_id_proc(endpoint: str, events: Any, dawdle: bool) -> None:
    """A worker under the id "w": it reports (event, version, pid, digest); with
    ``dawdle`` it says when it verified version 2 and waits before the copy."""
    import torch

    torch.set_num_threads(1)
    target = zeros_like(make_state(0))
    pid = os.getpid()

    def progress(version: int, bucket: int) -> None:
        if dawdle and version == 2:
            events.put(("verified", version, pid, 0))
            time.sleep(1.0)  # the test stops this process in here

    def applied(version: int) -> None:
        events.put(("applied", version, pid, state_digest(target)))

    WeightSubscriber(
        endpoint,
        target,
        worker_id="w",
        shm=True,
        heartbeat_interval=0.1,
        on_progress=progress,
        on_applied=applied,
    ).start()
    time.sleep(600)


def _next(events: Any, kind: str, version: int, pid: int | None = None) -> tuple[Any, ...]:
    """The next event of that kind and version (of that process), skipping others."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ev = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if ev[:2] == (kind, version) and (pid is None or ev[2] == pid):
            return tuple(ev)
    raise AssertionError(f"no {kind} of version {version}")


@pytest.mark.slow
def test_a_replacement_under_the_same_id_does_not_answer_for_its_predecessor(
    procs: Callable[..., Any],
) -> None:
    """Process A (id "w") verified version 2 and is stopped before its copy; a
    replacement B under the same id applies version 2 and says so. A still reads
    version 2's segment: it must not be packed again for a later version."""
    if not wshm.available():
        pytest.skip("no /dev/shm")
    # One queue per process: a process stopped while its queue's feeder thread still
    # holds the (cross-process) write lock would block the other one's reports.
    events_a = mp_context().Queue()
    events_b = mp_context().Queue()
    with WeightPublisher(shm=True, heartbeat_interval=0.1, worker_timeout=60) as pub:
        procs(same_id_proc, pub.endpoint, events_a, True)
        pub.wait_for_workers(1, 60)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).ok
        pub.publish(make_state(2), 2)
        _, _, a_pid, _ = _next(events_a, "verified", 2)
        os.kill(a_pid, signal.SIGSTOP)  # verified v2, not yet committed
        try:
            procs(same_id_proc, pub.endpoint, events_b, False)
            _, _, b_pid, digest = _next(events_b, "applied", 2)
            assert b_pid != a_pid and digest == state_digest(make_state(2))
            wait_for(lambda: pub.workers()["w"].pid == b_pid, 30, "B's Hello")
            for v in (3, 4):  # the old rule packed v4 into v2's segment
                pub.publish(make_state(v), v)
                _next(events_b, "applied", v, b_pid)
        finally:
            os.kill(a_pid, signal.SIGCONT)
        _, _, _, digest = _next(events_a, "applied", 2, a_pid)
        assert digest == state_digest(make_state(2)), "version 2 stamped on other bytes"
        assert pub.counters["segments_abandoned"] >= 1  # set aside, never rewritten


def test_a_fetch_never_reads_a_version_whose_segment_was_recycled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shared-memory Fetch of an old version is held before its registration while
    publish() recycles that version's segment: it is refused (before the fix it was
    answered "ready" over bytes of the newer version)."""
    if not wshm.available():
        pytest.skip("no /dev/shm")
    ctx: zmq.Context[Any] = zmq.Context()
    pub = WeightPublisher(context=ctx, shm=True, heartbeat_interval=0.1, worker_timeout=60)
    target = zeros_like(make_state(0))
    sub = WeightSubscriber(pub.endpoint, target, context=ctx, shm=True).start()
    in_window, recycled = threading.Event(), threading.Event()
    real_send = serving.Send
    real_acquire = pub.store.acquire

    class HeldSend(real_send):  # type: ignore[misc, valid-type]
        """Holds the serving thread between the Fetch's look-up and its registration
        until publish() has taken its buffer."""

        def __init__(self, ident: bytes, wid: str, fetch: WeightFetch) -> None:
            if ident == b"late-reader":
                in_window.set()
                assert recycled.wait(30)
            super().__init__(ident, wid, fetch)

    def acquire(version: int, total: int) -> Any:
        try:
            return real_acquire(version, total)
        finally:
            if in_window.is_set():
                recycled.set()

    dealer = ctx.socket(zmq.DEALER)
    try:
        pub.wait_for_workers(1, 30)
        ann1 = pub.publish(make_state(1), 1)
        assert pub.wait(1, 30).ok
        assert pub.publish_and_wait(make_state(2), 2, 30).ok
        monkeypatch.setattr(serving, "Send", HeldSend)
        monkeypatch.setattr(pub.store, "acquire", acquire)
        dealer.setsockopt(zmq.ROUTING_ID, b"late-reader")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.endpoint)
        enc, dec = fastio.Encoder(), fastio.Decoder()
        dealer.send_multipart(enc.encode(WeightFetch(1, 0, True)))
        assert in_window.wait(30)
        ann3 = pub.publish(make_state(3), 3)  # v1 answered by every worker: recycled
        assert ann3.shm_name == ann1.shm_name
        assert dealer.poll(30_000)
        reply = dec.decode(dealer.recv_multipart(copy=False))
        assert isinstance(reply, WeightError), reply
        assert not isinstance(reply, WeightBucket)
        assert "version 1 is not available" in reply.reason
        assert pub.wait(3, 30).ok  # and the publisher keeps serving
    finally:
        recycled.set()
        dealer.close(0)
        sub.close()
        pub.close()
        ctx.term()
