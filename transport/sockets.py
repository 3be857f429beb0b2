"""Socket setup in one place, and the pump that ties a ZeroMQ socket to asyncio.

Every fabric socket is made here, so its options are chosen once, deliberately:

``ZMQ_MAXMSGSIZE``
    Set on every socket. libzmq applies it per *frame*: a peer that sends a single
    frame larger than the limit is disconnected before the frame is buffered. A
    multi-frame message whose *total* exceeds the limit is answered with an Error reply
    by the decoder, but only after libzmq has received and buffered the whole message:
    the limit does not bound the memory a hostile peer can make a worker use (many
    frames each below it). Only trusted peers should reach a worker (loopback, or CURVE
    with ``authorized_clients_dir``).
High-water marks
    A ROUTER silently drops a message for a peer whose pipe is at its HWM. Worker
    ROUTERs therefore set ``ZMQ_ROUTER_MANDATORY``: at the HWM a non-blocking send
    raises ``EAGAIN`` and the message waits in the pump's own queue (visible and counted,
    never dropped); a send to a peer that has gone raises ``EHOSTUNREACH`` and is logged
    and counted as undeliverable. DEALERs block (``EAGAIN``) at their HWM, again into
    the pump's queue. The client bounds in-flight work per worker far below the HWM, so
    in normal operation no queue grows.
``ZMQ_IMMEDIATE`` on DEALERs
    Messages are not queued in libzmq for a worker whose connection is not up: the send
    fails with ``EAGAIN``. :class:`SocketPump` keeps such a message in its own queue and
    retries it (every 2 ms, backing off to 100 ms while nothing gets through), so it
    *can* reach a worker restarted at the same address; the client drops the queue
    when it declares the worker dead, and the restarted worker's new incarnation makes
    it re-send (new ids) and cancel whatever was delivered: never a duplicate answer.
Routing ids and ``ZMQ_ROUTER_HANDOVER``
    A client's DEALERs carry a routing id of their own (:func:`make_dealer`
    ``routing_id``), kept across reconnects, and worker ROUTERs let a reconnecting peer
    take its id over: answers still reach a client whose connection was reset.
``linger``
    0 at close: unsent messages at shutdown belong to requests that are being abandoned
    anyway. :meth:`SocketPump.close` still hands libzmq what the pump holds (joined
    replies of the last burst) before closing, without blocking.
CURVE
    Optional (:class:`CurveConfig`), off by default. Keys are ``zmq.auth`` certificate
    files; a worker with ``authorized_clients_dir`` admits only the public keys found
    there and logs and counts every refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from fastio.fabric_msgs import MAX_BATCHED_FRAME, pack_batch

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DEFAULT_PEER_QUEUE_LIMIT",
    "CurveConfig",
    "SocketPump",
    "WorkerAuthenticator",
    "apply_curve_client",
    "apply_curve_server",
    "make_dealer",
    "make_router",
    "recv_frames",
    "send_frames",
]

log = logging.getLogger("transport.sockets")

#: High-water mark (messages) of fabric sockets. Far above the per-worker in-flight
#: bound, so it is reached only when a peer stops reading.
DEFAULT_HWM = 100_000

#: Default limit of one message (all frames) on the fabric: 1 GiB. Requests and
#: responses are tokens; images of a VLM request stay far below it.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30


@dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ keys, as certificate files written by ``zmq.auth.create_certificates``.

    Parameters
    ----------
    secret_key_file:
        This side's ``.key_secret`` certificate (holds its public and secret key).
    server_public_key_file:
        Client and controller side: the worker's ``.key`` (public) certificate.
    authorized_clients_dir:
        Worker side: a directory of client ``.key`` certificates that may connect.
        ``None`` encrypts but admits any client that knows the server key.

    Examples
    --------
    >>> import zmq.auth, tempfile
    >>> d = tempfile.mkdtemp()
    >>> pub, sec = zmq.auth.create_certificates(d, "worker")
    >>> CurveConfig(secret_key_file=sec).secret_key_file == sec
    True
    """

    secret_key_file: str
    server_public_key_file: str | None = None
    authorized_clients_dir: str | None = None


