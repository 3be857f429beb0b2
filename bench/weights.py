"""Weight-update suite: publish a transformer-like fp32 state dict to 2 worker processes.

A model-size sweep (quick: ~30 and ~184 MiB; full: ~55 MiB, ~241 MiB and ~1 GiB; the
exact byte count is the case's ``size``, ``extra["size_unit"] == "bytes"``), so that
update time can be plotted against model size. Per size, two cases, each timed from
"the trainer calls ``publish()``" to "both workers have applied the version into their
live tensors and the trainer has their acknowledgements":

* ``tcp@<size>``: :class:`WeightPublisher` -> 2 :class:`WeightSubscriber` processes that
  fetch over TCP loopback (the shared-memory path switched off on the workers);
* ``shm@<size>``: the same with the same-host shared-memory path;
* ``ipc@<size>``: :mod:`transport.weights.routes.ipc` over CPU shared storage (the trainer's
  persistent buckets opened once by each worker; 32 MiB buckets, the whole model in
  slots, every bucket verified before any is copied), driven by
  :mod:`bench.ipc_link`.

Our side includes everything the guarantees cost: packing the trainer's tensors into
the staging snapshot and hashing it (xxh3) on the trainer, the transfer, and on each
worker hashing every block again before copying it into the live tensors (one pass,
``atomic=False``, passed explicitly: the fabric worker's default, where a version that
fails midway leaves the worker refusing to serve until the next complete one, never
serving a mixed version). The trainer and the worker processes start with
``WORKER_TUNABLES`` (glibc's memcpy threshold for non-temporal stores, as the README
recommends for both): :func:`run` measures the CPU cases in a child process started
with it, unless ``GLIBC_TUNABLES`` is set already, when they run in the calling process
and the workers start with its value (set it empty to measure without the tunable).
Every CPU measurement's ``extra`` holds the values trainer and workers ran with
(``trainer_glibc_tunables``, ``worker_glibc_tunables``). Each case has the same three baselines, measured in the same
run, with the same tensors, into the same worker processes' tensors:

* ``gloo``: torch.distributed gloo (a 3-rank group: trainer = root + 2 workers), one
  ``broadcast`` per tensor from the trainer's tensors straight into the workers' live
  tensors (the original system's process-group path: no packing, no checksum, no
  staging, no atomicity), then a barrier so the time covers the last receiver;
* ``gloo-bucketed``: :class:`transport.weights.dist.WeightGroup` (ours: flat buckets
  over the same gloo group, ``atomic=True``), then a barrier;
* ``disk``: :func:`save_weights` (safetensors, fsync, atomic rename) then both workers
  :func:`load_weights` (skipped for the larger model in quick mode).

``extra["buckets"]`` holds the per-bucket pipeline timing of the last fastio run on one
worker: arrival of the bucket's last byte (seconds from the worker's start of the
update), seconds spent checksumming it and copying it into the weights;
``extra["publish_returned_s"]`` is when ``publish()`` returned (every bucket packed).
``extra["cpu_s_per_update"]`` (fastio and the gloo baselines) holds the CPU seconds per
update of the trainer and of each worker process, all threads (I/O threads included).
``extra["floor_s"]`` is a lower bound of the fastio case on this machine, from the
primitives measured in the same run (``extra["primitives_s"]``: one version's memcpy,
xxh3 from memory and xxh3 in cache) and, for TCP, gloo's CPU seconds for the same bytes,
assuming no Python overhead and perfect use of the cores (see :func:`_floors`);
``extra["ceiling_ratio_vs_gloo"]`` is the best gloo ratio that floor allows. Where
CUDA exists, ``gpu-tcp@<size>``/``gpu-shm@<size>`` measure trainer GPU tensors to worker
GPU tensors (one process). ``python -m bench.weights --gpu-only`` runs the GPU suite
(:func:`gpu_suite`: the ``ipc`` path with one and two worker processes, pinned staging,
the device-copy and pinned-copy floors and a raw CUDA IPC bucket baseline) and writes its
rows under ``--out`` (``bench/results/gpu/`` by default); ``--focus`` runs only the
~184 MiB model's ``tcp`` and ``shm`` cases and ``gloo-bucketed`` (a quick loop for work
on the weight path).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import zmq

from bench.common import FASTIO, Measurement

SUITE = "weights"
_MIB = 1 << 20


def make_state(
    nbytes: int,
    hidden: int,
    vocab: int = 32000,
    seed: int = 0,
    device: str = "cpu",
    zeros: bool = False,
) -> dict[str, torch.Tensor]:
    """A llama-like fp32 state dict of about ``nbytes``: embeddings, attention and MLP
    matrices, norms (a realistic mix of a few huge, many large and many tiny tensors).
    ``zeros``: the same shapes, zero-filled (a worker's model before its first update)."""
    g = torch.Generator().manual_seed(seed)
    ffn = int(hidden * 8 / 3) // 64 * 64
    sd: dict[str, torch.Tensor] = {}

    def add(name: str, *shape: int) -> None:
        if zeros:
            sd[name] = torch.zeros(*shape, device=device)
        else:
            sd[name] = torch.randn(*shape, generator=g).to(device)

    add("embed_tokens.weight", vocab, hidden)
    add("lm_head.weight", vocab, hidden)
    add("norm.weight", hidden)
    layer_bytes = 4 * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden)
    n_layers = max(1, (nbytes - 2 * 4 * vocab * hidden) // layer_bytes)
    for i in range(n_layers):
        p = f"layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add(p + f"self_attn.{m}.weight", hidden, hidden)
        add(p + "mlp.gate_proj.weight", ffn, hidden)
        add(p + "mlp.up_proj.weight", ffn, hidden)
        add(p + "mlp.down_proj.weight", hidden, ffn)
        add(p + "input_layernorm.weight", hidden)
        add(p + "post_attention_layernorm.weight", hidden)
    return sd


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_group(port: int, rank: int, world: int, name: str) -> Any:
    import torch.distributed as dist

    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=td)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, td)  # type: ignore[attr-defined]


