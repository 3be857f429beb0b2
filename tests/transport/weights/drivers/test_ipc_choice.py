"""The ipc path inside WeightPublisher / WeightSubscriber: chosen per worker, reported
per worker (``UpdateResult.paths``, ``WeightSubscriber.path``), falling back to shm/tcp.

Real processes; CPU shared storage (torch's ``_share_filename_cpu_``) stands in for CUDA
IPC handles, so the publisher runs with ``ipc="cpu"`` (on CUDA tensors ``"auto"`` picks
ipc by itself).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import make_state, zeros_like
from transport.weights import WeightPublisher, WeightSubscriber, state_digest

BUCKET = 2048  # several buckets per version: more than the two slots


class _DieOnEntry:
    """A lock whose ``n``-th entry SIGKILLs the process: the ipc path enters the lock
    once per version, after reading every slot and before acking the last ones."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0

    def __enter__(self) -> None:
        self.count += 1
        if self.count == self.n:
            os.kill(os.getpid(), signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        return None


def worker_proc(endpoint: str, wid: str, opts: dict[str, Any]) -> None:
    """One worker process hosting one subscriber until the test kills it."""
    torch.set_num_threads(1)
    if opts.get("refuse_ipc"):
        from transport.weights.routes.ipc import IpcImporter, IpcRefused

        def refuse(self: Any, offer: Any) -> Any:
            raise IpcRefused("refused by the test")

        IpcImporter.open = refuse  # type: ignore[method-assign]
    die = opts.get("die_on_lock")
    WeightSubscriber(
        endpoint,
        zeros_like(make_state(0)),
        worker_id=wid,
        report_digest=True,
        heartbeat_interval=0.1,
        path=opts.get("path"),
        lock=_DieOnEntry(die) if die else None,
        publisher_timeout=opts.get("publisher_timeout", 10.0),
    ).start()
    threading.Event().wait()


def publisher(**kw: Any) -> WeightPublisher:
    return WeightPublisher(
        bucket_bytes=BUCKET, heartbeat_interval=0.1, worker_timeout=5.0, ipc="cpu", **kw
    )


def wait_ipc_open(pub: WeightPublisher, n: int) -> None:
    """Until ``n`` workers asked for the ipc path (the slots are offered at the first
    version that takes it)."""
    wait_for(lambda: len(pub.ipc.hellos) >= n, 30, "the workers' IpcHello")


@pytest.mark.slow
def test_two_workers_take_the_ipc_path_bit_identical(procs: Callable[..., Any]) -> None:
    with publisher() as pub:
        for wid in ("a", "b"):
            procs(worker_proc, pub.endpoint, wid, {})
        pub.wait_for_workers(2, 60)
        wait_ipc_open(pub, 2)
        for v in (1, 2, 3):
            res = pub.publish_and_wait(make_state(v), v, timeout=60)
            assert sorted(res.applied) == ["a", "b"]
            assert res.paths == {"a": "ipc", "b": "ipc"}
            for ack in res.applied.values():
                assert ack.via == "ipc" and ack.digest == state_digest(make_state(v))
        assert pub.counters.get("ipc_versions") == 3
        assert {w.path for w in pub.workers().values()} == {"ipc"}


@pytest.mark.slow
def test_a_refused_offer_falls_back_to_shm(procs: Callable[..., Any]) -> None:
    with publisher() as pub:
        procs(worker_proc, pub.endpoint, "ok", {})
        procs(worker_proc, pub.endpoint, "refused", {"refuse_ipc": True})
        procs(worker_proc, pub.endpoint, "forced-shm", {"path": "shm"})
        pub.wait_for_workers(3, 60)
        wait_ipc_open(pub, 2)  # "forced-shm" never asks
        for v in (1, 2):
            res = pub.publish_and_wait(make_state(v), v, timeout=60)
            assert res.paths == {"forced-shm": "shm", "ok": "ipc", "refused": "shm"}
            for ack in res.applied.values():
                assert ack.digest == state_digest(make_state(v))


@pytest.mark.slow
def test_a_worker_killed_mid_version_does_not_block_the_next(
    procs: Callable[..., Any],
) -> None:
    with publisher(ipc_timeout=30.0) as pub:
        procs(worker_proc, pub.endpoint, "a", {})
        victim = procs(worker_proc, pub.endpoint, "b", {"die_on_lock": 2})
        pub.wait_for_workers(2, 60)
        wait_ipc_open(pub, 2)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).paths == {
            "a": "ipc",
            "b": "ipc",
        }
        # b dies holding version 2's slots (read, not acked).
        res = pub.wait(pub.publish(make_state(2), 2).version, 30)
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL
        assert list(res.applied) == ["a"] and res.paths["a"] == "ipc"
        assert "lost" in res.failed["b"]
        # The slots b held are released: version 3 is packed and applied by a.
        res = pub.publish_and_wait(make_state(3), 3, timeout=30, workers=["a"])
        assert res.applied["a"].digest == state_digest(make_state(3))
        assert res.paths == {"a": "ipc"}


