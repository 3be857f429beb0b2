"""Worker side of weight updates: follow a publisher, fetch, verify, apply, acknowledge.
One background thread owns the sockets (``docs/weights.md``, "Three layers")."""

from __future__ import annotations

import contextlib
import functools
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
from fastio import weight_msgs as wm
from fastio.ipc_msgs import IpcOffer, IpcReady
from fastio.versions import VERSION_1
from transport import metrics, zmqio
from transport.addresses import warn_if_unresolvable, with_reachable_host
from transport.ratelog import RateLimitedLog
from transport.sockets import CurveConfig, make_dealer, make_socket
from transport.weights.binding import Binding, DtypeSpec, Rename, advertised_dtype, parse_dtype_spec
from transport.weights.bucket import named_tensors
from transport.weights.config import SubscriberConfig, make_config
from transport.weights.core.subscriber import Notice, SubscriberCore
from transport.weights.fetching import VersionFetcher
from transport.weights.reporting import Reporter
from transport.weights.results import UpdateStats
from transport.weights.routes import shm as _shm
from transport.weights.routes.ipc import PATHS, IpcReceiver, ipc_eligible

__all__ = ["PATHS", "WeightSubscriber"]

log = logging.getLogger("transport.weights.subscriber")

#: What the DEALER and SUB accept: the weight messages and the ipc route's Offer and Ready.
_FROM_PUBLISHER = Union[wm.PUBLISHER_TO_SUBSCRIBER, IpcOffer, IpcReady]  # noqa: UP007
_NOTICES: dict[type, Notice] = {
    wm.WeightWelcome: "welcome",
    wm.WeightHeartbeat: "heartbeat",
    wm.WeightAnnounce: "announce",
}


