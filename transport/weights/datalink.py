"""The data link of the TCP path: bucket bytes on a plain TCP stream beside the sockets.

Over ZeroMQ, each piece of a bucket is received by libzmq's I/O thread into a message
buffer it allocates (fresh pages, faulted and zeroed), and the worker then copies it
once more into its weights. On a plain stream socket the worker receives each block
straight into its parameter memory (``recv_into``) and hashes it while it is in cache:
one kernel copy per byte on each side, as a ``torch.distributed`` broadcast does, plus
the checksum. The control traffic (Hello, Announce, Fetch, Ack, heartbeats) stays on the
ZeroMQ sockets; only the bytes move here.

Protocol (``docs/PROTOCOL.md``): the publisher's Welcome carries the port of its data
listener and a secret token. The worker connects to that port on the publisher's host
and sends ``HELLO`` (magic, worker id, its token: an HMAC of its id under the publisher's
secret); the publisher answers one byte ``1`` once the link is registered, and from then
on writes the pieces of every Fetch that asks for the link (``data=True``) to
that connection, each as a :data:`PIECE` header followed by its bytes. Headers are
self-describing, so a worker drops a piece it no longer wants (a fetch it gave up) by
reading it away; anything malformed closes the connection, and the worker fetches the
rest over the ZeroMQ socket.

Trainer side: :class:`DataListener` (accepts and checks connections) and one
:class:`DataSender` thread per worker (its kernel copies run beside the other workers').
Worker side: :class:`DataReceiver`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "PIECE",
    "DataLinkError",
    "DataListener",
    "DataReceiver",
    "DataSender",
    "Piece",
    "connect",
    "worker_token",
]

log = logging.getLogger("transport.weights.datalink")

#: Worker -> publisher, once: magic, protocol version, worker id length, token length;
#: then the worker id (UTF-8) and the token (bytes).
HELLO = struct.Struct("<4sBHH")
HELLO_MAGIC = b"FIOL"
#: Publisher -> worker, per piece: magic, version, bucket index, offset in the bucket,
#: byte count, checksum of the bucket (on the last piece, else 0), last flag; then
#: ``nbytes`` bytes.
PIECE = struct.Struct("<4sqIQQQ?")
PIECE_MAGIC = b"FIOP"
PROTOCOL = 1
_MAX_ID = 1024
_MAX_TOKEN = 64
#: Seconds a connection has to complete its HELLO (and a worker to get its answer).
HANDSHAKE_TIMEOUT = 2.0
#: Handshakes under way at once; more connections are closed at once.
_MAX_HANDSHAKES = 64


def worker_token(secret: bytes, worker_id: str) -> bytes:
    """The token worker ``worker_id`` presents on the link: an HMAC of its id under the
    publisher's secret (each worker learns only its own, in its Welcome)."""
    return hmac.new(secret, worker_id.encode("utf-8"), hashlib.sha256).digest()[:16]


class DataLinkError(ConnectionError):
    """The data link failed or carried something malformed: it is closed."""


class Piece(NamedTuple):
    """A piece header read from the link."""

    version: int
    bucket: int
    offset: int
    nbytes: int
    checksum: int
    last: bool


