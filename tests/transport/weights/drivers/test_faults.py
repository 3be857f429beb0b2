"""Weight-update faults with real processes (spawned) and SIGKILL on purpose.

Each test checks that every worker ends on a consistent version (the digest of its
weights equals the digest of one complete version) or, copying as it verifies
(``atomic=False``, the default), says it holds none (version ``-1``) until the next
complete version restores it, and that the failure is reported clearly. Workers report their state through the protocol itself (Hello and Ack carry a
digest of the weights), so the test observes them the way a trainer would.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import (
    BUCKET,
    FaultyPublisher,
    digest_of,
    make_state,
    subscriber_proc,
    variant_target,
    zeros_like,
)
from transport.weights import WeightPublisher, state_digest


def publisher_proc(endpoint: str, n_workers: int, die_at: tuple[int, int]) -> None:
    """A trainer that publishes version 1, then dies serving bucket die_at[1] of version
    die_at[0] once every worker asked for it (so each holds the buckets before it,
    whatever its pace; an earlier asker's Fetch is left unanswered meanwhile)."""
    torch.set_num_threads(1)
    asked: set[str] = set()

    def fault(worker: str, version: int, index: int) -> str | None:
        if (version, index) != die_at:
            return None
        asked.add(worker)
        return "die" if len(asked) == n_workers else "hold"

    pub = FaultyPublisher(fault, endpoint, bucket_bytes=BUCKET, shm=False, heartbeat_interval=0.1)
    pub.wait_for_workers(n_workers, 60)
    pub.publish_and_wait(make_state(1), 1, timeout=60)
    pub.publish(make_state(2), 2)
    pub.wait(2, 60)
    raise SystemExit("the fault hook should have killed this process")


def disk_writer_proc(path: str) -> None:
    """A trainer saving version after version to disk until it is killed."""
    from transport.weights.disk import save_weights

    torch.set_num_threads(1)
    v = 0
    while True:
        v += 1
        save_weights(path, make_state(v, scale=400), v)


@pytest.fixture
def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_subscriber_killed_mid_update(procs: Callable[..., Any]) -> None:
    with WeightPublisher(
        bucket_bytes=BUCKET, shm=False, heartbeat_interval=0.1, worker_timeout=3.0
    ) as pub:
        procs(subscriber_proc, pub.endpoint, [("a", "good")], {})
        victim = procs(subscriber_proc, pub.endpoint, [("b", "good")], {"die_at": ("b", 2, 3)})
        pub.wait_for_workers(2, 60)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).ok
        res = pub.wait(pub.publish(make_state(2), 2).version, 30)
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL
        assert list(res.applied) == ["a"] and res.applied["a"].digest == digest_of(2)
        assert "worker lost" in res.failed["b"]
        # Restarted with the same id and fresh (zero) weights: it catches up from the
        # snapshot to the current version.
        procs(subscriber_proc, pub.endpoint, [("b", "good")], {})
        wait_for(
            lambda: pub.workers()["b"].version == 2 and pub.workers()["b"].alive,
            30,
            "the restarted worker to catch up",
        )
        assert pub.workers()["b"].digest == digest_of(2)
        assert pub.wait(2, 10).ok


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_publisher_killed_mid_update(
    procs: Callable[..., Any], endpoint: str, atomic: bool
) -> None:
    trainer = procs(publisher_proc, endpoint, 2, (2, 3))
    procs(
        subscriber_proc,
        endpoint,
        [("a", "good"), ("b", "good")],
        {"publisher_timeout": 1.0, "fetch_timeout": 0.5, "atomic": atomic},
    )
    trainer.join(90)
    assert trainer.exitcode == -signal.SIGKILL
    with WeightPublisher(endpoint, bucket_bytes=BUCKET, shm=False, heartbeat_interval=0.1) as pub:
        pub.wait_for_workers(2, 30)
        if atomic:
            # A new trainer finds both workers still on version 1, intact.
            wait_for(
                lambda: all(w.version == 1 for w in pub.workers().values()), 30, "workers' Hellos"
            )
            assert {w.digest for w in pub.workers().values()} == {digest_of(1)}
        else:
            # Buckets 0-2 of version 2 were in the weights when the trainer died: both
            # workers say they hold no complete version (and serve none).
            wait_for(
                lambda: all(w.version == -1 for w in pub.workers().values()), 30, "workers' Hellos"
            )
            assert digest_of(1) not in {w.digest for w in pub.workers().values()}
        res = pub.publish_and_wait(make_state(3), 3, timeout=60)
        assert {a.digest for a in res.applied.values()} == {digest_of(3)}
        wait_for(lambda: all(w.version == 3 for w in pub.workers().values()), 30, "Hellos")


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_corrupted_bucket(procs: Callable[..., Any], shm: bool, atomic: bool) -> None:
    def corrupt(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if worker == "b" and version == 2 and index == 1 else None

    with FaultyPublisher(corrupt, bucket_bytes=BUCKET, shm=shm, heartbeat_interval=0.1) as pub:
        opts = {"shm": shm, "atomic": atomic}
        procs(subscriber_proc, pub.endpoint, [("a", "good"), ("b", "good")], opts)
        pub.wait_for_workers(2, 60)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).ok
        res = pub.wait(pub.publish(make_state(2), 2).version, 30)
        assert list(res.applied) == ["a"] and res.applied["a"].digest == digest_of(2)
        assert "bucket 1 of version 2" in res.failed["b"] and "checksum" in res.failed["b"]
        wait_for(lambda: pub.workers()["b"].digest is not None, 10, "b's digest")
        if atomic:
            assert pub.workers()["b"].version == 1
            assert pub.workers()["b"].digest == digest_of(1)  # previous weights, intact
        else:
            # Bucket 0 of version 2 is in b's weights: b reports no complete version.
            assert "weights are mixed" in res.failed["b"]
            wait_for(lambda: pub.workers()["b"].version == -1, 10, "b's report")
            assert pub.workers()["b"].digest not in (digest_of(1), digest_of(2))
        # The next complete version restores b.
        res = pub.publish_and_wait(make_state(3), 3, timeout=60)
        assert res.ok and {a.digest for a in res.applied.values()} == {digest_of(3)}
        wait_for(lambda: pub.workers()["b"].version == 3, 10, "b's Hello")