class WeightSubscriber:
    """Keeps a model's weights at the latest version a :class:`WeightPublisher` serves.

    ``endpoint``: the publisher's ROUTER address; ``target``: an ``nn.Module`` or a mapping
    of name -> tensor, updated in place (``None`` with a ``loader``); ``config``: a
    :class:`~transport.weights.config.SubscriberConfig`, or its fields as keywords
    (``path=`` is ``route``); ``lock``: held while the weights are written (e.g. the
    engine's forward lock); ``on_applied``, ``on_progress``: called with each version
    applied (before its Ack), and with ``(version, bucket_index)`` per bucket verified;
    ``dtype``, ``rename``: the dtypes wanted, and trainer name -> engine name
    (:mod:`.binding`); ``loader``: called under ``lock`` with the ``(engine name,
    tensor)`` pairs of each version; ``context``, ``curve``: ZeroMQ context (default: the
    global one), CurveZMQ keys.

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
        if cfg.tune_malloc:  # process-wide: a version's freed chunks kept for the next
            zmqio.tune_malloc(32 << 20, 1 << 30)
        self.endpoint = endpoint
        self.curve = curve
        self.worker_id = cfg.worker_id or f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.targets = named_tensors(target) if target is not None else {}
        self.dtype = parse_dtype_spec(dtype)
        self.shm = cfg.shm and cfg.route != "tcp"
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.core = SubscriberCore(cfg.version, cfg.retries)
        self.counters = self.core.counters
        self.reporter = Reporter(
            self.core, self.worker_id, self.targets, self._send,
            report_digest=cfg.report_digest, on_applied=on_applied,
        )  # fmt: skip
        bind = functools.partial(
            Binding, targets=self.targets, rename=rename, dtype=self.dtype, strict=cfg.strict,
            loader=loader is not None,
        )  # fmt: skip
        self.fetcher = VersionFetcher(
            self.core, self.reporter, cfg, bind, lock=self.lock, loader=loader,
            on_progress=on_progress, keepalive=self.keepalive, endpoint=endpoint,
        )  # fmt: skip
        self.atomic = self.fetcher.atomic
        self._host = _shm.host_id()
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
        self._decoder = fastio.Decoder(
            _FROM_PUBLISHER, max_message_size=cfg.max_message_size + (1 << 20)
        )
        self._pub_endpoint = ""

    @property
    def version(self) -> int:
        """The version the weights hold (last one applied completely)."""
        return self.core.version

    @property
    def consistent(self) -> bool:
        """False while the weights are mixed (version ``-1`` reported)."""
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
        """The route of the last version applied (``"ipc"``, ``"shm"``, ``"tcp"``, ``""``)."""
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
        """Start the background thread (returns ``self``)."""
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
        with self.reporter.cond:
            return self.reporter.cond.wait_for(lambda: self.core.version >= version, timeout)

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

    def _run(self) -> None:
        # IMMEDIATE (make_dealer): a restarted publisher gets no stale Fetches.
        self._dealer = make_dealer(
            self._zctx, self.endpoint, hwm=10_000, max_message_size=self.config.max_message_size,
            curve=self.curve, routing_id=self.worker_id.encode(),
        )  # fmt: skip
        self._sub = make_socket(
            self._zctx, zmq.SUB, hwm=None, max_message_size=64 << 20, curve=self.curve,
            options={zmq.SUBSCRIBE: b""},
        )  # fmt: skip
        tcp = self.fetcher.tcp
        poller = tcp.poller = zmq.Poller()
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
                events = dict(poller.poll(int(max(0.0, min(next_hello - now, 0.2)) * 1000)))
                for sock in (self._sub, self._dealer):
                    if sock in events:
                        self._drain(sock)
                if tcp.link is not None and tcp.link.fd in events:
                    tcp.receive(self.fetcher)
        except Exception:  # the thread must not die silently
            log.exception("weight subscriber %s crashed", self.worker_id)
            raise
        finally:
            try:  # a version in flight may hold the lock: fail it
                self.fetcher.abandon("the subscriber was closed mid-version")
            except Exception:
                log.exception("weight subscriber %s: failing the version at close", self.worker_id)
            tcp.close()
            # A short linger for the ipc goodbye (the trainer waits for its acks).
            said_bye = self.ipc.close()
            self._dealer.close(linger=500 if said_bye else 0)
            self._sub.close(linger=0)
            self.fetcher.shm.close()

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
        # Weight messages carry no token arrays: version 1, which every release reads.
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(VERSION_1.encode(msg), zmq.NOBLOCK, copy=False)

    def keepalive(self) -> None:
        """A Hello if one is due (from inside a long copy or a lock's wait)."""
        if time.monotonic() - self._last_hello >= self.config.heartbeat_interval:
            self._hello()

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        r = self.reporter
        self._send(
            wm.WeightHello(
                self.worker_id, self._host, r.pid, self.core.reported_version, r.digest,
                self._hello_dtype, r.start_time, self.core.source,
            )
        )  # fmt: skip

    def _dispatch(self, msg: Any) -> None:
        if (kind := _NOTICES.get(type(msg))) is not None:
            step = self.core.notice(msg.publisher_id, kind, msg.seq, time.monotonic())
            if step == "hello":  # a publisher not shaken hands with (restarted), a lost Announce
                self._hello()
                return
            if step == "handshake":
                try:
                    self._new_publisher(msg)
                except Exception:
                    self.core.forget_publisher()  # the next Welcome shakes hands again
                    raise
        if isinstance(msg, wm.WeightWelcome):
            if msg.announce is not None:
                self.ipc.consider(msg.announce)
            self.ipc.hello(up_to_date=msg.announce is None)
        elif isinstance(msg, wm.WeightAnnounce):
            self.ipc.consider(msg)
        elif isinstance(msg, wm.WeightBucket):
            self.fetcher.on_bucket(msg)
        elif isinstance(msg, IpcOffer):
            self.ipc.on_offer(msg)
        elif isinstance(msg, IpcReady):
            self.ipc.on_ready(msg)
        elif isinstance(msg, wm.WeightError):
            self.core.count("errors_received")
            up = self.fetcher.update
            if up is None or msg.version != up.ann.version:
                self._rlog.warning("publisher error", "weight publisher error: %s", msg.reason)
                return
            self.fetcher.fail(up.ann.version, f"publisher: {msg.reason}")
            self._hello()  # a newer version exists: the Welcome brings its manifest

    def _new_publisher(self, w: wm.WeightWelcome) -> None:
        self.fetcher.abandon("the publisher was restarted mid-update")
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
            self._sub.connect(pub_endpoint)  # first: a failed one is tried at the next handshake
            self._pub_endpoint = pub_endpoint
