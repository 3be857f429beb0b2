"""Mixed weights on a standalone subscriber: which mode a plain lock gets, what is
reported while a one-pass version is under way, close() mid-version, and the ipc path
never entering the lock a shm/tcp stream holds."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from fastio.ipc_msgs import IpcAck, IpcReady
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import (
    FaultyPublisher,
    corrupting_bucket_1,
    equal,
    make_state,
    zeros_like,
)
from transport.weights import WeightPublisher, WeightSubscriber, state_digest


class RefusingLock:
    """A lock that declares it keeps the engine from serving mixed weights."""

    refuses_mixed = True

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


class DepthLock:
    """Records how deep it is entered (a plain lock entered twice would deadlock)."""

    def __init__(self) -> None:
        self.depth = self.max = 0

    def __enter__(self) -> None:
        self.depth += 1
        self.max = max(self.max, self.depth)

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


def test_the_one_pass_mode_is_the_default_only_under_a_lock_that_refuses_mixed() -> None:
    t = zeros_like(make_state(0))
    ep = "tcp://127.0.0.1:9"
    assert WeightSubscriber(ep, t).atomic
    assert WeightSubscriber(ep, t, lock=threading.Lock()).atomic
    assert not WeightSubscriber(ep, t, lock=RefusingLock()).atomic
    assert WeightSubscriber(ep, t, lock=RefusingLock(), loader=lambda w: None).atomic
    assert not WeightSubscriber(ep, t, lock=threading.Lock(), atomic=False).atomic


def test_a_plain_lock_keeps_the_previous_version_whole_when_a_version_fails() -> None:
    """An engine's step lock is left when a version fails: by default nothing of it
    may be in the weights then (the engine would generate from them)."""
    lock = threading.Lock()
    v1, v2 = make_state(1, scale=20), make_state(2, scale=20)
    tgt = zeros_like(v1)
    pub = corrupting_bucket_1({2})
    with pub, WeightSubscriber(pub.endpoint, tgt, shm=False, lock=lock) as sub:
        pub.wait_for_workers(1, 10)
        assert pub.publish_and_wait(v1, 1, timeout=30).ok
        res = pub.wait(pub.publish(v2, 2).version, 30)
        assert "failed its checksum" in res.failed[sub.worker_id]
        assert equal(tgt, v1), "the step lock was left with mixed weights"
        assert sub.consistent and sub.version == 1 and sub.reported_version == 1
        assert not lock.locked()


def test_a_one_pass_version_reports_no_version_from_its_first_write() -> None:
    v1, v2 = make_state(1, scale=50), make_state(2, scale=50)
    tgt = zeros_like(v1)
    seen: list[tuple[int, bool, int, bool]] = []
    digests: list[int | None] = []

    def progress(version: int, index: int) -> None:
        if version == 2:
            mixed = state_digest(tgt) not in (state_digest(v1), state_digest(v2))
            seen.append((index, sub.consistent, sub.reported_version, mixed))
            digests.append(sub.reporter.digest)  # what a Hello would carry now

    with WeightPublisher("tcp://127.0.0.1:*", bucket_bytes=16 << 10) as pub:
        sub = WeightSubscriber(
            pub.endpoint,
            tgt,
            on_progress=progress,
            shm=False,
            atomic=False,
            report_digest=True,
        ).start()
        try:
            pub.wait_for_workers(1, 10)
            assert pub.publish_and_wait(v1, 1, timeout=30).ok
            assert pub.publish_and_wait(v2, 2, timeout=30).ok
            assert sub.consistent and sub.reported_version == 2
        finally:
            sub.close()
    assert len(seen) > 1 and any(m for *_, m in seen), seen
    for index, consistent, reported, _ in seen:
        assert not consistent and reported == -1, (index, consistent, reported)
    # No digest of version 1 beside version -1: the weights no longer hold it.
    assert digests == [None] * len(seen), digests


def test_close_mid_version_leaves_the_lock_and_says_the_weights_are_mixed() -> None:
    go = threading.Event()

    def slow_bucket_2_of_version_2(worker: str, version: int, index: int) -> None:
        if version == 2 and index == 2:
            go.wait(10)  # the trainer slow mid-version (its serving thread)

    lock = threading.Lock()
    pub = FaultyPublisher(
        slow_bucket_2_of_version_2,
        "tcp://127.0.0.1:*",
        shm=False,
        bucket_bytes=4096,
        heartbeat_interval=0.1,
    )
    with pub:
        sub = WeightSubscriber(
            pub.endpoint, zeros_like(make_state(0)), lock=lock, shm=False, window=1, atomic=False
        ).start()
        try:
            pub.wait_for_workers(1, 10)
            assert pub.publish_and_wait(make_state(1), 1, timeout=30).ok

            def publish_2() -> None:  # the close at the end may find it still waiting
                with contextlib.suppress(RuntimeError):  # "publisher closed while publishing"
                    pub.publish(make_state(2), 2)

            threading.Thread(target=publish_2, daemon=True).start()
            wait_for(lock.locked, 10, "version 2's first write")
            sub.close()
            assert sub._thread is not None and not sub._thread.is_alive()
            assert not lock.locked(), "close() left the lock held"
            assert not sub.consistent and sub.reported_version == -1
            assert "closed mid-version" in sub.last_error
        finally:
            go.set()
            sub.close()


class FakeImporter:
    """What ``IpcReceiver.on_ready`` uses of an :class:`IpcImporter`."""

    def __init__(self) -> None:
        self.version = 1
        self.atomic = True
        self.serving = True
        self._held: list[IpcReady] = []
        self.readies: list[IpcReady] = []
        self.abandoned = 0

    def on_ready(self, r: IpcReady) -> list[IpcAck]:
        self.readies.append(r)
        return [IpcAck("w", r.version, r.bucket, r.slot, True, self.version, "")]

    def refuse(self, r: IpcReady, why: str) -> list[IpcAck]:
        held = [*self._held, r]
        self.abandon()
        return [IpcAck("w", h.version, h.bucket, h.slot, False, self.version, why) for h in held]

    def abandon(self) -> None:
        self.abandoned += 1


def subscriber_streaming_version(version: int) -> tuple[WeightSubscriber, DepthLock, Any]:
    """A subscriber (not started) whose one-pass shm/tcp version ``version`` holds the
    lock (after an ipc failure fell back), with the ipc path open."""
    lock = DepthLock()
    sub = WeightSubscriber("tcp://127.0.0.1:9", zeros_like(make_state(0)), lock=lock, atomic=False)
    sent: list[Any] = []
    sub.reporter.send = sub.fetcher.send = sub.ipc.send = sent.append
    sub.core.version = 1
    sub.ipc.importer = FakeImporter()  # type: ignore[assignment]
    sub.ipc.opened = True
    sub.ipc._t0 = time.monotonic()
    up: Any = SimpleNamespace(ann=SimpleNamespace(version=version), locked=False, wrote=False)
    sub.fetcher.update = up
    assert sub.fetcher.hold(up) and lock.depth == 1
    return sub, lock, sent


@pytest.mark.parametrize(("atomic", "bucket"), [(True, 1), (False, 0)])
def test_a_newer_ipc_version_supersedes_the_stream_holding_the_lock(
    atomic: bool, bucket: int
) -> None:
    """The ipc bucket that writes the live weights (the last one of an atomic import,
    any of a one-pass import) comes while a shm/tcp stream holds the lock."""
    sub, lock, _sent = subscriber_streaming_version(2)
    sub.ipc.importer.atomic = atomic  # type: ignore[union-attr]
    sub.ipc.on_ready(IpcReady(version=3, bucket=bucket, slot=0, n_buckets=2))
    assert lock.max == 1, "the ipc path entered the lock the stream held"
    assert sub.fetcher.update is None and "superseded by version 3" in sub.last_error
    imp: Any = sub.ipc.importer
    assert imp.readies, "the newer ipc version was not taken"
    assert lock.depth == 0


def test_an_older_ipc_version_is_refused_while_a_stream_holds_the_lock() -> None:
    sub, lock, sent = subscriber_streaming_version(3)
    sub.ipc.importer.atomic = False  # type: ignore[union-attr]  # writes the live weights at once
    sub.ipc.on_ready(IpcReady(version=2, bucket=0, slot=0, n_buckets=2))
    assert lock.max == 1, "the ipc path entered the lock the stream held"
    imp: Any = sub.ipc.importer
    assert not imp.readies and imp.abandoned
    acks = [m for m in sent if isinstance(m, IpcAck)]
    assert acks and not acks[0].ok and "being written by shm/tcp" in acks[0].error
    assert sub.fetcher.update is not None and lock.depth == 1  # the stream goes on
