"""The tcp route's data link: bucket bytes on a plain TCP stream beside the sockets
(``docs/PROTOCOL.md``, "Data link"). Trainer side :class:`LinkSender`, worker side
:class:`LinkClient`."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zmq

from fastio.weight_msgs import WeightBucket
from transport.weights.routes import Receiver
from transport.weights.routes.zmq import begin, stream_span, take

__all__ = ["PIECE", "DataLinkError", "DataListener", "DataReceiver", "DataSender", "LinkClient",
           "LinkSender", "Piece", "connect", "worker_token"]  # fmt: skip

log = logging.getLogger("transport.weights.datalink")

#: Worker -> publisher, once (then the id and the token).
HELLO = struct.Struct("<4sBHH")
HELLO_MAGIC = b"FIOL"
#: Publisher -> worker, per chunk (then the bytes).
PIECE = struct.Struct("<4sqIQQQ?")
PIECE_MAGIC = b"FIOP"
PROTOCOL = 1
_MAX_ID = 1024
_MAX_TOKEN = 64
HANDSHAKE_TIMEOUT = 2.0  # seconds to complete a HELLO (and get its answer)
_MAX_HANDSHAKES = 64  # under way at once; more connections are closed
LINK_RETRY_S = 60.0  # before a link that could not be opened is tried again


def worker_token(secret: bytes, worker_id: str) -> bytes:
    """The token ``worker_id`` presents: an HMAC of its id under the publisher's secret."""
    return hmac.new(secret, worker_id.encode("utf-8"), hashlib.sha256).digest()[:16]


class DataLinkError(ConnectionError):
    """The data link failed or carried something malformed (it is closed)."""


class Piece(NamedTuple):
    version: int
    bucket: int
    offset: int
    nbytes: int
    checksum: int
    last: bool


def _host_of(endpoint: str) -> tuple[str, socket.AddressFamily]:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host, socket.AF_INET6 if ":" in host else socket.AF_INET


def _blocking(sock: socket.socket, timeout: float) -> None:
    # SO_*TIMEO, not settimeout: a whole chunk moves in one system call.
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        conn.settimeout(max(deadline - time.monotonic(), 1e-6))  # TimeoutError past it
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("closed during the handshake")
        data += part
    return data


@dataclass(slots=True)
class Sent:
    done: bool = False  # a queued chunk: sent or dropped


class DataSender:
    """One worker's data connection, written by a thread of its own (``first``: bytes
    it writes before any chunk); closed after ``timeout`` seconds without progress."""

    def __init__(
        self,
        sock: socket.socket,
        worker_id: str,
        timeout: float,
        on_close: Callable[[DataSender], None],
        first: bytes = b"",
    ) -> None:
        self.sock = sock
        self.worker_id = worker_id
        self.broken = False
        self._on_close = on_close
        self._queue: deque[tuple[bytes, Any, Sent]] = deque([(first, None, Sent())])
        self._cv = threading.Condition()
        _blocking(sock, timeout)
        self._thread = threading.Thread(
            target=self._run, name=f"weights-data-{worker_id}", daemon=True
        )
        self._thread.start()

    def send(self, header: bytes, data: Any) -> Sent | None:
        """Queue a chunk (``data`` unchanged until done); ``None`` when closed."""
        sent = Sent()
        with self._cv:
            if self.broken:
                return None
            self._queue.append((header, data, sent))
            self._cv.notify()
        return sent

    def close(self) -> None:
        """Close the connection; queued chunks are dropped (done)."""
        with self._cv:
            if self.broken:
                return
            self.broken = True
            dropped, self._queue = self._queue, deque()
            self._cv.notify()
        for _, _, sent in dropped:
            sent.done = True
        _shut(self.sock)
        self._on_close(self)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self.broken)
                if self.broken:
                    return
                # Out of the queue while sent: close() drops only what is queued.
                header, data, sent = self._queue.popleft()
            try:
                self.sock.sendall(header)
                if data is not None:
                    self.sock.sendall(data)
            except Exception as exc:  # timeout, reset, closed: the link is done
                if not self.broken:
                    log.info("weight data link to %s closed: %s", self.worker_id, exc)
                self.close()
                return
            finally:
                sent.done = True


