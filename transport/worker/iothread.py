"""The worker's socket thread: it owns the ROUTER, answers pings, ``health`` and bad
input itself and hands the rest to the engine's loop (one wake-up per batch each way).
It also keeps what was lost for clients it could not reach (:class:`LostReplies`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from fastio import Decoder, Encoder, errors, versions
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from transport.sockets import SocketPump, make_monitor, make_router
from transport.worker.config import WorkerConfig
from transport.worker.counters import Counters
from transport.worker.requests import Requests

__all__ = ["DROPPED", "LOST_TTL_S", "LostReplies", "SocketThread"]

_ACCEPTED_KINDS = {MsgKind.FABRIC_SUBMIT, MsgKind.FABRIC_CANCEL, MsgKind.FABRIC_HEARTBEAT}
_ACCEPTED_KINDS |= {MsgKind.FABRIC_CONTROL, MsgKind.FABRIC_ERROR}
#: Handed to the engine's loop for a peer the pump dropped (it stopped reading).
DROPPED = object()
#: Peers whose encoder (or refusal) is remembered; past it the table starts afresh.
_MAX_PEERS = 65536
_V1 = versions.VERSION_1
#: Seconds a worker remembers the submissions it gave up for a client that stays away.
LOST_TTL_S = 3600.0


class LostReplies:
    """What a worker gave up for a client it could not reach, reported as ``Error(LOST)``
    when it pings again (PROTOCOL.md's "Behaviour of a worker"); from two threads."""

    def __init__(self, ttl: float = LOST_TTL_S) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        # peer -> (since when, lost submission ids, undelivered Error replies)
        self._table: dict[bytes, tuple[float, list[int], list[list[Any]]]] = {}
        #: Ids and replies recorded since the start (the worker's ``lost`` counter).
        self.count = 0

    def note(self, peer: bytes, ids: Sequence[int], replies: Sequence[list[Any]] = ()) -> None:
        """Record ``ids`` given up and ``replies`` undelivered for ``peer``."""
        if ids or replies:
            with self._lock:
                self.count += len(ids) + len(replies)
                entry = self._table.setdefault(peer, (time.monotonic(), [], []))
                entry[1].extend(ids)
                entry[2].extend(replies)

    def pop(self, peer: bytes) -> tuple[float, list[int], list[list[Any]]] | None:
        """Take what was recorded for ``peer`` (None: nothing)."""
        if peer not in self._table:  # at every ping: no lock for a peer that lost nothing
            return None
        with self._lock:
            return self._table.pop(peer, None)

    def expire(self) -> None:
        """Forget peers recorded more than ``ttl`` seconds ago (not coming back)."""
        old = time.monotonic() - self.ttl
        with self._lock:
            for peer in [p for p, entry in self._table.items() if entry[0] < old]:
                del self._table[peer]


class _Handoff:
    """A queue into another thread's loop: one wake-up per batch, whatever its size."""

    def __init__(self, take: Callable[[deque[Any]], None]) -> None:
        self.items: deque[Any] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop that takes
        self._take = take
        self._scheduled = False

    def put(self, item: Any) -> None:
        self.items.append(item)
        if not self._scheduled and self.loop is not None:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # that loop is closed: a dying worker
                self.loop.call_soon_threadsafe(self.take)

    def take(self) -> None:
        self._scheduled = False  # first: an item put from now on schedules another take
        if self.items:
            self._take(self.items)


class _Server(Protocol):
    """What the socket thread reads of its :class:`~transport.WorkerServer`."""

    config: WorkerConfig
    counters: Counters
    worker_id: str
    incarnation: str
    requests: Requests

    def status(self) -> fm.WorkerStatus: ...
    def _engine_waiting(self) -> int: ...
    def _dispatch(self, peer: bytes, msg: Any) -> None: ...


class SocketThread:
    """The ROUTER of one :class:`~transport.WorkerServer`, served from its own thread
    (``threaded=False``: on the engine's loop, ``WorkerConfig.inline``). It counts in
    ``server.counters.io`` and hands Submits, Cancels, Controls and :data:`DROPPED` to
    ``server._dispatch(peer, msg)`` on the engine's loop."""

    def __init__(self, server: _Server, threaded: bool = True) -> None:
        self.server = server
        self.config = server.config
        self.counts = server.counters.io
        self._dispatch = server._dispatch
        self.threaded = threaded
        self.lost = LostReplies()
        self.endpoints: list[str] = []
        #: Last time each peer was heard from (written here; the engine's loop sweeps it).
        self.peers: dict[bytes, float] = {}
        #: The encoder each peer reads (from its pings; version 1 before).
        self.encoders: dict[bytes, Encoder] = {}
        self._refused: dict[bytes, str] = {}  # peers refused for their versions, and why
        self._dec = Decoder(fm.CLIENT_TO_WORKER, max_message_size=self.config.max_message_size)
        # (arrival time, peer, message) for the engine's loop; the two Submit counts have
        # one writer each.
        self._inbox = _Handoff(self._take_inbox)
        self._submits_in = self._submits_taken = 0
        self._doomed: set[tuple[bytes, int]] = set()  # held, their Cancel on its way
        self._outbox = _Handoff(self._send_out)
        self._post: Callable[[list[Any]], None] = self._outbox.put
        self._pump: SocketPump | None = None
        self._monitor: SocketPump | None = None
        self._thread: threading.Thread | None = None

    async def start(self, zctx: zmq.Context[Any]) -> list[str]:
        """Bind and serve; returns the bound endpoints (or raises what binding raised)."""
        self.held = self.server.requests.held  # by (peer, id); built after this thread
        self._inbox.loop = asyncio.get_running_loop()
        if not self.threaded:
            await self._setup(zctx)
            assert self._pump is not None
            self._post = self._pump.send
            return self.endpoints
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(zctx, ready), name="fastio-worker-io", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            try:  # cancelled while binding: the bind ends first, then close() stops it
                ready.result(30)
            except BaseException:
                self._thread.join(5)  # the bind failed: the thread ends
            raise
        return self.endpoints

    def _run(self, zctx: zmq.Context[Any], ready: Future[None]) -> None:
        if not ready.set_running_or_notify_cancel():  # start() cancelled before this ran
            return
        loop = self._outbox.loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._setup(zctx))
        except BaseException as exc:
            ready.set_exception(exc)
        else:
            ready.set_result(None)
            loop.run_forever()
        finally:
            loop.close()

    async def _setup(self, zctx: zmq.Context[Any]) -> None:
        cfg = self.config
        sock, self.endpoints = make_router(
            zctx, cfg.bind, hwm=cfg.hwm, max_message_size=cfg.max_message_size, curve=cfg.curve
        )
        self._pump = SocketPump(
            sock,
            self._on_message,
            on_undeliverable=self._on_undeliverable,
            on_drop=self._on_drop,
            peer_queue_limit=cfg.peer_queue_limit,
            router=True,
            batch_frames=True,
        )
        if cfg.curve is not None:
            # A peer without CURVE, or with another server key, fails the handshake
            # before any authenticator sees it: only a socket monitor can tell.
            failed = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            mon = make_monitor(sock, failed | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._monitor = SocketPump(mon, self._on_monitor)

    def close(self) -> None:
        """Send what is queued, close the socket, stop the thread."""
        loop, thread = self._outbox.loop, self._thread
        if not self.threaded:
            self._stop()
        elif loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                loop.call_soon_threadsafe(self._stop)
            thread.join(10)

    def _stop(self) -> None:
        self._outbox.take()
        for pump in (self._monitor, self._pump):
            if pump is not None:
                pump.close()
        if self.threaded:
            asyncio.get_running_loop().stop()

    def engine_lag(self) -> float:
        """Seconds the oldest message not yet taken by the engine's loop has waited."""
        inbox = self._inbox.items
        if inbox:
            with contextlib.suppress(IndexError):  # taken meanwhile
                arrived: float = inbox[0][0]
                return max(0.0, time.monotonic() - arrived)
        return 0.0

    def queued_submits(self) -> int:
        """Submits queued for the engine's loop (Cancels and controls are not work)."""
        return max(0, self._submits_in - self._submits_taken)

    def discarded(self) -> int:
        """Bytes of replies the pump discarded for clients it dropped."""
        return self._pump.discarded if self._pump is not None else 0

    def _doomed_held(self) -> int:
        # Held requests whose Cancel is on its way: about to go, so not load.
        if self._doomed:
            self._doomed = {k for k in self._doomed if k in self.held}
        return len(self._doomed)

    def send(self, peer: bytes, msg: Any) -> None:
        """Encode ``msg`` in the version ``peer`` reads and send it (engine's loop)."""
        frames = self.encoders.get(peer, _V1).encode(msg)
        frames.insert(0, peer)
        self._post(frames)

    def _take_inbox(self, inbox: deque[tuple[float, bytes, Any]]) -> None:
        dispatch = self._dispatch
        while inbox:
            _, peer, msg = inbox.popleft()
            if type(msg) is fm.Submit:
                self._submits_taken += 1
            dispatch(peer, msg)

    def _send_out(self, out: deque[list[Any]]) -> None:
        if self._pump is not None:
            msgs = []
            while out:  # popped one by one: the engine's loop appends meanwhile
                msgs.append(out.popleft())
            self._pump.send_many(msgs)

    def _send(self, peer: bytes, msg: Any) -> None:
        assert self._pump is not None
        self._pump.send([peer, *self.encoders.get(peer, _V1).encode(msg)])

    def _to_engine(self, peer: bytes, msg: Any) -> None:
        if not self.threaded:
            self._dispatch(peer, msg)
            return
        if type(msg) is fm.Submit:
            self._submits_in += 1
        self._inbox.put((time.monotonic(), peer, msg))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        self.peers[peer] = time.monotonic()
        for body in fm.split(frames[1:]) if len(frames) > 1 else [[]]:
            self._on_one(peer, body)

    def _on_one(self, peer: bytes, body: list[zmq.Frame]) -> None:
        if not body:
            self._bad(peer, -1, fm.ErrorCode.BAD_MESSAGE, "empty message")
            return
        try:
            msg = self._dec.decode(body)
        except errors.DecodeError as exc:
            self._bad_decode(peer, body, exc)
            return
        tp = type(msg)
        if tp is fm.Submit:
            self._to_engine(peer, msg)
        elif tp is fm.Heartbeat:
            self._pong(peer, msg)
        elif tp is fm.Control and msg.op == "health":  # as live as a pong
            self.counts.counts["control"] += 1
            self._send(peer, fm.ControlReply(seq=msg.seq, ok=True, status=self.server.status()))
        elif tp is fm.Error:
            text = "client %r reports error %s on id %s: %s"
            self.counts.note("error_replies_received", text, peer, msg.code, msg.id, msg.message)
        else:  # a Cancel, or a Control op that is the engine's
            if tp is fm.Cancel and (peer, msg.id) in self.held:
                self._doomed.add((peer, msg.id))
                if len(self._doomed) > 4096:  # pruned at pongs; a peer may never ping
                    self._doomed_held()
            self._to_engine(peer, msg)

    def _pong(self, peer: bytes, msg: fm.Heartbeat) -> None:
        try:
            enc = versions.encoder_for(msg)
        except errors.IncompatiblePeer as exc:
            self._refuse(peer, str(exc))
            return
        if self.encoders.get(peer) is not enc:
            if len(self.encoders) >= _MAX_PEERS:
                self.encoders.clear()
            self.encoders[peer] = enc
        self._report_lost(peer)
        # What a new request would wait behind: Submits held or queued, less those a
        # Cancel on its way will end (off the waiting ones first).
        server, gate = self.server, self.server.requests.gate
        running, held, doomed = gate.running, len(self.held), self._doomed_held()
        if doomed:
            running = max(0, running - max(0, doomed - max(0, held - running)))
            held = max(0, held - doomed)
        queued = self.queued_submits()
        pong = fm.Heartbeat(
            sent_at=msg.sent_at,
            worker_id=server.worker_id,
            incarnation=server.incarnation,
            in_flight=held + queued,
            paused=gate.paused,
            version=server.requests.version(),
            running=running,
            waiting=max(0, held - running) + queued + server._engine_waiting(),
            engine_lag=self.engine_lag(),
            **versions.STATED,
        )
        self._send(peer, pong)

    def _refuse(self, peer: bytes, why: str) -> None:
        # Versions this worker cannot serve: one Error naming both sides' versions (at
        # version 1) and no pong, so that the peer never uses this worker.
        if self._refused.get(peer) == why:
            return
        if len(self._refused) >= _MAX_PEERS:
            self._refused.clear()
        self._refused[peer] = why
        text = f"worker {self.server.worker_id} cannot serve this client: {why}"
        self.counts.note("incompatible_peers", "client %r refused: %s", peer, text)
        self.encoders.pop(peer, None)
        self._send(peer, self.counts.error(-1, fm.ErrorCode.UNSUPPORTED_VERSION, text))

    def _report_lost(self, peer: bytes) -> None:
        if (lost := self.lost.pop(peer)) is None:
            return
        assert self._pump is not None
        # Undeliverable again (the peer left at once): noted again by _on_undeliverable.
        text = "the worker gave up this submission; re-send it"
        for id in lost[1]:
            self._send(peer, self.counts.error(id, fm.ErrorCode.LOST, text))
        for reply in lost[2]:
            self._pump.send([peer, *reply])

    def _bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self._send(peer, self.counts.bad(peer, id, code, text))

    def _bad_decode(self, peer: bytes, body: list[Any], exc: errors.DecodeError) -> None:
        _, kind, first = fm.peek(body)
        submit = kind == MsgKind.FABRIC_SUBMIT and first is not None
        code, id, text = fm.ErrorCode.BAD_MESSAGE, -1, str(exc)
        if isinstance(exc, errors.MessageTooLarge):
            code, id = fm.ErrorCode.TOO_LARGE, first if first is not None else -1
        elif isinstance(exc, errors.UnsupportedVersion):
            code = fm.ErrorCode.UNSUPPORTED_VERSION
        elif isinstance(exc, errors.FrameError):
            # Not a fastio message (header, frame count): attributed to the Submit when
            # its id can be read, so that its caller hears of it.
            id = first if submit and first is not None else -1
        elif submit and first is not None:
            code, id, text = fm.ErrorCode.BAD_REQUEST, first, f"invalid Submit: {exc}"
        elif kind is not None and kind not in _ACCEPTED_KINDS:
            code, text = fm.ErrorCode.UNKNOWN_KIND, f"message kind {kind} not accepted by a worker"
        self._bad(peer, id, code, text)

    def _on_undeliverable(self, frames: list[Any]) -> None:
        # Its requests keep running; its Results' ids (to generate again) and copies of
        # its Errors are reported when it is heard again.
        peer, lost, replies = bytes(frames[0]), [], []
        for msg in fm.split(frames[1:]):
            _, kind, first = fm.peek(msg)
            if first is None or first < 0:
                continue
            if kind == MsgKind.FABRIC_RESULT:
                lost.append(first)
            elif kind == MsgKind.FABRIC_ERROR:
                replies.append([bytes(f) for f in msg])  # the encoder's buffers are not ours
        self.lost.note(peer, lost, replies)
        self.counts.note("undeliverable", "client %r unreachable: a reply is dropped", peer)

    def _on_drop(self, peer: Any) -> None:  # it stopped reading: cancel its requests
        self.counts.counts["dropped_peers"] += 1
        self._to_engine(bytes(peer), DROPPED)

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        name, text = zmq.Event(event["event"]).name, "refused a peer at the CURVE handshake"
        self.counts.note("handshake_failed", text + " (%s on %s)", name, event["endpoint"])