def test_name_shape_dtype_mismatch(procs: Callable[..., Any]) -> None:
    variants = ["good", "name", "shape", "dtype"]
    with WeightPublisher(bucket_bytes=BUCKET, heartbeat_interval=0.1) as pub:
        procs(subscriber_proc, pub.endpoint, [(v, v) for v in variants], {"shm": True})
        pub.wait_for_workers(4, 60)
        res = pub.wait(pub.publish(make_state(1), 1).version, 30)
        assert list(res.applied) == ["good"] and res.applied["good"].digest == digest_of(1)
        assert "'layers.0.norm.weight' is not a parameter" in res.failed["name"]
        assert "missing from the update: ['layers.0.norm.renamed']" in res.failed["name"]
        assert "shape mismatch for 'layers.0.mlp.weight'" in res.failed["shape"]
        assert "model has [65, 30], update has [65, 31]" in res.failed["shape"]
        assert "dtype mismatch for 'layers.0.attn.weight'" in res.failed["dtype"]
        assert "model has float32, update has bfloat16" in res.failed["dtype"]
        workers = pub.workers()
        for v in variants[1:]:
            assert workers[v].version == -1
            assert workers[v].digest == state_digest(variant_target(v))  # untouched


def test_disk_writer_killed_mid_write(procs: Callable[..., Any], tmp_path: Any) -> None:
    from transport.weights.disk import latest_version, load_weights

    writer = procs(disk_writer_proc, str(tmp_path))
    wait_for(lambda: (latest_version(tmp_path) or 0) >= 3, 60, "three versions on disk")
    writer.kill()  # SIGKILL, most likely in the middle of writing the next version
    writer.join(10)
    assert writer.exitcode == -signal.SIGKILL
    target = zeros_like(make_state(0, scale=400))
    v = load_weights(tmp_path, target)
    assert v >= 3
    assert state_digest(target) == state_digest(make_state(v, scale=400))  # complete