def _set_common(sock: zmq.Socket[Any], hwm: int, max_message_size: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)


def apply_curve_server(sock: zmq.Socket[Any], curve: CurveConfig | None) -> None:
    """Make ``sock`` a CURVE server with the keys of ``curve`` (nothing when ``None``).
    Set before binding."""
    if curve is None:
        return
    pub, sec = zmq.auth.load_certificate(curve.secret_key_file)
    if sec is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    sock.curve_secretkey = sec
    sock.curve_publickey = pub
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket[Any], curve: CurveConfig | None) -> None:
    """Make ``sock`` a CURVE client of the server whose public key ``curve`` names
    (nothing when ``None``). Set before connecting."""
    if curve is None:
        return
    if curve.server_public_key_file is None:
        raise ValueError("CurveConfig.server_public_key_file is needed to connect")
    pub, sec = zmq.auth.load_certificate(curve.secret_key_file)
    if sec is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    server_pub, _ = zmq.auth.load_certificate(curve.server_public_key_file)
    sock.curve_secretkey = sec
    sock.curve_publickey = pub
    sock.curve_serverkey = server_pub


def make_router(
    ctx: zmq.Context[Any],
    bind: str | list[str],
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
) -> tuple[zmq.Socket[Any], list[str]]:
    """A worker's ROUTER, bound to each address; returns it and the bound endpoints
    (``tcp://127.0.0.1:0`` binds a free port and reports which)."""
    sock = ctx.socket(zmq.ROUTER)
    _set_common(sock, hwm, max_message_size)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A client reconnecting under its routing id (a reset connection) takes the id over
    # from a connection the worker still thinks is up, so replies reach it again.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # Heartbeats are ours; TCP keepalive catches half-open connections on real networks.
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    endpoints = []
    try:
        apply_curve_server(sock, curve)
        for address in [bind] if isinstance(bind, str) else bind:
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            sock.bind(address)
            endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except BaseException:
        sock.close(linger=0)  # or terminating its context would wait for it forever
        raise
    return sock, endpoints


