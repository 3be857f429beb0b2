"""The process-group path (gloo on CPU, real processes) and the integration with the
fabric: one controller-side call pauses, publishes, awaits the workers and resumes, and
later responses carry the new version."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from fastio import AllocationMode, GenerationHyperparameters, LLMRequest, WeightUpdateMeta
from tests.helpers import free_port, mp_context
from tests.transport.weights.helpers import equal, make_state, zeros_like
from transport.weights import WeightPublisher, state_digest, update_weights
from transport.weights.dist import WeightGroup, param_specs, trainer_rank, worker_rank, world_size


def test_ranks_follow_the_reference_layout() -> None:
    meta = WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d2p1t2+d1p1t1"), [], master_address="127.0.0.1"
    )
    assert world_size(meta) == 5 and trainer_rank() == 0
    assert [worker_rank(meta, s, r) for s in (0, 1) for r in (0, 1)] == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        worker_rank(meta, 0, 2)
    with pytest.raises(ValueError, match="type='nccl'"):
        WeightGroup(WeightUpdateMeta(type="disk", path="/x"), 0)


def dist_worker(meta: WeightUpdateMeta, server: int, tp_rank: int) -> None:
    """A generation rank: receives versions 1 (atomic) and 2 (streaming), checks them."""
    torch.set_num_threads(1)
    target = zeros_like(make_state(0))
    group = WeightGroup(
        meta, worker_rank(meta, server, tp_rank), backend="gloo", bucket_bytes=4096, timeout=60
    )
    group.recv(target, atomic=True)
    if not equal(target, make_state(1)):
        raise SystemExit(3)
    group.recv(target, atomic=False)
    if not equal(target, make_state(2)):
        raise SystemExit(4)
    group.pg.barrier().wait()


def test_gloo_broadcast_of_buckets_to_worker_processes() -> None:
    alloc = AllocationMode.from_str("sglang.d1p1t2+d1p1t1")  # one server, tp 2: ranks 1, 2
    meta = WeightUpdateMeta.from_param_specs(
        alloc, param_specs(make_state(0)), nccl_group_name="test-weights",
        master_address="127.0.0.1", master_port=free_port(),
    )  # fmt: skip
    ctx = mp_context()
    ps = [ctx.Process(target=dist_worker, args=(meta, 0, r), daemon=True) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        group = WeightGroup(meta, trainer_rank(), backend="gloo", bucket_bytes=4096, timeout=60)
        assert len(group.plan) > 2
        group.send(make_state(1))
        group.send(make_state(2))
        group.pg.barrier().wait()
        for p in ps:
            p.join(60)
        assert [p.exitcode for p in ps] == [0, 0]
        assert len(group.last_timings) == len(group.plan)
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
            p.join(10)


# -- the fabric -----------------------------------------------------------------------
@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(heartbeat_interval=0.1)
    yield pub
    pub.close()


def test_update_weights_through_the_fabric(
    spawn: Callable[..., Any], publisher: WeightPublisher
) -> None:
    from transport import FabricController, SyncFabricClient
    from transport.engine import ReferenceEngine, TinyLM

    plugin = ["--plugin", "transport.weights.update:subscribe"]
    opts = ["--plugin-opt", f"weights_endpoint={publisher.endpoint}"]
    opts += ["--plugin-opt", "weights_digest=1"]
    workers = [
        spawn(
            "--bind",
            "tcp://127.0.0.1:0",
            "--worker-id",
            f"gen{i}",
            "--token-interval",
            "0.002",
            *plugin,
            *opts,
        )
        for i in range(2)
    ]
    addresses = [w.address for w in workers]
    publisher.wait_for_workers(2, 30)
    req = LLMRequest(
        rid="r1",
        input_ids=[1, 2, 3],
        gconfig=GenerationHyperparameters(max_new_tokens=8, greedy=True),
    )
    with FabricController(addresses, timeout=30) as ctl, SyncFabricClient(addresses) as client:
        before = client.generate(req)
        assert list(before.output_versions) == [0] * 8

        new = TinyLM(seed=1)
        res = update_weights(ctl, publisher, new, version=1, timeout=30)
        assert sorted(res.applied) == ["gen0", "gen1"]
        assert {a.digest for a in res.applied.values()} == {state_digest(new.state_dict())}
        assert {s.version for s in ctl.health().values()} == {1}

        after = client.generate(req)
        assert list(after.output_versions) == [1] * 8
        # The workers now generate exactly what the new weights generate.
        import asyncio

        local = asyncio.run(ReferenceEngine(model=new).generate(req))
        assert np.array_equal(after.output_tokens.array, local.output_tokens.array)
        assert not np.array_equal(after.output_tokens.array, before.output_tokens.array)

        # An update while a long generation runs: it is interrupted and resumed, and
        # each token says which weights produced it.
        long = LLMRequest(
            rid="r2", input_ids=[4, 5], gconfig=GenerationHyperparameters(max_new_tokens=300)
        )
        fut = client.submit(long)
        from tests.transport.conftest import wait_for

        wait_for(lambda: sum(s.running for s in ctl.health().values()) > 0, 10, "generation")
        update_weights(ctl, publisher, TinyLM(seed=2), version=2, timeout=30)
        resp = fut.result(60)
        versions = list(resp.output_versions)
        assert len(versions) == 300 and versions == sorted(versions)
        assert set(versions) <= {1, 2} and versions[-1] == 2


# -- one device per rank, and a trainer that dies before broadcasting -----------------
def test_assign_devices_gives_each_rank_its_local_rank() -> None:
    from transport.weights.dist import assign_devices

    assert assign_devices(["a", "a", "b", "a"], [4, 4, 1, 4], [None] * 4) == [0, 1, 0, 2]
    assert assign_devices(["a", "a", "a"], [3, 3, 3], [None, 0, None]) == [1, 0, 2]
    assert assign_devices([], [], []) == []


@pytest.mark.parametrize(
    ("hosts", "counts", "requested", "named"),
    [
        (["a", "a"], [1, 1], [None, None], "ranks 0 and 1"),  # one GPU, two ranks
        (["a", "a", "a"], [4, 4, 4], [None, 2, 2], "ranks 1 and 2"),  # explicit clash
        (["a", "b"], [1, 1], [0, 3], "rank 1 asked for cuda:3"),
        (["a"], [0], [None], "has 0 CUDA device"),
    ],
)
def test_assign_devices_refuses_two_ranks_on_one_device(
    hosts: list[str], counts: list[int], requested: list[int | None], named: str
) -> None:
    from transport.weights.dist import DeviceConflictError, assign_devices

    with pytest.raises(DeviceConflictError, match=named) as info:
        assign_devices(hosts, counts, requested)
    assert "one device per rank" in str(info.value) and isinstance(info.value, ValueError)


def _nccl_rank_on_one_gpu(meta: WeightUpdateMeta, rank: int, q: Any) -> None:
    """A rank of an NCCL group on a host that shows one CUDA device (patched: this is
    what a one-GPU machine reports); it must be refused before NCCL is touched."""
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    try:
        WeightGroup(meta, rank, timeout=60)
        q.put((rank, "formed"))
    except Exception as exc:
        q.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_nccl_group_refuses_two_ranks_on_one_gpu_at_setup() -> None:
    """Real processes, a real TCPStore: both the trainer and its worker refuse, naming
    each other (before: every rank went to cuda:0 and NCCL said "Duplicate GPU")."""
    meta = WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d1p1t1+d1p1t1"), param_specs(make_state(0)),
        nccl_group_name="test-one-gpu", master_address="127.0.0.1", master_port=free_port(),
    )  # fmt: skip
    ctx = mp_context()
    q = ctx.Queue()
    ps = [ctx.Process(target=_nccl_rank_on_one_gpu, args=(meta, r, q), daemon=True) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        got = dict(q.get(timeout=90) for _ in ps)
        for rank in (0, 1):
            assert got[rank].startswith("DeviceConflictError"), got
            assert "ranks 0 and 1" in got[rank] and "one device per rank" in got[rank]
    finally:
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()


def _trainer_forms_group_then_dies(meta: WeightUpdateMeta, q: Any) -> None:
    group = WeightGroup(meta, trainer_rank(), backend="gloo", bucket_bytes=4096, timeout=300)
    q.put("formed")
    q.get()  # dies on command, before broadcasting anything
    del group
    import os

    os._exit(1)


def _worker_recv_timed(meta: WeightUpdateMeta, q: Any, join_timeout: float | None) -> None:
    import time

    from transport.weights.errors import WeightUpdateError

    t0 = time.monotonic()
    try:
        group = WeightGroup(
            meta, worker_rank(meta, 0), backend="gloo", bucket_bytes=4096, timeout=300,
            join_timeout=join_timeout,
        )  # fmt: skip
        q.put("formed")
        group.recv(zeros_like(make_state(0)))
        q.put(("received", time.monotonic() - t0))
    except WeightUpdateError as exc:
        q.put((f"WeightUpdateError: {exc}", time.monotonic() - t0))


def _meta_one_worker(name: str) -> WeightUpdateMeta:
    return WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d1p1t1+d1p1t1"), param_specs(make_state(0)),
        nccl_group_name=name, master_address="127.0.0.1", master_port=free_port(),
    )  # fmt: skip


@pytest.mark.slow
def test_worker_fails_fast_when_its_trainer_dies_before_broadcasting() -> None:
    """The group formed, the trainer is killed before its first broadcast: the worker's
    recv fails within seconds (gloo's connections close), not after timeout=300."""
    meta = _meta_one_worker("test-dead-trainer")
    ctx = mp_context()
    tq, wq = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_trainer_forms_group_then_dies, args=(meta, tq), daemon=True)
    worker = ctx.Process(target=_worker_recv_timed, args=(meta, wq, None), daemon=True)
    trainer.start()
    worker.start()
    try:
        assert tq.get(timeout=90) == "formed" and wq.get(timeout=90) == "formed"
        tq.put("die")
        trainer.join(30)
        what, seconds = wq.get(timeout=120)
        assert what.startswith("WeightUpdateError") and seconds < 60, (what, seconds)
    finally:
        for p in (trainer, worker):
            if p.is_alive():
                p.kill()
            p.join(10)


