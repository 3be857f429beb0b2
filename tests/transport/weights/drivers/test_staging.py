"""The trainer side's owners: a staged version packs itself step by step, and the ipc
route's snapshot holds the slots while it is read."""

from __future__ import annotations

import threading

import pytest
import torch

from fastio.ipc_msgs import IpcAck
from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightAnnounce, WeightHello
from tests.transport.weights.helpers import make_state
from transport.weights.core.publisher import PublisherCore
from transport.weights.errors import WeightUpdateError
from transport.weights.routes.ipc import IpcOffering
from transport.weights.staging import Staged, VersionStore, plan_version

BUCKET = 8 << 10


def _staged(packed: dict[str, torch.Tensor], cond: threading.Condition) -> Staged:
    """Version 1 of the helpers' state, packed from ``packed``."""
    plan = plan_version(make_state(1), "", BUCKET)
    total = plan[-1].shm_offset + plan[-1].nbytes
    st = Staged(1, torch.empty(total, dtype=torch.uint8), None)
    ann = WeightAnnounce("p", 0, 1, "xxh3_64", total, plan)
    st.prepare(ann, packed, 4 << 10, cond)
    return st


def test_a_staged_version_packs_step_by_step_then_ends() -> None:
    cond = threading.Condition()
    st = _staged(make_state(1), cond)
    assert st.announce is not None and st.job is not None
    steps = 1
    while st.pack_step(cond):
        steps += 1
    assert steps > len(st.announce.buckets)  # yields inside buckets too (chunk_bytes)
    assert st.job is None and st.error is None and not st.pack_step(cond)
    assert st.buckets_done == len(st.announce.buckets) and st.packed == st.buf.numel()
    assert all(b.checksum for b in st.announce.buckets)


def test_a_failed_packing_is_kept_for_publish() -> None:
    cond = threading.Condition()
    st = _staged({}, cond)  # every name missing
    assert not st.pack_step(cond)
    assert st.job is None and isinstance(st.error, KeyError)


def test_an_ipc_only_version_has_no_buffer_and_no_packing() -> None:
    st = Staged.ipc_only(3)
    ann = WeightAnnounce("p", 0, 3, "xxh3_64", 0, [])
    st.prepare(ann, make_state(1), 4 << 10, threading.Condition())
    assert st.unstaged and st.ipc_packing and st.job is None and st.buf.numel() == 0
    st.slots_packed()
    assert not st.ipc_packing and st.unstaged


def _offering(cond: threading.Condition, core: PublisherCore, mode: str = "cpu") -> IpcOffering:
    """An ipc route of ``cpu`` slots, no worker, a publish waiting 0.3 s at most."""
    return IpcOffering(
        mode,
        None,
        0.3,
        core=core,
        cond=cond,
        encoder=VERSION_1,
        wake=lambda: None,
        publisher_id="p",
        bucket_bytes=BUCKET,
    )


def test_an_unknown_ipc_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="ipc must be one of"):
        _offering(threading.Condition(), PublisherCore("host", 5.0), "bogus")


def test_an_ipc_notice_from_a_lost_worker_leaves_it_lost() -> None:
    cond = threading.Condition()
    core = PublisherCore("host", 5.0)
    core.on_hello("w", WeightHello("w", "host", 100), 0.0)
    ipc = _offering(cond, core)
    assert [w for w, _ in core.tick(6.0)] == ["w"]
    assert ipc.handle("w", IpcAck("w", -1, -2, -1, True), 7.0) is None  # its goodbye
    assert not core.workers["w"].alive and core.workers["w"].last_seen == 7.0


def test_a_snapshot_holds_the_slots_until_its_block_ends() -> None:
    cond = threading.Condition()
    ipc = _offering(cond, PublisherCore("host", 5.0))
    state = make_state(1)
    with ipc.snapshot(1) as src:
        assert src is None  # no slots yet
    ipc.prepare(state, lambda: True)
    ipc.publish(state, 1)
    exp = ipc.exporter
    assert exp is not None
    with pytest.raises(RuntimeError, match="reader failed"), ipc.snapshot(1) as src:
        assert src is not None and exp.snapshot_reads == 1
        assert all(torch.equal(src[k], state[k]) for k in state)
        with pytest.raises(WeightUpdateError, match="still read for a snapshot"):
            ipc.publish(make_state(2), 2)  # waits for the reader, in vain
        raise RuntimeError("reader failed")
    assert exp.snapshot_reads == 0  # let go, even on an error
    with ipc.snapshot(2) as src:
        assert src is None  # not packed: the slots hold no version 2
    ipc.publish(make_state(2), 2)
    ipc.close()


def _ipc_only(store: VersionStore, version: int) -> Staged:
    """``version`` of the helpers' state, published to ipc workers only: announced."""
    plan = plan_version(make_state(version), "", BUCKET)
    total = plan[-1].shm_offset + plan[-1].nbytes
    st = Staged.ipc_only(version)
    ann = WeightAnnounce("p", 0, version, "xxh3_64", total, plan)
    st.prepare(ann, make_state(version), 4 << 10, store.cond)
    with store.cond:
        store.core.announce(st, 0.0)
    return st


def _staged_late() -> tuple[threading.Condition, VersionStore, IpcOffering, Staged]:
    """Version 1 published on cpu slots, then staged late from them (ipc workers only)."""
    cond = threading.Condition()
    core = PublisherCore("host", 5.0)
    store = VersionStore(core, cond, use_shm=False, keep_versions=1)
    ipc = _offering(cond, core)
    ipc.prepare(make_state(1), lambda: True)
    ipc.publish(make_state(1), 1)
    st = _ipc_only(store, 1)
    store.stage_late(st, ipc, 4 << 10)
    return cond, store, ipc, st


def test_a_version_staged_late_holds_the_snapshot_until_packed_even_if_retired() -> None:
    """A late staging (a Fetch of a version ipc workers alone read) holds the slots
    until its packing ends; a newer version does not retire it before that (it did,
    its packing never run: the slots stayed held and every later publish failed)."""
    cond, store, ipc, st = _staged_late()
    exp = ipc.exporter
    assert exp is not None
    assert exp.snapshot_reads == 1 and not st.unstaged and st.job is not None
    _ipc_only(store, 2)  # the newer version: 1 is retired once nothing needs it
    with cond:
        store.retire()
    while any(v.pack_step(cond) for v in list(store.versions.values())):
        pass  # the serving loop's steps
    assert exp.snapshot_reads == 0 and st.error is None
    assert st.buckets_done == len(plan_version(make_state(1), "", BUCKET))
    with cond:
        store.retire()
    assert list(store.versions) == [2]
    ipc.publish(make_state(2), 2)  # the slots are free
    ipc.close()


def test_closing_the_store_lets_go_of_a_late_staging_not_yet_packed() -> None:
    cond, store, ipc, st = _staged_late()
    exp = ipc.exporter
    assert exp is not None
    assert exp.snapshot_reads == 1
    with cond:
        store.close()
    assert exp.snapshot_reads == 0 and st.job is None
    ipc.close()
