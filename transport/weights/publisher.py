"""Trainer side of weight updates: stage a version in flat buckets and serve it.

Sockets (see ``docs/PROTOCOL.md``, "Weight updates"):

* a ROUTER (``endpoint``) that answers Hello with Welcome (plus the latest manifest when
  the worker is behind: the snapshot of the zguide's Clone pattern), serves Fetch with
  the bucket's bytes as zero-copy frames, and collects Acks;
* a PUB (``pub_endpoint``, told to workers in the Welcome) carrying sequence-numbered
  Announce and Heartbeat notices only.

A version is staged in one buffer, a shared-memory segment when ``/dev/shm`` allows it
(same-host workers read it in place) and private memory otherwise. The buffer is the
version's snapshot: late joiners and re-fetches are served from it. Buffers are reused
from version to version, but one that a worker's process may still read is never
overwritten (the buffer rule, see :mod:`transport.weights.buffers`).

The path of each worker. A worker on this host whose process the trainer can see, and
that can open the trainer's memory, takes the ``ipc`` path (:mod:`transport.weights.ipc`:
persistent buckets of the trainer's memory, packed again every version, announced with
``IpcReady`` on the same ROUTER; wired in :mod:`transport.weights.ipc_serving`) when
``ipc`` allows it: ``"auto"`` for CUDA tensors, ``"cpu"`` for CPU tensors too (on CPU,
torch's shared-memory files are slower than the ``shm`` path: opt-in), ``"off"`` never. Every other worker, and an ``ipc`` worker whose
offer was refused or whose version failed there, takes ``shm`` (same host) or ``tcp``.
Each Ack says which (``via``), and :attr:`UpdateResult.paths` reports it per worker.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Union

try:
    import torch
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "WeightPublisher") from exc
import zmq

import fastio
from fastio.ipc_msgs import IpcAck, IpcHello
from fastio.versions import VERSION_1
from fastio.weight_msgs import SUBSCRIBER_TO_PUBLISHER, WeightAnnounce
from transport import metrics
from transport.sockets import CurveConfig, WorkerAuthenticator, apply_curve_server
from transport.weights import shm as _shm
from transport.weights.bucket import (
    Hasher,
    named_tensors,
    split_aliases,
)
from transport.weights.buffers import VersionBuffers
from transport.weights.config import PublisherConfig, make_config
from transport.weights.core.publisher import PublisherCore
from transport.weights.datalink import DataListener, DataSender
from transport.weights.errors import UpdateIncomplete
from transport.weights.ipc_serving import IPC_MODES, IpcServing
from transport.weights.ratelog import RateLimitedLog
from transport.weights.results import SubscriberInfo, UpdateResult
from transport.weights.staging import Staged, pack_steps, plan_version

__all__ = ["DEFAULT_CHUNK_BYTES", "IPC_MODES", "WeightPublisher"]

log = logging.getLogger("transport.weights.publisher")

#: Size of the pieces a bucket is cut into on the wire, one message each. One frame of
#: hundreds of MiB is several times slower (one huge fresh allocation per message on the
#: receiver), and separate messages let the I/O thread interleave workers and the worker
#: checksum a piece while the next arrives. 4 MiB rather than 1 since the worker copies
#: each piece into its staging buffer and frees it at once: fewer messages, less trainer
#: CPU per update, the pipeline as deep (bench/results).
DEFAULT_CHUNK_BYTES = 4 << 20

#: I/O threads of the publisher's private context that carry the ROUTER's connections
#: (the bucket bytes); one more carries the PUB's.
_ROUTER_IO_THREADS = 2

#: What the ROUTER accepts: the weight messages and the ipc path's Hello and Ack.
_FROM_SUBSCRIBER = Union[SUBSCRIBER_TO_PUBLISHER, IpcHello, IpcAck]  # noqa: UP007


class WeightPublisher(IpcServing, VersionBuffers):
    """Publishes versions of a model's weights to :class:`WeightSubscriber` workers.

    Parameters
    ----------
    endpoint:
        ROUTER address to bind (``tcp://127.0.0.1:*`` picks a free port; see
        :attr:`endpoint` for the bound one). Workers connect here.
    config:
        :class:`~transport.weights.config.PublisherConfig`; its fields are also taken
        as keyword arguments (``bucket_bytes=...``), which override it.
    context:
        ZeroMQ context (default: a private one, terminated at :meth:`close`).
    curve:
        CurveZMQ on both sockets (:class:`transport.CurveConfig`: this side's secret
        key and, to admit only known workers, ``authorized_clients_dir``). Turn it on
        whenever workers connect across hosts: a worker with a wrong or missing key
        gets nothing, not even the announcements.

    Examples
    --------
    >>> pub = WeightPublisher("tcp://127.0.0.1:*")  # doctest: +SKIP
    >>> pub.publish(model.state_dict(), version=1)  # doctest: +SKIP
    >>> pub.wait(1, timeout=30).ok  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        config: PublisherConfig | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveConfig | None = None,
        **settings: Any,
    ) -> None:
        cfg = self.config = make_config(PublisherConfig, config, settings)
        checksum, shm, data_link = cfg.checksum, cfg.shm, cfg.data_link
        self._init_ipc(cfg.ipc, cfg.ipc_slots, cfg.ipc_timeout)
        Hasher(checksum)  # validates the name now rather than at the first publish
        self.bucket_bytes = cfg.bucket_bytes
        self.chunk_bytes = cfg.chunk_bytes
        self.checksum_algo = checksum
        self.heartbeat_interval = cfg.heartbeat_interval
        self.worker_timeout = cfg.worker_timeout
        metrics.expose("publisher")
        self.keep_versions = cfg.keep_versions
        self.publisher_id = secrets.token_hex(8)
        self.host_id = _shm.host_id()
        #: Workers and versions: who must answer, who may still read a buffer.
        self.core = PublisherCore(self.host_id, cfg.worker_timeout)
        #: Counters: bad messages, fetches served, bytes sent, ...
        self.counters = self.core.counters
        self._rlog = RateLimitedLog(log)
        self._use_shm = _shm.available() if shm is None else bool(shm and _shm.available())
        if self._use_shm:
            _shm.cleanup_stale()
        self._probe: _shm.Probe | None = None
        if self._use_shm:
            try:
                self._probe = _shm.write_probe()
            except OSError as exc:
                log.warning("no shared-memory fast path (%s); workers will use TCP", exc)
                self._use_shm = False

        # A private context by default: its I/O threads serve only the weights, and
        # close() can terminate it without touching the application's sockets. The
        # kernel copies of the bucket sends run in the I/O threads, so workers'
        # connections must be spread over them: libzmq gives a new connection to the
        # least loaded thread (counting listeners and every connection), which with two
        # threads put both workers' ROUTER connections on one thread and their SUB
        # connections on the other (one I/O thread then did every bucket send). Hence
        # thread 0 for the PUB (small notices) and threads 1..n for the ROUTER, whose
        # connections then alternate between them.
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = context or zmq.Context(io_threads=1 + _ROUTER_IO_THREADS)
        self._auth: WorkerAuthenticator | None = None
        if curve is not None:
            # The ZAP handler must run before the sockets bind.
            self._auth = WorkerAuthenticator(self._ctx, curve)
        self._router = self._ctx.socket(zmq.ROUTER)
        if self._own_ctx:
            self._router.setsockopt(zmq.AFFINITY, ((1 << _ROUTER_IO_THREADS) - 1) << 1)
        apply_curve_server(self._router, curve)
        self._router.setsockopt(zmq.LINGER, 0)
        # At the HWM a ROUTER drops silently; MANDATORY turns that into EAGAIN, which
        # is answered as "busy" instead (workers bound their fetches by a window).
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted worker reuses its id; it takes the route over from the dead one.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.SNDHWM, 10_000)
        self._router.setsockopt(zmq.RCVHWM, 10_000)
        # Workers only send small messages; anything larger is hostile: disconnect.
        self._router.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        self._router.bind(endpoint)
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = self._ctx.socket(zmq.PUB)
        if self._own_ctx:
            self._pub.setsockopt(zmq.AFFINITY, 1)
        apply_curve_server(self._pub, curve)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self._pub.bind(cfg.pub_endpoint or _sibling(self.endpoint))
        self.pub_endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_addr = f"inproc://fastio-weights-wake-{self.publisher_id}"
        self._wake_r = self._ctx.socket(zmq.PAIR)
        self._wake_r.bind(wake_addr)
        self._wake_w = self._ctx.socket(zmq.PAIR)
        self._wake_w.connect(wake_addr)
        self._wake_lock = threading.Lock()

        # Weight messages carry no token arrays: version 1, which every release reads.
        self._encoder = VERSION_1
        self._decoder = fastio.Decoder(_FROM_SUBSCRIBER, max_message_size=8 << 20)
        self._cond = threading.Condition()
        self._versions: dict[int, Staged] = {}
        self._latest: Staged | None = None
        self._free_segments: list[_shm.ShmSegment] = []
        self._pending: list[Staged] = []
        self._parked: list[tuple[bytes, str, Any]] = []
        self._seq = 0
        self._closed = False
        self._senders: dict[str, DataSender] = {}
        self._data_token = b""
        self._listener: DataListener | None = None
        if self.endpoint.startswith("tcp://") and (
            data_link or (data_link is None and curve is None)
        ):
            self._data_token = secrets.token_bytes(16)
            try:
                self._listener = DataListener(
                    self.endpoint, self._data_token, self._admit_link, cfg.data_port
                )
            except OSError as exc:
                log.warning("no data link (%s); TCP workers get ZeroMQ frames", exc)
        self._thread = threading.Thread(
            target=self._serve, name=f"weights-publisher-{self.publisher_id}", daemon=True
        )
        self._thread.start()

    # -- public API ------------------------------------------------------------------
    @property
    def latest_version(self) -> int:
        """The latest published version (``-1`` before the first)."""
        with self._cond:
            return self._latest.version if self._latest else -1

    def workers(self) -> dict[str, SubscriberInfo]:
        """A snapshot of the known workers, by id."""
        with self._cond:
            return {k: SubscriberInfo(**vars(v)) for k, v in self.core.workers.items()}

    def wait_for_workers(self, n: int, timeout: float) -> list[str]:
        """Wait until at least ``n`` live workers said Hello; returns their ids.

        Raises ``TimeoutError`` when fewer are there after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                alive = sorted(w for w, i in self.core.workers.items() if i.alive)
                if len(alive) >= n:
                    return alive
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(alive)} of {n} weight subscribers connected")
                self._cond.wait(left)

    def publish(self, state: Any, version: int) -> WeightAnnounce:
        """Stage ``state`` as ``version`` and announce it to every worker.

        Parameters
        ----------
        state:
            An ``nn.Module``, a state dict or an iterable of ``(name, tensor)`` (e.g.
            ``model.named_parameters()``); CPU or CUDA tensors of any supported dtype.
        version:
            Must be greater than every version published before.

        Returns
        -------
        WeightAnnounce
            The manifest sent to the workers. Returns once every bucket is packed (the
            caller may then change its tensors); workers fetch meanwhile, and
            :meth:`wait` collects their answers.
        """
        t0 = time.monotonic()
        everything = named_tensors(state)
        tensors, aliases = split_aliases(dict(everything))
        with self._cond:
            if self._closed:
                raise RuntimeError("publisher is closed")
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(
                    f"version {version} is not newer than the latest ({self._latest.version})"
                )
        ipc = self._ipc_wanted(everything)
        if ipc:
            # Slots first: a worker that opens them defers the Announce below.
            self._prepare_ipc(everything)
        with self._cond:
            wanted = {i.dtype for i in self.core.workers.values() if i.alive}
        plan = plan_version(tensors, wanted, self.bucket_bytes)
        total = plan[-1].shm_offset + plan[-1].nbytes if plan else 0
        # Staged for shm/tcp now only when someone will read it that way; otherwise
        # the ipc slots are the snapshot, staged from on the first Hello or Fetch
        # that needs it (a late joiner, a failed ipc version).
        lazy = ipc and self._ipc_only()
        staged = Staged(version, torch.empty(0, dtype=torch.uint8), None)
        if lazy:
            staged.unstaged = staged.ipc_packing = True
            self._count("versions_not_staged")
        else:
            staged = self._acquire(version, total)
        staged.announce = WeightAnnounce(
            publisher_id=self.publisher_id,
            seq=0,  # assigned by the serving thread, which owns the sequence
            version=version,
            checksum_algo=self.checksum_algo,
            total_bytes=total,
            buckets=plan,
            shm_name=staged.seg.name if staged.seg is not None else "",
            aliases=aliases,
        )
        # The serving thread announces, then packs chunk by chunk, answering fetches in
        # between: bucket k's pieces are on the wire while the rest is being packed.
        # (Packing in this thread instead would fight the serving thread for the GIL at
        # every block.) Checksums are filled in as buckets are packed; the last piece
        # of each bucket carries its checksum.
        if not lazy:
            staged.job = pack_steps(
                staged,
                plan,
                tensors,
                checksum_algo=self.checksum_algo,
                chunk_bytes=self.chunk_bytes,
                cond=self._cond,
            )
        with self._cond:
            self._pending.append(staged)
        self._wake()
        with self._cond:
            while (staged in self._pending or staged.job is not None) and not self._closed:
                self._cond.wait(1.0)
            if staged.error is not None:
                raise staged.error
            if self._closed:
                raise RuntimeError("publisher closed while publishing")
        if ipc:
            # After the Announce (which ipc workers keep as their fallback), so that
            # their Acks find the version registered.
            try:
                self._publish_ipc(everything, version)
            finally:
                with self._cond:
                    staged.ipc_packing = False
                self._wake()  # fetches parked meanwhile are answered now
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="pack").observe(time.monotonic() - t0)
        return staged.announce

    def _ipc_only(self) -> bool:
        """Whether every live worker reads the next version by ``ipc`` and the slots
        hold a whole version (a snapshot to stage from later)."""
        with self._cond:
            exp = self._ipc
            if exp is None or exp.n_slots < len(exp.layout):
                return False
            return all(
                w in exp.workers and exp.workers[w].opened
                for w, i in self.core.workers.items()
                if i.alive
            )

    def _stage_late(self, st: Staged) -> bool:
        """Stage a version published only to ``ipc`` workers, from the ipc slots, while
        they still hold it (serving thread). False when they no longer do."""
        assert st.announce is not None
        with self._cond:
            if not st.unstaged:
                return True
            exp = self._ipc
            src = exp.snapshot(st.version) if exp is not None else None
            if exp is None or src is None:
                return False
            exp.snapshot_reads += 1
        total = st.announce.total_bytes
        try:
            fresh = self._acquire(st.version, total)
        except BaseException:
            with self._cond:
                exp.snapshot_reads -= 1
            raise
        job = pack_steps(
            st,
            st.announce.buckets,
            src,
            checksum_algo=self.checksum_algo,
            chunk_bytes=self.chunk_bytes,
            cond=self._cond,
        )

        def reading() -> Iterator[None]:
            try:
                yield from job
            finally:
                with self._cond:
                    exp.snapshot_reads -= 1
                    self._cond.notify_all()

        with self._cond:
            st.buf, st.seg = fresh.buf, fresh.seg
            st.announce.shm_name = st.seg.name if st.seg is not None else ""
            st.unstaged = False
            st.job = reading()
        self._count("versions_staged_late")
        return True

    def wait(
        self, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """Wait until every expected worker answered ``version``, or ``timeout`` passed.

        Parameters
        ----------
        version:
            A published version.
        timeout:
            Seconds to wait at most.
        workers:
            The worker ids to wait for; default: the workers alive when the version
            was announced, plus any that answered it since.

        Returns
        -------
        UpdateResult
            Never raises for workers' failures: ``result.ok`` says whether all applied.
            (:meth:`publish_and_wait` raises instead.)
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._versions.get(version)
            if st is None or st.announce is None:
                raise KeyError(f"version {version} was not published by this publisher")
            led = st.ledger
            if workers is not None:
                led.expected = set(workers)
            while not (led.answered() and led.expected):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            res = self.core.result(version, time.monotonic())
            if res.failed and not led.failure_counted:
                led.failure_counted = True
                metrics.PUBLISHER_FAILURES.inc()
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="wait").observe(res.elapsed_s)
        return res

    def publish_and_wait(
        self, state: Any, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """:meth:`publish` then :meth:`wait`; raises :class:`UpdateIncomplete` unless every
        expected worker applied the version (the exception carries the result)."""
        t0 = time.monotonic()
        self.publish(state, version)
        res = self.wait(version, timeout, workers=workers)
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="total").observe(time.monotonic() - t0)
        if not res.ok:
            raise UpdateIncomplete(
                f"version {version}: applied by {sorted(res.applied)}, failed "
                f"{res.failed}, no answer from {res.missing}",
                res,
            )
        return res

    def close(self) -> None:
        """Stop serving, close the sockets and free every staged buffer."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(5.0)
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            senders = list(self._senders.values())
        for sender in senders:
            sender.close()
            sender.join(5.0)
        for s in (self._router, self._pub, self._wake_r, self._wake_w):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()
        with self._cond:
            self._close_buffers()
            self._latest = None
        self._close_ipc()
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admit_link(self, worker_id: str, sock: socket.socket) -> bool:
        """A worker's data link, token checked (the listener's thread)."""
        with self._cond:
            if self._closed:
                return False
            old = self._senders.pop(worker_id, None)
            self._senders[worker_id] = DataSender(
                sock, worker_id, self.worker_timeout, self._link_closed, first=b"\x01"
            )
            self._count("data_links")
        if old is not None:
            old.close()  # a restarted worker's: its replacement has the id now
        return True

    def _link_closed(self, sender: DataSender) -> None:
        with self._cond:
            if self._senders.get(sender.worker_id) is sender:
                del self._senders[sender.worker_id]

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_w.send(b"", zmq.NOBLOCK)


def _sibling(endpoint: str) -> str:
    """A PUB address next to the ROUTER's: same host with a free port, or ``.pub``."""
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    return endpoint + ".pub"