def _trainer_dies_while_forming(meta: WeightUpdateMeta) -> None:
    # World size 3 with one worker that never comes: the trainer waits in the group's
    # formation, listening on its store, until it is killed.
    WeightGroup(meta, trainer_rank(), backend="gloo", bucket_bytes=4096, timeout=300)


@pytest.mark.slow
def test_worker_whose_trainer_died_before_the_group_formed_waits_join_timeout_only() -> None:
    import time

    meta = WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d1p1t2+d1p1t1"), param_specs(make_state(0)),
        nccl_group_name="test-dead-forming", master_address="127.0.0.1",
        master_port=free_port(),
    )  # fmt: skip
    ctx = mp_context()
    trainer = ctx.Process(target=_trainer_dies_while_forming, args=(meta,), daemon=True)
    trainer.start()
    wq = ctx.Queue()
    worker = ctx.Process(target=_worker_recv_timed, args=(meta, wq, 5.0), daemon=True)
    try:
        deadline = time.monotonic() + 90
        while True:  # the trainer's store is up: it got as far as forming the group
            try:
                socket.create_connection(("127.0.0.1", meta.nccl_master_port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "trainer never listened"
                trainer.join(0.1)
        trainer.kill()
        trainer.join(10)
        worker.start()
        what, seconds = wq.get(timeout=120)
        assert what.startswith("WeightUpdateError") and "join_timeout=5.0" in what, what
        assert seconds < 60, seconds
    finally:
        for p in (trainer, worker):
            if p.is_alive():
                p.kill()
            p.join(10)
