"""The pump that ties a non-blocking ZeroMQ socket to asyncio (the loop model of the
fabric's sockets: ``docs/concepts.md``)."""

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
_RETRY_MIN_S, _RETRY_MAX_S = 0.002, 0.1
# A send this soon after the previous one *ended* starts a coalescing burst.
_BURST_GAP_S = 100e-6
_perf_counter = time.perf_counter
# A joined message is sent at this size, and a larger one never joined (ZeroMQ delivers
# a message whole: its receiver would idle until all of it arrived).
_JOIN_LIMIT = 256 << 10
# In SocketPump._pending: no message to this destination in the burst yet.
_FIRST: Any = object()


class _Queue(deque[list[Any]]):
    """Messages to one destination that met EAGAIN, and their bytes."""

    size = 0


class _Joined:
    """Messages to one destination being joined into one ZeroMQ message."""

    __slots__ = ("frames", "n", "size", "small")

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames  # the ROUTER identity, then finished parts
        self.small: list[bytes] = []  # a run of small single-frame messages
        self.n = self.size = 0

    def close_batch(self) -> list[Any]:  # the frames, the run of small ones as one frame
        if small := self.small:
            self.frames.append(small[0] if len(small) == 1 else pack_batch(small))
            self.small = []
        return self.frames


