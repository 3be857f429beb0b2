"""The worker's socket thread: it owns the ROUTER, answers pings, ``health`` and bad
input itself and hands the rest to the engine's loop (one wake-up per batch each way)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from fastio import (
    DecodeError,
    Decoder,
    Encoder,
    FrameError,
    IncompatiblePeer,
    MessageTooLarge,
    UnsupportedVersion,
    versions,
)
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from transport.sockets import SocketPump, make_monitor, make_router
from transport.worker.config import WorkerConfig
from transport.worker.counters import Counters, log_counted
from transport.worker.lost import LostReplies
from transport.worker.pausing import PauseGate

__all__ = ["DROPPED", "SocketThread"]

_ACCEPTED_KINDS = {MsgKind.FABRIC_SUBMIT, MsgKind.FABRIC_CANCEL, MsgKind.FABRIC_HEARTBEAT}
_ACCEPTED_KINDS |= {MsgKind.FABRIC_CONTROL, MsgKind.FABRIC_ERROR}

#: Handed to the engine's loop for a peer the pump dropped (it stopped reading).
DROPPED = object()

#: Peers whose encoder is remembered; past it the table starts afresh (version 1 until
#: a forgotten peer's next ping).
_MAX_ENCODERS = 65536
_V1 = versions.VERSION_1


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
        # Cleared before taking: an item put after this schedules another take.
        self._scheduled = False
        if self.items:
            self._take(self.items)


class SocketThread:
    """The ROUTER of one :class:`~transport.WorkerServer`, served from its own thread.

    It counts in ``counters.io`` and reads ``lost``, ``gate`` and ``held`` (the held
    requests by ``(peer, id)``); pongs and health replies report ``worker_id``,
    ``incarnation``, ``version()``, ``engine_waiting()`` and ``status()``.
    ``dispatch(peer, msg)`` runs on the engine's loop for a Submit, Cancel, Control or
    :data:`DROPPED`. ``threaded=False``: served on the engine's loop (``inline``).
    """

    def __init__(
        self,
        config: WorkerConfig,
        counters: Counters,
        lost: LostReplies,
        gate: PauseGate,
        held: Mapping[tuple[bytes, int], object],
        *,
        worker_id: str,
        incarnation: str,
        version: Callable[[], int],
        engine_waiting: Callable[[], int],
        status: Callable[[], fm.WorkerStatus],
        dispatch: Callable[[bytes, Any], None],
        threaded: bool = True,
    ) -> None:
        self.config = config
        self.counts = counters.io
        self.lost = lost
        self.gate = gate
        self.held = held
        self.worker_id = worker_id
        self.incarnation = incarnation
        self._version = version
        self._engine_waiting = engine_waiting
        self._status = status
        self._dispatch = dispatch
        self.threaded = threaded
        self.endpoints: list[str] = []
        #: Last time each peer was heard from (written here; the engine's loop sweeps it).
        self.peers: dict[bytes, float] = {}
        #: The encoder each peer reads (from its pings; version 1 before).
        self.encoders: dict[bytes, Encoder] = {}
        #: Peers refused for their versions, with the reason they were sent (once).
        self._refused: dict[bytes, str] = {}
        self._dec = Decoder(fm.CLIENT_TO_WORKER, max_message_size=config.max_message_size)
        # (arrival time, peer, message) for the engine's loop; Submits in and taken have
        # one writer each.
        self._inbox = _Handoff(self._take_inbox)
        self._submits_in = 0
        self._submits_taken = 0
        # Held requests whose Cancel is on its way to the engine's loop.
        self._doomed: set[tuple[bytes, int]] = set()
        self._outbox = _Handoff(self._send_out)
        self._post: Callable[[list[Any]], None] = self._outbox.put
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: SocketPump | None = None
        self._monitor: SocketPump | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    async def start(self, zmq_context: zmq.Context[Any]) -> list[str]:
        """Bind and serve; returns the bound endpoints (or raises what binding raised)."""
        self._inbox.loop = asyncio.get_running_loop()
        if not self.threaded:
            self._loop = self._inbox.loop
            await self._setup(zmq_context)
            assert self._pump is not None
            self._post = self._pump.send
            return self.endpoints
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(zmq_context, ready), name="fastio-worker-io", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join(5)
            raise self._error
        return self.endpoints

    def _run(self, zmq_context: zmq.Context[Any], ready: threading.Event) -> None:
        loop = self._loop = self._outbox.loop = asyncio.new_event_loop()
        try:
            try:
                loop.run_until_complete(self._setup(zmq_context))
            except BaseException as exc:
                self._error = exc
                return
            finally:
                ready.set()
            loop.run_forever()
        finally:
            loop.close()

    async def _setup(self, zmq_context: zmq.Context[Any]) -> None:
        cfg = self.config
        sock, self.endpoints = make_router(
            zmq_context, cfg.bind, hwm=cfg.hwm, max_message_size=cfg.max_message_size,
            curve=cfg.curve,
        )  # fmt: skip
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
        if not self.threaded:
            if self._pump is not None:
                self._stop()
            return
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # its loop is closed already
            loop.call_soon_threadsafe(self._stop)
        thread.join(10)

    def _stop(self) -> None:
        self._outbox.take()
        if self._monitor is not None:
            self._monitor.close()
        if self._pump is not None:
            self._pump.close()
        if self.threaded and self._loop is not None:
            self._loop.stop()

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
        """Held requests whose Cancel is on its way: about to go, so not load."""
        if not self._doomed:
            return 0
        held = self.held
        self._doomed = doomed = {k for k in self._doomed if k in held}
        return len(doomed)

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
            while out:
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
        if len(frames) > 1:
            for body in fm.split(frames[1:]):
                self._on_one(peer, body)
        else:
            self._on_one(peer, [])

    def _on_one(self, peer: bytes, body: list[zmq.Frame]) -> None:
        if not body:
            self._bad(peer, -1, fm.ErrorCode.BAD_MESSAGE, "empty message")
            return
        try:
            msg = self._dec.decode(body)
        except MessageTooLarge as exc:
            _, _, first = fm.peek(body)
            self._bad(peer, first if first is not None else -1, fm.ErrorCode.TOO_LARGE, str(exc))
            return
        except DecodeError as exc:
            self._bad_decode(peer, body, exc)
            return
        tp = type(msg)
        if tp is fm.Submit:
            self._to_engine(peer, msg)
        elif tp is fm.Heartbeat:
            self._pong(peer, msg)
        elif tp is fm.Control and msg.op == "health":  # as live as a pong
            self.counts.counts["control"] += 1
            self._send(peer, fm.ControlReply(seq=msg.seq, ok=True, status=self._status()))
        elif tp is fm.Error:
            self.counts.counts["error_replies_received"] += 1
            log_counted(
                self.counts.counts["error_replies_received"],
                "client %r reports error %s on id %s: %s", peer, msg.code, msg.id, msg.message,
            )  # fmt: skip
        else:  # a Cancel, or a Control op that is the engine's
            if tp is fm.Cancel and (peer, msg.id) in self.held:
                self._doomed.add((peer, msg.id))
                if len(self._doomed) > 4096:  # pruned at pongs; a peer may never ping
                    self._doomed_held()
            self._to_engine(peer, msg)

    def _pong(self, peer: bytes, msg: fm.Heartbeat) -> None:
        try:
            enc = versions.encoder_for(msg)
        except IncompatiblePeer as exc:
            self._refuse(peer, str(exc))
            return
        encoders = self.encoders
        if encoders.get(peer) is not enc:
            if len(encoders) >= _MAX_ENCODERS:
                encoders.clear()
            encoders[peer] = enc
        if peer in self.lost:
            self._report_lost(peer)
        # What a new request would wait behind: Submits held or queued, less those a
        # Cancel on its way will end (off the waiting ones first).
        running = self.gate.running
        held = len(self.held)
        doomed = self._doomed_held()
        if doomed:
            running = max(0, running - max(0, doomed - max(0, held - running)))
            held = max(0, held - doomed)
        queued = self.queued_submits()
        self._send(
            peer,
            fm.Heartbeat(
                sent_at=msg.sent_at,
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                in_flight=held + queued,
                paused=self.gate.paused,
                version=self._version(),
                running=running,
                waiting=max(0, held - running) + queued + self._engine_waiting(),
                engine_lag=self.engine_lag(),
                **versions.STATED,
            ),
        )

    def _refuse(self, peer: bytes, why: str) -> None:
        """A peer stating versions this worker cannot serve: one Error naming both
        sides' versions (at version 1) and no pong, so it never uses this worker."""
        if self._refused.get(peer) == why:
            return
        if len(self._refused) >= _MAX_ENCODERS:
            self._refused.clear()
        self._refused[peer] = why
        counts = self.counts.counts
        counts["incompatible_peers"] += 1
        text = f"worker {self.worker_id} cannot serve this client: {why}"
        log_counted(counts["incompatible_peers"], "client %r refused: %s", peer, text)
        self.encoders.pop(peer, None)
        self._send_error(peer, -1, fm.ErrorCode.UNSUPPORTED_VERSION, text)

    def _report_lost(self, peer: bytes) -> None:
        assert self._pump is not None
        ids, replies = self.lost.pop(peer)
        # Undeliverable again (the peer left at once): noted again by _on_undeliverable.
        for id in ids:
            self._send_error(
                peer, id, fm.ErrorCode.LOST, "the worker gave up this submission; re-send it"
            )
        for reply in replies:
            self._pump.send([peer, *reply])

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self.counts.errors[code.name] += 1
        self._send(peer, fm.Error(id=id, code=int(code), message=text))

    def _bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        n = self.counts.bad(rejected=code == fm.ErrorCode.BAD_REQUEST)
        log_counted(n, "bad message from %r: %s", peer, text)
        self._send_error(peer, id, code, text)

    def _bad_decode(self, peer: bytes, body: list[Any], exc: DecodeError) -> None:
        _, kind, first = fm.peek(body)
        if isinstance(exc, UnsupportedVersion):
            self._bad(peer, -1, fm.ErrorCode.UNSUPPORTED_VERSION, str(exc))
        elif isinstance(exc, FrameError):
            # Not a fastio message (header, frame count): BAD_MESSAGE, attributed to
            # the Submit when its id can be read, so that its caller hears of it.
            id = first if kind == MsgKind.FABRIC_SUBMIT and first is not None else -1
            self._bad(peer, id, fm.ErrorCode.BAD_MESSAGE, str(exc))
        elif kind == MsgKind.FABRIC_SUBMIT and first is not None:
            self._bad(peer, first, fm.ErrorCode.BAD_REQUEST, f"invalid Submit: {exc}")
        elif kind is not None and kind not in _ACCEPTED_KINDS:
            self._bad(
                peer, -1, fm.ErrorCode.UNKNOWN_KIND, f"message kind {kind} not accepted by a worker"
            )
        else:
            self._bad(peer, -1, fm.ErrorCode.BAD_MESSAGE, str(exc))

    def _on_undeliverable(self, frames: list[Any]) -> None:
        # Its requests keep running; what is lost is reported when it is heard again.
        counts = self.counts.counts
        counts["undeliverable"] += 1
        peer = self.lost.note_undeliverable(frames)
        log_counted(counts["undeliverable"], "client %r unreachable: a reply is dropped", peer)

    def _on_drop(self, peer: Any) -> None:  # it stopped reading: cancel its requests
        self.counts.counts["dropped_peers"] += 1
        self._to_engine(bytes(peer), DROPPED)

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        counts = self.counts.counts
        counts["handshake_failed"] += 1
        log_counted(
            counts["handshake_failed"],
            "refused a peer at the CURVE handshake (%s on %s)",
            zmq.Event(event["event"]).name,
            event["endpoint"],
        )