class DataListener:
    """Accepts data connections on ``endpoint``'s host and ``port`` (0: any) presenting
    :func:`worker_token` of ``secret``; ``admit(worker_id, socket)`` takes one or not (and
    owes the answer byte ``1`` before any chunk)."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        admit: Callable[[str, socket.socket], bool],
        port: int = 0,
    ) -> None:
        host, family = _host_of(endpoint)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._secret = secret
        self._admit = admit
        self._slots = threading.Semaphore(_MAX_HANDSHAKES)
        self._closed = threading.Event()
        self.rejected = 0
        self._thread = threading.Thread(target=self._run, name="weights-data-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5.0)
        self._sock.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the accept timeout (a look at _closed), or closing
                continue
            # Each handshake on a bounded thread of its own: a dawdler delays no one.
            if self._slots.acquire(blocking=False):
                threading.Thread(
                    target=self._hello, args=(conn,), name="weights-data-hello", daemon=True
                ).start()
            else:
                self.rejected += 1
                conn.close()

    def _hello(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic, proto, n_id, n_token = HELLO.unpack(_recv_exact(conn, HELLO.size, deadline))
            if magic != HELLO_MAGIC or proto != PROTOCOL:
                raise ValueError(f"not a fastio data link hello ({magic!r}, protocol {proto})")
            if n_id > _MAX_ID or n_token > _MAX_TOKEN:
                raise ValueError("hello too long")
            body = _recv_exact(conn, n_id + n_token, deadline)
            wid = body[:n_id].decode("utf-8")
            if not hmac.compare_digest(body[n_id:], worker_token(self._secret, wid)):
                raise ValueError(f"wrong token for {wid!r}")
            if self._closed.is_set() or not self._admit(wid, conn):
                self.rejected += 1
                conn.close()
        except (OSError, ValueError) as exc:
            self.rejected += 1
            log.warning("weight data link: refused a connection: %s", exc)
            conn.close()
        finally:
            self._slots.release()


def connect(endpoint: str, port: int, worker_id: str, token: bytes, timeout: float) -> DataReceiver:
    """Open the data link to the publisher at ``endpoint``'s host, ``port``."""
    sock = socket.create_connection((_host_of(endpoint)[0], port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wid = worker_id.encode("utf-8")
        sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL, len(wid), len(token)) + wid + token)
        if _recv_exact(sock, 1, time.monotonic() + timeout) != b"\x01":
            raise DataLinkError("the publisher refused the data link")
    except BaseException:
        sock.close()
        raise
    return DataReceiver(sock, timeout)


