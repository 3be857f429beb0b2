"""Weight updates: bucketing, publisher/subscriber over real sockets (in one process,
the worker side in its thread), shared memory and its fallback, disk, bad input.

Multi-process faults (SIGKILL mid-update, corrupt buckets, mismatches) live in
``drivers/test_faults.py``; the process-group path and the fabric integration in
``test_dist.py``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

import fastio
import transport.weights as tw
from fastio.weight_msgs import (
    PUBLISHER_TO_SUBSCRIBER,
    WeightAck,
    WeightAnnounce,
    WeightBucket,
    WeightError,
    WeightFetch,
    WeightHello,
    WeightWelcome,
)
from tests.helpers import free_port
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import equal, make_state, plan_for, zeros_like
from transport.weights import (
    BucketApplier,
    WeightMismatchError,
    WeightPublisher,
    WeightSubscriber,
    check_manifest,
    pack_bucket,
    plan_buckets,
    state_digest,
)
from transport.weights.bucket import ALIGNMENT, Hasher, checksum
from transport.weights.disk import MARKER, latest_version, load_weights, save_weights
from transport.weights.routes import shm as wshm

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.int32, torch.int16]  # fmt: skip


# -- bucketing -----------------------------------------------------------------------
def test_all_is_complete_and_sorted() -> None:
    # isort style (ruff RUF022): CONSTANTS, then Classes, then functions
    def key(n: str) -> tuple[int, str]:
        return (0 if n.isupper() else 1 if n[0].isupper() else 2, n)

    assert tw.__all__ == sorted(tw.__all__, key=key)
    for name in tw.__all__:
        assert hasattr(tw, name), name


def test_plan_respects_bucket_size_alignment_and_order() -> None:
    sd = make_state(0)
    plan = plan_for(sd, bucket_bytes=4096)
    names = [t.name for b in plan for t in b.tensors]
    assert names == list(sd)
    for b in plan:
        assert b.nbytes <= 4096 or len(b.tensors) == 1  # only a lone big tensor exceeds
        for t in b.tensors:
            assert t.offset % ALIGNMENT == 0
            assert t.nbytes == sd[t.name].numel() * sd[t.name].element_size()
    # buckets lie back to back (aligned) in one segment
    for a, b in itertools.pairwise(plan):
        assert b.shm_offset >= a.shm_offset + a.nbytes
        assert b.shm_offset % ALIGNMENT == 0


def test_plan_rejects_duplicates_and_bad_sizes() -> None:
    with pytest.raises(WeightMismatchError, match="duplicate"):
        plan_buckets([("a", "float32", (2,)), ("a", "float32", (2,))])
    with pytest.raises(ValueError):
        plan_buckets([("a", "float32", (2,))], bucket_bytes=0)
    with pytest.raises(WeightMismatchError, match="unknown dtype"):
        plan_buckets([("a", "complex64", (2,))])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_apply_roundtrip_every_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    src = {
        "a": (torch.randn(7, 5, generator=g) * 50).to(dtype),
        "b": (torch.randn(3, generator=g) * 50).to(dtype),
        "c": (torch.randn((), generator=g) * 50).to(dtype),
    }
    plan = plan_for(src, 1 << 20)
    dst = zeros_like(src)
    for info in plan:
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        pack_bucket(info, src, buf)
        BucketApplier(dst).apply(info, [buf])
    assert equal(src, dst)


def test_apply_from_chunks_split_anywhere_and_noncontiguous() -> None:
    src = make_state(2)
    src["t"] = torch.randn(12, 10).t()  # non-contiguous source
    plan = plan_for(src, 1 << 20)
    (info,) = plan
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    rng = np.random.default_rng(0)
    cuts = sorted(rng.choice(np.arange(1, info.nbytes), size=40, replace=False).tolist())
    chunks = [buf[a:b] for a, b in zip([0, *cuts], [*cuts, info.nbytes], strict=True)]
    dst = zeros_like(src)
    dst["t"] = torch.zeros(12, 10).t()  # non-contiguous target: written in place
    ref = dst["t"]
    BucketApplier(dst).apply(info, chunks)
    assert equal(src, dst)
    assert dst["t"] is ref


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_copies_spread_over_threads_land_where_one_thread_puts_them(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transport.weights.bucket as wb

    monkeypatch.setattr(wb, "_THREAD_PIECE", 256)  # small pieces: tensors cut across threads
    src = make_state(4, scale=8)
    (info,) = plan_for(src, 1 << 20)
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    third = info.nbytes // 3
    chunks = [buf[:third], buf[third : 2 * third], buf[2 * third :]]
    dst = zeros_like(src)
    applier = BucketApplier(dst, copy_threads=threads)
    applier.apply(info, chunks)
    assert equal(src, dst)
    assert applier._pool is not None  # the threads did run


def test_apply_skips_empty_chunks_and_refuses_short_ones() -> None:
    src = make_state(3)
    (info,) = plan_for(src, 1 << 20)
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    half = info.nbytes // 2
    empty = buf[:0]
    chunks = [empty, buf[:half], empty, empty, buf[half:], empty]
    dst = zeros_like(src)
    BucketApplier(dst).apply(info, chunks)
    assert equal(src, dst)
    with pytest.raises(ValueError, match="end before"):
        BucketApplier(zeros_like(src)).apply(info, [buf[: info.nbytes - 8]])


def test_padding_is_zeroed_so_checksums_are_deterministic() -> None:
    src = {"a": torch.ones(3), "b": torch.ones(3)}
    (info,) = plan_for(src, 1 << 20)
    sums = []
    for fill in (0x00, 0xAB):
        buf = torch.full((info.nbytes,), fill, dtype=torch.uint8)
        pack_bucket(info, src, buf)
        sums.append(checksum([buf.numpy()]))
    assert sums[0] == sums[1]


def test_checksum_algorithms_match_their_libraries() -> None:
    data = np.arange(100_000, dtype=np.uint32).view(np.uint8)
    h = Hasher("crc32")
    h.update(data[:777])
    h.update(data[777:])
    assert h.digest() == zlib.crc32(data)
    if "xxh3_64" in tw.bucket.CHECKSUM_ALGOS:
        import xxhash

        assert checksum([data[:5], data[5:]], "xxh3_64") == xxhash.xxh3_64_intdigest(data)
    with pytest.raises(ValueError, match="not available"):
        Hasher("md5")


def test_check_manifest_names_every_problem() -> None:
    sd = make_state(0)
    plan = plan_for(sd, 1 << 20)
    check_manifest(plan, sd)
    bad = dict(sd)
    bad["layers.0.norm.weight"] = torch.zeros(34)
    bad["embed.weight"] = torch.zeros(97, 33, dtype=torch.float16)
    del bad["steps"]
    bad["extra"] = torch.zeros(1)
    with pytest.raises(WeightMismatchError) as ei:
        check_manifest(plan, bad)
    msg = str(ei.value)
    assert "shape mismatch for 'layers.0.norm.weight'" in msg
    assert "dtype mismatch for 'embed.weight'" in msg
    assert "'steps' is not a parameter" in msg
    assert "missing from the update: ['extra']" in msg
    # not strict: a subset of the model may be updated
    sub = {k: v for k, v in sd.items() if k != "mask"}
    check_manifest(plan_for(sub, 1 << 20), sd, strict=False)


# -- publisher / subscriber ----------------------------------------------------------
@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


class Pair:
    """A publisher and its subscribers, closed at teardown."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.ctx = ctx
        self.pub: WeightPublisher | None = None
        self.subs: list[WeightSubscriber] = []

    def publisher(self, **kw: Any) -> WeightPublisher:
        kw.setdefault("heartbeat_interval", 0.1)
        fault = kw.pop("fault", None)
        if fault is not None:
            from tests.transport.weights.helpers import FaultyPublisher

            self.pub = FaultyPublisher(fault, context=self.ctx, **kw)
        else:
            self.pub = WeightPublisher(context=self.ctx, **kw)
        return self.pub

    def subscriber(self, target: Any, **kw: Any) -> WeightSubscriber:
        assert self.pub is not None
        kw.setdefault("heartbeat_interval", 0.1)
        kw.setdefault("report_digest", True)
        s = WeightSubscriber(self.pub.endpoint, target, context=self.ctx, **kw).start()
        self.subs.append(s)
        return s

    def close(self) -> None:
        for s in self.subs:
            s.close()
        if self.pub is not None:
            self.pub.close()