def _bcast(pg: Any, t: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def _worker(
    idx: int,
    ctrl: str,
    tcp_ep: str,
    shm_ep: str,
    nbytes: int,
    hidden: int,
    vocab: int,
    gloo_port: int,
    dist_meta: bytes,
    ipc_ep: str,
) -> None:
    """One generation worker: two subscribers (TCP-only and shm) and an ipc importer on
    the same tensors, and a control DEALER that runs the baselines on command
    (plain-bytes commands)."""
    import threading

    import fastio
    from bench.ipc_link import IpcWorkerLink
    from transport.weights import WeightSubscriber
    from transport.weights.disk import load_weights
    from transport.weights.dist import WeightGroup
    from transport.weights.routes.ipc import IpcImporter

    torch.set_num_threads(1)
    sd = make_state(nbytes, hidden, vocab, zeros=True)
    subs = [
        WeightSubscriber(tcp_ep, sd, worker_id=f"tcp-{idx}", shm=False, atomic=False).start(),
        WeightSubscriber(shm_ep, sd, worker_id=f"shm-{idx}", shm=True, atomic=False).start(),
    ]
    ipc = IpcWorkerLink(IpcImporter(sd, worker_id=f"ipc-{idx}"), ipc_ep)
    ipc_thread = threading.Thread(target=ipc.run, daemon=True)
    ipc_thread.start()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctrl)
    sock.send(b"ready")
    pg = group = None
    meta = fastio.decode([dist_meta], fastio.WeightUpdateMeta)
    try:
        while True:
            cmd, *args = sock.recv().split()
            if cmd == b"quit":
                break
            if cmd == b"gloo":
                if pg is None:
                    pg = _gloo_group(gloo_port, idx + 1, 3, "bench-gloo")
                for _ in range(int(args[0])):
                    for t in sd.values():
                        _bcast(pg, t).wait()
                    pg.barrier().wait()
            elif cmd == b"dist":
                if group is None:  # CPU tensors: gloo also where CUDA exists
                    group = WeightGroup(
                        meta, idx + 1, backend="gloo", bucket_bytes=int(args[1]), timeout=120
                    )
                for _ in range(int(args[0])):
                    group.recv(sd, atomic=True)
                    group.pg.barrier().wait()
            elif cmd == b"disk":
                load_weights(args[0].decode(), sd)
            sock.send(b"ok")
    finally:
        for s in subs:
            s.close()
        ipc.stop()
        ipc_thread.join(10)
        ipc.close()
        sock.close(linger=0)


#: The ``GLIBC_TUNABLES`` the trainer (a child process :func:`run` starts for the CPU
#: cases) and the worker processes start with unless ``GLIBC_TUNABLES`` is set already
#: (set it, even empty, to measure without): glibc's ``memcpy`` uses non-temporal
#: stores from 128 KiB instead of its default (a fraction of the last-level cache), as
#: :func:`transport.weights.bucket.copy_bytes` recommends and the README recommends for
#: trainer and worker processes. The gloo baselines run in the same processes.
WORKER_TUNABLES = "glibc.cpu.x86_non_temporal_threshold=131072"