class SocketPump:
    """Ties a non-blocking ZeroMQ socket to the running asyncio loop: incoming messages
    (lists of ``zmq.Frame``) go to ``on_recv`` in batches of up to ``batch``; :meth:`send`
    never blocks: at the HWM a message waits in an ordered queue per destination (per peer
    with ``router``), retried on a timer; a peer queued past ``peer_queue_limit`` bytes is
    dropped (``on_drop(peer)``, counted in :attr:`dropped`) until a send to it gets
    through; ``on_undeliverable`` gets a message to a peer that has gone. In a burst,
    messages after the first to a destination are joined (up to ``coalesce``; with
    ``batch_frames`` small ones share a batch frame: ``docs/PROTOCOL.md``).
    ``defer_check`` (a requester): a batch woken by the FD handles one, a drain the rest."""

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
        self.on_recv = on_recv
        self.on_undeliverable = on_undeliverable
        self.on_drop = on_drop
        self.batch = batch
        self.router = router
        self.coalesce = coalesce
        self.batch_frames = batch_frames
        self.peer_queue_limit = peer_queue_limit
        self.defer_check = defer_check
        self.loop = asyncio.get_running_loop()
        self._queues: dict[Any, _Queue] = {}  # per destination (None for a DEALER)
        self._dropped: set[Any] = set()
        #: Peers dropped for not reading (a count of drops, for status and metrics).
        self.dropped = 0
        #: Messages discarded (to dropped peers, or not handed to libzmq at close).
        self.discarded = 0
        self._burst = self._in_batch = self._scheduled = self._closed = False
        self._last_send = 0.0
        # Per destination of the burst, the messages being joined (None: its first went).
        self._pending: dict[Any, _Joined | None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._retry_s = _RETRY_MIN_S
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._pollin = [(sock, POLLIN)]
        # Almost always an arrival: the first receive goes without asking.
        self.loop.add_reader(self._fd, self._drain, True)
        self._schedule()

    @property
    def queue(self) -> list[list[Any]]:
        """Every message waiting for a free pipe, all destinations (a copy)."""
        return [m for q in self._queues.values() for m in q]

    def poke(self) -> None:
        """Look for input at the end of this loop iteration (call it after using
        :attr:`sock` directly)."""
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
                # Cheaper than an empty recv; sees input whose FD edge our sends took.
                if (i or not readable) and not zmq_poll(pollin, 0):
                    return
                try:
                    frames = recv_frames(sock)
                except zmq.ZMQError as exc:  # nothing there, or closed under us
                    if exc.errno in (zmq.EAGAIN, zmq.ENOTSOCK):
                        return
                    raise
                try:
                    on_recv(frames)
                except Exception:  # a bug in a handler must not stop the pump
                    log.exception("error handling an incoming message")
                if self._closed:
                    return
            self._schedule()  # more may be waiting: after the other callbacks
        finally:
            self._in_batch = False
            if self._burst and not self._closed:  # the burst ends with the batch
                self._burst = False
                self._send_pending()

    def send(self, frames: list[Any]) -> None:
        """Send one message without blocking (joined in a burst, queued at the HWM)."""
        if not self._burst:
            if self._closed:
                return
            in_batch = self._in_batch  # a burst, ended by the batch
            if in_batch or _perf_counter() - self._last_send < _BURST_GAP_S:
                self._burst = True
                self._pending[frames[0] if self.router else None] = None
                if not in_batch:
                    self._schedule()  # ended by a drain
            self._send_now(frames)
            if not in_batch:
                self._last_send = _perf_counter()
            return
        router = self.router
        key = frames[0] if router else None
        pending = self._pending
        joined = pending.get(key, _FIRST)
        if joined is _FIRST:  # goes at once: a lone reply never waits for its batch
            pending[key] = None
            self._send_now(frames)
            if not self._in_batch:
                self._last_send = _perf_counter()
            return
        last = frames[-1]
        small = False
        if (len(frames) - 1 if router else len(frames)) == 1 and type(last) is bytes:
            size = len(last)
            small = self.batch_frames and size <= MAX_BATCHED_FRAME
        else:
            size = nbytes(frames)
        if size >= _JOIN_LIMIT:  # never joined; what waits for it goes first
            if joined is not None:
                pending[key] = None
                self._send_now(joined.close_batch())
            self._send_now(frames)
            return
        if joined is None:
            joined = pending[key] = _Joined([key] if router else [])
        if small:
            joined.small.append(last)
        else:
            if joined.small:
                joined.close_batch()
            joined.frames.extend(frames[1:] if router else frames)
        joined.n += 1
        joined.size += size
        if joined.n >= self.coalesce or joined.size >= _JOIN_LIMIT:
            pending[key] = None
            self._send_now(joined.close_batch())

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
        pending, self._pending = self._pending, {}
        for joined in pending.values():
            if joined is not None:
                self._send_now(joined.close_batch())

    def _send_now(self, frames: list[Any]) -> None:
        if self._queues:
            key = frames[0] if self.router else None
            if key in self._queues:  # behind messages waiting for it: keep the order
                self._enqueue(key, frames)
                return
        try:
            send_frames(self.sock, frames)
        except zmq.Again:
            key = frames[0] if self.router else None
            if key in self._dropped:
                self.discarded += 1  # dropped and still not reading: not queued again
            else:
                self._enqueue(key, frames)
        except zmq.ZMQError as exc:
            self._undeliverable(frames, exc)
        else:
            if self._dropped:  # only a ROUTER drops
                self._dropped.discard(frames[0])  # it reads again
        # The send may have taken the FD's edge (it is edge-triggered): look now.
        if not (self._in_batch or self._scheduled or self._closed) and zmq_poll(self._pollin, 0):
            self._schedule()

    def _undeliverable(self, frames: list[Any], exc: zmq.ZMQError) -> None:
        if exc.errno != errno.EHOSTUNREACH:
            raise exc
        if self.on_undeliverable is not None:  # a peer that has gone
            self.on_undeliverable(frames)

    def _enqueue(self, key: Any, frames: list[Any]) -> None:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue()
        q.append(frames)
        q.size += nbytes(frames)
        if self.router and q.size > self.peer_queue_limit:
            self._drop(key)
        self._arm_timer()

    def _drop(self, key: Any) -> None:
        n = len(self._queues.pop(key, ()))
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

    def _flush(self) -> None:  # each destination until its pipe is full
        for key, q in list(self._queues.items()):
            while q:
                try:
                    send_frames(self.sock, q[0])
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    self._undeliverable(q[0], exc)
                q.size -= nbytes(q.popleft())
            if not q and self._queues.get(key) is q:
                del self._queues[key]
        if self._queues:
            self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = self.loop.call_later(self._retry_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        before = sum(len(q) for q in self._queues.values())
        if before:
            self._flush()  # re-arms the timer while anything is left
            self._schedule()
        stuck = sum(len(q) for q in self._queues.values()) >= before > 0
        # A peer that is down is retried less often.
        self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S) if stuck else _RETRY_MIN_S

    def discard_queued(self) -> int:
        """Drop every message not sent yet; returns how many."""
        n = sum(len(q) for q in self._queues.values())
        n += sum(j is not None for j in self._pending.values())
        self._retry_s = _RETRY_MIN_S
        self._queues.clear()
        self._pending.clear()
        return n

    def close(self) -> None:
        """Hand what the pump holds to libzmq (in order, without blocking; what cannot go
        is counted in :attr:`discarded`), then close the socket (linger 0)."""
        if self._closed:
            return
        self._burst = False
        try:  # queues first (older); joined messages behind a stuck queue are discarded
            if self._queues:
                self._flush()
            pending, self._pending = self._pending, {}
            for key, joined in pending.items():
                if joined is None:
                    continue
                if key in self._queues:
                    self.discarded += 1
                    continue
                frames = joined.close_batch()
                try:
                    send_frames(self.sock, frames)
                except zmq.ZMQError as exc:  # a full pipe, a closed socket, a gone peer
                    if exc.errno != errno.EHOSTUNREACH:
                        self.discarded += 1
                    elif self.on_undeliverable is not None:
                        try:
                            self.on_undeliverable(frames)
                        except Exception:  # a bug there must not stop the close
                            log.exception("on_undeliverable failed")
            self.discarded += sum(len(q) for q in self._queues.values())
        except Exception:  # a closed socket, a failing on_undeliverable: nothing to do
            log.debug("flush at close failed", exc_info=True)
        self._queues.clear()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(Exception):  # the loop may be closed already
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)