@pytest.fixture
def pair(ctx: zmq.Context[Any]) -> Iterator[Pair]:
    p = Pair(ctx)
    yield p
    p.close()


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_versions_reach_every_worker_in_place(pair: Pair, shm: bool) -> None:
    pub = pair.publisher(bucket_bytes=8192, chunk_bytes=1000, shm=shm)
    targets = [zeros_like(make_state(0)) for _ in range(2)]
    refs = [dict(t) for t in targets]
    subs = [pair.subscriber(t, shm=shm, worker_id=f"w{i}") for i, t in enumerate(targets)]
    pub.wait_for_workers(2, 10)
    for version in (1, 2, 3):
        src = make_state(version)
        res = pub.publish_and_wait(src, version, timeout=20)
        assert sorted(res.applied) == ["w0", "w1"] and not res.failed and not res.missing
        for t, ref in zip(targets, refs, strict=True):
            assert equal(t, src)
            assert all(t[k] is ref[k] for k in t)  # the same tensors, written in place
        for ack in res.applied.values():
            assert ack.digest == state_digest(src)
            assert ack.via == ("shm" if shm and wshm.available() else "tcp")
            assert ack.stats["b0_verify_s"] >= 0 and "b1_apply_s" in ack.stats
    assert all(s.version == 3 for s in subs)
    assert len(pub.publish(make_state(4), 4).buckets) > 2