def _start_env(name: str) -> str | None:
    """``name`` in the environment this process started with (what glibc read its
    tunables from; ``None``: unset), not a later change of ``os.environ``."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:  # not Linux: the environment as it is now
        return os.environ.get(name)
    prefix = name.encode() + b"="
    for e in entries:
        if e.startswith(prefix):
            return e[len(prefix) :].decode(errors="replace")
    return None


@contextlib.contextmanager
def _worker_env() -> Any:
    """``GLIBC_TUNABLES`` for the processes started inside (see ``WORKER_TUNABLES``)."""
    if "GLIBC_TUNABLES" in os.environ:
        yield
        return
    os.environ["GLIBC_TUNABLES"] = WORKER_TUNABLES
    try:
        yield
    finally:
        del os.environ["GLIBC_TUNABLES"]


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux)."""
    if pid == os.getpid():
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """Per-process CPU seconds per update: trainer and each worker, over a timed loop."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.start = [_cpu_s(p) for p in self.pids]

    def per_update(self, n: int) -> dict[str, float]:
        used = [_cpu_s(p) - s for p, s in zip(self.pids, self.start, strict=True)]
        names = ["trainer"] + [f"worker{i}" for i in range(len(self.pids) - 1)]
        out = {name: round(u / max(n, 1), 3) for name, u in zip(names, used, strict=True)}
        out["total"] = round(sum(used) / max(n, 1), 3)
        return out


def _primitives(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Seconds this machine needs, single-threaded, for the unavoidable work of one
    version of ``state`` (best of 3, in the trainer process):

    * ``copy_s``: copying every tensor into a flat buffer, one ``memcpy`` per tensor (the
      trainer's packing costs about the same);
    * ``hash_s``: xxh3 over the flat buffer in 8 MiB pieces from memory;
    * ``hash_hot_s``: xxh3 over the same bytes while they are in cache (the trainer
      hashes each block right after copying it);
    * ``fused_s``: a worker's verify-and-copy pass
      (:class:`transport.weights.streaming.BucketStream`): each 256 KiB block of the
      flat buffer hashed, then copied into the tensors.

    Measured in the trainer process, which starts with the workers' ``GLIBC_TUNABLES``
    (``WORKER_TUNABLES`` unless set otherwise, see :func:`run`): ``copy_s`` and
    ``fused_s`` depend on it.
    """
    import numpy as np

    from transport.weights.bucket import Hasher, checksum, dtype_name, plan_buckets
    from transport.weights.streaming import BucketStream

    srcs = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in state.values()]
    total = sum(a.size for a in srcs)
    buf = np.ones(total, dtype=np.uint8)  # written: no page faults in the timings
    hot = buf[: 256 << 10]
    plan = plan_buckets(
        ((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in state.items()), 1 << 62
    )
    # Written, as a worker's segment is: pages never written would all read the one
    # zero page, from cache, and make the verify-and-copy pass look cheaper than it is.
    packed = np.ones(sum(b.nbytes for b in plan), dtype=np.uint8)
    dst = {k: v.clone() for k, v in state.items()}
    best = {"copy_s": 1e9, "hash_s": 1e9, "hash_hot_s": 1e9, "fused_s": 1e9}
    for _ in range(3):
        t0 = time.perf_counter()
        pos = 0
        for a in srcs:
            np.copyto(buf[pos : pos + a.size], a)
            pos += a.size
        t1 = time.perf_counter()
        h = Hasher("xxh3_64")
        for pos in range(0, total, 8 << 20):
            h.update(buf[pos : pos + (8 << 20)])
        t2 = time.perf_counter()
        for _ in range(max(1, total // hot.size)):
            checksum([hot], "xxh3_64")
        t3 = time.perf_counter()
        for b in plan:
            st = BucketStream(b, dst, None, "xxh3_64")
            st.feed(packed[b.shm_offset : b.shm_offset + b.nbytes])
        t4 = time.perf_counter()
        for k, v in (
            ("copy_s", t1 - t0),
            ("hash_s", t2 - t1),
            ("hash_hot_s", t3 - t2),
            ("fused_s", t4 - t3),
        ):
            best[k] = min(best[k], v)
    return {k: round(v, 4) for k, v in best.items()}


def _floors(prim: dict[str, float], gloo_cpu: float, cores: int) -> dict[str, float]:
    """Lower bounds of one update's wall time on this machine, from the primitives and
    gloo's CPU seconds for the same transfer, with no Python overhead at all and perfect
    use of ``cores``: the trainer packs (copy + hot hash) while the two workers verify
    and copy each block as it is packed (the subscribers' default), so the update ends
    with the trainer's packing or when every core's share of the work is done.

    * shm: packing plus two verify-and-copy passes;
    * tcp: the same plus the kernel's socket copies, taken to cost what they cost gloo.
    """
    pack = prim["copy_s"] + prim["hash_hot_s"]
    work = pack + 2 * prim["fused_s"]
    shm = max(pack, work / cores)
    tcp = max(pack, (work + gloo_cpu) / cores)
    return {"shm": round(shm, 4), "tcp": round(tcp, 4)}


def _bucket_table(ack: Any) -> list[dict[str, float]]:
    st = ack.stats
    out = []
    i = 0
    while f"b{i}_recv_s" in st:
        out.append(
            {k: round(st.get(f"b{i}_{k}", 0.0), 4) for k in ("recv_s", "verify_s", "apply_s")}
        )
        i += 1
    return out


def _run_size(
    nbytes: int, hidden: int, vocab: int, reps: int, quick: bool, focus: bool = False
) -> list[Measurement]:
    """One model size: the fastio cases and their baselines; ``focus``: only ``tcp``,
    ``shm`` and ``gloo-bucketed`` (for iterating on the weight path)."""
    import fastio
    from bench.ipc_link import IpcTrainerLink
    from fastio import AllocationMode, WeightUpdateMeta
    from transport.weights import WeightPublisher
    from transport.weights.disk import save_weights
    from transport.weights.dist import WeightGroup, param_specs
    from transport.weights.routes.ipc import IpcExporter

    state = make_state(nbytes, hidden, vocab, seed=1)
    size = _nbytes(state)
    label = f"{size / (1 << 30):.2f}GiB" if size >= 1 << 30 else f"{size // _MIB}MiB"
    # What glibc read in this (the trainer's) process and what the workers start with.
    tunables = {
        "trainer_glibc_tunables": _start_env("GLIBC_TUNABLES"),
        "worker_glibc_tunables": os.environ.get("GLIBC_TUNABLES", WORKER_TUNABLES),
    }
    bucket = 256 * _MIB
    ctx: zmq.Context[Any] = zmq.Context.instance()
    ctrl = ctx.socket(zmq.ROUTER)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl_ep = f"tcp://127.0.0.1:{_free_port()}"
    ctrl.bind(ctrl_ep)
    tcp_pub = WeightPublisher(shm=False, bucket_bytes=bucket)
    shm_pub = WeightPublisher(shm=True, bucket_bytes=bucket)
    # ipc: smaller buckets than the sockets' so that packing bucket k+1 overlaps the
    # workers' checksum of bucket k (a bucket is announced only once it is whole)
    ipc_bucket = 32 * _MIB
    ipc_link = IpcTrainerLink(IpcExporter(state, bucket_bytes=ipc_bucket, slots=None))
    gloo_port = _free_port()
    alloc = AllocationMode.from_str("sglang.d2p1t1+d1p1t1")
    meta = WeightUpdateMeta.from_param_specs(
        alloc, param_specs(state), nccl_group_name="bench-dist", master_address="127.0.0.1"
    )
    meta_bytes = b"".join(bytes(f) for f in fastio.encode(meta))
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(
            target=_worker,
            args=(
                i,
                ctrl_ep,
                tcp_pub.endpoint,
                shm_pub.endpoint,
                nbytes,
                hidden,
                vocab,
                gloo_port,
                meta_bytes,
                ipc_link.endpoint,
            ),
            daemon=True,
        )
        for i in range(2)
    ]
    with _worker_env():
        for p in procs:
            p.start()
    idents: list[bytes] = []
    out: list[Measurement] = []
    tmp = tempfile.mkdtemp(prefix="fastio-bench-disk-")
    try:
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        while len(idents) < 2:
            if not poller.poll(120_000):
                raise RuntimeError("bench workers did not start")
            ident, _ = ctrl.recv_multipart()
            idents.append(ident)
        tcp_pub.wait_for_workers(2, 60)
        shm_pub.wait_for_workers(2, 60)
        ipc_link.wait_for_workers(2, 60)

        def command(cmd: bytes) -> None:
            for ident in idents:
                ctrl.send_multipart([ident, cmd])
            for _ in idents:
                if not poller.poll(300_000):
                    raise RuntimeError(f"bench workers did not answer {cmd!r}")
                ctrl.recv_multipart()

        version = [0]
        pids = [p.pid for p in procs if p.pid is not None]
        cpu: dict[str, dict[str, float]] = {}

        def fastio_case(pub: WeightPublisher, via: str) -> Measurement:
            samples = []
            packed = []
            last = None
            meter = _CpuMeter(pids)
            for r in range(reps + 2):  # two warm up: each allocates one of the 2 buffers
                if r == 2:
                    meter = _CpuMeter(pids)
                version[0] += 1
                t0 = time.perf_counter()
                pub.publish(state, version[0])
                packed.append(time.perf_counter() - t0)
                res = pub.wait(version[0], 300)
                dt = time.perf_counter() - t0
                if not res.ok:
                    raise RuntimeError(f"weight update failed: {res}")
                samples.append(dt)
                last = res
            assert last is not None
            ack = next(iter(last.applied.values()))
            if ack.via != via:
                raise RuntimeError(f"expected the {via} path, workers used {ack.via}")
            return Measurement.from_samples(
                SUITE,
                f"{via}@{label}",
                FASTIO,
                size,
                samples[2:],
                size_unit="bytes",
                gb_per_s_per_worker=round(size / 1e9 / min(samples[2:]), 3),
                buckets=_bucket_table(ack),
                publish_returned_s=round(statistics.median(packed[2:]), 4),
                bucket_bytes=bucket,
                **tunables,
                cpu_s_per_update=meter.per_update(reps),
                worker_stats={
                    k: round(v, 4)
                    for k, v in ack.stats.items()
                    if "_" in k and not k.startswith("b")
                },
            )

        def ipc_case() -> Measurement:
            samples = []
            meter = _CpuMeter(pids)
            for r in range(reps + 2):
                if r == 2:
                    meter = _CpuMeter(pids)
                version[0] += 1
                t0 = time.perf_counter()
                res = ipc_link.publish(state, version[0], timeout=300)
                samples.append(time.perf_counter() - t0)
                if not res.ok or len(res.applied) != 2:
                    raise RuntimeError(f"ipc weight update failed: {res}")
            ack = next(iter(res.applied.values()))
            return Measurement.from_samples(
                SUITE,
                f"ipc@{label}",
                FASTIO,
                size,
                samples[2:],
                size_unit="bytes",
                gb_per_s_per_worker=round(size / 1e9 / min(samples[2:]), 3),
                bucket_bytes=ipc_bucket,
                slots=ipc_link.exporter.n_slots,
                **tunables,
                cpu_s_per_update=meter.per_update(reps),
                worker_stats={k: round(v, 4) for k, v in ack.stats.items()},
            )

        prim = _primitives(state)
        ours = [fastio_case(tcp_pub, "tcp"), fastio_case(shm_pub, "shm")]
        if not focus:
            ours.append(ipc_case())

        # gloo, one broadcast per tensor into the live tensors (the reference's way)
        pg = None

        def gloo_per_tensor() -> list[float]:
            nonlocal pg
            for ident in idents:
                ctrl.send_multipart([ident, b"gloo %d" % (reps + 1)])
            if pg is None:
                pg = _gloo_group(gloo_port, 0, 3, "bench-gloo")
            samples = []
            meter = _CpuMeter(pids)
            for r in range(reps + 1):
                if r == 1:
                    meter = _CpuMeter(pids)
                t0 = time.perf_counter()
                for t in state.values():
                    _bcast(pg, t).wait()
                pg.barrier().wait()
                samples.append(time.perf_counter() - t0)
            for _ in idents:
                poller.poll(60_000)
                ctrl.recv_multipart()
            cpu["gloo"] = meter.per_update(reps)
            return samples[1:]

        def gloo_bucketed() -> list[float]:
            for ident in idents:
                ctrl.send_multipart([ident, b"dist %d %d" % (reps + 1, bucket)])
            group = WeightGroup(meta, 0, backend="gloo", bucket_bytes=bucket, timeout=120)
            samples = []
            meter = _CpuMeter(pids)
            for r in range(reps + 1):
                if r == 1:
                    meter = _CpuMeter(pids)
                t0 = time.perf_counter()
                group.send(state)
                group.pg.barrier().wait()
                samples.append(time.perf_counter() - t0)
            for _ in idents:
                poller.poll(60_000)
                ctrl.recv_multipart()
            cpu["gloo-bucketed"] = meter.per_update(reps)
            group.close()
            return samples[1:]

        def disk() -> list[float]:
            samples = []
            for _ in range(reps + 1):
                version[0] += 1
                t0 = time.perf_counter()
                save_weights(tmp, state, version[0])
                command(b"disk " + tmp.encode())
                samples.append(time.perf_counter() - t0)
            return samples[1:]

        baselines = {"gloo-bucketed": gloo_bucketed()}
        if not focus:
            baselines = {"gloo": gloo_per_tensor(), **baselines}
        if not focus and (not quick or size <= 256 * _MIB):
            baselines["disk"] = disk()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        floors = _floors(prim, cpu.get("gloo", {}).get("total", 0.0), cores)
        gloo_med = statistics.median(baselines.get("gloo", baselines["gloo-bucketed"]))
        for m in ours:
            via = m.case.split("@")[0]
            # What the guarantees leave reachable here: the floor and the best ratio
            # against gloo it allows (see _floors).
            m.extra["primitives_s"] = prim
            if via in floors:
                m.extra["floor_s"] = floors[via]
                m.extra["ceiling_ratio_vs_gloo"] = round(gloo_med / floors[via], 2)
            out.append(m)
            for impl, samples in baselines.items():
                out.append(
                    Measurement.from_samples(
                        SUITE,
                        m.case,
                        impl,
                        size,
                        samples,
                        size_unit="bytes",
                        gb_per_s_per_worker=round(size / 1e9 / min(samples), 3),
                        **tunables,
                        **({"cpu_s_per_update": cpu[impl]} if impl in cpu else {}),
                    )
                )
        with contextlib.suppress(zmq.ZMQError):
            for ident in idents:
                ctrl.send_multipart([ident, b"quit"])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        tcp_pub.close()
        shm_pub.close()
        ipc_link.close()
        ctrl.close(linger=0)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _FabricDefault:
    """A no-op copy lock that declares it refuses to serve mixed weights, as the fabric
    worker's does: the subscriber takes the fabric's default modes (one pass over
    shm/tcp, the ``ipc`` path atomic), which ``atomic=False`` would not (it makes the
    ``ipc`` path one-pass too). Nothing is served from these weights."""

    refuses_mixed = True

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _gpu_cases(nbytes: int, hidden: int, vocab: int, reps: int) -> list[Measurement]:
    """Trainer CUDA tensors -> worker CUDA tensors through the fabric (one process, the
    worker side in its thread), over TCP and through shared memory."""
    from transport.weights import WeightPublisher, WeightSubscriber

    state = make_state(nbytes, hidden, vocab, seed=1, device="cuda")
    size = _nbytes(state)
    out = []
    for via in ("tcp", "shm"):
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with (
            WeightPublisher(shm=via == "shm") as pub,
            WeightSubscriber(pub.endpoint, target, shm=via == "shm", lock=_FabricDefault()),
        ):
            pub.wait_for_workers(1, 30)
            samples = []
            for v in range(1, reps + 2):
                t0 = time.perf_counter()
                pub.publish(state, v)
                res = pub.wait(v, 300)
                if not res.ok:
                    raise RuntimeError(f"GPU weight update failed: {res}")
                samples.append(time.perf_counter() - t0)
            out.append(
                Measurement.from_samples(
                    SUITE,
                    f"gpu-{via}@{size // _MIB}MiB",
                    FASTIO,
                    size,
                    samples[1:],
                    size_unit="bytes",
                    device=torch.cuda.get_device_name(),
                )
            )
    return out


# -- GPU suite (bench/gpu_check.sh) -----------------------------------------------------
#: (label, bytes, hidden, vocab) of the GPU suite: ~184 MiB, ~1 GiB and ~8 GiB fp32.
GPU_SIZES = [
    ("184MiB", 192 * _MIB, 512, 32000),
    ("1GiB", 1 << 30, 1024, 32000),
    ("8GiB", 8 << 30, 2048, 32000),
]


def _device_state(nbytes: int, hidden: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """:func:`make_state`'s shapes, filled on the device (an 8 GiB state in a second)."""
    sd = make_state(nbytes, hidden, vocab, device="cuda", zeros=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in sd.values():
        t.normal_(generator=g)
    return sd


def _median_cuda(fn: Any, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _gpu_ipc_worker(
    endpoint: str, wid: str, nbytes: int, hidden: int, vocab: int, stop: Any
) -> None:
    """A worker process of the GPU suite: CUDA parameters fed by the ipc path."""
    import threading

    from bench.ipc_link import IpcWorkerLink
    from transport.weights.routes.ipc import IpcImporter

    torch.cuda.set_device(0)
    sd = make_state(nbytes, hidden, vocab, device="cuda", zeros=True)
    link = IpcWorkerLink(IpcImporter(sd, worker_id=wid), endpoint)

    def stopper() -> None:
        stop.wait()
        link.stop()

    threading.Thread(target=stopper, daemon=True).start()
    link.run(poll_s=0.2)
    link.close()


def _copy_floors(size: int) -> dict[str, float]:
    """Seconds to copy ``size`` bytes device to device, and each way through pinned
    host memory (the floors of the ipc and pinned paths)."""
    flat = torch.empty(size, dtype=torch.uint8, device="cuda")
    flat2 = torch.empty_like(flat)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return {
        "d2d": _median_cuda(lambda: flat2.copy_(flat)),
        "d2h-pinned": _median_cuda(lambda: host.copy_(flat, non_blocking=True), 5),
        "h2d-pinned": _median_cuda(lambda: flat.copy_(host, non_blocking=True), 5),
    }


def _raw_ipc_worker(shapes: Any, dtypes: Any, q_in: Any, q_out: Any) -> None:
    """The raw CUDA IPC baseline's worker (``shared/gpu/ipc_baseline.py``): one flat
    bucket received once (torch.multiprocessing pickles its handle), copied into its
    parameters every version, ack over a queue."""
    torch.cuda.set_device(0)
    params = [torch.zeros(s, dtype=d, device="cuda") for s, d in zip(shapes, dtypes, strict=True)]
    bucket = None
    while True:
        msg = q_in.get()
        if msg is None:
            return
        kind, version, payload = msg
        if kind == "bucket":
            bucket = payload
            continue
        assert bucket is not None
        off = 0
        for p in params:
            nb = p.numel() * p.element_size()
            p.view(-1).view(torch.uint8).copy_(bucket[off : off + nb])
            off += nb
        torch.cuda.synchronize()
        q_out.put(version)


def _raw_ipc(state: dict[str, torch.Tensor], reps: int) -> tuple[float, list[float]]:
    import torch.multiprocessing as tmp

    tensors = list(state.values())
    total = _nbytes(state)
    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    w = ctx.Process(
        target=_raw_ipc_worker,
        args=([tuple(t.shape) for t in tensors], [t.dtype for t in tensors], q_in, q_out),
        daemon=True,
    )
    w.start()
    bucket = torch.empty(total, dtype=torch.uint8, device="cuda")
    q_in.put(("bucket", 0, bucket))
    samples = []
    try:
        for v in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            off = 0
            for t in tensors:
                nb = t.numel() * t.element_size()
                bucket[off : off + nb].copy_(t.reshape(-1).view(torch.uint8))
                off += nb
            torch.cuda.synchronize()
            q_in.put(("version", v, None))
            if q_out.get(timeout=300) != v:
                raise RuntimeError("raw ipc baseline: wrong version acked")
            samples.append(time.perf_counter() - t0)
        q_in.put(None)
        w.join(30)
    finally:
        if w.is_alive():
            w.kill()
    return statistics.median(samples[1:]), samples


def _pinned_staging(state: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    """Trainer CUDA tensors -> a /dev/shm mapping registered as pinned -> a device staging
    -> CUDA targets, with device checksums both ways (:mod:`bench.pinned`),
    in one process: what the pinned shared-memory path costs without the sockets."""
    import mmap

    from bench import pinned
    from transport.weights.bucket import dtype_name
    from transport.weights.routes.ipc import plan_layout

    layout = plan_layout(
        ((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in state.items()), 256 * _MIB
    )
    total = sum(b.nbytes for b in layout)
    path = f"/dev/shm/fastio-bench-pinned-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        seg = mmap.mmap(fd, total)
        region = pinned.PinnedRegion(torch.frombuffer(seg, dtype=torch.uint8))
        staging = torch.empty(total, dtype=torch.uint8, device="cuda")
        targets = {k: torch.zeros_like(v) for k, v in state.items()}
        samples, ok = [], True
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sums, done = pinned.stage_out(layout, state, region.tensor)
            want = [int(c.item()) for c in sums]
            done[-1].synchronize()
            ok = ok and bool(pinned.stage_in(layout, region.tensor, staging, want).item())
            pinned.apply_staged(layout, staging, targets)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        ok = ok and all(torch.equal(targets[k], state[k]) for k in state)
        region.close()
        del region, seg
        return {"median_s": statistics.median(samples[1:]), "samples": samples, "verified": ok}
    finally:
        os.close(fd)
        os.unlink(path)


def gpu_suite(
    out_dir: str,
    sizes: list[tuple[str, int, int, int]] | None = None,
    reps: int = 5,
    budget_s: float = 230.0,
) -> list[dict[str, Any]]:  # pragma: no cover - needs a GPU
    """The GPU weight-update suite, one JSON row per case (printed and appended to
    ``<out_dir>/weights-gpu.jsonl``): per size, the floors (device copy, pinned copies
    each way), the raw CUDA IPC bucket baseline, fastio's ``ipc`` path (two slots and
    whole model; one and two worker processes on the trainer's GPU), pinned staging, and
    at 184 MiB/1 GiB the socket paths (``gpu-tcp``/``gpu-shm``). Stops starting new
    sizes after ``budget_s`` seconds (rows say what was skipped)."""
    import json

    from bench.ipc_link import IpcTrainerLink
    from transport.weights.routes.ipc import IpcExporter

    os.makedirs(out_dir, exist_ok=True)
    rows: list[dict[str, Any]] = []
    start = time.monotonic()

    def emit(**row: Any) -> None:
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        with open(os.path.join(out_dir, "weights-gpu.jsonl"), "a") as f:
            f.write(line + "\n")

    emit(case="device", name=torch.cuda.get_device_name(), torch=torch.__version__,
         cuda=torch.version.cuda)  # fmt: skip
    spawn = mp.get_context("spawn")
    for label, nbytes, hidden, vocab in sizes or GPU_SIZES:
        if time.monotonic() - start > budget_s:
            emit(case=f"skipped@{label}", reason=f"over the {budget_s} s budget")
            continue
        state = _device_state(nbytes, hidden, vocab, seed=1)
        size = _nbytes(state)
        for name, sec in _copy_floors(size).items():
            emit(case=f"floor-{name}@{label}", size=size, median_s=sec, gb_per_s=size / sec / 1e9)
        raw_med, raw_samples = _raw_ipc(state, reps)
        emit(case=f"raw-cuda-ipc-bucket@{label}", size=size, median_s=raw_med,
             samples=raw_samples, gb_per_s=size / raw_med / 1e9)  # fmt: skip
        stop = spawn.Event()
        link = IpcTrainerLink(IpcExporter(state, slots=2))
        procs: list[Any] = []
        version = 0
        try:
            for mode, slots in (("ipc", 2), ("ipc-whole", None)):
                if slots is None:
                    link.swap(IpcExporter(state, slots=None), ["gpu0"])
                for n_workers in (1, 2):
                    while len(procs) < n_workers:
                        wid = f"gpu{len(procs)}"
                        procs.append(spawn.Process(
                            target=_gpu_ipc_worker,
                            args=(link.endpoint, wid, nbytes, hidden, vocab, stop), daemon=True,
                        ))  # fmt: skip
                        procs[-1].start()
                        link.wait_for_workers(len(procs), 180)
                    if n_workers == 2 and slots is None:
                        link._send("gpu1", link.exporter.offer(link.hellos["gpu1"]))
                        link.wait_for_workers(2, 60)
                    samples = []
                    for _ in range(reps + 1):
                        version += 1
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        res = link.publish(state, version, timeout=300)
                        samples.append(time.perf_counter() - t0)
                        if not res.ok or len(res.applied) != n_workers:
                            raise RuntimeError(f"ipc update failed: {res}")
                    med = statistics.median(samples[1:])
                    emit(case=f"{mode}@{label}", workers=n_workers, size=size, median_s=med,
                         samples=samples, gb_per_s=size / med / 1e9,
                         slots=link.exporter.n_slots, ratio_vs_raw_ipc=med / raw_med,
                         worker_stats=next(iter(res.applied.values())).stats)  # fmt: skip
        finally:
            stop.set()
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
            link.close()
        vfs = os.statvfs("/dev/shm")
        if vfs.f_bavail * vfs.f_frsize > size + (1 << 30):  # a full tmpfs would SIGBUS us
            emit(case=f"pinned-staging@{label}", size=size, **_pinned_staging(state, reps))
        else:
            emit(case=f"skipped-pinned-staging@{label}", reason="/dev/shm too small")
        if nbytes <= 1 << 30:
            for m in _gpu_cases(nbytes, hidden, vocab, reps):
                emit(case=m.case, size=size, median_s=m.median_s, samples=m.samples)
        del state
        torch.cuda.empty_cache()
    return rows


def run(quick: bool) -> list[Measurement]:
    """Measure weight updates; quick: a ~30 MiB and a ~184 MiB model, 5 repeats.

    The CPU cases run with the trainer and its worker processes started with
    ``WORKER_TUNABLES``: in a child process started for the trainer (results back as
    JSON; its failure raises :class:`RuntimeError` with the end of its stderr), unless
    ``GLIBC_TUNABLES`` is set in this process's environment (even empty), when they run
    here, trainer and workers with that value. The GPU cases (where CUDA exists) run in
    this process.
    """
    if "GLIBC_TUNABLES" in os.environ:
        out = cpu_measurements(quick)
    else:
        out = _cpu_measurements_in_child(quick)
    if torch.cuda.is_available():
        sizes = GPU_SIZES[:2] if quick else GPU_SIZES
        out += gpu_measurements(gpu_suite("bench/results/gpu", sizes, reps=5))
    return out


def cpu_measurements(quick: bool) -> list[Measurement]:
    """The CPU cases (:func:`_run_size` per model size), in this process: the trainer
    runs with whatever ``GLIBC_TUNABLES`` this process started with."""
    # (bytes, hidden size, vocabulary): a model-size sweep for plotting update time
    # against size; the small models get a small vocabulary so that the embeddings do
    # not make up the whole model.
    if quick:
        plan = [(32 * _MIB, 256, 8000), (192 * _MIB, 512, 32000)]
    else:
        plan = [(64 * _MIB, 512, 8000), (256 * _MIB, 768, 32000), (1 << 30, 1024, 32000)]
    reps = 5
    out: list[Measurement] = []
    for nbytes, hidden, vocab in plan:
        out += _run_size(nbytes, hidden, vocab, reps, quick)
    return out


def focus_measurements(quick: bool) -> list[Measurement]:
    """The ~184 MiB model's ``tcp`` and ``shm`` cases and ``gloo-bucketed`` only
    (``python -m bench.weights --focus``: a quick loop for work on the weight path)."""
    return _run_size(192 * _MIB, 512, 32000, 5, True, focus=True)


def _import_roots() -> list[str]:
    """The directories ``bench``, ``fastio`` and ``transport`` are imported from here
    (a checkout's root, usually one), for the child's ``PYTHONPATH``."""
    import importlib

    roots: list[str] = []
    for name in ("bench", "fastio", "transport"):
        mod = importlib.import_module(name)
        paths = list(getattr(mod, "__path__", []))
        if paths:
            root = os.path.dirname(os.path.abspath(paths[0]))
            if root not in roots:
                roots.append(root)
    return roots


#: Lines of the child's stderr kept for the error it raises.
_STDERR_TAIL = 40


def _cpu_measurements_in_child(
    quick: bool,
    tunables: str = WORKER_TUNABLES,
    target: str = "bench.weights:cpu_measurements",
) -> list[Measurement]:
    """``target(quick)`` (``module:function``, by default :func:`cpu_measurements`) in a
    child Python process started with ``GLIBC_TUNABLES=tunables`` (glibc reads tunables
    only at a process's start), the parent's ``sys.path`` roots of
    ``bench``/``fastio``/``transport`` first on its ``PYTHONPATH``. The child writes
    the measurements as JSON to a file this process reads (:meth:`Measurement.to_dict`
    and back); its stdout goes to ours and its stderr too, the end of which a
    failure's :class:`RuntimeError` carries."""
    import collections
    import json
    import subprocess
    import sys
    import threading

    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, GLIBC_TUNABLES=tunables)
    env["PYTHONPATH"] = os.pathsep.join([*_import_roots(), *([pp] if pp else [])])
    with tempfile.TemporaryDirectory(prefix="fastio-bench-weights-") as tmp:
        result = os.path.join(tmp, "measurements.json")
        proc = subprocess.Popen(
            [sys.executable, "-c", "import bench.weights as w; w._child_main()", result, target]
            + (["--quick"] if quick else []),
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        stderr = proc.stderr
        tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)

        def pump() -> None:  # forward the child's stderr as it comes, keep its end
            for raw in stderr:
                line = raw.decode(errors="replace")
                tail.append(line)
                sys.stderr.write(line)
            sys.stderr.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait()
        except BaseException:  # interrupted: let the child stop its workers, then kill
            import signal

            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            reader.join(30)
            stderr.close()
        if rc != 0 or not os.path.exists(result):
            raise RuntimeError(
                f"the weights benchmark's trainer process (GLIBC_TUNABLES={tunables}) "
                f"exited with {rc}; the end of its stderr:\n" + "".join(tail)
            )
        with open(result) as f:
            doc = json.load(f)
    return [Measurement(**m) for m in doc["measurements"]]


def _child_main() -> None:
    """The child of :func:`_cpu_measurements_in_child`: ``argv[1]`` is the JSON file to
    write, ``argv[2]`` the ``module:function`` to call, ``--quick`` the mode."""
    import importlib
    import json
    import sys
    import traceback

    path, target, quick = sys.argv[1], sys.argv[2], "--quick" in sys.argv[3:]
    rc = 0
    try:
        module, _, func = target.partition(":")
        ms = getattr(importlib.import_module(module), func)(quick)
        tmp = path + ".part"
        with open(tmp, "w") as f:
            json.dump({"measurements": [m.to_dict() for m in ms]}, f)
        os.replace(tmp, path)  # whole or absent: a child killed while writing is no result
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # As the __main__ block: no waiting on the threads and atexit hooks of the libraries.
    os._exit(rc)


def gpu_measurements(rows: list[dict[str, Any]]) -> list[Measurement]:
    """The GPU suite's rows as :class:`Measurement` s for the report: each fastio case
    (``gpu-ipc``/``gpu-ipc-whole`` per worker count, ``gpu-pinned``, ``gpu-shm``,
    ``gpu-tcp``) next to the same size's baselines of the same run (raw CUDA IPC bucket,
    device copy; pinned D2H + H2D for the pinned case)."""
    by_size: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if "median_s" in r and "@" in r["case"]:
            name, label = r["case"].split("@")
            by_size.setdefault(label, {})[
                name + (f"/{r['workers']}w" if "workers" in r else "")
            ] = r
    out = []
    for label, cases in by_size.items():
        raw = cases.get("raw-cuda-ipc-bucket")
        d2d = cases.get("floor-d2d")
        d2h, h2d = cases.get("floor-d2h-pinned"), cases.get("floor-h2d-pinned")
        for name, r in cases.items():
            if name.startswith(("raw-", "floor-")):
                continue
            case = f"gpu-{name.removeprefix('gpu-')}@{label}".replace("pinned-staging", "pinned")
            size = int(r.get("size", 0))
            out.append(Measurement.from_samples(
                SUITE, case, FASTIO, size, r.get("samples", [r["median_s"]])[1:] or [r["median_s"]],
                size_unit="bytes", **{k: v for k, v in r.items() if k not in ("case", "samples", "size", "median_s")},
            ))  # fmt: skip
            base: dict[str, float] = {}
            if name.startswith("ipc"):
                base = {
                    k: b["median_s"] for k, b in (("raw-cuda-ipc", raw), ("d2d-copy", d2d)) if b
                }
            elif name.startswith("pinned") and d2h and h2d:
                base = {"pinned-d2h+h2d": d2h["median_s"] + h2d["median_s"]}
            for impl, sec in base.items():
                out.append(
                    Measurement.from_samples(SUITE, case, impl, size, [sec], size_unit="bytes")
                )
    return out


if __name__ == "__main__":  # pragma: no cover - manual runs
    import sys

    if "--gpu-only" in sys.argv:
        # bench/gpu_check.sh on a lent GPU machine: the GPU suite only.
        args = sys.argv[sys.argv.index("--gpu-only") + 1 :]
        out_dir = args[args.index("--out") + 1] if "--out" in args else "bench/results/gpu"
        budget = float(args[args.index("--budget") + 1]) if "--budget" in args else 230.0
        gpu_suite(out_dir, budget_s=budget)
        os._exit(0)
    if "--focus" in sys.argv:
        ms = _cpu_measurements_in_child(True, target="bench.weights:focus_measurements")
    else:
        ms = run("--quick" in sys.argv)
    for m in ms:
        print(m.case, m.impl, f"{m.median_s:.3f}s", m.extra.get("gb_per_s_per_worker"))
        if m.impl == FASTIO:
            print("   buckets:", m.extra.get("buckets"))
        for k in ("cpu_s_per_update", "worker_stats", "publish_returned_s", "primitives_s"):
            if k in m.extra:
                print(f"   {k}:", m.extra[k])
    os._exit(0)