def test_bad_path_values_are_refused() -> None:
    with pytest.raises(ValueError, match="ipc='always': expected one of auto, cpu, off"):
        WeightPublisher(ipc="always")
    with pytest.raises(ValueError, match="path='nccl': expected one of ipc, shm, tcp"):
        WeightSubscriber("tcp://127.0.0.1:1", zeros_like(make_state(0)), path="nccl")
    with pytest.raises(ValueError, match="path='ipc'"):
        WeightSubscriber("tcp://127.0.0.1:1", zeros_like(make_state(0)), path="ipc", dtype="auto")


@pytest.mark.slow
def test_a_late_joiner_catches_up_by_shm_then_takes_ipc(procs: Callable[..., Any]) -> None:
    with publisher() as pub:
        procs(worker_proc, pub.endpoint, "a", {})
        pub.wait_for_workers(1, 60)
        wait_ipc_open(pub, 1)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).paths == {"a": "ipc"}
        procs(worker_proc, pub.endpoint, "late", {})
        # It catches up from the snapshot (ipc carries only whole versions), then asks.
        wait_for(
            lambda: pub.workers().get("late") is not None and pub.workers()["late"].version == 1,
            30,
            "the late joiner to catch up",
        )
        assert pub.workers()["late"].path == "shm"
        assert pub.workers()["late"].digest == state_digest(make_state(1))
        wait_ipc_open(pub, 2)
        res = pub.publish_and_wait(make_state(2), 2, timeout=60)
        assert res.paths == {"a": "ipc", "late": "ipc"}
        assert {a.digest for a in res.applied.values()} == {state_digest(make_state(2))}


@pytest.mark.slow
def test_ipc_bytes_are_counted_under_the_ipc_label() -> None:
    prom = pytest.importorskip("prometheus_client")

    def value(name: str, path: str) -> float:
        return float(prom.REGISTRY.get_sample_value(name, {"path": path}) or 0.0)

    names = ("fastio_publisher_bytes_total", "fastio_subscriber_bytes_total")
    before = {(n, p): value(n, p) for n in names for p in ("ipc", "shm", "tcp")}
    with publisher() as pub:
        sub = WeightSubscriber(pub.endpoint, zeros_like(make_state(0)), heartbeat_interval=0.1)
        with sub:
            pub.wait_for_workers(1, 30)
            wait_ipc_open(pub, 1)
            res = pub.publish_and_wait(make_state(1), 1, timeout=30)
            assert res.paths == {sub.worker_id: "ipc"}
            assert sub.path == "ipc" and sub.ipc_open and sub.version == 1
            nbytes = sub.last_stats.bytes
    assert nbytes > 0
    for n in names:
        assert value(n, "ipc") - before[(n, "ipc")] == nbytes
        assert value(n, "shm") == before[(n, "shm")]  # the worker fetched nothing else
        assert value(n, "tcp") == before[(n, "tcp")]


@pytest.mark.slow
def test_update_weights_over_the_ipc_path_with_real_workers(
    spawn: Callable[..., Any],
) -> None:
    from transport import FabricController
    from transport.engine import TinyLM
    from transport.weights import update_weights

    plugin = "transport.weights.update:subscribe"
    with publisher() as pub:
        workers = []
        for wid, path in (("gpu0", "ipc"), ("far", "tcp")):
            args = ["--bind", "tcp://127.0.0.1:0", "--worker-id", wid, "--plugin", plugin]
            for opt in (f"weights_endpoint={pub.endpoint}", f"weights_path={path}"):
                args += ["--plugin-opt", opt]
            workers.append(spawn(*args, "--plugin-opt", "weights_digest=1"))
        pub.wait_for_workers(2, 30)
        wait_ipc_open(pub, 1)
        with FabricController([w.address for w in workers]) as ctl:
            for v in (1, 2):
                model = TinyLM(seed=v)
                res = update_weights(ctl, pub, model, version=v, timeout=30)
                assert res.ok and res.paths == {"far": "tcp", "gpu0": "ipc"}
                digest = state_digest(model.state_dict())
                assert {a.digest for a in res.applied.values()} == {digest}
                assert {s.version for s in ctl.health(timeout=5).values()} == {v}