class DataReceiver:
    """The worker's end: chunk headers, bytes into the caller's buffers
    (:class:`DataLinkError` on a stall of ``timeout`` s, the end or a bad header)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # registered with the subscriber's zmq.Poller
        _blocking(sock, timeout)
        self._head = bytearray(PIECE.size)
        self._scratch = np.empty(256 << 10, dtype=np.uint8)

    def close(self) -> None:
        _shut(self.sock)

    def header(self) -> Piece:
        self.fill(self._head)
        magic, *fields = PIECE.unpack(self._head)
        if magic != PIECE_MAGIC:
            raise DataLinkError(f"bad piece header {bytes(self._head[:4])!r}")
        return Piece(*fields)

    def fill(self, buf: Any) -> None:
        """Receive exactly ``len(buf)`` bytes into ``buf``."""
        view = memoryview(buf).cast("B")
        got = 0
        while got < view.nbytes:
            try:
                k = self.sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError) as exc:
                raise DataLinkError("the data link stalled") from exc
            except OSError as exc:
                raise DataLinkError(f"data link: {exc}") from exc
            if k == 0:
                raise DataLinkError("the publisher closed the data link")
            got += k

    def scratch(self, n: int) -> np.ndarray[Any, Any]:
        """A reusable receive buffer of at least ``n`` bytes (its first ``n``)."""
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def discard(self, n: int) -> None:  # a chunk nobody wants any more
        for a in range(0, n, 1 << 20):
            self.fill(self.scratch(min(n - a, 1 << 20)))


@dataclass(eq=False)
class LinkClient:
    """The worker's side: the link offered in the Welcome, opened for a TCP version
    within ``min(fetch_timeout, 2 s)``; no chunk over ``max_message_size`` read."""

    endpoint: str
    worker_id: str
    fetch_timeout: float
    max_message_size: int
    count: Callable[[str], None]
    poller: zmq.Poller | None = field(default=None, init=False)
    link: DataReceiver | None = field(default=None, init=False)
    offer: tuple[int, bytes] | None = field(default=None, init=False)
    retry_at: float = field(default=0.0, init=False)

    def new_offer(self, offer: tuple[int, bytes] | None) -> None:
        self.close()
        self.retry_at = 0.0
        self.offer = offer

    def open(self) -> None:
        """Connect the offered link, if not open."""
        if self.link or self.offer is None or self.poller is None:
            return
        if time.monotonic() < self.retry_at:
            return
        port, token = self.offer
        try:
            self.link = connect(
                self.endpoint, port, self.worker_id, token, min(self.fetch_timeout, 2.0)
            )
        except (OSError, ValueError) as exc:
            # Unreachable or refused: frames, and no new attempt for a while (it blocks).
            self.retry_at = time.monotonic() + LINK_RETRY_S
            self.count("data_link_refused")
            log.info("weight data link unavailable (%s); fetching as ZeroMQ frames", exc)
            return
        self.poller.register(self.link.fd, zmq.POLLIN)
        self.count("data_links")

    def close(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            if self.poller is not None:
                self.poller.unregister(link.fd)
            link.close()

    def receive(self, f: Receiver, msg: WeightBucket | None = None) -> None:
        """A chunk on the data link (``msg`` unused), straight where it belongs."""
        link = self.link
        assert link is not None
        try:
            p = link.header()
            if p.nbytes > self.max_message_size:
                # Never read gigabytes away on the word of a header.
                raise DataLinkError(f"a chunk of {p.nbytes} bytes (larger than allowed)")
            up, i, t = f.update, p.bucket, time.monotonic()
            if (
                up is None
                or up.seg is not None
                or p.version != up.ann.version
                or i not in up.sched.outstanding
            ):
                self.count("stale_pieces")
                link.discard(p.nbytes)
                return
            if p.offset + p.nbytes > up.ann.buckets[i].nbytes:
                raise DataLinkError(f"a chunk beyond the end of bucket {i}")
            part = begin(f, up, i, p.offset, p.nbytes, t)
            if part is None:  # left over from an earlier answer, or the lock refused
                link.discard(p.nbytes)
                return
            take(part, link, p.nbytes, up.stage[i] if up.stage is not None else None, keep=True)
        except DataLinkError as exc:
            f.link_failed(str(exc))
            return
        f.chunk_done(up, i, part, t, True, p.last, p.checksum)


class LinkSender:
    """The trainer side: a :class:`DataListener`, a :class:`DataSender` per worker."""

    span = staticmethod(stream_span)

    def __init__(
        self, endpoint: str, port: int, timeout: float, count: Callable[[str], None]
    ) -> None:
        self.secret = secrets.token_bytes(16)
        self.timeout = timeout
        self.count = count
        self.senders: dict[str, DataSender] = {}
        self.lock = threading.Lock()
        self.closed = False
        self.listener = DataListener(endpoint, self.secret, self._admit, port)
        self.port = self.listener.port

    def token(self, worker_id: str) -> bytes:  # for its Welcome
        return worker_token(self.secret, worker_id)

    def send(self, ident: bytes, wid: str, msg: WeightBucket) -> Sent | None:
        with self.lock:
            sender = self.senders.get(wid)
        if sender is None:
            return None
        (chunk,) = msg.chunks
        n = memoryview(chunk).nbytes
        sent = sender.send(
            PIECE.pack(PIECE_MAGIC, msg.version, msg.index, msg.offset, n, msg.checksum, msg.last),
            chunk,
        )
        if sent is not None:
            self.count("data_link_pieces")
        return sent

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            self.closed = True
            senders = list(self.senders.values())
        for sender in senders:
            sender.close()
            sender.join(5.0)

    def _admit(self, worker_id: str, sock: socket.socket) -> bool:  # token checked
        with self.lock:
            if self.closed:
                return False
            old = self.senders.pop(worker_id, None)
            self.senders[worker_id] = DataSender(
                sock, worker_id, self.timeout, self._closed, first=b"\x01"
            )
            self.count("data_links")
        if old is not None:
            old.close()  # a restarted worker's: its replacement has the id now
        return True

    def _closed(self, sender: DataSender) -> None:
        with self.lock:
            if self.senders.get(sender.worker_id) is sender:
                del self.senders[sender.worker_id]
