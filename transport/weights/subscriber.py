"""Worker side of weight updates: follow a publisher, fetch, verify, apply, acknowledge.

A subscriber runs one background thread that owns its sockets: a DEALER to the
publisher's ROUTER (Hello heartbeats, Fetch, Ack) and a SUB on its PUB (Announce and
Heartbeat notices, sequence-numbered). Its parts, by concern: fetching and verifying a
version (:mod:`transport.weights.fetching`), committing it
(:mod:`transport.weights.commit`) and the ``ipc`` path with its path choice and
fallbacks (:mod:`transport.weights.ipc_receiving`).

Never serving a mixed version: two modes
-----------------------------------------
A bucket's checksum is known only once its last byte has arrived, and applying bucket k
of version N before the rest has arrived and been verified leaves a mixed model if the
rest never comes (publisher killed, corrupt bytes). Two answers, by ``atomic``:

* ``atomic=False`` (the default under a lock that refuses to serve mixed weights,
  such as the fabric's, :func:`transport.weights.update.attach_subscriber`, without
  a ``loader``): verify and copy in one pass.
  Each 256 KiB block of a bucket is hashed, then copied into the parameters while it
  is still in cache (:mod:`transport.weights.streaming`): shared memory is read once,
  a TCP piece is copied once and its frame freed at once, and the copy overlaps the
  trainer's packing. The ``lock`` is held from the version's first write until it
  completes (network waits included); meanwhile the worker reports version ``-1``.
  If the version fails after that (a bucket fails its checksum for good,
  the publisher dies or goes silent, a newer version supersedes it), the weights are
  mixed: :attr:`WeightSubscriber.consistent` is false, the worker reports version
  ``-1`` (no complete version) in its Ack and Hellos, the failed Ack says "weights
  are mixed", and the fabric's lock keeps the worker paused
  (:func:`transport.weights.update.attach_subscriber`) until a later version, or the
  same one fetched again, completes.
* ``atomic=True`` (the default otherwise: a plain lock such as an engine's step lock
  is left when a version fails, and the engine would serve what is in the weights):
  the previous version stays whole until the new one is verified
  entirely. Same host (shared memory): the publisher's segment *is* the staging area;
  every bucket's checksum is verified in place, then copied into the parameters (no
  extra memory on the worker). Over TCP: each piece is hashed as it arrives and copied,
  while still in cache, into a staging buffer the worker keeps from version to version
  (one version's bytes); once every bucket is verified they are copied into the
  parameters. A failed version leaves the previous weights, and version, in place.

Either way the metadata (names, shapes, dtypes, layout) is checked before a byte is
fetched (a mismatch fails the version with the weights untouched), the parameters are
written in place (references held by the engine stay valid) and the version is switched
only after the last copy.
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

import numpy as np

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
from transport.sockets import CurveConfig, apply_curve_client
from transport.weights import shm as _shm
from transport.weights.binding import DtypeSpec, Rename, advertised_dtype, parse_dtype_spec
from transport.weights.bucket import BucketApplier, named_tensors, state_digest
from transport.weights.commit import VersionCommit
from transport.weights.config import SubscriberConfig, make_config
from transport.weights.core.subscriber import SubscriberCore, choose_atomic
from transport.weights.datalink import DataReceiver
from transport.weights.fetching import InFlight
from transport.weights.ipc import process_start_time
from transport.weights.ipc_receiving import PATHS, IpcReceiving, ipc_eligible
from transport.weights.malloc import tune_malloc as _tune_malloc
from transport.weights.ratelog import RateLimitedLog
from transport.weights.results import UpdateStats

__all__ = ["PATHS", "WeightSubscriber"]

log = logging.getLogger("transport.weights.subscriber")

#: What the DEALER and SUB accept: the weight messages and the ipc path's Offer and Ready.
_FROM_PUBLISHER = Union[PUBLISHER_TO_SUBSCRIBER, IpcOffer, IpcReady]  # noqa: UP007


class WeightSubscriber(IpcReceiving, VersionCommit):
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
        self.endpoint = endpoint
        self.data_link = cfg.data_link
        self._init_ipc(ipc_eligible(cfg.route, target, loader, dtype, rename))
        if cfg.tune_malloc:
            _tune_malloc()
        if target is None and loader is None:
            raise ValueError("a WeightSubscriber needs a target, a loader or both")
        self.targets = named_tensors(target) if target is not None else {}
        self.dtype = parse_dtype_spec(dtype)
        self.rename = rename
        self.loader = loader
        self._hello_dtype = advertised_dtype(self.dtype, self.targets)
        self.worker_id = cfg.worker_id or f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.shm = cfg.shm and cfg.route != "tcp"
        #: shm/tcp: verify every bucket before the first write, or one pass (``atomic``).
        refuses = getattr(lock, "refuses_mixed", False)
        self.atomic = choose_atomic(cfg.atomic, refuses, loader is not None)
        # The ipc route keeps its own default (atomic) unless told.
        self._ipc_atomic = True if cfg.atomic is None else cfg.atomic
        self.window = cfg.window
        self.fetch_timeout = cfg.fetch_timeout
        self.retries = cfg.retries
        #: Versions, publishers, what to report (the protocol core, no I/O).
        self.core = SubscriberCore(cfg.version, cfg.retries)
        self.heartbeat_interval = cfg.heartbeat_interval
        self.publisher_timeout = cfg.publisher_timeout
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.on_applied = on_applied
        self.on_progress = on_progress
        self.report_digest = cfg.report_digest
        self.strict = cfg.strict
        self.max_message_size = cfg.max_message_size
        if curve is not None and curve.server_public_key_file is None:
            raise ValueError("CurveConfig.server_public_key_file is needed to subscribe")
        self.curve = curve
        #: Counters: bad messages, gaps, retries, versions applied / failed.
        self.counters = self.core.counters
        self._rlog = RateLimitedLog(log)
        #: Error text of the last failed version ("" if none).
        self.last_error = ""
        #: Timings of the last applied version.
        self.last_stats = UpdateStats()
        self._digest: int | None = state_digest(self.targets) if cfg.report_digest else None
        self._applier = BucketApplier(self.targets, copy_threads=cfg.copy_threads)
        self._ctx = context or zmq.Context.instance()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_hello = 0.0
        self._host = _shm.host_id()
        self._start_time = process_start_time(os.getpid()) or 0
        # Weight messages carry no token arrays: version 1, which every release reads.
        self._encoder = VERSION_1
        self._decoder = fastio.Decoder(
            _FROM_PUBLISHER, max_message_size=cfg.max_message_size + (1 << 20)
        )
        # per publisher instance
        self._pub_endpoint = ""
        self._shm_ok = False
        self._update: InFlight | None = None
        self._segments: dict[str, _shm.ShmSegment] = {}
        self._staging: np.ndarray[Any, Any] | None = None
        self._poller: zmq.Poller | None = None
        #: The data link (open), and the publisher's offer of one (port, token).
        self._link: DataReceiver | None = None
        self._link_offer: tuple[int, bytes] | None = None
        self._link_retry_at = 0.0

    # -- public API --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version the weights hold (last one applied completely)."""
        return self.core.version

    @property
    def consistent(self) -> bool:
        """False while the weights are mixed: from a one-pass version's first write
        (``atomic=False``) until it completes, after such a version failed, or after a
        copy or the ``loader`` failed midway. The worker then
        reports version ``-1`` and must not serve; a later complete version makes it
        true again. :attr:`version` stays the last version applied completely."""
        return self.core.consistent

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
        with self._cond:
            while self.core.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        with self._cond:
            self._closed = True
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> WeightSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ------------------------------------------------------------------------
    def _run(self) -> None:
        self._dealer = self._ctx.socket(zmq.DEALER)
        apply_curve_client(self._dealer, self.curve)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.ROUTING_ID, self.worker_id.encode())
        self._dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_size)
        self._dealer.setsockopt(zmq.RCVHWM, 10_000)
        # Nothing is queued while the publisher is down: a restarted publisher must not
        # receive a burst of stale Fetches meant for its predecessor.
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)
        self._dealer.connect(self.endpoint)
        self._sub = self._ctx.socket(zmq.SUB)
        apply_curve_client(self._sub, self.curve)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        poller = self._poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        next_hello = 0.0
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                now = time.monotonic()
                if now >= next_hello:
                    self._hello()
                    next_hello = now + self.heartbeat_interval
                    self._check_timeouts(now)
                timeout = min(next_hello - now, 0.2)
                events = dict(poller.poll(int(max(0.0, timeout) * 1000)))
                if self._sub in events:
                    self._drain(self._sub)
                if self._dealer in events:
                    self._drain(self._dealer)
                if self._link is not None and self._link.fd in events:
                    self._on_data()
        except Exception:  # the thread must not die silently
            log.exception("weight subscriber %s crashed", self.worker_id)
            raise
        finally:
            # A version in flight holds the lock from its first write: fail it (the
            # weights are mixed if it wrote) so the lock is left, never held for good.
            if self._update is not None:
                try:
                    self._fail(self._update.ann.version, "the subscriber was closed mid-version")
                except Exception:
                    log.exception(
                        "weight subscriber %s: failing the version at close", self.worker_id
                    )
            # The ipc goodbye must reach the trainer (else it waits for this worker's
            # acks until ipc_timeout): a short linger for it.
            self._close_link()
            said_bye = self._ipc_close()
            self._dealer.close(linger=500 if said_bye else 0)
            self._sub.close(linger=0)
            self._drop_segments()

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frames)
            except fastio.DecodeError as exc:
                self._count("bad_messages")
                self._rlog.warning("bad message", "bad message from the weight publisher: %s", exc)
                continue
            try:
                self._dispatch(msg)
            except Exception as exc:  # keep following the publisher; report the version
                self._count("internal_errors")
                log.exception("weight subscriber %s: error handling a message", self.worker_id)
                if self._update is not None:
                    self._fail(self._update.ann.version, f"internal error: {exc!r}")

    def _send(self, msg: Any) -> None:
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    def _keepalive(self) -> None:
        """A Hello if one is due, from inside a long commit (or a lock's wait): a
        worker silent for the publisher's ``worker_timeout`` is declared lost, and the
        shared memory it still copies from could be reused for the next version."""
        if time.monotonic() - self._last_hello >= self.heartbeat_interval:
            self._hello()

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        self._send(
            WeightHello(
                self.worker_id,
                self._host,
                os.getpid(),
                self.core.reported_version,
                self._digest,
                self._hello_dtype,
                self._start_time,
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
                self._consider(msg.announce)
            self._ipc_hello(up_to_date=msg.announce is None)
        elif isinstance(msg, WeightHeartbeat):
            if self.core.on_heartbeat(msg.seq):
                self._hello()  # an Announce was lost: ask for the snapshot
        elif isinstance(msg, WeightAnnounce):
            self.core.on_announce(msg.seq)
            self._consider(msg)
        elif isinstance(msg, WeightBucket):
            self._on_bucket(msg)
        elif isinstance(msg, WeightError):
            self._on_error(msg)
        elif isinstance(msg, IpcOffer):
            self._on_ipc_offer(msg)
        elif isinstance(msg, IpcReady):
            self._on_ipc_ready(msg)

    def _new_publisher(self, w: WeightWelcome) -> None:
        if self._update is not None:
            self._fail(self._update.ann.version, "the publisher was restarted mid-update")
        self.core.shake_hands(w.publisher_id, w.seq)
        self._pub_host = w.host_id
        self._close_link()
        self._link_retry_at = 0.0
        self._link_offer = (
            (w.data_port, w.data_token) if self.data_link and w.data_port > 0 else None
        )
        self._ipc_reset()
        self._shm_ok = (
            self.shm and w.host_id == self._host and _shm.read_probe(w.shm_probe, w.shm_token)
        )
        # A publisher bound to every interface reports 0.0.0.0: its PUB is on the host
        # this worker reached its ROUTER at.
        pub_endpoint = with_reachable_host(w.pub_endpoint, self.endpoint)
        if pub_endpoint != self._pub_endpoint:
            if self._pub_endpoint:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(self._pub_endpoint)
            self._pub_endpoint = pub_endpoint
            self._sub.connect(pub_endpoint)
        self._drop_segments()

    def _on_error(self, msg: WeightError) -> None:
        up = self._update
        self._count("errors_received")
        if up is None or msg.version != up.ann.version:
            self._rlog.warning("publisher error", "weight publisher error: %s", msg.reason)
            return
        self._fail(up.ann.version, f"publisher: {msg.reason}")
        # A newer version exists: the next Hello brings its manifest.
        self._hello()
