"""Trainer side of weight updates: stage a version in flat buckets and serve it."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

try:
    import torch  # noqa: F401  (only the check that the extra is installed)
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "WeightPublisher") from exc
import zmq

from fastio.versions import VERSION_1
from fastio.weight_msgs import WeightAnnounce, WeightWelcome
from transport import metrics
from transport.sockets import CurveConfig, WorkerAuthenticator, bind_all, make_socket
from transport.weights.bucket import named_tensors, split_aliases
from transport.weights.config import PublisherConfig, make_config
from transport.weights.core.publisher import PublisherCore
from transport.weights.errors import UpdateIncomplete
from transport.weights.results import SubscriberInfo, UpdateResult
from transport.weights.routes import shm as _shm
from transport.weights.routes.ipc import IPC_MODES, IpcOffering
from transport.weights.serving import Serving
from transport.weights.staging import Staged, VersionStore, plan_version

__all__ = ["IPC_MODES", "WeightPublisher"]

log = logging.getLogger("transport.weights.publisher")

#: I/O threads of the private context for the ROUTER (the bucket bytes); one more: PUB.
_ROUTER_IO_THREADS = 2


class WeightPublisher:
    """Publishes versions of a model's weights to :class:`WeightSubscriber` workers.

    Parameters
    ----------
    endpoint:
        ROUTER address to bind (``tcp://127.0.0.1:*``: a free port, see :attr:`endpoint`).
    config, **settings:
        A :class:`~transport.weights.config.PublisherConfig`, or its fields as keywords.
    context:
        ZeroMQ context (default: a private one, terminated at :meth:`close`).
    curve:
        CurveZMQ on both sockets (:class:`transport.CurveConfig`); use it across hosts.

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
        self.publisher_id = secrets.token_hex(8)
        self.host_id = _shm.host_id()
        metrics.expose("publisher")
        self.core = PublisherCore(self.host_id, cfg.worker_timeout, publisher_id=self.publisher_id)
        self.counters = self.core.counters
        self._cond = threading.Condition()
        self._probe: _shm.Probe | None = None
        if cfg.shm is not False and _shm.available():
            _shm.cleanup_stale()
            try:
                self._probe = _shm.write_probe()
            except OSError as exc:
                log.warning("no shared-memory fast path (%s); workers will use TCP", exc)
        self.store = VersionStore(self.core, self._cond, self._probe is not None, cfg.keep_versions)
        # A private context by default, its I/O threads pinned (AFFINITY below).
        self._own_zctx = context is None
        self._zctx: zmq.Context[Any] = context or zmq.Context(io_threads=1 + _ROUTER_IO_THREADS)
        self._auth = WorkerAuthenticator(self._zctx, curve) if curve is not None else None
        # At the HWM a ROUTER drops silently; MANDATORY turns that into EAGAIN, answered
        # as "busy". A restarted worker reuses its id; HANDOVER gives it the route.
        router_opts: dict[int, int | bytes] = {zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}
        pub_opts: dict[int, int | bytes] = {zmq.SNDHWM: 10_000}  # a PUB receives nothing
        if self._own_zctx:  # the ROUTER on I/O threads 1.._ROUTER_IO_THREADS, the PUB on 0
            router_opts[zmq.AFFINITY] = ((1 << _ROUTER_IO_THREADS) - 1) << 1
            pub_opts[zmq.AFFINITY] = 1
        server = partial(make_socket, self._zctx, curve=curve, curve_server=True)
        router = server(zmq.ROUTER, hwm=10_000, max_message_size=4 << 20, options=router_opts)
        self.endpoint: str = bind_all(router, endpoint)[0]
        pub = server(zmq.PUB, hwm=None, max_message_size=None, options=pub_opts)
        tcp = self.endpoint.startswith("tcp://")  # the PUB next to the ROUTER by default
        next_to = self.endpoint.rsplit(":", 1)[0] + ":*" if tcp else self.endpoint + ".pub"
        self.pub_endpoint: str = bind_all(pub, cfg.pub_endpoint or next_to)[0]
        self.ipc = IpcOffering(
            cfg.ipc,
            cfg.ipc_slots,
            cfg.ipc_timeout,
            core=self.core,
            cond=self._cond,
            encoder=VERSION_1,
            wake=lambda: self.serving.wake(),
            publisher_id=self.publisher_id,
            bucket_bytes=cfg.bucket_bytes,
        )
        shm = (self._probe.name, self._probe.token) if self._probe else ("", "")
        welcome = WeightWelcome(self.publisher_id, self.host_id, self.pub_endpoint, 0, *shm)
        link = tcp and (cfg.data_link or (cfg.data_link is None and curve is None))
        self.serving = Serving(cfg, self.store, self.ipc, router, pub, welcome, link=link)
        self._thread = threading.Thread(
            target=self.serving.run, name=f"weights-publisher-{self.publisher_id}", daemon=True
        )
        self.start()

    def start(self) -> WeightPublisher:
        """Start serving (returns ``self``; idempotent; done when made)."""
        if self._thread.ident is None and not self.serving.closed:
            self._thread.start()
        return self

    @property
    def latest_version(self) -> int:
        """The latest published version (``-1`` before the first)."""
        with self._cond:
            return self.core.latest_version

    def workers(self) -> dict[str, SubscriberInfo]:
        """A snapshot of the known workers, by id."""
        with self._cond:
            return {k: SubscriberInfo(**vars(v)) for k, v in self.core.workers.items()}

    def wait_for_workers(self, n: int, timeout: float) -> list[str]:
        """Wait until ``n`` live workers said Hello; their ids (else ``TimeoutError``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.core.alive()) >= n, timeout):
                raise TimeoutError(f"{len(self.core.alive())} of {n} weight subscribers connected")
            return sorted(self.core.alive())

    def publish(self, state: Any, version: int) -> WeightAnnounce:
        """Stage ``state`` (an ``nn.Module``, a state dict or ``(name, tensor)`` pairs) as
        ``version`` (newer than any before) and announce it; returns the manifest once
        every bucket is packed (the tensors may then change)."""
        t0 = time.monotonic()
        everything = named_tensors(state)
        tensors, aliases = split_aliases(dict(everything))
        with self._cond:
            if self.serving.closed:
                raise RuntimeError("publisher is closed")
            self.core.check_newer(version)
        ipc = self.ipc.wanted(everything)
        if ipc:  # slots first: a worker that opens them defers the Announce below
            self.ipc.prepare(everything, lambda: self.serving.closed)
        with self._cond:
            dtype = self.core.wanted_dtype()
        plan = plan_version(tensors, dtype, self.config.bucket_bytes)
        total = plan[-1].shm_offset + plan[-1].nbytes if plan else 0
        # Only ipc workers: the slots are the snapshot, staged late if someone needs it.
        if ipc and self.ipc.only():
            staged = Staged.ipc_only(version)
            self.core.count("versions_not_staged")
        else:
            staged = self.store.acquire(version, total)
        shm_name = staged.seg.name if staged.seg is not None else ""
        announce = WeightAnnounce(  # seq: the serving thread's, which owns it
            self.publisher_id, 0, version, self.config.checksum, total, plan, shm_name, aliases
        )
        staged.prepare(announce, tensors, self.config.chunk_bytes, self._cond)
        self.serving.submit(staged)  # packed by the serving thread between its sends
        with self._cond:
            if staged.error is not None:
                raise staged.error
            if self.serving.closed:
                if self.store.closed:  # closed before it took this version's buffer
                    self.store.close([staged])
                raise RuntimeError("publisher closed while publishing")
        if ipc:  # after the Announce (ipc workers' fallback), so their Acks find it
            try:
                self.ipc.publish(everything, version)
            finally:
                with self._cond:
                    staged.slots_packed()
                self.serving.wake()  # fetches parked meanwhile are answered now
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="pack").observe(time.monotonic() - t0)
        return announce

    def wait(
        self, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """Wait until every expected worker answered ``version`` (``workers``: the ids,
        default those alive at the announcement), or ``timeout`` passed; never raises
        for workers' failures (``result.ok``)."""
        with self._cond:
            led = self.core.lookup(version)
            if isinstance(led, UpdateResult):  # retired: its final result
                return led
            self.core.expect(led, workers)
            self._cond.notify_all()  # fewer expected may settle it for another waiter
            self._cond.wait_for(lambda: led.settled() or self.serving.closed, timeout)
            res, first_failure = self.core.outcome(led, time.monotonic())
            if first_failure:
                metrics.PUBLISHER_FAILURES.inc()
        metrics.PUBLISHER_PHASE_SECONDS.labels(phase="wait").observe(res.elapsed_s)
        return res

    def publish_and_wait(
        self, state: Any, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """:meth:`publish` then :meth:`wait`; :class:`UpdateIncomplete` unless all applied."""
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
        if not self.serving.stop():
            return
        self._thread.join(5.0)
        self.serving.close()
        if self._auth is not None:
            self._auth.stop()
        if self._own_zctx:
            self._zctx.term()
        with self._cond:
            self.store.close(self.serving.pending)
        self.ipc.close()
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> WeightPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
