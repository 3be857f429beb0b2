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
        tensor to overwrite. CPU or CUDA tensors. ``None`` with a ``loader`` that takes
        every tensor.
    worker_id:
        Unique id of this worker (default: a random one). A restarted worker may reuse
        its id: the publisher then counts it as the same worker.
    version:
        The version the model holds now (``-1``: none).
    shm:
        Read same-host versions from shared memory when the handshake shows it works.
    atomic:
        ``True``: keep the previous weights whole until a version is verified
        entirely; ``False``: verify and copy in one pass, the weights mixed from the
        version's first write to its end, and after a version that failed midway
        until a later one completes (:attr:`consistent` false, version ``-1``
        reported; see the module docstring). Only safe with a ``lock`` that refuses
        to serve mixed weights. ``None`` (default): ``False`` when the ``lock``
        declares it refuses to serve mixed weights (a true ``refuses_mixed``
        attribute, as the fabric's lock of :func:`~transport.weights.update.attach_subscriber`
        does) and there is no ``loader``, else ``True``. The ``ipc`` path is atomic
        unless this is ``False``.
    window:
        Buckets requested ahead over TCP.
    fetch_timeout:
        Seconds before an unanswered Fetch is sent again.
    retries:
        Attempts per bucket (timeouts and checksum failures) before the version fails.
    heartbeat_interval:
        Seconds between Hellos to the publisher.
    publisher_timeout:
        With no message from the publisher for this long, a version in progress fails.
    lock:
        Held while the parameters are written (e.g. the engine's forward lock): with
        ``atomic`` for the copy of a verified version; in one-pass mode from the
        version's first write to its end, network waits included. If entering it
        raises, the version fails on this worker, which keeps its weights. A plain
        lock is left when a one-pass version fails midway, so the engine would
        generate from mixed weights: one-pass mode needs a lock that then keeps the
        engine from serving (``refuses_mixed``, see ``atomic``).
    on_applied:
        Called with the new version once it is in the weights, under ``lock`` and
        before the Ack is sent (in the subscriber's thread).
    on_progress:
        Called with ``(version, bucket_index)`` when a bucket arrived and was verified.
    report_digest:
        Send a digest of the weights (:func:`state_digest`) in Hellos and Acks.
    strict:
        The update must cover every tensor of ``target``.
    dtype:
        The dtypes wanted (see :mod:`transport.weights.binding`): ``None`` (exact
        match), ``"auto"`` (each target's own dtype), one dtype for every floating
        tensor, or a dict engine name -> dtype. Casts are bit-identical to
        ``tensor.to(dtype)``; the trainer casts when every worker wants the same
        narrower dtype (advertised in the Hello), else this worker casts in its copy.
    rename:
        Trainer name -> engine name: a dict (names not in it stay) or a callable
        (returning ``None`` skips the tensor).
    loader:
        Called with an iterable of ``(engine name, tensor)`` for every tensor of a
        version (aliases included, in the wanted dtype) once the whole version has
        verified and the in-place copy (into ``target``) is done, under ``lock``: the
        shape ``model.load_weights(...)`` takes. The tensors are read-only and valid
        only during the call (copy what must outlive it). If it raises, the version
        fails on this worker and is reported to the trainer; the engine's weights are
        then in whatever state the loader left them (possibly mixed),
        :attr:`consistent` is false and :attr:`version` stays the previous one until a
        later version completes.
    context:
        ZeroMQ context (default: the global instance).
    max_message_size:
        Largest frame accepted from the publisher (``ZMQ_MAXMSGSIZE``).
    tune_malloc:
        Opt-in, process-wide: on glibc, keep the allocator from returning freed memory
        to the kernel between versions (:func:`transport.weights.malloc.tune_malloc`):
        received TCP frames then reuse warm pages instead of faulting in fresh zeroed
        ones (see bench/results for the effect).
    curve:
        CurveZMQ keys (:class:`transport.CurveConfig`: this worker's ``.key_secret`` and
        the publisher's public ``.key`` as ``server_public_key_file``).
    path:
        Override of the path (see :mod:`transport.weights.publisher`): ``None`` takes
        ``ipc`` whenever the publisher offers it and the worker can open the trainer's
        memory (same host, no ``dtype``/``rename``/``loader``), else ``shm`` or
        ``tcp``; ``"shm"`` never asks for ``ipc``; ``"tcp"`` neither, and no shared
        memory; ``"ipc"`` is ``None`` that raises when ``ipc`` is impossible by
        configuration. A version that fails on ``ipc`` is fetched by ``shm``/``tcp``.
        :attr:`path` and :attr:`last_stats` (``via``) say which path the last version
        took.
    copy_threads:
        Threads that copy a verified version into CPU parameters (``numpy.copyto``
        releases the GIL); default :func:`~transport.weights.bucket.default_copy_threads`
        (one per 4 cores, at most 4: on a small host every worker copies at once).
    data_link:
        Over TCP, receive bucket bytes on the publisher's data link when it offers one
        (a plain TCP connection to its host, :mod:`transport.weights.datalink`): the
        bytes land straight in the weights (or the staging buffer), with no ZeroMQ
        message buffers between. ``False``: always ZeroMQ frames. A link that fails
        is closed and the rest of the version comes as ZeroMQ frames.

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
        worker_id: str | None = None,
        version: int = -1,
        shm: bool = True,
        atomic: bool | None = None,
        window: int = 2,
        fetch_timeout: float = 5.0,
        retries: int = 3,
        heartbeat_interval: float = 0.5,
        publisher_timeout: float = 10.0,
        lock: Any = None,
        on_applied: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        report_digest: bool = False,
        strict: bool = True,
        dtype: DtypeSpec = None,
        rename: Rename = None,
        loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
        context: zmq.Context[Any] | None = None,
        max_message_size: int = 1 << 30,
        tune_malloc: bool = False,
        curve: CurveConfig | None = None,
        path: str | None = None,
        copy_threads: int | None = None,
        data_link: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.data_link = data_link
        self._init_ipc(ipc_eligible(path, target, loader, dtype, rename))
        if path == "tcp":
            shm = False
        if tune_malloc:
            _tune_malloc()
        if target is None and loader is None:
            raise ValueError("a WeightSubscriber needs a target, a loader or both")
        if loader is not None and atomic is False:
            raise ValueError("a loader takes whole versions: it needs atomic=True")
        self.targets = named_tensors(target) if target is not None else {}
        self.dtype = parse_dtype_spec(dtype)
        self.rename = rename
        self.loader = loader
        self._hello_dtype = advertised_dtype(self.dtype, self.targets)
        self.worker_id = worker_id or f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.shm = shm
        #: shm/tcp: verify every bucket before the first write (``True``), or verify
        #: and copy in one pass (``False``: the default only under a lock that refuses
        #: to serve mixed weights, see ``atomic``).
        self.atomic = (
            loader is not None or not getattr(lock, "refuses_mixed", False)
            if atomic is None
            else atomic
        )
        # The ipc path keeps its own default (atomic) unless told.
        self._ipc_atomic = True if atomic is None else atomic
        self.window = max(1, window)
        self.fetch_timeout = fetch_timeout
        self.retries = max(1, retries)
        self.heartbeat_interval = heartbeat_interval
        self.publisher_timeout = publisher_timeout
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.on_applied = on_applied
        self.on_progress = on_progress
        self.report_digest = report_digest
        self.strict = strict
        self.max_message_size = max_message_size
        if curve is not None and curve.server_public_key_file is None:
            raise ValueError("CurveConfig.server_public_key_file is needed to subscribe")
        self.curve = curve
        #: Counters: bad messages, gaps, retries, versions applied / failed.
        self.counters: dict[str, int] = {}
        self._rlog = RateLimitedLog(log)
        #: Error text of the last failed version ("" if none).
        self.last_error = ""
        #: Timings of the last applied version.
        self.last_stats = UpdateStats()
        self._version = version
        self._consistent = True
        self._digest: int | None = state_digest(self.targets) if report_digest else None
        self._applier = BucketApplier(self.targets, copy_threads=copy_threads)
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
            _FROM_PUBLISHER, max_message_size=max_message_size + (1 << 20)
        )
        # per publisher instance
        self._pub_id = ""
        self._pub_endpoint = ""
        self._shm_ok = False
        self._last_seq = 0
        self._last_heard = 0.0
        self._update: InFlight | None = None
        self._attempts: dict[tuple[str, int], int] = {}
        self._given_up: set[tuple[str, int]] = set()
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
        return self._version

    @property
    def consistent(self) -> bool:
        """False while the weights are mixed: from a one-pass version's first write
        (``atomic=False``) until it completes, after such a version failed, or after a
        copy or the ``loader`` failed midway. The worker then
        reports version ``-1`` and must not serve; a later complete version makes it
        true again. :attr:`version` stays the last version applied completely."""
        return self._consistent

    @property
    def path(self) -> str:
        """The path of the last version applied (``"ipc"``, ``"shm"``, ``"tcp"``; ``""``
        before the first)."""
        return self.last_stats.via

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def last_heard(self) -> float:
        """``time.monotonic()`` of the last message from the publisher (0: none yet)."""
        return self._last_heard

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
            while self._version < version:
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
                self.reported_version,
                self._digest,
                self._hello_dtype,
                self._start_time,
            )
        )

    def _dispatch(self, msg: Any) -> None:
        if (
            isinstance(msg, (WeightWelcome, WeightHeartbeat, WeightAnnounce))
            and msg.publisher_id != self._pub_id
        ):
            if not isinstance(msg, WeightWelcome):
                # A notice from a publisher we have not shaken hands with (it was
                # restarted): ask it for its state.
                self._hello()
                return
            self._new_publisher(msg)
        self._last_heard = time.monotonic()
        if isinstance(msg, WeightWelcome):
            if msg.announce is not None:
                self._consider(msg.announce)
            self._ipc_hello(up_to_date=msg.announce is None)
        elif isinstance(msg, WeightHeartbeat):
            if msg.seq > self._last_seq:
                self._count("gaps")  # an Announce was lost: ask for the snapshot
                self._last_seq = msg.seq
                self._hello()
        elif isinstance(msg, WeightAnnounce):
            if msg.seq > self._last_seq + 1:
                self._count("gaps")
            self._last_seq = max(self._last_seq, msg.seq)
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
        self._pub_id = w.publisher_id
        self._pub_host = w.host_id
        self._close_link()
        self._link_retry_at = 0.0
        self._link_offer = (
            (w.data_port, w.data_token) if self.data_link and w.data_port > 0 else None
        )
        self._ipc_reset()
        self._last_seq = w.seq
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
