"""The ``ipc`` weight path on CPU shared storage (the same code as CUDA IPC, torch's
shared-memory files in place of CUDA handles): handles exported once and reused, acks
gating slot reuse, either side killed on purpose, refusals. Real processes talking over a
ZeroMQ ROUTER/DEALER pair; the CUDA-only checks skip without a device."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch

import fastio
from bench.ipc_link import IpcOutcomes
from fastio.ipc_msgs import IpcAck, IpcHandle, IpcHello, IpcOffer, IpcReady
from tests.transport.weights import helpers as weights_helpers
from transport.weights.core.process import process_start_time
from transport.weights.errors import WeightUpdateError
from transport.weights.routes.ipc import (
    IpcExporter,
    IpcImporter,
    IpcRefused,
    checksum,
    plan_layout,
)
from transport.weights.routes.ipc_worker import ipc_eligible

BUCKET = 8 << 10  # several buckets of the state below, so two slots are reused in turn


def make_state(version: int) -> dict[str, torch.Tensor]:
    """The helpers' mixed state dict (0-d, empty, odd byte counts) plus one more tensor,
    different for every version."""
    state = weights_helpers.make_state(version)
    g = torch.Generator().manual_seed(1_000_003 + version)
    state["head.weight"] = torch.randn(40, 50, generator=g)
    return state


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in make_state(0).items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- pure parts ------------------------------------------------------------------------
def test_layout_is_bounded_and_back_to_back() -> None:
    specs = [("a", "float32", (10,)), ("b", "bfloat16", (3,)), ("c", "float32", (600,))]
    buckets = plan_layout(specs, 1024)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a", "b"], ["c"]]
    assert [(t.offset, t.nbytes) for t in buckets[0].tensors] == [(0, 40), (40, 6)]
    assert [b.nbytes for b in buckets] == [512, 2560]  # rounded up to 512; c is alone


def test_checksum_is_exact_on_any_order_and_sees_moved_rows() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g)
    c = checksum(x)
    assert c.dtype == torch.int64 and c.dim() == 0 and torch.equal(checksum(x.clone()), c)
    swapped = torch.cat([x[512:1024], x[:512], x[1024:]])  # two rows change places
    assert not torch.equal(checksum(swapped), c)
    flipped = x.clone()
    flipped[4000] ^= 1
    assert not torch.equal(checksum(flipped), c)
    big = torch.full((1024,), 255, dtype=torch.uint8)  # wraps around, stays defined
    assert torch.equal(checksum(big), checksum(big.clone()))


def test_messages_are_plain_msgpack() -> None:
    h = IpcHandle("cpu", -1, b"/torch_1_2_3", 4096, manager=b"/tmp/x/manager.sock")
    offer = IpcOffer("p", 1, 2, [], plan_layout([("a", "float32", (4,))], 64))
    for msg in (h, offer, IpcAck("w", 1, 0, 0, True, stats={"copy_s": 0.1})):
        frames = fastio.encode(msg if not isinstance(msg, IpcHandle) else {"h": msg})
        raw = msgpack.unpackb(b"".join(bytes(f) for f in frames), strict_map_key=False)
        assert raw is not None  # an independent msgpack reader takes it: no pickle
    back = fastio.decode(fastio.encode(offer), IpcOffer)
    assert back == offer


# -- one process: the lifetime rules ---------------------------------------------------
def _pair(
    slots: int | None = 2, atomic: bool = True
) -> tuple[IpcExporter, IpcImporter, dict[str, torch.Tensor]]:
    exp = IpcExporter(make_state(0), bucket_bytes=BUCKET, slots=slots)
    dst = zeros()
    imp = IpcImporter(dst, worker_id="w", atomic=atomic)
    ack = imp.open(exp.offer(imp.hello()))
    assert ack.ok, ack.error
    exp.handle_ack(ack)
    return exp, imp, dst


@pytest.mark.parametrize("slots", [2, None])
@pytest.mark.parametrize("atomic", [True, False])
def test_versions_through_reused_slots(slots: int | None, atomic: bool) -> None:
    exp, imp, dst = _pair(slots, atomic)
    assert len(exp.layout) > 2 and exp.n_slots == (2 if slots else len(exp.layout))
    outcomes = IpcOutcomes(exp)

    def send(_: str, r: IpcReady) -> None:
        for a in imp.on_ready(r):
            outcomes.ack(a)

    for v in (1, 2, 3):
        exp.publish(make_state(v), v, send=outcomes.sending(send), wait=lambda s: None)
        res = outcomes.result(v, wait=lambda s: None, timeout=5)
        assert res.ok and list(res.applied) == ["w"]
        assert equal(dst, make_state(v)) and imp.version == v and imp.serving
    exp.close()
    imp.close()


def test_a_slot_is_not_packed_again_before_its_reader_acks() -> None:
    exp, _imp, dst = _pair(slots=2)
    held: list[IpcReady] = []
    with pytest.raises(WeightUpdateError, match=r"slot 0 is still read by \['w'\]"):
        exp.publish(
            make_state(1), 1, send=lambda w, r: held.append(r), wait=time.sleep, timeout=0.5
        )
    assert [r.bucket for r in held] == [0, 1]  # the third bucket waited for slot 0
    assert equal(dst, zeros())
    exp.drop_worker("w", dead=False)  # the worker is no reader any more
    exp.publish(make_state(1), 1, send=lambda w, r: None, wait=time.sleep, timeout=0.5)


def test_a_corrupt_bucket_is_refused_and_the_worker_keeps_its_version() -> None:
    exp, imp, dst = _pair(slots=None)
    acks: list[IpcAck] = []
    exp.publish(make_state(1), 1, send=lambda w, r: acks.extend(imp.on_ready(r)), wait=time.sleep)
    assert all(a.ok for a in acks) and equal(dst, make_state(1))
    for a in acks:
        exp.handle_ack(a)
    acks.clear()

    def corrupting(_: str, r: IpcReady) -> None:
        if r.bucket == 1:
            exp._slots[r.slot][0][3] ^= 0xFF  # the bytes a worker reads are not what was packed
        acks.extend(imp.on_ready(r))

    outcomes = IpcOutcomes(exp)
    exp.publish(make_state(2), 2, send=outcomes.sending(corrupting), wait=time.sleep)
    assert [a.ok for a in acks] == [False] * len(exp.layout)
    assert "checksum mismatch" in acks[0].error and acks[0].current_version == 1
    assert equal(dst, make_state(1)) and imp.version == 1
    for a in acks:
        outcomes.ack(a)
    res = outcomes.result(2, wait=time.sleep, timeout=1)
    assert not res.ok and "checksum" in res.failed["w"]


def test_a_worker_that_joins_mid_version_takes_the_next_whole_one() -> None:
    exp = IpcExporter(make_state(0), bucket_bytes=BUCKET, slots=None)
    dst = zeros()
    imp = IpcImporter(dst, worker_id="late")
    acks: list[IpcAck] = []

    def send(_: str, r: IpcReady) -> None:
        acks.extend(imp.on_ready(r))

    def join_after_first_bucket(_: str, r: IpcReady) -> None:
        if r.bucket == 0 and not imp.offer:
            exp.handle_ack(imp.open(exp.offer(imp.hello())))

    other = IpcImporter(zeros(), worker_id="first")
    exp.handle_ack(other.open(exp.offer(other.hello())))
    exp.publish(make_state(1), 1, send=lambda w, r: send(w, r) if w == "late" else
                join_after_first_bucket(w, r), wait=time.sleep)  # fmt: skip
    assert acks and not any(a.ok for a in acks) and "came before" in acks[0].error
    assert imp.version == -1 and equal(dst, zeros())
    for a in acks:
        exp.handle_ack(a)
    acks.clear()
    exp.drop_worker("first", dead=False)
    exp.publish(make_state(2), 2, send=send, wait=time.sleep)
    assert all(a.ok for a in acks) and imp.version == 2 and equal(dst, make_state(2))


def test_refusals() -> None:
    exp = IpcExporter(make_state(0), bucket_bytes=BUCKET)
    # a process the trainer cannot see (another host or pid namespace)
    ghost = IpcHello("ghost", pid=1 << 22, start_time=1)
    offer = exp.offer(ghost)
    assert offer.error and "another host or pid namespace" in offer.error and not offer.slots
    with pytest.raises(IpcRefused, match="another host"):
        IpcImporter(zeros()).open(offer)
    # a worker whose model does not match the layout acks with the reason and is dropped
    other = {k: v for k, v in zeros().items() if k != "mask"}
    imp = IpcImporter(other, worker_id="odd")
    ack = imp.open(exp.offer(imp.hello()))
    assert not ack.ok and "mask" in ack.error
    exp.handle_ack(ack)
    assert "odd" not in exp.workers
    # a trainer offer whose process is gone
    good = IpcImporter(zeros(), worker_id="late")
    stale = exp.offer(good.hello())
    with pytest.raises(IpcRefused, match="trainer pid"):
        good.open(IpcOffer(stale.publisher_id, 1 << 22, 1, stale.slots, stale.buckets))
    exp.close()


# -- real processes over ZeroMQ --------------------------------------------------------
def _shm_files(exp: IpcExporter) -> list[str]:
    return [f"/dev/shm{h.handle.decode()}" for _, _, h in exp._slots if h is not None]


def trainer_main(cmds: Any, out: Any, slots: int | None) -> None:
    """The trainer process: serves an IpcTrainerLink, runs commands from the test."""
    from bench.ipc_link import IpcTrainerLink

    torch.set_num_threads(1)
    link = IpcTrainerLink(IpcExporter(make_state(0), bucket_bytes=BUCKET, slots=slots))
    files = _shm_files(link.exporter)
    out.put(("endpoint", link.endpoint, files))
    while True:
        try:
            cmd, *args = cmds.get(timeout=0.05)
        except queue.Empty:
            link.pump(0.05)
            continue
        if cmd == "workers":
            link.wait_for_workers(args[0], 60)
            out.put(("workers", sorted(link.exporter.workers)))
        elif cmd == "publish":
            res = link.publish(make_state(args[0]), args[0], timeout=60)
            out.put(("published", args[0], sorted(res.applied), res.failed))
        elif cmd == "close":
            link.close()
            deadline = time.monotonic() + 20
            while any(os.path.exists(f) for f in files) and time.monotonic() < deadline:
                time.sleep(0.05)  # torch's shared files go when the last reference does
            out.put(("closed", [f for f in files if os.path.exists(f)]))
            return


def worker_main(
    endpoint: str, wid: str, out: Any, ctl: Any, atomic: bool, hold: tuple[int, int] | None
) -> None:
    """A worker process: applies versions, reports each (and its model's state), can be
    told to stop, holds (no ack) at bucket ``hold`` = (version, bucket) until resumed."""
    from bench.ipc_link import IpcWorkerLink

    torch.set_num_threads(1)
    dst = zeros()
    link = IpcWorkerLink(IpcImporter(dst, worker_id=wid, atomic=atomic), endpoint)
    opened = [0]
    real_open = link.importer.open

    def counting_open(offer: IpcOffer) -> IpcAck:
        opened[0] += 1
        return real_open(offer)

    link.importer.open = counting_open  # type: ignore[method-assign]

    resume = threading.Event()

    def control() -> None:  # "resume" releases a hold, "stop" ends the run
        while True:
            cmd = ctl.get()
            if cmd == "resume":
                resume.set()
            elif cmd == "stop":
                link.stop()
                return

    threading.Thread(target=control, daemon=True).start()

    def on_ready(r: IpcReady) -> None:
        if hold is not None and (r.version, r.bucket) == hold:
            out.put(("holding", wid, r.version, r.bucket))
            resume.wait(120)

    def on_version(v: int) -> None:
        out.put(("applied", wid, v, equal(dst, make_state(v))))

    reason = link.run(on_ready=on_ready, on_version=on_version, poll_s=0.05)
    imp = link.importer
    state = "v1" if equal(dst, make_state(1)) else "other"
    out.put(("done", wid, reason, imp.version, imp.serving, state, opened[0]))
    link.close()


class Harness:
    def __init__(self, slots: int | None = 2) -> None:
        self.ctx = mp.get_context("spawn")
        self.cmds = self.ctx.Queue()
        self.tout = self.ctx.Queue()
        # One queue per process: a process killed while it holds a queue's lock would
        # block every other writer of that queue.
        self.outs: dict[str, Any] = {}
        self.trainer = self.ctx.Process(
            target=trainer_main, args=(self.cmds, self.tout, slots), daemon=True
        )
        self.trainer.start()
        _, self.endpoint, self.files = self.tout.get(timeout=90)
        self.workers: dict[str, Any] = {}
        self.ctl: dict[str, Any] = {}

    def worker(self, wid: str, *, atomic: bool = True, hold: tuple[int, int] | None = None) -> Any:
        ctl = self.ctx.Queue()
        self.outs[wid] = self.ctx.Queue()
        p = self.ctx.Process(
            target=worker_main,
            args=(self.endpoint, wid, self.outs[wid], ctl, atomic, hold),
            daemon=True,
        )
        p.start()
        self.workers[wid], self.ctl[wid] = p, ctl
        return p

    def ask(self, *cmd: Any) -> Any:
        self.cmds.put(cmd)
        return self.tout.get(timeout=120)

    def expect(self, wid: str, kind: str, timeout: float = 120) -> tuple[Any, ...]:
        msg = self.outs[wid].get(timeout=timeout)
        assert msg[0] == kind, msg
        return tuple(msg)

    def close(self) -> None:
        for p in [self.trainer, *self.workers.values()]:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.fixture
def harness() -> Iterator[Any]:
    made: list[Harness] = []

    def make(slots: int | None = 2) -> Harness:
        made.append(Harness(slots))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.mark.slow
def test_two_worker_processes_open_once_and_take_every_version(harness: Any) -> None:
    h = harness(2)
    for w in ("w0", "w1"):
        h.worker(w)
    assert h.ask("workers", 2) == ("workers", ["w0", "w1"])
    for v in (1, 2, 3):
        assert h.ask("publish", v) == ("published", v, ["w0", "w1"], {})
        got = [h.expect(w, "applied")[1:] for w in ("w0", "w1")]
        assert got == [("w0", v, True), ("w1", v, True)]
    for w in ("w0", "w1"):
        h.ctl[w].put("stop")
    done = [h.expect(w, "done")[1:] for w in ("w0", "w1")]
    # each worker opened the trainer's slots once, for three versions
    assert [d[-1] for d in done] == [1, 1] and {d[1] for d in done} == {"stopped"}
    for p in h.workers.values():
        p.join(30)
    assert h.ask("close") == ("closed", [])  # nothing left in /dev/shm


@pytest.mark.slow
def test_a_killed_worker_frees_its_slot_and_leaks_nothing(harness: Any) -> None:
    h = harness(2)
    h.worker("live")
    victim = h.worker("victim", hold=(2, 0))  # stops acking at version 2, bucket 0
    h.ask("workers", 2)
    assert h.ask("publish", 1)[2] == ["live", "victim"]
    for w in ("live", "victim"):
        h.expect(w, "applied")
    h.cmds.put(("publish", 2))
    h.expect("victim", "holding")  # the trainer now waits for slot 0 (the victim may read it)
    os.kill(victim.pid, signal.SIGKILL)
    kind, v, applied, failed = h.tout.get(timeout=60)
    assert (kind, v, applied) == ("published", 2, ["live"]) and "gone" in failed["victim"]
    assert h.expect("live", "applied")[1:] == ("live", 2, True)
    h.ctl["live"].put("stop")
    assert h.expect("live", "done")[1:3] == ("live", "stopped")
    h.workers["live"].join(30)
    # the trainer released the dead worker's references: its memory goes with close()
    assert h.ask("close") == ("closed", [])


@pytest.mark.slow
@pytest.mark.parametrize("atomic", [True, False])
def test_a_killed_trainer_leaves_the_worker_on_a_complete_version(
    harness: Any, atomic: bool
) -> None:
    h = harness(2)
    # It holds bucket 1 of version 2 unacked: the trainer, which needs slot 1 again for
    # the last bucket, stops after bucket 2; the worker never sees the last one.
    h.worker("w", atomic=atomic, hold=(2, 1))
    h.ask("workers", 1)
    h.ask("publish", 1)
    assert h.expect("w", "applied")[1:] == ("w", 1, True)
    h.cmds.put(("publish", 2))
    h.expect("w", "holding")
    os.kill(h.trainer.pid, signal.SIGKILL)
    h.trainer.join(30)
    h.ctl["w"].put("resume")
    _, _wid, reason, version, serving, state, opened = h.expect("w", "done", 60)
    assert (reason, version, opened) == ("trainer gone", 1, 1)
    if atomic:  # never a mixed version: the previous one, whole
        assert serving and state == "v1"
    else:  # half of version 2 was copied: the worker refuses to serve
        assert not serving and state == "other"


# -- CUDA ------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cuda_checksum_matches_the_cpu_one() -> None:  # pragma: no cover - CUDA
    x = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    assert int(checksum(x.cuda()).item()) == int(checksum(x).item())


def cuda_worker_main(endpoint: str, out: Any) -> None:  # pragma: no cover - CUDA
    from bench.ipc_link import IpcWorkerLink

    dst = {k: v.cuda() for k, v in zeros().items()}
    link = IpcWorkerLink(IpcImporter(dst, worker_id="gpu"), endpoint)

    def on_version(v: int) -> None:
        want = {k: t.cuda() for k, t in make_state(v).items()}
        out.put((v, equal(dst, want)))
        if v == 2:
            link.stop()

    link.run(on_version=on_version)
    link.close()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("slots", [2, None])
def test_cuda_ipc_versions_to_a_worker_process(slots: int | None) -> None:  # pragma: no cover
    from bench.ipc_link import IpcTrainerLink

    state = {k: v.cuda() for k, v in make_state(0).items()}
    link = IpcTrainerLink(IpcExporter(state, bucket_bytes=BUCKET, slots=slots))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=cuda_worker_main, args=(link.endpoint, out), daemon=True)
    p.start()
    try:
        link.wait_for_workers(1, 120)
        for v in (1, 2):
            res = link.publish({k: t.cuda() for k, t in make_state(v).items()}, v, timeout=60)
            assert res.ok, res.failed
            assert out.get(timeout=60) == (v, True)
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
        link.close()


def test_process_start_time_sees_this_process() -> None:
    assert process_start_time(os.getpid()) is not None
    assert process_start_time(1 << 22) is None


# -- pinned host staging ---------------------------------------------------------------
def test_pinned_staging_imports_on_cpu_and_applies_a_staged_version() -> None:
    from bench import pinned

    src = make_state(3)
    layout = plan_layout([(k, str(v.dtype)[6:], tuple(v.shape)) for k, v in src.items()], BUCKET)
    staging = torch.zeros(sum(b.nbytes for b in layout), dtype=torch.uint8)
    pos = 0
    for b in layout:
        for e in b.tensors:
            staging[pos + e.offset : pos + e.offset + e.nbytes] = (
                src[e.name].reshape(-1).view(torch.uint8)
            )
        pos += b.nbytes
    dst = zeros()
    pinned.apply_staged(layout, staging, dst)
    assert equal(dst, src)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            pinned.PinnedRegion(torch.zeros(4096, dtype=torch.uint8))


@pytest.mark.cuda
@cuda
def test_cuda_pinned_shared_memory_round_trip() -> None:  # pragma: no cover - CUDA
    import mmap

    from bench import pinned

    src = {k: v.cuda() for k, v in make_state(4).items()}
    layout = plan_layout([(k, str(v.dtype)[6:], tuple(v.shape)) for k, v in src.items()], BUCKET)
    total = sum(b.nbytes for b in layout)
    fd = os.open("/dev/shm/fastio-test-pinned", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        seg = mmap.mmap(fd, total)
        with pinned.PinnedRegion(torch.frombuffer(seg, dtype=torch.uint8)) as host:
            sums, done = pinned.stage_out(layout, src, host.tensor)
            for ev in done:
                ev.synchronize()
            staging = torch.empty(total, dtype=torch.uint8, device="cuda")
            want = [int(s.item()) for s in sums]
            assert bool(pinned.stage_in(layout, host.tensor, staging, want).item())
            want[0] += 1
            assert not bool(pinned.stage_in(layout, host.tensor, staging, want).item())
            dst = {k: torch.zeros_like(v) for k, v in src.items()}
            pinned.apply_staged(layout, staging, dst)
            assert equal(dst, src)
        del host
    finally:
        os.close(fd)
        os.unlink("/dev/shm/fastio-test-pinned")


def test_cpu_checksum_is_the_device_formula_bit_for_bit() -> None:
    """The CPU sum64 (numpy, single-threaded) equals the torch formula the devices use,
    wrap-around included."""
    from transport.weights.routes.ipc import checksum

    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 1000):
        payload = torch.randint(0, 256, (rows * 512,), dtype=torch.uint8, generator=g)
        payload[:64] = 255  # large words: sums wrap
        words = payload.view(torch.int64).view(-1, 64).sum(dim=1)
        ref = (words * torch.arange(1, words.numel() + 1, dtype=torch.int64)).sum()
        assert int(checksum(payload)) == int(ref)


def test_ipc_eligibility_refuses_an_unknown_route_and_an_ipc_it_cannot_take() -> None:
    target = {"w": torch.zeros(2)}
    assert ipc_eligible(None, target, None, None, None)
    assert not ipc_eligible("tcp", target, None, None, None)
    assert not ipc_eligible(None, target, None, "bfloat16", None)
    with pytest.raises(ValueError, match="path must be None or one of"):
        ipc_eligible("bogus", target, None, None, None)
    with pytest.raises(ValueError, match="copies into `target` as is"):
        ipc_eligible("ipc", target, print, None, None)