def test_ipc_endpoint(pair: Pair, tmp_path: Path) -> None:
    pub = pair.publisher(endpoint=f"ipc://{tmp_path}/w.sock", shm=False)
    assert pub.pub_endpoint == f"ipc://{tmp_path}/w.sock.pub"
    t = zeros_like(make_state(0))
    pair.subscriber(t)
    pub.wait_for_workers(1, 10)
    pub.publish_and_wait(make_state(5), 5, timeout=20)
    assert equal(t, make_state(5))


def test_late_joiner_catches_up_from_the_snapshot(pair: Pair) -> None:
    pub = pair.publisher(bucket_bytes=4096)
    pub.publish(make_state(1), 1)
    pub.publish(make_state(2), 2)  # nobody listened: the snapshot is all there is
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t)
    assert sub.wait_version(2, 20)
    assert equal(t, make_state(2))
    assert pub.wait(2, 10).ok


def test_lost_announcements_are_detected_by_sequence_numbers(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PUB drops (slow joiner, HWM): the Heartbeat's sequence number reveals the gap and
    the worker fetches the state over the ROUTER."""
    pub = pair.publisher(shm=False)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t)
    pub.wait_for_workers(1, 10)
    dec = fastio.Decoder(PUBLISHER_TO_SUBSCRIBER)

    def is_announce(frames: list[Any]) -> bool:
        return isinstance(dec.decode([bytes(f) for f in frames]), WeightAnnounce)

    class DropAnnounces:
        def __init__(self, sock: Any) -> None:
            self.sock = sock

        def send_multipart(self, frames: list[Any], *a: Any, **kw: Any) -> Any:
            return None if is_announce(frames) else self.sock.send_multipart(frames, *a, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.sock, name)

    real_reply = pub.serving.reply
    monkeypatch.setattr(pub.serving, "pub", DropAnnounces(pub.serving.pub))
    monkeypatch.setattr(
        pub.serving, "reply", lambda ident, frames, track=False: (
            None if is_announce(frames) else real_reply(ident, frames, track)
        ),
    )  # fmt: skip
    pub.publish(make_state(1), 1)
    assert pub.wait(1, 20).ok and equal(t, make_state(1))
    # The version may come by a Hello's Welcome first; the next Heartbeat shows the gap.
    wait_for(lambda: sub.counters.get("gaps", 0) >= 1, 10, "the gap counted")


def test_newer_version_supersedes_one_in_flight(pair: Pair) -> None:
    pub = pair.publisher(bucket_bytes=2048, chunk_bytes=512, shm=False)
    t = zeros_like(make_state(0))
    seen: list[tuple[int, int]] = []
    sub = pair.subscriber(t, on_progress=lambda v, i: seen.append((v, i)))
    pub.wait_for_workers(1, 10)
    pub.publish(make_state(1), 1)
    pub.publish(make_state(2), 2)
    assert pub.wait(2, 20).ok
    assert sub.version == 2 and equal(t, make_state(2))


def test_transient_corruption_is_refetched(pair: Pair) -> None:
    hits: list[int] = []

    def corrupt_once(worker: str, version: int, index: int) -> str | None:
        if index == 1 and not hits:
            hits.append(index)
            return "corrupt"
        return None

    pub = pair.publisher(bucket_bytes=4096, shm=False, fault=corrupt_once)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t)
    pub.wait_for_workers(1, 10)
    assert pub.wait(pub.publish(make_state(1), 1).version, 20).ok
    assert equal(t, make_state(1))
    assert sub.counters["checksum_failures"] == 1 and sub.counters["refetches"] == 1


def test_persistent_corruption_keeps_previous_weights(pair: Pair) -> None:
    def corrupt(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if version == 2 and index == 2 else None

    pub = pair.publisher(bucket_bytes=4096, shm=False, fault=corrupt)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t, retries=2, atomic=True)
    pub.wait_for_workers(1, 10)
    pub.publish_and_wait(make_state(1), 1, timeout=20)
    res = pub.wait(pub.publish(make_state(2), 2).version, 20)
    assert not res.ok
    (err,) = res.failed.values()
    assert "bucket 2 of version 2 failed its checksum 2 times" in err
    assert sub.version == 1 and equal(t, make_state(1))  # never mixed
    assert pub.workers()[sub.worker_id].digest == state_digest(make_state(1))


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_later_bucket_failing_leaves_the_worker_refusing_to_serve(pair: Pair, shm: bool) -> None:
    """One-pass mode (``atomic=False``): buckets 0 and 1 are already in the weights when bucket
    2 fails; the worker says it holds no complete version until the next one lands."""
    if shm and not wshm.available():
        pytest.skip("no /dev/shm")

    def corrupt(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if version == 2 and index == 2 else None

    pub = pair.publisher(bucket_bytes=4096, shm=shm, fault=corrupt)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t, retries=2, shm=shm, report_digest=True, atomic=False)
    pub.wait_for_workers(1, 10)
    assert pub.publish_and_wait(make_state(1), 1, timeout=20).ok and sub.consistent
    res = pub.wait(pub.publish(make_state(2), 2).version, 20)
    err = res.failed[sub.worker_id]
    assert "bucket 2 of version 2" in err and "checksum" in err
    assert "weights are mixed" in err and "not serving" in err
    assert not sub.consistent and sub.version == 1 and not equal(t, make_state(1))
    # Its Ack and Hellos report no complete version.
    wait_for(lambda: pub.workers()[sub.worker_id].version == -1, 10, "the worker's report")
    # The next complete version restores it.
    res = pub.publish_and_wait(make_state(3), 3, timeout=20)
    assert res.ok and sub.consistent and sub.version == 3 and equal(t, make_state(3))
    assert res.applied[sub.worker_id].digest == state_digest(make_state(3))
    wait_for(lambda: pub.workers()[sub.worker_id].version == 3, 10, "the Hello saying so")


def test_the_lock_is_released_only_once_the_weights_are_marked_mixed(pair: Pair) -> None:
    """Under a lock that refuses mixed weights, the engine behind it may serve again the
    moment the lock is released: by then the worker must already say they are mixed."""
    seen: list[bool] = []  # the worker's consistency at each release of its lock
    subs: list[WeightSubscriber] = []

    class RecordingLock:
        refuses_mixed = True

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            seen.append(subs[0].consistent)

    def corrupt(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if version == 2 and index == 2 else None

    pub = pair.publisher(bucket_bytes=4096, shm=False, fault=corrupt)
    subs.append(
        pair.subscriber(zeros_like(make_state(0)), retries=1, shm=False, lock=RecordingLock())
    )
    pub.wait_for_workers(1, 10)
    assert pub.publish_and_wait(make_state(1), 1, timeout=20).ok and seen == [True]
    res = pub.wait(pub.publish(make_state(2), 2).version, 20)
    assert "weights are mixed" in res.failed[subs[0].worker_id]
    assert seen == [True, False], seen  # released after buckets 0 and 1 landed: mixed


def test_corrupted_shared_memory_is_detected(pair: Pair) -> None:
    if not wshm.available():
        pytest.skip("no /dev/shm")

    def corrupt(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if version == 2 and index == 1 else None

    pub = pair.publisher(bucket_bytes=4096, shm=True, fault=corrupt)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t, atomic=True)
    pub.wait_for_workers(1, 10)
    assert pub.publish_and_wait(make_state(1), 1, timeout=20).applied[sub.worker_id].via == "shm"
    res = pub.wait(pub.publish(make_state(2), 2).version, 20)
    assert "bucket 1 of version 2 fails its checksum in shared memory" in res.failed[sub.worker_id]
    assert sub.version == 1 and equal(t, make_state(1))
    # the next good version goes through
    assert pub.publish_and_wait(make_state(3), 3, timeout=20).ok and equal(t, make_state(3))


def test_mismatch_is_reported_before_touching_weights(pair: Pair) -> None:
    pub = pair.publisher(shm=False)
    good = zeros_like(make_state(0))
    bad = zeros_like(make_state(0))
    bad["layers.0.norm.weight"] = torch.zeros(32)
    before = state_digest(bad)
    pair.subscriber(good, worker_id="good")
    sub_bad = pair.subscriber(bad, worker_id="bad")
    pub.wait_for_workers(2, 10)
    res = pub.wait(pub.publish(make_state(1), 1).version, 20)
    assert list(res.applied) == ["good"]
    assert "shape mismatch for 'layers.0.norm.weight'" in res.failed["bad"]
    assert state_digest(bad) == before and sub_bad.version == -1
    assert sub_bad.counters.get("versions_failed") == 1  # not retried at every Hello


def test_streaming_mode_applies_as_buckets_arrive(pair: Pair) -> None:
    pub = pair.publisher(bucket_bytes=4096, shm=False)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t, atomic=False)
    pub.wait_for_workers(1, 10)
    pub.publish_and_wait(make_state(1), 1, timeout=20)
    assert equal(t, make_state(1)) and sub.consistent


def test_a_copy_failing_half_way_is_reported_as_mixed(pair: Pair) -> None:
    pub = pair.publisher(bucket_bytes=4096, shm=False)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t, atomic=True)
    pub.wait_for_workers(1, 10)
    real = sub.fetcher.applier.apply

    def broken(info: Any, chunks: Any, dests: Any = None) -> None:
        if info.index == 2:
            raise RuntimeError("device lost (test)")
        real(info, chunks, dests)

    sub.fetcher.applier.apply = broken  # type: ignore[method-assign]
    res = pub.wait(pub.publish(make_state(1), 1).version, 20)
    assert "applying failed, weights are mixed" in res.failed[sub.worker_id]
    assert "device lost" in res.failed[sub.worker_id]
    assert not sub.consistent and sub.version == -1
    sub.fetcher.applier.apply = real  # type: ignore[method-assign]
    assert pub.publish_and_wait(make_state(2), 2, timeout=20).ok
    assert sub.consistent and equal(t, make_state(2))


def test_shm_falls_back_to_tcp_when_the_segment_cannot_be_opened(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not wshm.available():
        pytest.skip("no /dev/shm")

    def refuse(name: str) -> Any:
        raise PermissionError(13, "denied (test)")

    monkeypatch.setattr(wshm.ShmSegment, "open", staticmethod(refuse))
    pub = pair.publisher(shm=True)
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t)
    pub.wait_for_workers(1, 10)
    res = pub.publish_and_wait(make_state(1), 1, timeout=20)
    assert next(iter(res.applied.values())).via == "tcp"
    assert sub.counters["shm_fallbacks"] == 1 and equal(t, make_state(1))


def test_other_host_or_private_dev_shm_uses_tcp(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker that cannot read the probe (another host, a container's own /dev/shm).
    monkeypatch.setattr(wshm, "read_probe", lambda name, token: False)
    pub = pair.publisher(shm=None)
    t = zeros_like(make_state(0))
    pair.subscriber(t)
    pub.wait_for_workers(1, 10)
    res = pub.publish_and_wait(make_state(1), 1, timeout=20)
    assert next(iter(res.applied.values())).via == "tcp"


def test_curve_admits_only_known_workers(pair: Pair, tmp_path: Path) -> None:
    import zmq.auth

    from transport.sockets import CurveConfig

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, pub_secret = zmq.auth.create_certificates(str(keys), "trainer")
    good_public, good_secret = zmq.auth.create_certificates(str(keys), "good")
    _, bad_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "good.key").write_bytes(Path(good_public).read_bytes())
    pub = pair.publisher(
        curve=CurveConfig(secret_key_file=pub_secret, authorized_clients_dir=str(allowed))
    )
    server_key = str(keys / "trainer.key")
    good = zeros_like(make_state(0))
    bad = zeros_like(make_state(0))
    pair.subscriber(good, worker_id="good", curve=CurveConfig(good_secret, server_key))
    stranger = pair.subscriber(bad, worker_id="stranger", curve=CurveConfig(bad_secret, server_key))
    pub.wait_for_workers(1, 10)
    res = pub.publish_and_wait(make_state(1), 1, timeout=20)
    assert list(res.applied) == ["good"] and equal(good, make_state(1))
    assert not stranger.wait_version(1, 0.5) and "stranger" not in pub.workers()
    assert pub._auth is not None and pub._auth.denied >= 1


def test_wait_reports_missing_workers_on_timeout(pair: Pair) -> None:
    pub = pair.publisher(shm=False)
    pub.publish(make_state(1), 1)
    res = pub.wait(1, 0.3, workers=["ghost"])
    assert res.missing == ["ghost"] and not res.ok
    with pytest.raises(tw.UpdateIncomplete) as ei:
        pub.publish_and_wait(make_state(2), 2, timeout=0.3, workers=["ghost"])
    assert ei.value.result.missing == ["ghost"]
    with pytest.raises(ValueError, match="not newer"):
        pub.publish(make_state(2), 2)
    with pytest.raises(KeyError):
        pub.wait(99, 0.1)


def test_garbage_to_the_publisher_is_answered_and_counted(pair: Pair, ctx: Any) -> None:
    pub = pair.publisher(shm=False)
    pub.publish(make_state(1), 1)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.setsockopt(zmq.ROUTING_ID, b"probe-peer")
    s.connect(pub.endpoint)
    dec = fastio.Decoder(PUBLISHER_TO_SUBSCRIBER)
    enc = fastio.Encoder()
    try:
        for garbage in ([b"\xff\x00garbage"], [b""], enc.encode(fastio.LLMRequest(input_ids=[1]))):
            s.send_multipart(garbage)
            reply = dec.decode(s.recv_multipart())
            assert isinstance(reply, WeightError) and "bad message" in reply.reason
        # unknown version and bucket: clear errors, the publisher keeps serving
        s.send_multipart(enc.encode(WeightFetch(7, 0)))
        err = dec.decode(s.recv_multipart())
        assert isinstance(err, WeightError) and "not available (latest is 1)" in err.reason
        s.send_multipart(enc.encode(WeightFetch(1, 999)))
        assert "no bucket 999" in dec.decode(s.recv_multipart()).reason
        s.send_multipart(enc.encode(WeightHello("probe", "h", 1)))
        welcome = dec.decode(s.recv_multipart())
        assert isinstance(welcome, WeightWelcome) and welcome.announce.version == 1
        s.send_multipart(enc.encode(WeightFetch(1, 0)))
        piece = dec.decode(s.recv_multipart())
        assert isinstance(piece, WeightBucket) and piece.last
    finally:
        s.close(linger=0)
    assert pub.counters["bad_messages"] == 3
    assert list(pub.workers()) == ["probe-peer"]  # only the Hello made a worker
    t = zeros_like(make_state(0))
    sub = pair.subscriber(t)
    assert pub.wait(1, 20, workers=[sub.worker_id]).ok


def test_garbage_to_the_subscriber_is_counted(pair: Pair, ctx: Any) -> None:
    # A rogue "publisher": the subscriber must survive its messages.
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    t = zeros_like(make_state(0))
    sub = WeightSubscriber(f"tcp://127.0.0.1:{port}", t, context=ctx, heartbeat_interval=0.1)
    sub.start()
    try:
        assert rogue.poll(5000)
        ident = rogue.recv_multipart()[0]
        rogue.send_multipart([ident, b"\x00garbage"])
        rogue.send_multipart([ident, *fastio.encode(WeightBucket(1, 0, 0, 0, True, []))])
        from tests.transport.conftest import wait_for

        wait_for(lambda: sub.counters.get("bad_messages") and sub.counters.get("stale_pieces"))
        assert sub._thread is not None and sub._thread.is_alive()
    finally:
        sub.close()
        rogue.close(linger=0)


def test_shm_segment_survives_unlink_and_stale_ones_are_cleaned() -> None:
    if not wshm.available():
        pytest.skip("no /dev/shm")
    seg = wshm.ShmSegment.create(4096)
    seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    reader = wshm.ShmSegment.open(seg.name)
    seg.close()  # the owner unlinks
    assert not (wshm.SHM_DIR / seg.name).exists()
    assert reader.tensor[:4].tolist() == [1, 2, 3, 4]
    reader.close()
    with pytest.raises(OSError):
        wshm.ShmSegment.open("../etc/passwd")
    stale = wshm.SHM_DIR / "fastio-w-deadbeef"  # no owner holds its lock
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    live = wshm.ShmSegment.create(64)
    os.utime(wshm.SHM_DIR / live.name, (time.time() - 60, time.time() - 60))
    assert wshm.cleanup_stale() >= 1 and not stale.exists()
    assert (wshm.SHM_DIR / live.name).exists()  # its owner (this process) holds the lock
    live.close()


# -- disk ----------------------------------------------------------------------------
def test_disk_roundtrip_atomic_marker_and_gc(tmp_path: Path) -> None:
    meta = fastio.WeightUpdateMeta(type="disk", path=str(tmp_path / "wu"))
    assert latest_version(meta) is None
    for v in (1, 2, 3):
        save_weights(meta, make_state(v), v)
    assert latest_version(meta) == 3
    assert sorted(p.name for p in (tmp_path / "wu").iterdir()) == [MARKER, "v00000002", "v00000003"]
    t = zeros_like(make_state(0))
    ref = dict(t)
    assert load_weights(meta, t) == 3
    assert equal(t, make_state(3)) and all(t[k] is ref[k] for k in t)
    assert load_weights(meta, t, version=2) == 2 and equal(t, make_state(2))
    with pytest.raises(ValueError, match="not newer"):
        save_weights(meta, make_state(1), 3)


def test_disk_writer_dying_midway_leaves_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transport.weights.disk as wdisk

    save_weights(tmp_path, make_state(1), 1)

    def half_written(tensors: Any, path: str, metadata: Any = None) -> None:
        Path(path).write_bytes(b"\x10\x00\x00\x00half")  # then the writer "dies"
        raise OSError("disk full (test)")

    monkeypatch.setattr(wdisk, "_save_file", half_written)
    with pytest.raises(OSError):
        save_weights(tmp_path, make_state(2), 2)
    assert latest_version(tmp_path) == 1
    t = zeros_like(make_state(0))
    assert load_weights(tmp_path, t) == 1 and equal(t, make_state(1))


def test_disk_mismatch_leaves_weights_untouched(tmp_path: Path) -> None:
    save_weights(tmp_path, make_state(1), 1)
    t = zeros_like(make_state(0))
    t["embed.weight"] = torch.zeros(97, 34)
    before = state_digest(t)
    with pytest.raises(WeightMismatchError, match=r"shape mismatch for 'embed\.weight'"):
        load_weights(tmp_path, t)
    assert state_digest(t) == before
    with pytest.raises(tw.WeightUpdateError, match="no weights"):
        load_weights(tmp_path / "nothing", t)


def test_errors_form_one_tree() -> None:
    from transport.errors import TransportError

    for e in (WeightMismatchError, tw.UpdateIncomplete):
        assert issubclass(e, tw.WeightUpdateError) and issubclass(e, TransportError)
    assert issubclass(WeightMismatchError, ValueError)
    assert issubclass(tw.UpdateIncomplete, TimeoutError)


def test_never_raised_errors_are_deprecated_aliases() -> None:
    """``ChecksumError`` and ``VersionUnavailable`` still import, with a warning."""
    from transport.weights import errors

    for name in ("ChecksumError", "VersionUnavailable"):
        with pytest.warns(DeprecationWarning, match=f"{name} is deprecated"):
            cls = getattr(tw, name)
        with pytest.warns(DeprecationWarning, match=f"{name} is deprecated"):
            assert getattr(errors, name) is cls
        assert issubclass(cls, tw.WeightUpdateError) and name not in tw.__all__
    with pytest.warns(DeprecationWarning):
        from transport.weights import ChecksumError
    assert issubclass(ChecksumError, ValueError)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_cuda_tensors_on_both_sides(pair: Pair, shm: bool) -> None:
    src = {k: v.cuda() for k, v in make_state(3).items()}
    t = {k: torch.zeros_like(v) for k, v in src.items()}
    pub = pair.publisher(bucket_bytes=4096, shm=shm)
    pair.subscriber(t, shm=shm)
    pub.wait_for_workers(1, 10)
    pub.publish_and_wait(src, 1, timeout=30)
    assert all(torch.equal(t[k], src[k]) for k in src)
    assert all(v.is_cuda for v in t.values())


# -- wait(): woken by what settles it, not by the heartbeat ---------------------------
def _raw_worker(ctx: Any, pub: WeightPublisher, wid: str) -> zmq.Socket[Any]:
    """A worker that says Hello and then only what the test makes it send."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, wid.encode())
    s.connect(pub.endpoint)
    s.send_multipart(fastio.Encoder().encode(WeightHello(wid, "elsewhere", 1)))
    return s


def _waiting(pub: WeightPublisher, n: int) -> bool:
    return len(pub._cond._waiters) >= n  # type: ignore[attr-defined]  # threads in wait()


def _wait_in_thread(pub: WeightPublisher, version: int, out: list[Any]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(pub.wait(version, timeout=60)))
    t.start()
    wait_for(lambda: _waiting(pub, 1), what="wait() blocked")
    return t


def test_a_narrower_wait_wakes_one_waiting_as_announced(pair: Pair, ctx: Any) -> None:
    # Heartbeats (which notify every waiter) 60 s apart: only the narrowing may wake it.
    pub = pair.publisher(shm=False, ipc="off", heartbeat_interval=60, worker_timeout=120)
    socks = [_raw_worker(ctx, pub, w) for w in ("w0", "w1")]
    try:
        pub.wait_for_workers(2, 10)
        pub.publish(make_state(1), 1)
        socks[0].send_multipart(fastio.Encoder().encode(WeightAck("w0", 1, True, 1)))
        wait_for(lambda: "w0" in pub.core.versions[1].acks, what="w0's Ack")
        out: list[Any] = []
        waiter = _wait_in_thread(pub, 1, out)  # as announced: w0 and w1
        assert sorted(pub.wait(1, timeout=5, workers=["w0"]).applied) == ["w0"]
        waiter.join(10)
        assert not waiter.is_alive() and out[0].ok, "the first waiter slept on"
    finally:
        for s in socks:
            s.close(linger=0)


def test_close_ends_a_wait_in_progress(pair: Pair, ctx: Any) -> None:
    pub = pair.publisher(shm=False, ipc="off", heartbeat_interval=60, worker_timeout=120)
    sock = _raw_worker(ctx, pub, "w0")
    try:
        pub.wait_for_workers(1, 10)
        pub.publish(make_state(1), 1)
        out: list[Any] = []
        waiter = _wait_in_thread(pub, 1, out)
        pub.close()
        waiter.join(10)
        assert not waiter.is_alive(), "wait() slept through close()"
        assert out[0].missing == ["w0"]
    finally:
        sock.close(linger=0)


@pytest.mark.skipif(not wshm.available(), reason="needs /dev/shm")
def test_a_version_not_yet_announced_at_close_frees_its_segment(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = pair.publisher(shm=True, ipc="off", heartbeat_interval=60)
    monkeypatch.setattr(pub.serving, "wake", lambda: None)  # the loop never takes it
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            pub.publish(make_state(1), 1)
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    pending = wait_for(lambda: list(pub.serving.pending), what="the version queued")
    seg = pending[0].seg
    assert seg is not None and (wshm.SHM_DIR / seg.name).exists()
    pub.close()
    t.join(10)
    assert not t.is_alive() and "closed while publishing" in str(errors[0])
    assert not (wshm.SHM_DIR / seg.name).exists()


@pytest.mark.parametrize("ipc", ["off", "cpu"], ids=["tcp", "ipc"])
@pytest.mark.parametrize("again", [1, 5], ids=["older", "same-number"])
def test_a_restarted_publisher_s_versions_are_applied_whatever_their_number(
    ctx: Any, again: int, ipc: str
) -> None:
    # The trainer restarted (a new publisher on the same endpoint) from an earlier
    # checkpoint: its version `again` is not above what the worker holds, yet it is
    # other weights. The worker applies it, and no Hello of the old version acks it.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    old, new = {"w": torch.full((64, 64), 5.0)}, {"w": torch.full((64, 64), 1.0)}
    target = {"w": torch.zeros(64, 64)}
    # Each publisher on a context of its own: its close() ends the listener at once.
    pub = WeightPublisher(endpoint, shm=False, ipc=ipc, heartbeat_interval=0.1)
    sub = WeightSubscriber(
        endpoint, target, report_digest=True, context=ctx, heartbeat_interval=0.1
    ).start()
    try:
        pub.wait_for_workers(1, 20)
        assert pub.publish_and_wait(old, 5, timeout=20).ok
        pub.close()
        pub = WeightPublisher(endpoint, shm=False, ipc=ipc, heartbeat_interval=0.1)
        pub.wait_for_workers(1, 20)
        if ipc != "off":  # the slots asked for (offered with the version): it goes by ipc
            wait_for(lambda: len(pub.ipc.hellos) >= 1, 20, "the worker's IpcHello")
        res = pub.publish_and_wait(new, again, timeout=20)
        assert res.applied[sub.worker_id].digest == state_digest(new)
        assert res.paths[sub.worker_id] == ("tcp" if ipc == "off" else "ipc")
        assert sub.version == again and equal(target, new)
    finally:
        sub.close()
        pub.close()


def test_a_handshake_that_failed_part_way_is_tried_again(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = zmq.Socket.connect
    sub_connects: list[str] = []

    def connect(sock: zmq.Socket[Any], endpoint: str) -> Any:
        if sock.type == zmq.SUB:
            sub_connects.append(endpoint)
            if len(sub_connects) == 1:  # the first one to the PUB fails
                raise zmq.ZMQError(zmq.EINVAL)
        return real(sock, endpoint)

    monkeypatch.setattr(zmq.Socket, "connect", connect)
    pub = pair.publisher(shm=False)
    sub = pair.subscriber(zeros_like(make_state(0)))
    wait_for(lambda: len(sub_connects) >= 2, 10, "the handshake tried again")
    assert sub_connects == [pub.pub_endpoint] * 2 and sub.counters["internal_errors"] == 1
    assert pub.publish_and_wait(make_state(1), 1, timeout=20).ok
