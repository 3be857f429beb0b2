"""Trainer side of weight updates: stage a version in flat buckets and serve it.

:class:`WeightPublisher` owns its parts: the protocol core
(:class:`~transport.weights.core.publisher.PublisherCore`: who is a worker, who must
answer, who may still read a buffer), the staged versions
(:class:`~transport.weights.buffers.VersionStore`), the ``ipc`` route
(:class:`~transport.weights.routes.ipc.IpcOffering`), the data link's listener and
senders (:mod:`transport.weights.routes.tcp`) and the serving loop
(:class:`~transport.weights.serving.Serving`, one thread that owns the ROUTER and PUB).
:meth:`WeightPublisher.publish` runs in the caller's thread: it lays the version out and
hands it to the serving thread, which announces it and packs it while it serves.

Routes, per worker: a worker on this host that can open the trainer's memory takes
``ipc`` when the ``ipc`` setting allows it (``"auto"``: CUDA tensors, ``"cpu"``: CPU
tensors too, ``"off"``: never); every other worker, and a version that fails there,
takes ``shm`` (same host) or ``tcp``. Each Ack says which (``via``), and
:attr:`UpdateResult.paths` reports it per worker.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

try:
    import torch
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "WeightPublisher") from exc
import zmq

from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightAnnounce
from transport import metrics
from transport.sockets import CurveConfig, WorkerAuthenticator, bind_all, make_socket
from transport.weights.bucket import Hasher, named_tensors, split_aliases
from transport.weights.buffers import VersionStore
from transport.weights.config import PublisherConfig, make_config
from transport.weights.core.publisher import PublisherCore
from transport.weights.errors import UpdateIncomplete
from transport.weights.results import SubscriberInfo, UpdateResult
from transport.weights.routes import shm as _shm
from transport.weights.routes.ipc import IPC_MODES, IpcOffering
from transport.weights.routes.tcp import DataListener, DataSender
from transport.weights.serving import Serving
from transport.weights.staging import Staged, pack_steps, plan_version

__all__ = ["DEFAULT_CHUNK_BYTES", "IPC_MODES", "WeightPublisher"]

log = logging.getLogger("transport.weights.publisher")

#: Size of the chunks a bucket travels in, one message each: chunks let the I/O thread
#: interleave workers and the worker hash one while the next arrives; a huge frame is
#: one huge fresh allocation on the receiver.
DEFAULT_CHUNK_BYTES = 4 << 20

#: I/O threads of the publisher's private context that carry the ROUTER's connections
#: (the bucket bytes); one more carries the PUB's.
_ROUTER_IO_THREADS = 2
#: Workers only send small messages; a larger frame is hostile: disconnect.
_MAX_FROM_WORKER = 4 << 20


class WeightPublisher:
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
        CurveZMQ on both sockets (:class:`transport.CurveConfig`; ``authorized_clients_dir``
        admits only known workers). Use it across hosts: a worker without the right
        key gets nothing, not even the announcements.

    Examples
    --------
    >>> pub = WeightPublisher("tcp://127.0.0.1:*")  # doctest: +SKIP
    >>> pub.publish(model.state_dict(), version=1)  # doctest: +SKIP
    >>> pub.wait(1, timeout=30).ok  # doctest: +SKIP
    True
    """

    #: The serving loop's class (a subclass may inject faults, as the tests do).
    serving_class: type[Serving] = Serving

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
        Hasher(cfg.checksum)  # validates the name now rather than at the first publish
        self.bucket_bytes = cfg.bucket_bytes
        self.chunk_bytes = cfg.chunk_bytes
        self.checksum_algo = cfg.checksum
        self.heartbeat_interval = cfg.heartbeat_interval
        self.worker_timeout = cfg.worker_timeout
        self.keep_versions = cfg.keep_versions
        self.publisher_id = secrets.token_hex(8)
        self.host_id = _shm.host_id()
        metrics.expose("publisher")
        #: Workers and versions: who must answer, who may still read a buffer.
        self.core = PublisherCore(self.host_id, cfg.worker_timeout)
        #: Counters: bad messages, fetches served, bytes sent, ...
        self.counters = self.core.counters
        self._cond = threading.Condition()
        use_shm = _shm.available() if cfg.shm is None else bool(cfg.shm and _shm.available())
        probe: _shm.Probe | None = None
        if use_shm:
            _shm.cleanup_stale()
            try:
                probe = _shm.write_probe()
            except OSError as exc:
                log.warning("no shared-memory fast path (%s); workers will use TCP", exc)
                use_shm = False
        self._probe = probe
        #: The staged versions and their buffers (the buffer rule).
        self.store = VersionStore(self.core, self._cond, use_shm, cfg.keep_versions)
        # A private context by default, its I/O threads pinned (see _options): libzmq
        # would otherwise put every ROUTER connection on the least loaded one.
        self._own_zctx = context is None
        self._zctx: zmq.Context[Any] = context or zmq.Context(io_threads=1 + _ROUTER_IO_THREADS)
        self._auth: WorkerAuthenticator | None = None
        if curve is not None:  # the ZAP handler must run before the sockets bind
            self._auth = WorkerAuthenticator(self._zctx, curve)
        affinity = self._own_zctx
        router = make_socket(
            self._zctx, zmq.ROUTER, hwm=10_000, max_message_size=_MAX_FROM_WORKER, curve=curve,
            curve_server=True, options=_options(zmq.ROUTER, affinity),
        )  # fmt: skip
        self.endpoint: str = bind_all(router, endpoint)[0]
        pub = make_socket(
            self._zctx, zmq.PUB, hwm=None, max_message_size=None, curve=curve,
            curve_server=True, options=_options(zmq.PUB, affinity),
        )  # fmt: skip
        self.pub_endpoint: str = bind_all(pub, cfg.pub_endpoint or _sibling(self.endpoint))[0]
        self.senders: dict[str, DataSender] = {}
        token, listener = b"", None
        if self.endpoint.startswith("tcp://") and (
            cfg.data_link or (cfg.data_link is None and curve is None)
        ):
            token = secrets.token_bytes(16)
            try:
                listener = DataListener(self.endpoint, token, self._admit_link, cfg.data_port)
            except OSError as exc:
                log.warning("no data link (%s); TCP workers get ZeroMQ frames", exc)
        self._listener = listener
        #: The ipc route's slots and the workers that asked for them.
        self.ipc = IpcOffering(
            cfg.ipc, cfg.ipc_slots, cfg.ipc_timeout, core=self.core, cond=self._cond,
            encoder=VERSION_1, wake=self._wake, publisher_id=self.publisher_id,
            bucket_bytes=cfg.bucket_bytes,
        )  # fmt: skip
        #: The serving thread's loop and its sockets.
        self.serving = self.serving_class(
            cfg, self.core, self.store, self.ipc, self._cond, router=router, pub=pub,
            zctx=self._zctx, publisher_id=self.publisher_id, host_id=self.host_id,
            probe=probe, listener=listener, data_token=token, senders=self.senders,
        )  # fmt: skip
        self._thread = threading.Thread(
            target=self.serving.run, name=f"weights-publisher-{self.publisher_id}", daemon=True
        )
        self._thread.start()

    # -- public API ------------------------------------------------------------------
    @property
    def latest_version(self) -> int:
        """The latest published version (``-1`` before the first)."""
        with self._cond:
            return self.store.latest.version if self.store.latest else -1

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
            The manifest sent, once every bucket is packed (the caller may then change
            its tensors); :meth:`wait` collects the workers' answers.
        """
        t0 = time.monotonic()
        everything = named_tensors(state)
        tensors, aliases = split_aliases(dict(everything))
        with self._cond:
            if self.serving.closed:
                raise RuntimeError("publisher is closed")
            if self.store.latest is not None and version <= self.store.latest.version:
                raise ValueError(
                    f"version {version} is not newer than the latest ({self.store.latest.version})"
                )
        ipc = self.ipc.wanted(everything)
        if ipc:
            # Slots first: a worker that opens them defers the Announce below.
            self.ipc.prepare(everything, lambda: self.serving.closed)
        with self._cond:
            wanted = {i.dtype for i in self.core.workers.values() if i.alive}
        plan = plan_version(tensors, wanted, self.bucket_bytes)
        total = plan[-1].shm_offset + plan[-1].nbytes if plan else 0
        # Staged now only when someone will read it by shm/tcp; otherwise the ipc
        # slots are the snapshot, staged from when a late joiner or a re-fetch needs it.
        lazy = ipc and self.ipc.only()
        staged = Staged(version, torch.empty(0, dtype=torch.uint8), None)
        if lazy:
            staged.unstaged = staged.ipc_packing = True
            self.core.count("versions_not_staged")
        else:
            staged = self.store.acquire(version, total)
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
        # The serving thread packs step by step between its sends (packing here would
        # fight it for the GIL), so bucket k is on the wire while the rest is packed.
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
            self.serving.pending.append(staged)
        self._wake()
        with self._cond:
            while (
                staged in self.serving.pending or staged.job is not None
            ) and not self.serving.closed:
                self._cond.wait(1.0)
            if staged.error is not None:
                raise staged.error
            if self.serving.closed:
                raise RuntimeError("publisher closed while publishing")
        if ipc:
            # After the Announce (which ipc workers keep as their fallback), so that
            # their Acks find the version registered.
            try:
                self.ipc.publish(everything, version)
            finally:
                with self._cond:
                    staged.ipc_packing = False
                self._wake()  # fetches parked meanwhile are answered now
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="pack").observe(time.monotonic() - t0)
        return staged.announce

    def wait(
        self, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """Wait until every expected worker answered ``version``, or ``timeout`` passed.

        Parameters
        ----------
        version:
            A published version; one retired since (its buffer freed) returns its
            final result while it is among the last ``KEEP_RESULTS`` (64) retired.
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
            st = self.store.versions.get(version)
            if st is None and version in self.core.retired:
                return self.core.retired[version]  # answered and retired since
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
            res = led.result(time.monotonic())  # held even if retired meanwhile
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
            if self.serving.closed:
                return
            self.serving.closed = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(5.0)
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            senders = list(self.senders.values())
        for sender in senders:
            sender.close()
            sender.join(5.0)
        self.serving.close_sockets()
        if self._auth is not None:
            self._auth.stop()
        if self._own_zctx:
            self._zctx.term()
        with self._cond:
            self.store.closed = True
            self.store.close()
            self.store.latest = None
        self.ipc.close()
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admit_link(self, worker_id: str, sock: socket.socket) -> bool:
        """A worker's data link, token checked (the listener's thread)."""
        with self._cond:
            if self.serving.closed:
                return False
            old = self.senders.pop(worker_id, None)
            self.senders[worker_id] = DataSender(
                sock, worker_id, self.worker_timeout, self._link_closed, first=b"\x01"
            )
            self.core.count("data_links")
        if old is not None:
            old.close()  # a restarted worker's: its replacement has the id now
        return True

    def _link_closed(self, sender: DataSender) -> None:
        with self._cond:
            if self.senders.get(sender.worker_id) is sender:
                del self.senders[sender.worker_id]

    def _wake(self) -> None:
        self.serving.wake()


def _options(kind: int, pinned: bool) -> dict[int, int | bytes]:
    """The ROUTER's or PUB's further options; ``pinned``: on the private context's I/O
    threads (the ROUTER on 1.._ROUTER_IO_THREADS, the PUB on 0)."""
    if kind == zmq.PUB:  # a send HWM only: a PUB receives nothing but subscriptions
        options: dict[int, int | bytes] = {zmq.SNDHWM: 10_000}
        affinity = 1
    else:
        # At the HWM a ROUTER drops silently; MANDATORY turns that into EAGAIN, answered
        # as "busy" (workers bound their fetches by a window). A restarted worker reuses
        # its id; HANDOVER lets it take the route over from the dead one.
        options = {zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}
        affinity = ((1 << _ROUTER_IO_THREADS) - 1) << 1
    if pinned:
        options[zmq.AFFINITY] = affinity
    return options


def _sibling(endpoint: str) -> str:
    """A PUB address next to the ROUTER's: same host with a free port, or ``.pub``."""
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    return endpoint + ".pub"
