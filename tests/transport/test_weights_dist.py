"""The process-group path (gloo on CPU, real processes) and the integration with the
fabric: one controller-side call pauses, publishes, awaits the workers and resumes, and
later responses carry the new version."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from fastio import AllocationMode, GenerationHyperparameters, LLMRequest, WeightUpdateMeta
from tests.transport.test_weights import equal, make_state, zeros_like
from transport.weights import WeightPublisher, state_digest, update_weights
from transport.weights.dist import WeightGroup, param_specs, trainer_rank, worker_rank, world_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    group = WeightGroup(meta, worker_rank(meta, server, tp_rank), bucket_bytes=4096, timeout=60)
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
        master_address="127.0.0.1", master_port=_free_port(),
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=dist_worker, args=(meta, 0, r), daemon=True) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        group = WeightGroup(meta, trainer_rank(), bucket_bytes=4096, timeout=60)
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
