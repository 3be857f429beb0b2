"""Verify and copy in one pass (``atomic=False``, the fabric worker's default).

The stream itself (bytes split anywhere, tied and cast targets), and a fabric worker
whose version fails after its first write: it must not generate from its mixed weights
until a later version completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import (
    corrupting_bucket_1,
    equal,
    make_state,
    status,
    worker_args,
    zeros_like,
)
from transport import ControlError, FabricController
from transport.engine import TinyLM
from transport.weights import BucketApplier, pack_bucket, plan_buckets
from transport.weights.bucket import checksum, dtype_name
from transport.weights.streaming import BucketStream

PLUGIN = "transport.weights.update:subscribe"


@pytest.mark.parametrize("piece", [1, 1000, 4096, 1 << 20])
def test_a_stream_hashes_and_copies_pieces_split_anywhere(piece: int) -> None:
    src = make_state(1)
    plan = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in src.items()], 1 << 30)
    (info,) = plan
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    dst = zeros_like(src)
    st = BucketStream(info, dst, None, "xxh3_64")
    assert not st.rest
    data = buf.numpy()
    for a in range(0, data.size, piece):
        st.feed(data[a : a + piece])
    assert st.hasher.digest() == checksum([data], "xxh3_64") and st.size == info.nbytes
    assert equal(dst, src)


def test_a_stream_leaves_cast_and_strided_targets_to_the_applier() -> None:
    src = {"a": torch.randn(8, 8), "b": torch.randn(16), "c": torch.randn(4, 6)}
    plan = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in src.items()], 1 << 20)
    (info,) = plan
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    tied = torch.zeros(8, 8)
    strided = torch.zeros(6, 4).t()  # the shape (4, 6), not contiguous
    dst = {"a": tied, "a2": tied, "b": torch.zeros(16, dtype=torch.bfloat16), "c": strided}
    dests = {"a": ["a", "a2"], "b": ["b"], "c": ["c"]}
    st = BucketStream(info, dst, dests, "crc32")
    assert [e.name for e in st.rest] == ["b", "c"]
    st.feed(buf.numpy())
    assert torch.equal(tied, src["a"]) and not strided.any()  # plain: written; rest: not yet
    BucketApplier(dst).apply(st.rest_info(), [buf], dests)
    assert torch.equal(dst["b"], src["b"].to(torch.bfloat16)) and torch.equal(strided, src["c"])
    assert np.array_equal(tied.numpy(), dst["a2"].numpy())


@pytest.mark.slow
def test_a_worker_whose_version_failed_midway_serves_nothing_until_the_next(
    spawn: Callable[..., Any],
) -> None:
    """Version 2's bucket 0 is in the weights when bucket 1 fails for good: the worker
    stays paused (the copy's own pause; a controller's resume is refused at once),
    reports no complete version (health too), and generates again once version 3 has
    landed whole. Version 4 fails the same way under a controller's pause: version 5
    completing does not end that pause, only the controller's resume does."""
    pub = corrupting_bucket_1({2, 4}, worker_timeout=30.0)
    w = spawn(*worker_args("w", pub.endpoint, "--plugin", PLUGIN))
    with pub, FabricController([w.address]) as ctl:
        pub.wait_for_workers(1, 30)
        # No controller pause: the subscriber pauses the worker for each copy itself.
        assert pub.publish_and_wait(TinyLM(seed=1), 1, timeout=30).ok
        wait_for(lambda: not status(ctl)["w"].paused, 20, "the copy's pause undone")
        res = pub.wait(pub.publish(TinyLM(seed=2), 2).version, 30, workers=["w"])
        assert "weights are mixed" in res.failed["w"], res
        wait_for(lambda: pub.workers()["w"].version == -1, 20, "w reporting no version")
        st = status(ctl)["w"]
        assert st.paused and st.version == -1, "a worker with mixed weights was resumed"
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="weights are mixed") as err:
            ctl.resume(timeout=10.0)  # refused at once, not parked
        assert time.monotonic() - t0 < 5.0 and "stays paused" in str(err.value)
        assert status(ctl)["w"].paused
        assert pub.publish_and_wait(TinyLM(seed=3), 3, timeout=30).ok
        wait_for(lambda: not status(ctl)["w"].paused, 20, "the worker generating again")
        assert status(ctl)["w"].version == 3
        # Mixed again, now under a controller's pause (as update_weights does it).
        res = pub.wait(pub.publish(TinyLM(seed=4), 4).version, 30, workers=["w"])
        assert "weights are mixed" in res.failed["w"], res
        ctl.pause(10.0)
        with pytest.raises(ControlError, match="weights are mixed"):
            ctl.resume(timeout=10.0)
        assert pub.publish_and_wait(TinyLM(seed=5), 5, timeout=30).ok
        st = status(ctl)["w"]
        assert st.paused and st.version == 5, "version 5 ended the controller's pause"
        ctl.resume(timeout=10.0)
        assert not status(ctl)["w"].paused
