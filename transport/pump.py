"""The pump that ties a non-blocking ZeroMQ socket to asyncio, and its frame I/O.

:class:`SocketPump` is the loop model of the fabric's sockets: the client's DEALERs run
on the caller's asyncio loop, a worker's ROUTER on its socket thread's loop; the weight
routes and the controller poll blocking sockets in threads of their own. Sockets are
made by :mod:`transport.sockets`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from fastio.fabric_msgs import MAX_BATCHED_FRAME, pack_batch
from transport.zmqio import POLLIN, nbytes, recv_frames, send_frames, zmq_poll

__all__ = ["DEFAULT_PEER_QUEUE_LIMIT", "SocketPump"]

log = logging.getLogger("transport.sockets")

#: Bytes a ROUTER pump holds for one peer beyond libzmq's pipe before dropping it.
DEFAULT_PEER_QUEUE_LIMIT = 64 << 20

# Retry interval of messages that met EAGAIN, doubled while nothing gets through.
_RETRY_MIN_S = 0.002
_RETRY_MAX_S = 0.1

# A send this soon after the previous one *ended* starts a coalescing burst.
_BURST_GAP_S = 100e-6
_perf_counter = time.perf_counter

# A joined message is sent at this size, and a larger message never joined: ZeroMQ
# delivers a message whole, so its receiver would idle until all of it arrived.
_JOIN_LIMIT = 256 << 10
# Marks "no message to this destination in the burst yet" in SocketPump._pending, and
# "none at all" in SocketPump._first.
_FIRST: Any = object()


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

    Incoming messages (lists of ``zmq.Frame``) go to ``on_recv`` in batches from a
    reader callback on the socket's FD. :meth:`send` never blocks: at the HWM a message
    waits in an ordered queue per destination (``router=True``: per peer, frame 0),
    retried on wake-ups and a timer, so a peer that stops reading holds only its own
    messages. A peer queued past ``peer_queue_limit`` bytes is dropped (queue
    discarded, ``on_drop(peer)``, :attr:`dropped` counted) until one send gets through.

    Coalescing: in a burst (a batch of incoming messages, or sends back to back until
    the next drain), the first message to each destination goes at once and later ones
    are joined into one ZeroMQ message (PROTOCOL.md), sent at the burst's end or at
    256 KiB; with ``batch_frames``, runs of small single-frame messages travel as one
    batch frame (:func:`fastio.fabric_msgs.split`).

    The FD is edge-triggered and our own sends can consume its readiness, so
    ``ZMQ_EVENTS`` is asked after a send outside a batch and before every receive in
    one. ``defer_check`` (a requester): a batch woken by the FD handles its first
    message and leaves the rest to a drain behind what that message woke.
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
        # Per destination (None for a DEALER): messages that met EAGAIN, and bytes.
        self._queues: dict[Any, deque[list[Any]]] = {}
        self._queued_bytes: dict[Any, int] = {}
        self._dropped: set[Any] = set()
        #: Peers dropped for not reading (a count of drops, for status and metrics).
        self.dropped = 0
        #: Messages discarded (to dropped peers, or not handed to libzmq at close).
        self.discarded = 0
        self.router = router
        self.coalesce = coalesce
        self._burst = False
        self._last_send = 0.0
        self._in_batch = False
        self.batch_frames = batch_frames
        # The first destination of this burst (its first message went at once; a burst
        # to one destination needs no dict), and per other destination of this burst:
        # messages being joined (None: none yet).
        self._first: Any = _FIRST
        self._pending: dict[Any, _Joined | None] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._retry_s = _RETRY_MIN_S
        self._closed = False
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._pollin = [(sock, POLLIN)]  # zmq_poll's argument
        # Almost always an arrival: the first receive goes without asking (readable=True).
        self.loop.add_reader(self._fd, self._drain, True)
        self._schedule()

    @property
    def queue(self) -> list[list[Any]]:
        """Every message waiting for a free pipe, all destinations (a copy)."""
        return [m for q in self._queues.values() for m in q]

    def poke(self) -> None:
        """Look for input at the end of this loop iteration: call it after using
        :attr:`sock` directly (a send can consume the edge of ZeroMQ's FD)."""
        self._schedule()

    def drain_now(self) -> None:
        """Read and dispatch what has arrived, now (up to one batch)."""
        if not self._closed and not self._in_batch:
            self._drain()

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._drain)

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
                # Cheaper than an empty recv, and sees input whose edge our sends took.
                if (i or not readable) and not zmq_poll(pollin, 0):
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
            if self._burst and not self._closed:  # the burst ends with the batch
                self._burst = False
                if self._pending:
                    self._send_pending()

    def send(self, frames: list[Any]) -> None:
        """Send one message without blocking (coalesced within a burst, queued at the
        HWM)."""
        if not self._burst:
            if self._closed:
                return
            if self._in_batch:  # a burst, ended by the batch; its first message goes now
                self._burst = True
                self._first = frames[0] if self.router else None
                self._send_now(frames)
                return
            if _perf_counter() - self._last_send < _BURST_GAP_S:  # ended by a drain
                self._burst = True
                self._first = frames[0] if self.router else None
                self._schedule()
            self._send_now(frames)
            self._last_send = _perf_counter()
            return
        router = self.router
        key = frames[0] if router else None
        pending = self._pending
        joined = pending.get(key, _FIRST)
        if joined is _FIRST:
            if key != self._first:  # goes at once: a lone reply never waits for its batch
                pending[key] = None
                self._send_now(frames)
                if not self._in_batch:
                    self._last_send = _perf_counter()
                return
            joined = None
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
            size = nbytes(frames)
        if size >= _JOIN_LIMIT:  # never joined; what waits for it goes first
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
        self._first = _FIRST
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
            if key in self._queues:  # behind messages waiting for it: keep the order
                self._enqueue(key, frames)
                self._arm_timer()
                return
        try:
            send_frames(self.sock, frames)
        except zmq.Again:
            key = frames[0] if self.router else None
            if key in self._dropped:
                self.discarded += 1  # dropped and still not reading: not queued again
            else:
                self._enqueue(key, frames)
                self._arm_timer()
        except zmq.ZMQError as exc:
            self._undeliverable(frames, exc)
        else:
            if self._dropped:  # only a ROUTER drops
                self._dropped.discard(frames[0])  # it reads again
        # The send may have taken the FD's edge: look now.
        if not (self._in_batch or self._scheduled or self._closed) and zmq_poll(self._pollin, 0):
            self._schedule()

    def _undeliverable(self, frames: list[Any], exc: zmq.ZMQError) -> None:
        if exc.errno != errno.EHOSTUNREACH:
            raise exc
        if self.on_undeliverable is not None:  # a peer that has gone
            self.on_undeliverable(frames)

    def _send_or_report(self, frames: list[Any]) -> None:
        try:
            send_frames(self.sock, frames)
        except zmq.Again:
            raise
        except zmq.ZMQError as exc:
            self._undeliverable(frames, exc)

    def _enqueue(self, key: Any, frames: list[Any]) -> None:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            self._queued_bytes[key] = 0
        q.append(frames)
        size = self._queued_bytes[key] + nbytes(frames)
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
        msg = "peer %r does not read: dropped it and %d queued messages (queue over %d bytes)"
        log.warning(msg, bytes(key)[:32], n, self.peer_queue_limit)
        if self.on_drop is not None:
            try:
                self.on_drop(key)
            except Exception:  # a bug there must not stop the pump
                log.exception("on_drop failed")

    def _flush(self) -> None:
        # Each destination until its pipe is full: one that does not read holds no one.
        for key, q in list(self._queues.items()):
            while q:
                frames = q[0]
                try:
                    self._send_or_report(frames)
                except zmq.Again:
                    break
                q.popleft()
                self._queued_bytes[key] -= nbytes(frames)
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
            if self._queues:  # a peer that is down is retried less often
                stuck = sum(len(q) for q in self._queues.values()) >= before
                self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S) if stuck else _RETRY_MIN_S
                self._arm_timer()
                return
        self._retry_s = _RETRY_MIN_S

    def discard_queued(self) -> int:
        """Drop every message not sent yet; returns how many."""
        n = sum(len(q) for q in self._queues.values())
        n += sum(j is not None for j in self._pending.values())
        self._retry_s = _RETRY_MIN_S
        self._queues.clear()
        self._queued_bytes.clear()
        self._pending.clear()
        return n

    def close(self) -> None:
        """Hand what the pump holds to libzmq (best effort, non-blocking, in order; what
        cannot go is counted in :attr:`discarded`), detach from the loop, close (linger 0).
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
        # Queues first (older); joined messages behind a stuck queue are discarded too.
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
            try:
                self._send_or_report(joined.done())
            except zmq.ZMQError:  # a full pipe, a closed socket
                self.discarded += 1
            except Exception:  # a bug in on_undeliverable must not stop the close
                log.exception("on_undeliverable failed")
        for q in self._queues.values():
            self.discarded += len(q)
        self._queues.clear()
        self._queued_bytes.clear()