class _NoReadies(WeightPublisher):
    """Offers the slots but never delivers a version by ipc (tests only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ipc.publish = lambda tensors, version: None  # type: ignore[method-assign]


@pytest.mark.slow
def test_a_version_that_never_comes_by_ipc_is_fetched_by_shm(
    procs: Callable[..., Any],
) -> None:
    pub = _NoReadies(bucket_bytes=BUCKET, heartbeat_interval=0.1, ipc="cpu")
    with pub:
        procs(worker_proc, pub.endpoint, "a", {"publisher_timeout": 1.0})
        pub.wait_for_workers(1, 60)
        wait_ipc_open(pub, 1)
        res = pub.publish_and_wait(make_state(1), 1, timeout=30)
        assert (
            pub.ipc.exporter is not None and pub.ipc.exporter.workers["a"].opened
        )  # it deferred to ipc
        assert res.paths == {"a": "shm"}
        assert res.applied["a"].digest == state_digest(make_state(1))


@pytest.mark.slow
def test_a_closed_subscriber_says_goodbye_and_does_not_hold_slots() -> None:
    with publisher(ipc_timeout=5.0) as pub:
        subs = [
            WeightSubscriber(pub.endpoint, zeros_like(make_state(0)), heartbeat_interval=0.1)
            for _ in range(2)
        ]
        for s in subs:
            s.start()
        try:
            pub.wait_for_workers(2, 30)
            wait_ipc_open(pub, 2)
            assert set(pub.publish_and_wait(make_state(1), 1, timeout=30).paths.values()) == {"ipc"}
            subs[1].close()  # its process lives on: only its goodbye frees the slots
            assert pub.ipc.exporter is not None
            wait_for(lambda: subs[1].worker_id not in pub.ipc.exporter.workers, 10, "the goodbye")
            res = pub.publish_and_wait(make_state(2), 2, timeout=30, workers=[subs[0].worker_id])
            assert res.paths == {subs[0].worker_id: "ipc"}
        finally:
            for s in subs:
                s.close()


@pytest.mark.slow
def test_a_version_read_only_by_ipc_is_staged_only_when_someone_needs_it(
    procs: Callable[..., Any],
) -> None:
    """Every live worker on ipc and the slots holding whole versions: nothing is packed
    for shm/tcp; a late joiner gets the version staged then, from the slots."""
    with publisher(ipc_slots=None) as pub:
        procs(worker_proc, pub.endpoint, "a", {})
        pub.wait_for_workers(1, 60)
        wait_ipc_open(pub, 1)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).paths == {"a": "ipc"}
        assert pub.counters["versions_not_staged"] == 1
        assert "buffers_created" not in pub.counters  # no segment, no private buffer
        procs(worker_proc, pub.endpoint, "late", {})
        wait_for(
            lambda: pub.workers().get("late") is not None and pub.workers()["late"].version == 1,
            30,
            "the late joiner to catch up",
        )
        assert pub.counters["versions_staged_late"] == 1
        assert pub.workers()["late"].path == "shm"
        assert pub.workers()["late"].digest == state_digest(make_state(1))
        wait_ipc_open(pub, 2)
        res = pub.publish_and_wait(make_state(2), 2, timeout=60)
        assert res.paths == {"a": "ipc", "late": "ipc"}
        assert {a.digest for a in res.applied.values()} == {state_digest(make_state(2))}
        assert pub.counters["versions_not_staged"] == 2
        assert pub.counters["buffers_created"] == 1  # only the late joiner's snapshot


class _GatedIpc(WeightPublisher):
    """Holds the packing of version 2 into the ipc slots until the test opens the gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        super().__init__(*args, **kwargs)
        publish = self.ipc.publish

        def gated(state: Any, version: int) -> None:
            if version == 2:
                self.entered.set()
                self.gate.wait(60)
            publish(state, version)

        self.ipc.publish = gated  # type: ignore[method-assign]


@pytest.mark.slow
def test_a_fetch_during_ipc_packing_is_answered_when_it_ends(procs: Callable[..., Any]) -> None:
    """Every live worker reads by ipc, so version 2 is staged nowhere while it is packed
    into the slots; a worker joining then over TCP asks for it and is answered as soon
    as the packing ends, not when its Fetch times out (here 60 s, with no retry:
    before, the version failed on it)."""
    pub = _GatedIpc(bucket_bytes=BUCKET, heartbeat_interval=0.1, ipc="cpu", ipc_slots=None)
    late = WeightSubscriber(
        pub.endpoint,
        zeros_like(make_state(0)),
        worker_id="late",
        path="tcp",
        fetch_timeout=60.0,
        retries=1,
        heartbeat_interval=0.1,
    )
    with pub:
        procs(worker_proc, pub.endpoint, "a", {})
        pub.wait_for_workers(1, 60)
        wait_ipc_open(pub, 1)
        assert pub.publish_and_wait(make_state(1), 1, timeout=60).paths == {"a": "ipc"}
        publishing = threading.Thread(target=pub.publish, args=(make_state(2), 2), daemon=True)
        publishing.start()
        assert pub.entered.wait(30)
        with late:  # joins now
            wait_for(lambda: pub.counters.get("fetches_deferred", 0) >= 1, 30, "a deferred fetch")
            pub.gate.set()
            publishing.join(30)
            assert late.wait_version(2, 20), (late.last_error, late.counters)
            assert state_digest(late.targets) == state_digest(make_state(2))
            res = pub.wait(2, 30)
            assert res.ok and res.paths == {"a": "ipc", "late": "tcp"}, res
