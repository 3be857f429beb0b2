"""Worker side of weight updates: follow a publisher, fetch, verify, apply, acknowledge.

Loop model: one background thread owns the sockets, a DEALER to the publisher's ROUTER
(Hello, Fetch, Ack) and a SUB on its PUB (sequence-numbered Announce and Heartbeat),
polled with a ``zmq.Poller`` next to the data link's socket. Everything below runs in
that thread; other threads only read the version (:meth:`WeightSubscriber.wait_version`).

:class:`WeightSubscriber` owns its parts: the protocol core
(:class:`~transport.weights.core.subscriber.SubscriberCore`: which version, what to
report), the :class:`~transport.weights.reporting.Reporter` (version switches, Acks), the
shm/tcp routes (:class:`~transport.weights.fetching.VersionFetcher`) and the ``ipc`` route
(:class:`~transport.weights.routes.ipc.IpcReceiver`).

Never a mixed version served (``docs/PROTOCOL.md``, "Apply and commit"): with
``atomic=True`` nothing is written before every bucket verified (over TCP each chunk is
hashed and staged in a buffer kept between versions; through shared memory the segment is
the staging area); with ``atomic=False`` (only under a lock that refuses to serve mixed
weights) each block is hashed then copied while in cache, the lock held from the first
write to the end, and a version failing midway leaves the worker reporting version
``-1`` until one completes. Either way the manifest is checked before a byte moves, the
tensors are written in place and the version switches after the last copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Union

try:
    import torch
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "WeightSubscriber") from exc
import zmq

import fastio
from fastio.ipc_msgs import IpcOffer, IpcReady
from fastio.versions import VERSION_1
from fastio.weight_msgs import (
    PUBLISHER_TO_SUBSCRIBER,
    WeightAnnounce,
    WeightBucket,
    WeightError,
    WeightHeartbeat,
    WeightHello,
    WeightWelcome,
)
from transport import metrics
from transport.addresses import warn_if_unresolvable, with_reachable_host
from transport.sockets import CurveConfig, make_dealer, make_socket
from transport.weights.binding import DtypeSpec, Rename, advertised_dtype, parse_dtype_spec
from transport.weights.bucket import BucketApplier, named_tensors
from transport.weights.config import SubscriberConfig, make_config
from transport.weights.core.subscriber import SubscriberCore, choose_atomic
from transport.weights.fetching import VersionFetcher
from transport.weights.malloc import tune_malloc as _tune_malloc
from transport.weights.ratelog import RateLimitedLog
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes import shm as _shm
from transport.weights.routes.ipc import PATHS, IpcReceiver, ipc_eligible

__all__ = ["PATHS", "WeightSubscriber"]

log = logging.getLogger("transport.weights.subscriber")

#: What the DEALER and SUB accept: the weight messages and the ipc path's Offer and Ready.
_FROM_PUBLISHER = Union[PUBLISHER_TO_SUBSCRIBER, IpcOffer, IpcReady]  # noqa: UP007


class WeightSubscriber:
    """Keeps a model's weights at the latest version a :class:`WeightPublisher` serves.

    Parameters
    ----------
    endpoint:
        The publisher's ROUTER address.
    target:
        An ``nn.Module`` (its state dict is updated in place) or a mapping of name ->
        tensor to overwrite. CPU or CUDA tensors. ``None`` with a ``loader``.
    config:
        :class:`~transport.weights.config.SubscriberConfig`; its fields are also taken
        as keyword arguments (``window=4``), which override it. ``path=`` is the
        ``route`` field's keyword.
    lock:
        Held while the weights are written (e.g. the engine's forward lock): for the
        copy of a verified version, or in one-pass mode from the version's first
        write to its end. If entering it raises, the version fails and the weights
        stay. One-pass mode needs a lock that then refuses to serve
        (``refuses_mixed``), as the fabric's does.
    on_applied:
        Called with the new version once it is in the weights, under ``lock``, before
        the Ack (in the subscriber's thread).
    on_progress:
        Called with ``(version, bucket_index)`` when a bucket arrived and verified.
    dtype:
        The dtypes wanted (:mod:`transport.weights.binding`): ``None`` (exact match),
        ``"auto"``, one dtype for every floating tensor, or a dict engine name ->
        dtype; casts are bit-identical to ``tensor.to(dtype)``.
    rename:
        Trainer name -> engine name: a dict or a callable (``None`` skips a tensor).
    loader:
        Called under ``lock`` with ``(engine name, tensor)`` pairs of every verified
        version, after the in-place copy (the shape of ``model.load_weights``); the
        tensors are valid only during the call. If it raises, the version fails and
        :attr:`consistent` is false until a later version completes.
    context:
        ZeroMQ context (default: the global instance).
    curve:
        CurveZMQ keys (:class:`transport.CurveConfig`: this worker's secret key and
        the publisher's public key as ``server_public_key_file``).

    Examples
    --------
    >>> sub = WeightSubscriber("tcp://127.0.0.1:5555", model).start()  # doctest: +SKIP
    >>> sub.wait_version(1, timeout=30)  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        endpoint: str,
        target: Any,
        *,
        config: SubscriberConfig | None = None,
        lock: Any = None,
        on_applied: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        dtype: DtypeSpec = None,
        rename: Rename = None,
        loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveConfig | None = None,
        **settings: Any,
    ) -> None:
        cfg = self.config = make_config(SubscriberConfig, config, settings)
        eligible = ipc_eligible(cfg.route, target, loader, dtype, rename)
        if target is None and loader is None:
            raise ValueError("a WeightSubscriber needs a target, a loader or both")
        if curve is not None and curve.server_public_key_file is None:
            raise ValueError("CurveConfig.server_public_key_file is needed to subscribe")
        if cfg.tune_malloc:
            _tune_malloc()
        self.endpoint = endpoint
        self.curve = curve
        self.worker_id = cfg.worker_id or f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.targets = named_tensors(target) if target is not None else {}
        self.dtype = parse_dtype_spec(dtype)
        self.shm = cfg.shm and cfg.route != "tcp"
        #: shm/tcp: verify every bucket before the first write, or one pass.
        self.atomic = choose_atomic(
            cfg.atomic, getattr(lock, "refuses_mixed", False), loader is not None
        )
        self.lock = lock if lock is not None else contextlib.nullcontext()
        #: Versions, publishers, what to report (the protocol core, no I/O).
        self.core = SubscriberCore(cfg.version, cfg.retries)
        #: Counters: bad messages, gaps, retries, versions applied / failed.
        self.counters = self.core.counters
        self.reporter = Reporter(
            self.core, self.worker_id, self.targets, self._send,
            report_digest=cfg.report_digest, on_applied=on_applied,
        )  # fmt: skip
        #: The shm and tcp routes: fetch, verify, commit.
        self.fetcher = VersionFetcher(
            self.core, self.reporter, cfg, self.targets,
            BucketApplier(self.targets, copy_threads=cfg.copy_threads),
            atomic=self.atomic, lock=self.lock, dtype=self.dtype, rename=rename,
            loader=loader, on_progress=on_progress, send=self._send,
            keepalive=self.keepalive, endpoint=endpoint, worker_id=self.worker_id,
        )  # fmt: skip
        self._host = _shm.host_id()
        #: The ipc route (atomic unless told otherwise).
        self.ipc = IpcReceiver(
            self.core, self.reporter, self.fetcher, self.targets,
            eligible=eligible, atomic=cfg.atomic is not False, lock=self.lock,
            send=self._send, worker_id=self.worker_id, host=self._host,
            publisher_timeout=cfg.publisher_timeout,
        )  # fmt: skip
        self._hello_dtype = advertised_dtype(self.dtype, self.targets)
        self._rlog = RateLimitedLog(log)
        self._zctx = context or zmq.Context.instance()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_hello = 0.0
        # Weight messages carry no token arrays: version 1, which every release reads.
        self._encoder = VERSION_1
        self._decoder = fastio.Decoder(
            _FROM_PUBLISHER, max_message_size=cfg.max_message_size + (1 << 20)
        )
        self._pub_endpoint = ""

    # -- public API --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version the weights hold (last one applied completely)."""
        return self.core.version

    @property
    def consistent(self) -> bool:
        """False while the weights are mixed (a one-pass version in progress or failed
        midway, a copy or the ``loader`` failed midway): the worker then reports version
        ``-1`` and must not serve until a later version completes."""
        return self.core.consistent

    @property
    def last_error(self) -> str:
        """Error text of the last failed version (``""``: none)."""
        return self.reporter.last_error

    @property
    def last_stats(self) -> UpdateStats:
        """Timings of the last applied version."""
        return self.reporter.last_stats

    @property
    def ipc_open(self) -> bool:
        """Whether the trainer's ipc slots are open (next versions come by ``ipc``)."""
        return self.ipc.opened

    @property
    def ipc_refused(self) -> str:
        """Why the ipc route was refused (``""``: it was not)."""
        return self.ipc.refused

    @property
    def reported_version(self) -> int:
        """The version reported to the publisher: ``-1`` while the weights are mixed."""
        return self.core.reported_version

    @property
    def route(self) -> str:
        """The route of the last version applied (``"ipc"``, ``"shm"``, ``"tcp"``; ``""``
        before the first)."""
        return self.last_stats.via

    #: The older name of :attr:`route`.
    path = route

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def last_heard(self) -> float:
        """``time.monotonic()`` of the last message from the publisher (0: none yet)."""
        return self.core.last_heard

    def start(self) -> WeightSubscriber:
        """Start the background thread (returns ``self``). A publisher host name that
        does not resolve is logged as a WARNING (the thread keeps trying)."""
        if self._thread is None:
            metrics.expose("subscriber")
            warn_if_unresolvable(
                self.endpoint, log, f"weight subscriber {self.worker_id}, publisher"
            )
            self._thread = threading.Thread(
                target=self._run, name=f"weights-subscriber-{self.worker_id}", daemon=True
            )
            self._thread.start()
        return self

    def wait_version(self, version: int, timeout: float) -> bool:
        """Wait until the weights are at ``version`` or newer; False on timeout."""
        deadline = time.monotonic() + timeout
        cond = self.reporter.cond
        with cond:
            while self.core.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                cond.wait(left)
            return True

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        with self.reporter.cond:
            self._closed = True
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> WeightSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ------------------------------------------------------------------------
    def _run(self) -> None:
        self._dealer = make_dealer(
            self._zctx,
            self.endpoint,
            hwm=10_000,
            max_message_size=self.config.max_message_size,
            curve=self.curve,
            routing_id=self.worker_id.encode(),
        )  # fmt: skip (IMMEDIATE: a restarted publisher gets no stale Fetches)
        self._sub = make_socket(
            self._zctx, zmq.SUB, hwm=None, max_message_size=64 << 20, curve=self.curve,
            options={zmq.SUBSCRIBE: b""},
        )  # fmt: skip
        poller = self.fetcher.tcp.poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        next_hello = 0.0
        try:
            while True:
                with self.reporter.cond:
                    if self._closed:
                        return
                now = time.monotonic()
                if now >= next_hello:
                    self._hello()
                    next_hello = now + self.config.heartbeat_interval
                    self.fetcher.check_timeouts(now)
                    self.ipc.check_timeouts(now)
                timeout = min(next_hello - now, 0.2)
                events = dict(poller.poll(int(max(0.0, timeout) * 1000)))
                if self._sub in events:
                    self._drain(self._sub)
                if self._dealer in events:
                    self._drain(self._dealer)
                link = self.fetcher.tcp.link
                if link is not None and link.fd in events:
                    self.fetcher.tcp.read(self.fetcher)
        except Exception:  # the thread must not die silently
            log.exception("weight subscriber %s crashed", self.worker_id)
            raise
        finally:
            # A version in flight may hold the lock: fail it, so the lock is released.
            try:
                self.fetcher.abandon("the subscriber was closed mid-version")
            except Exception:
                log.exception("weight subscriber %s: failing the version at close", self.worker_id)
            self.fetcher.tcp.close()
            # The ipc goodbye must reach the trainer (else it waits for this worker's
            # acks until ipc_timeout): a short linger for it.
            said_bye = self.ipc.close()
            self._dealer.close(linger=500 if said_bye else 0)
            self._sub.close(linger=0)
            self.fetcher.shm.drop()

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frames)
            except fastio.DecodeError as exc:
                self.core.count("bad_messages")
                self._rlog.warning("bad message", "bad message from the weight publisher: %s", exc)
                continue
            try:
                self._dispatch(msg)
            except Exception as exc:  # keep following the publisher; report the version
                self.core.count("internal_errors")
                log.exception("weight subscriber %s: error handling a message", self.worker_id)
                self.fetcher.abandon(f"internal error: {exc!r}")

    def _send(self, msg: Any) -> None:
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    def keepalive(self) -> None:
        """A Hello if one is due, from inside a long copy (or a lock's wait): a worker
        silent for the publisher's ``worker_timeout`` is lost, and the shared memory it
        still copies from could be reused."""
        if time.monotonic() - self._last_hello >= self.config.heartbeat_interval:
            self._hello()

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        self._send(
            WeightHello(
                self.worker_id,
                self._host,
                self.reporter.pid,
                self.core.reported_version,
                self.reporter.digest,
                self._hello_dtype,
                self.reporter.start_time,
            )
        )

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, (WeightWelcome, WeightHeartbeat, WeightAnnounce)):
            step = self.core.notice(
                msg.publisher_id, isinstance(msg, WeightWelcome), time.monotonic()
            )
            if step == "hello":  # a publisher not shaken hands with (restarted)
                self._hello()
                return
            if step == "handshake":
                assert isinstance(msg, WeightWelcome)
                self._new_publisher(msg)
        if isinstance(msg, WeightWelcome):
            if msg.announce is not None:
                self.ipc.consider(msg.announce)
            self.ipc.hello(up_to_date=msg.announce is None)
        elif isinstance(msg, WeightHeartbeat):
            if self.core.on_heartbeat(msg.seq):
                self._hello()  # an Announce was lost: ask for the snapshot
        elif isinstance(msg, WeightAnnounce):
            self.core.on_announce(msg.seq)
            self.ipc.consider(msg)
        elif isinstance(msg, WeightBucket):
            self.fetcher.on_bucket(msg)
        elif isinstance(msg, WeightError):
            self._on_error(msg)
        elif isinstance(msg, IpcOffer):
            self.ipc.on_offer(msg)
        elif isinstance(msg, IpcReady):
            self.ipc.on_ready(msg)

    def _new_publisher(self, w: WeightWelcome) -> None:
        self.fetcher.abandon("the publisher was restarted mid-update")
        self.core.shake_hands(w.publisher_id, w.seq)
        self.fetcher.new_publisher(
            self.shm and w.host_id == self._host and _shm.read_probe(w.shm_probe, w.shm_token),
            (w.data_port, w.data_token) if self.config.data_link and w.data_port > 0 else None,
        )
        self.ipc.reset(w.host_id)
        # A publisher bound to every interface reports 0.0.0.0: its PUB is on the host
        # this worker reached its ROUTER at.
        pub_endpoint = with_reachable_host(w.pub_endpoint, self.endpoint)
        if pub_endpoint != self._pub_endpoint:
            if self._pub_endpoint:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(self._pub_endpoint)
            self._pub_endpoint = pub_endpoint
            self._sub.connect(pub_endpoint)

    def _on_error(self, msg: WeightError) -> None:
        up = self.fetcher.update
        self.core.count("errors_received")
        if up is None or msg.version != up.ann.version:
            self._rlog.warning("publisher error", "weight publisher error: %s", msg.reason)
            return
        self.fetcher.fail(up.ann.version, f"publisher: {msg.reason}")
        # A newer version exists: the next Hello brings its manifest.
        self._hello()