def _host_of(endpoint: str) -> tuple[str, socket.AddressFamily]:
    """The host of a ``tcp://host:port`` endpoint, unbracketed, and its family."""
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1], socket.AF_INET6
    return host, socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _blocking(sock: socket.socket, timeout: float) -> None:
    """A blocking socket whose sends and receives give up after ``timeout`` seconds
    without progress (``SO_SNDTIMEO``/``SO_RCVTIMEO``): a whole piece then moves in
    one system call, where Python's own timeouts poll before every partial one."""
    sock.settimeout(None)
    sec = int(timeout)
    tv = struct.pack("ll", sec, int((timeout - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


# -- trainer side ----------------------------------------------------------------------
class Sent:
    """Tracks one queued piece: :attr:`done` once the kernel has copied its bytes (or
    the link dropped it), after which its buffer may be written again."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class DataSender:
    """One worker's data connection on the publisher: a thread writes queued pieces.

    A worker that stops reading stalls only its own thread; after ``timeout`` seconds
    without progress the connection is closed (the worker fetches again over ZeroMQ).
    """

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
        self._queue: deque[tuple[bytes, Any, Sent]] = deque()
        if first:  # written by this thread before any piece (one writer per socket)
            self._queue.append((first, None, Sent()))
        self._cv = threading.Condition()
        _blocking(sock, timeout)
        self._thread = threading.Thread(
            target=self._run, name=f"weights-data-{worker_id}", daemon=True
        )
        self._thread.start()

    def send(self, header: bytes, data: Any) -> Sent | None:
        """Queue a piece (``data``: a buffer that stays unchanged until the returned
        tracker is done); None when the link is closed."""
        sent = Sent()
        with self._cv:
            if self.broken:
                return None
            self._queue.append((header, data, sent))
            self._cv.notify()
        return sent

    def close(self) -> None:
        """Close the connection; queued pieces are dropped (their trackers done)."""
        with self._cv:
            if self.broken:
                return
            self.broken = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify()
        for _, _, sent in dropped:
            sent.done = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._on_close(self)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self.broken:
                    self._cv.wait()
                if self.broken:
                    return
                # Out of the queue while it is sent: close() drops the queue only,
                # and this piece is done once the kernel stopped reading it.
                header, data, sent = self._queue.popleft()
            try:
                self.sock.sendall(header)
                if data is not None:
                    self.sock.sendall(data)
            except Exception as exc:  # timeout, reset, closed; anything else closes it too
                if not self.broken:
                    log.info("weight data link to %s closed: %s", self.worker_id, exc)
                sent.done = True
                self.close()
                return
            sent.done = True


class DataListener:
    """Accepts workers' data connections for a publisher.

    Parameters
    ----------
    endpoint:
        The publisher's ROUTER endpoint (``tcp://host:port``): the listener binds the
        same host, on ``port`` (0: a free one; see :attr:`port`).
    secret:
        The publisher's secret: worker ``w`` must present :func:`worker_token` of it
        (it learns it from its Welcome, which only a worker admitted on the ROUTER
        receives).
    admit:
        Called with ``(worker_id, socket)`` for a connection that presented its token
        (from a handshake thread); returns whether it is taken (else it is closed). It
        owes the worker the answer byte ``1`` before any piece.
    """

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
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                continue
            # Each handshake on a thread of its own, within a deadline: a peer that
            # connects and dawdles delays no one else. Bounded in number.
            if not self._slots.acquire(blocking=False):
                self.rejected += 1
                conn.close()
                continue
            threading.Thread(
                target=self._admit_one, args=(conn,), name="weights-data-hello", daemon=True
            ).start()

    def _admit_one(self, conn: socket.socket) -> None:
        try:
            try:
                wid = self._handshake(conn, time.monotonic() + HANDSHAKE_TIMEOUT)
            except (OSError, ValueError) as exc:
                self.rejected += 1
                log.warning("weight data link: refused a connection: %s", exc)
                conn.close()
                return
            if self._closed.is_set() or not self._admit(wid, conn):
                self.rejected += 1
                conn.close()
        finally:
            self._slots.release()

    def _handshake(self, conn: socket.socket, deadline: float) -> str:
        _tune(conn)
        head = _recv_exact(conn, HELLO.size, deadline)
        magic, proto, n_id, n_token = HELLO.unpack(head)
        if magic != HELLO_MAGIC or proto != PROTOCOL:
            raise ValueError(f"not a fastio data link hello ({magic!r}, protocol {proto})")
        if n_id > _MAX_ID or n_token > _MAX_TOKEN:
            raise ValueError("hello too long")
        body = _recv_exact(conn, n_id + n_token, deadline)
        wid = body[:n_id].decode("utf-8")
        if not hmac.compare_digest(body[n_id:], worker_token(self._secret, wid)):
            raise ValueError(f"wrong token for {wid!r}")
        return wid


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake too slow")
        conn.settimeout(left)
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("closed during the handshake")
        got += k
    return bytes(buf)


# -- worker side -----------------------------------------------------------------------
def connect(endpoint: str, port: int, worker_id: str, token: bytes, timeout: float) -> DataReceiver:
    """Open the data link to the publisher at ``endpoint``'s host, ``port``."""
    host, _ = _host_of(endpoint)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        wid = worker_id.encode("utf-8")
        sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL, len(wid), len(token)) + wid + token)
        if _recv_exact(sock, 1, time.monotonic() + timeout) != b"\x01":
            raise DataLinkError("the publisher refused the data link")
    except BaseException:
        sock.close()
        raise
    return DataReceiver(sock, timeout)


class DataReceiver:
    """The worker's end of the data link: piece headers, and bytes received straight
    into the caller's buffers.

    Every read waits at most ``timeout`` seconds for progress; a timeout, the end of the
    stream or a malformed header raises :class:`DataLinkError` (close the link then).
    """

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        #: The descriptor (the key ``zmq.Poller.poll`` reports it under).
        self.fd = sock.fileno()
        _blocking(sock, timeout)
        self._head = bytearray(PIECE.size)
        self._head_view = memoryview(self._head)
        self._scratch: np.ndarray[Any, Any] | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def header(self) -> Piece:
        """The next piece's header."""
        self.fill(self._head_view)
        magic, version, index, offset, nbytes, checksum, last = PIECE.unpack(self._head)
        if magic != PIECE_MAGIC:
            raise DataLinkError(f"bad piece header {bytes(self._head[:4])!r}")
        return Piece(version, index, offset, nbytes, checksum, last)

    def fill(self, buf: Any) -> None:
        """Receive exactly ``len(buf)`` bytes into ``buf`` (a writable buffer)."""
        view = buf if isinstance(buf, memoryview) else memoryview(buf).cast("B")
        n = view.nbytes
        got = 0
        sock = self.sock
        try:
            while got < n:
                k = sock.recv_into(view[got:] if got else view, n - got, socket.MSG_WAITALL)
                if k == 0:
                    raise DataLinkError("the publisher closed the data link")
                got += k
        except (BlockingIOError, TimeoutError) as exc:
            raise DataLinkError("the data link stalled") from exc
        except DataLinkError:
            raise
        except OSError as exc:
            raise DataLinkError(f"data link: {exc}") from exc

    def scratch(self, n: int) -> np.ndarray[Any, Any]:
        """A reusable receive buffer of at least ``n`` bytes (its first ``n``)."""
        if self._scratch is None or self._scratch.size < n:
            self._scratch = np.empty(max(n, 256 << 10), dtype=np.uint8)
        return self._scratch[:n]

    def discard(self, n: int) -> None:
        """Read ``n`` bytes away (a piece nobody wants any more)."""
        step = 1 << 20
        while n > 0:
            k = min(n, step)
            self.fill(self.scratch(k))
            n -= k