def make_dealer(
    ctx: zmq.Context[Any],
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
    reconnect_ivl_ms: int = 100,
    routing_id: bytes | None = None,
) -> zmq.Socket[Any]:
    """A client's or controller's DEALER connected to one worker.

    ``routing_id``: the identity the worker's ROUTER knows this peer by, kept across
    reconnects (libzmq otherwise draws a new one per connection, and replies to the old
    one are undeliverable). Unique per peer; must not start with a zero byte.
    """
    sock = ctx.socket(zmq.DEALER)
    _set_common(sock, hwm, max_message_size)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(reconnect_ivl_ms, 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    apply_curve_client(sock, curve)
    sock.connect(address)
    dealer: zmq.Socket[Any] = sock
    return dealer


class WorkerAuthenticator:
    """ZAP handler of a worker: admits the client keys of ``authorized_clients_dir``
    (or any key when it is ``None``), logs and counts refusals.

    Runs ``zmq.auth``'s authenticator thread on the worker's context; start it before
    binding.
    """

    def __init__(self, ctx: zmq.Context[Any], curve: CurveConfig) -> None:
        self.denied = 0
        self._lock = threading.Lock()
        self._allowed: set[bytes] | None = None
        if curve.authorized_clients_dir is not None:
            d = Path(curve.authorized_clients_dir)
            if not d.is_dir():
                raise ValueError(f"authorized_clients_dir {d} is not a directory")
            self._allowed = set(zmq.auth.load_certificates(str(d)))
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("transport.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """``zmq.auth`` credentials-provider hook: is ``key`` (z85 public key) admitted?"""
        if self._allowed is None or key in self._allowed:
            return True
        with self._lock:
            self.denied += 1
        log.warning("refused CURVE client key %s (not in authorized_clients_dir)", key[:12])
        return False

    def stop(self) -> None:
        """Stop the authenticator thread."""
        self._auth.stop()


# Plain ints: ``zmq.POLLIN`` and friends are enums whose ``&`` runs Python code.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
# The Cython socket methods, without pyzmq's Python wrappers (send_multipart type-checks
# every part and wraps every send; recv_multipart asks RCVMORE with a getsockopt per
# frame): they would run for every frame on the hot path. ``zmq.backend.Socket`` is
# not pyzmq's documented API: the version range where it is tested is pinned in
# pyproject.toml, and without it the public methods (same signature) are used.
_backend_socket: Any = getattr(getattr(zmq, "backend", None), "Socket", None)
_send: Callable[..., Any] = getattr(_backend_socket, "send", None) or zmq.Socket.send
_recv: Callable[..., Any] = getattr(_backend_socket, "recv", None) or zmq.Socket.recv
# "Does input wait?": ``zmq_poll`` of the one socket with timeout 0 asks ZMQ_EVENTS
# (processing pending commands, which re-arms the FD) as ``sock.get(zmq.EVENTS)`` does,
# without the option's enum lookup that pyzmq's ``get`` makes in Python.
_zmq_poll: Callable[..., list[Any]] = zmq.zmq_poll

#: Bytes a ROUTER pump holds for one peer beyond libzmq's own pipe (which holds up to
#: the HWM in messages) before that peer is dropped: its queue discarded and
#: ``on_drop`` told. A peer that reads again drains its queue long before this.
DEFAULT_PEER_QUEUE_LIMIT = 64 << 20


def _nbytes(frames: list[Any]) -> int:
    n = 0
    for f in frames:
        try:
            n += memoryview(f).nbytes
        except TypeError:  # pragma: no cover - not a buffer: counted as small
            n += 64
    return n


# Retry interval of the queue of messages that met EAGAIN: from 2 ms, doubled while
# nothing gets through, up to 100 ms.
_RETRY_MIN_S = 0.002
_RETRY_MAX_S = 0.1

# A send this soon after the previous one ended (outside a receive batch) starts a
# coalescing burst. Measured from the end of the previous send: a send that wakes
# libzmq's I/O thread can take far longer than this on a loaded machine (the I/O thread
# takes the core), and a gap measured from its start would then never see the next
# send as back to back, so no burst would start exactly when coalescing matters most.
# One request at a time is a whole round trip apart.
_BURST_GAP_S = 100e-6
_perf_counter = time.perf_counter

# A joined ZeroMQ message is sent once it holds this many bytes, and a message this
# large is never joined: ZeroMQ hands a message over whole, so the receiver of a large
# joined one would idle until all of it had arrived. Far above what joining saves
# (microseconds per message), far below what the wire moves in a millisecond.
_JOIN_LIMIT = 256 << 10
# Marks "no message to this destination in the burst yet" in SocketPump._pending.
_FIRST: Any = object()


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)``, cheaper.

    Like it, atomic: ``zmq.Again`` (or ``EHOSTUNREACH``) can only be raised for the
    first frame, before anything is queued. pyzmq copies frames below its copy
    threshold and sends larger ones zero-copy.
    """
    last = len(frames) - 1
    if last == 0:
        _send(sock, frames[0], _NOBLOCK, False)
        return
    for i in range(last):
        _send(sock, frames[i], _SNDMORE_NOBLOCK, False)
    _send(sock, frames[last], _NOBLOCK, False)


def recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """``sock.recv_multipart(zmq.NOBLOCK, copy=False)``, cheaper (``Frame.more``
    instead of a ``RCVMORE`` getsockopt per frame). Raises ``zmq.Again`` when empty."""
    frame: zmq.Frame = _recv(sock, _NOBLOCK, False)
    if not frame.more:
        return [frame]
    parts = [frame]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        parts.append(frame)
    return parts


class _Joined:
    """Messages to one destination being joined into one ZeroMQ message."""

    __slots__ = ("frames", "n", "size", "small")

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames  # the ROUTER identity, then finished parts
        self.small: list[bytes] = []  # a run of small single-frame messages
        self.n = 0
        self.size = 0  # bytes of the messages joined

    def close_batch(self) -> None:
        small = self.small
        self.frames.append(small[0] if len(small) == 1 else pack_batch(small))
        self.small = []

    def done(self) -> list[Any]:
        if self.small:
            self.close_batch()
        return self.frames


class SocketPump:
    """Ties a non-blocking ZeroMQ socket to the running asyncio loop.

    Incoming multipart messages (lists of ``zmq.Frame``) are handed to ``on_recv`` in
    batches from a reader callback on the socket's FD, without a future per message.
    :meth:`send` never blocks: at the HWM (``EAGAIN``) the message waits in an ordered
    queue retried on every wake-up and on a short timer. Queues are per destination
    (``router=True``: per peer): a peer that stops reading holds only its own messages,
    everyone else's keep going. A peer whose queue grows past ``peer_queue_limit``
    bytes is dropped: its queue is discarded, ``on_drop(peer)`` is called (once per
    drop), :attr:`dropped` counts it, and later messages to it that meet a full pipe
    are discarded at once (not queued) until one gets through again.

    Coalescing: the first message of a burst to each destination is sent at once (no
    added latency); messages sent later in the same burst to the same destination are
    joined into one ZeroMQ message (fastio messages back to back, see PROTOCOL.md) and
    sent at its end, or as soon as the joined message holds 256 KiB; a message that
    large is never joined (the receiver could not start on it before the whole joined
    message arrived). With ``batch_frames`` (peers that split with
    :func:`fastio.fabric_msgs.split`), runs of small single-frame messages among them
    travel as one batch frame. A burst is one batch of incoming messages (replies sent
    by ``on_recv``), or, for sends from elsewhere (tasks), what is sent until the next
    drain after a send that starts within 100 us of the end of the previous one (a
    lone send costs no drain). Under load this turns many small ZeroMQ messages, each
    waking libzmq's I/O thread, into a few.

    ``router=True``: frame 0 of each message is the ROUTER peer identity, the
    destination; it is written once per coalesced ZeroMQ message.

    The ZeroMQ FD is edge-triggered and our own sends can consume its readiness: after
    a send outside a batch, ``ZMQ_EVENTS`` is asked at once (which also re-arms the FD)
    and a drain is scheduled if input waits; inside a batch, the batch asks it before
    every receive anyway.

    ``defer_check``: a batch woken by the FD handles its first message, then leaves
    the rest (and the ``ZMQ_EVENTS`` query that ends a batch) to a drain scheduled
    behind whatever that message woke. For a requester (the client): the task woken by
    a reply runs first and sends its next request, whose own query is then skipped (a
    drain is due): one query per round trip instead of two, and none between a reply
    and the next request.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_recv: Callable[[list[zmq.Frame]], None],
        *,
        on_undeliverable: Callable[[list[Any]], None] | None = None,
        batch: int = 256,
        router: bool = False,
        coalesce: int = 256,
        batch_frames: bool = False,
        on_drop: Callable[[Any], None] | None = None,
        peer_queue_limit: int = DEFAULT_PEER_QUEUE_LIMIT,
        defer_check: bool = False,
    ) -> None:
        self.sock = sock
        self.defer_check = defer_check
        self.on_recv = on_recv
        self.on_undeliverable = on_undeliverable
        self.on_drop = on_drop
        self.peer_queue_limit = peer_queue_limit
        self.batch = batch
        self.loop = asyncio.get_running_loop()
        # Per destination (None for a DEALER): messages that met EAGAIN, in order, and
        # their bytes.
        self._queues: dict[Any, deque[list[Any]]] = {}
        self._queued_bytes: dict[Any, int] = {}
        self._dropped: set[Any] = set()
        #: Peers dropped for not reading (a count of drops, for status and metrics).
        self.dropped = 0
        #: Messages discarded: queues of dropped peers, and sends to them meanwhile;
        #: at :meth:`close`, what could not be handed to libzmq.
        self.discarded = 0
        self.router = router
        self.coalesce = coalesce
        self._burst = False
        self._last_send = 0.0
        self._in_batch = False
        self.batch_frames = batch_frames
        # Per destination sent to in the current burst: the messages being joined
        # (None: one went at once, none joined yet).
        self._pending: dict[Any, _Joined | None] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._retry_s = _RETRY_MIN_S
        self._closed = False
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._pollin = [(sock, _POLLIN)]  # _zmq_poll's argument
        self.loop.add_reader(self._fd, self._on_readable)
        self._schedule()

    @property
    def queue(self) -> list[list[Any]]:
        """Every message waiting for a free pipe, all destinations (a copy)."""
        return [m for q in self._queues.values() for m in q]

    def queued(self, dest: Any = None) -> int:
        """Messages waiting for ``dest`` (a ROUTER peer; ``None`` for a DEALER)."""
        q = self._queues.get(dest)
        return len(q) if q is not None else 0

    def poke(self) -> None:
        """Look for input at the end of this loop iteration. Call it after using
        :attr:`sock` directly: a send can consume the edge of ZeroMQ's FD, after which
        the loop would not be told about messages already waiting."""
        self._schedule()

    def drain_now(self) -> None:
        """Read and dispatch what has arrived, now (up to one batch)."""
        if not self._closed and not self._in_batch:
            self._drain()

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _on_readable(self) -> None:
        # The FD is readable: commands are pending, almost always a message's arrival.
        # The first receive goes without asking ZMQ_EVENTS first (the receive
        # processes the commands itself): one pyzmq getsockopt fewer per wake-up, at the
        # price of an EAGAIN exception on the rare wake-up without input.
        self._drain(True)

    def _drain(self, readable: bool = False) -> None:
        self._scheduled = False
        if self._closed or self._in_batch:
            return
        if self._queues:
            self._flush()
        sock = self.sock
        pollin = self._pollin
        on_recv = self.on_recv
        self._in_batch = True
        try:
            for i in range(self.batch):
                if i and readable and self.defer_check:
                    break  # the rest in a drain behind what the first message woke
                # Asking ZMQ_EVENTS before each receive (which also re-arms the FD) is
                # cheaper than the EAGAIN exception of an empty recv, and sees input
                # that our own sends (replies from on_recv) took the edge of.
                if (i or not readable) and not _zmq_poll(pollin, 0):
                    return
                try:
                    frames = recv_frames(sock)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:  # pragma: no cover - socket closed under us
                    if exc.errno == zmq.ENOTSOCK:
                        return
                    raise
                try:
                    on_recv(frames)
                except Exception:  # a bug in a handler must not stop the pump
                    log.exception("error handling an incoming message")
                if self._closed:
                    return
            # More may be waiting: let other callbacks run, then continue.
            self._schedule()
        finally:
            self._in_batch = False
            if self._burst and not self._closed:
                # The burst ends with the batch (or with this drain, for one started
                # by sends back to back).
                self._burst = False
                if self._pending:
                    self._send_pending()

    def send(self, frames: list[Any]) -> None:
        """Send one message without blocking (coalesced within a burst, queued at the
        HWM)."""
        if self._closed:
            return
        if not self._burst:
            if self._in_batch:
                self._burst = True  # it ends with the batch
            elif _perf_counter() - self._last_send < _BURST_GAP_S:
                # Back to back: a burst, ended by the next drain (no callback of its
                # own: one is often due anyway). A lone send (one request at a time)
                # just goes.
                self._burst = True
                self._schedule()
            else:
                self._send_now(frames)
                self._last_send = _perf_counter()
                return
        router = self.router
        key = frames[0] if router else None
        pending = self._pending
        joined = pending.get(key, _FIRST)
        if joined is _FIRST:
            # The first message to a destination in a burst goes at once: a lone reply
            # never waits for the end of its batch.
            pending[key] = None
            self._send_now(frames)
            if not self._in_batch:
                self._last_send = _perf_counter()
            return
        body = len(frames) - 1 if router else len(frames)
        last = frames[-1]
        if body == 1 and type(last) is bytes:
            size = len(last)
            if self.batch_frames and size <= MAX_BATCHED_FRAME:
                if joined is None:
                    joined = pending[key] = _Joined([key] if router else [])
                joined.small.append(last)
                self._joined(key, joined, size)
                return
        else:
            size = _nbytes(frames)
        if size >= _JOIN_LIMIT:
            # Large: never joined (the receiver could not start on it before the
            # whole joined message arrived); what waits for it goes first.
            if joined is not None:
                pending[key] = None
                self._send_now(joined.done())
            self._send_now(frames)
            return
        if joined is None:
            joined = pending[key] = _Joined([key] if router else [])
        if joined.small:
            joined.close_batch()
        joined.frames.extend(frames[1:] if router else frames)
        self._joined(key, joined, size)

    def _joined(self, key: Any, joined: _Joined, size: int) -> None:
        joined.n += 1
        joined.size += size
        if joined.n >= self.coalesce or joined.size >= _JOIN_LIMIT:
            self._pending[key] = None
            self._send_now(joined.done())

    def send_many(self, messages: list[list[Any]]) -> None:
        """Send several messages as one burst (coalesced per destination)."""
        if len(messages) == 1 or self._burst or self._in_batch:
            for frames in messages:
                self.send(frames)
            return
        self._burst = True
        try:
            for frames in messages:
                self.send(frames)
        finally:
            self._burst = False
            self._send_pending()

    def _send_pending(self) -> None:
        if self._pending:
            pending = self._pending
            self._pending = {}
            for joined in pending.values():
                if joined is not None:
                    self._send_now(joined.done())

    def _send_now(self, frames: list[Any]) -> None:
        if self._queues:
            key = frames[0] if self.router else None
            if key in self._queues:
                # Behind messages already waiting for this destination: keep the order.
                self._enqueue(key, frames)
                self._arm_timer()
                return
        try:
            send_frames(self.sock, frames)
        except zmq.ZMQError as exc:
            self._send_failed(frames, exc)
        else:
            if self._dropped and self.router:
                self._dropped.discard(frames[0])  # it reads again
        # The send may have taken the FD's edge: look now (this also re-arms it).
        # (Not inside a batch, which looks before every receive, nor when a drain is
        # due anyway.)
        if (
            not self._in_batch
            and not self._scheduled
            and not self._closed
            and _zmq_poll(self._pollin, 0)
        ):
            self._schedule()

    def _send_failed(self, frames: list[Any], exc: zmq.ZMQError) -> None:
        if isinstance(exc, zmq.Again):
            key = frames[0] if self.router else None
            if key in self._dropped:
                self.discarded += 1  # dropped and still not reading: not queued again
                return
            self._enqueue(key, frames)
            self._arm_timer()
        elif exc.errno == errno.EHOSTUNREACH:
            if self.on_undeliverable is not None:
                self.on_undeliverable(frames)
        else:
            raise exc

    def _enqueue(self, key: Any, frames: list[Any]) -> None:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            self._queued_bytes[key] = 0
        q.append(frames)
        size = self._queued_bytes[key] + _nbytes(frames)
        self._queued_bytes[key] = size
        if self.router and size > self.peer_queue_limit:
            self._drop(key)

    def _drop(self, key: Any) -> None:
        q = self._queues.pop(key, None)
        self._queued_bytes.pop(key, None)
        n = len(q) if q is not None else 0
        self.discarded += n
        self.dropped += 1
        self._dropped.add(key)
        log.warning(
            "peer %r does not read: dropped it and %d queued messages (queue over %d bytes)",
            bytes(key)[:32],
            n,
            self.peer_queue_limit,
        )
        if self.on_drop is not None:
            try:
                self.on_drop(key)
            except Exception:  # a bug there must not stop the pump
                log.exception("on_drop failed")

    def _flush(self) -> None:
        # Each destination in turn, until its pipe is full: one that does not read
        # holds up no one else.
        for key, q in list(self._queues.items()):
            while q:
                frames = q[0]
                try:
                    send_frames(self.sock, frames)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    if self.on_undeliverable is not None:
                        self.on_undeliverable(frames)
                q.popleft()
                self._queued_bytes[key] -= _nbytes(frames)
            if not q and self._queues.get(key) is q:
                del self._queues[key]
                del self._queued_bytes[key]
        if self._queues:
            self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = self.loop.call_later(self._retry_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._queues:
            before = sum(len(q) for q in self._queues.values())
            self._flush()
            self._schedule()
            if self._queues:
                # Nothing got through: a peer that is down (not one at its HWM, which
                # drains) is retried less often until it is back or declared dead.
                stuck = sum(len(q) for q in self._queues.values()) >= before
                self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S) if stuck else _RETRY_MIN_S
                self._arm_timer()
                return
        self._retry_s = _RETRY_MIN_S

    def discard_queued(self, dest: Any = ...) -> int:
        """Drop messages not sent yet (all, or those for ``dest``); returns how many
        ZeroMQ messages (for the logs)."""
        if dest is not ...:
            q = self._queues.pop(dest, None)
            self._queued_bytes.pop(dest, None)
            joined = self._pending.pop(dest, None)
            return (len(q) if q is not None else 0) + (joined is not None)
        n = sum(len(q) for q in self._queues.values())
        n += sum(j is not None for j in self._pending.values())
        self._retry_s = _RETRY_MIN_S
        self._queues.clear()
        self._queued_bytes.clear()
        self._pending.clear()
        return n

    def close(self) -> None:
        """Hand what the pump still holds to libzmq, then detach from the loop and close
        the socket (linger 0).

        Best effort and non-blocking: messages waiting for a free pipe are retried once
        and messages being joined in a burst (replies sent by ``on_recv`` just before,
        sends back to back) are sent, in order; what meets a full pipe, a peer that has
        gone or a closed socket is discarded (counted in :attr:`discarded`) without an
        error. With linger 0, libzmq itself may still discard what its I/O thread has
        not written yet (see the module's notes on ``linger``).
        """
        if self._closed:
            return
        self._burst = False
        if self._queues or self._pending:
            try:
                self._flush_for_close()
            except Exception:  # a closed socket, a failing on_undeliverable: nothing to do
                log.debug("flush at close failed", exc_info=True)
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(Exception):  # the loop may be closed already
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)

    def _flush_for_close(self) -> None:
        # The queues first (older); a destination whose queue is still stuck keeps its
        # joined messages back too (they would overtake it), and both are discarded.
        if self._queues:
            self._flush()
        pending = self._pending
        self._pending = {}
        for key, joined in pending.items():
            if joined is None:
                continue
            if key in self._queues:
                self.discarded += 1
                continue
            frames = joined.done()
            try:
                send_frames(self.sock, frames)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH or self.on_undeliverable is None:
                    self.discarded += 1  # a full pipe, a closed socket
                    continue
                try:
                    self.on_undeliverable(frames)
                except Exception:  # a bug there must not stop the close
                    log.exception("on_undeliverable failed")
        for q in self._queues.values():
            self.discarded += len(q)
        self._queues.clear()
        self._queued_bytes.clear()
