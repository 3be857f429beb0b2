"""The worker's socket thread: it owns the ROUTER, answers pings and moves bytes.

Engine work never runs here. The thread runs an asyncio loop of its own with a
:class:`~transport.sockets.SocketPump` on the ROUTER; it decodes what arrives, answers
``Heartbeat`` pings and ``health`` controls itself (with the engine's load read from the
server: running, waiting, engine lag), answers undecodable messages with an ``Error``,
and hands every other message to the engine's loop through a queue (one wake-up per
batch, not per message). Replies built on the engine's loop come back through another
queue and leave as one coalesced burst per wake-up.

So a handler that blocks its loop for seconds (a sync ``time.sleep``, a torch forward
run inline) delays its own requests, never a pong. The thread shares the GIL with the
engine: a pure-Python engine step holding it delays the socket thread by at most the
interpreter's switch interval (``sys.getswitchinterval()``; ``python -m transport.worker``
sets 1 ms, Python's default is 5 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

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
from transport import metrics
from transport.sockets import SocketPump, make_router
from transport.worker.context import RequestContext, WorkerConfig
from transport.worker.lost import LostReplies

__all__ = ["DROPPED", "SocketThread", "log_counted"]

log = logging.getLogger("transport.worker")

_ACCEPTED_KINDS = {MsgKind.FABRIC_SUBMIT, MsgKind.FABRIC_CANCEL, MsgKind.FABRIC_HEARTBEAT}
_ACCEPTED_KINDS |= {MsgKind.FABRIC_CONTROL, MsgKind.FABRIC_ERROR}

#: Put in the engine's queue for a peer the pump dropped (it stopped reading).
DROPPED = object()

#: Peers whose encoder is remembered; past it the table starts afresh (a forgotten peer
#: gets version-1 replies, which every peer reads, until its next ping).
_MAX_ENCODERS = 65536


def log_counted(n: int, fmt: str, *args: Any) -> None:
    """Log the first ten occurrences, then every power of two: hostile input must not
    flood the log."""
    if n <= 10 or (n & (n - 1)) == 0:
        log.warning(fmt + " (occurrence %d)", *args, n)


class _Server(Protocol):
    """What the socket thread uses of its :class:`~transport.WorkerServer` (declared here
    so that this module needs not import the server's)."""

    @property
    def config(self) -> WorkerConfig: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def _paused(self) -> bool: ...
    @property
    def _running(self) -> int: ...
    @property
    def _tasks(self) -> dict[tuple[bytes, int], tuple[asyncio.Task[None], RequestContext]]: ...
    @property
    def _peers(self) -> dict[bytes, float]: ...
    @property
    def _lost(self) -> LostReplies: ...
    def status(self) -> fm.WorkerStatus: ...
    def _dispatch(self, peer: bytes, msg: Any) -> None: ...
    def _drain_inbox(self) -> None: ...
    def _on_submit(self, peer: bytes, sub: fm.Submit) -> None: ...


class SocketThread:
    """The ROUTER of one :class:`~transport.WorkerServer`, served from its own thread.

    Created and started from the server's (engine's) loop: :meth:`start` returns once
    the socket is bound (or raises what binding raised).
    """

    def __init__(self, server: _Server, ctx: zmq.Context[Any], threaded: bool = True) -> None:
        self.server = server
        #: False: the socket is served on the engine's loop itself (handlers that never
        #: block, see ``WorkerConfig.inline``): no thread, no hand-offs.
        self.threaded = threaded
        self.ctx = ctx
        self.endpoints: list[str] = []
        #: Counters of what this thread handles (merged into the server's status).
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "bad_messages", "undeliverable", "error_replies_received", "control",
                "handshake_failed", "dropped_peers", "discarded", "incompatible_peers",
            ),
            0,
        )  # fmt: skip
        #: (arrival time, peer, message) for the engine's loop, oldest first.
        self.inbox: deque[tuple[float, bytes, Any]] = deque()
        #: Submits put in the inbox so far (written by this thread only).
        self._submits_in = 0
        #: Held requests whose Cancel is on its way to the engine's loop (this thread's).
        self._doomed: set[tuple[bytes, int]] = set()
        self._in_scheduled = False
        self._outbox: deque[list[Any]] = deque()
        self._out_scheduled = False
        self._engine_loop = asyncio.get_running_loop()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: SocketPump | None = None
        self._monitor: SocketPump | None = None
        #: The encoder each peer reads, from the versions its pings state
        #: (``fastio.versions``); peers not heard from get ``versions.VERSION_1``
        #: (version 1, ext 4: what every peer reads). Read by the engine's loop too.
        self.encoders: dict[bytes, Encoder] = {}
        self._enc = versions.VERSION_1
        #: Peers refused for their versions, with the reason they were sent (once).
        self._refused: dict[bytes, str] = {}
        cfg = server.config
        self._dec = Decoder(fm.CLIENT_TO_WORKER, max_message_size=cfg.max_message_size)
        self._thread: threading.Thread | None = None
        #: :meth:`post` for the thread that started this one (the engine's loop):
        #: served inline, the pump's own send (no check of the calling thread).
        self.post_here: Callable[[list[Any]], None] = self.post
        self._ident = -1
        self._error: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Start the thread, bind; returns the bound endpoints."""
        if not self.threaded:
            self._ident = threading.get_ident()
            self._loop = self._engine_loop
            await self._setup()
            assert self._pump is not None
            self.post_here = self._pump.send
            return self.endpoints
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="fastio-worker-io", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join(5)
            raise self._error
        return self.endpoints

    def _run(self, ready: threading.Event) -> None:
        self._ident = threading.get_ident()
        loop = self._loop = asyncio.new_event_loop()
        try:
            try:
                loop.run_until_complete(self._setup())
            except BaseException as exc:
                self._error = exc
                return
            finally:
                ready.set()
            loop.run_forever()
        finally:
            loop.close()

    async def _setup(self) -> None:
        cfg = self.server.config
        sock, self.endpoints = make_router(
            self.ctx, cfg.bind, hwm=cfg.hwm, max_message_size=cfg.max_message_size,
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
            mon = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
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
        self._drain_outbox()
        if self._monitor is not None:
            self._monitor.close()
        if self._pump is not None:
            self._pump.close()
        assert self._loop is not None
        if self.threaded:
            self._loop.stop()

    # -- load, as the pongs report it -----------------------------------------------------
    def engine_lag(self) -> float:
        """Seconds the oldest message not yet taken by the engine's loop has waited."""
        inbox = self.inbox
        if inbox:
            with contextlib.suppress(IndexError):  # taken meanwhile
                return max(0.0, time.monotonic() - inbox[0][0])
        return 0.0

    def queued_submits(self) -> int:
        """Submits in the inbox, not yet taken by the engine's loop.

        Only Submits are work: a batch of Cancels (a client that comes back after a
        partition cancels what it re-sent elsewhere) or controls waiting there are not,
        and counted as waiting work they would steer clients away from this worker.
        Submits in less the engine's count of those it took (``received``, counted as
        it takes each one): two counters, each written by one thread, so no lock."""
        return max(0, self._submits_in - self.server.counters["received"])

    def _doomed_held(self) -> int:
        """Held requests with a Cancel received and not yet carried out: about to go,
        so not load. (Those the engine has ended are forgotten here.)"""
        doomed = self._doomed
        if not doomed:
            return 0
        tasks = self.server._tasks
        self._doomed = doomed = {k for k in doomed if k in tasks}
        return len(doomed)

    # -- sending ------------------------------------------------------------------------
    def post(self, frames: list[Any]) -> None:
        """Send ``[peer, *body]``; from any thread (the engine's loop queues it here)."""
        if threading.get_ident() == self._ident:
            assert self._pump is not None
            self._pump.send(frames)
            return
        self._outbox.append(frames)
        if not self._out_scheduled:
            self._out_scheduled = True
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # closed: replies of a dying worker
                self._loop.call_soon_threadsafe(self._drain_outbox)

    def _drain_outbox(self) -> None:
        # Cleared before taking: a post after this schedules another drain.
        self._out_scheduled = False
        out = self._outbox
        if not out or self._pump is None:
            return
        msgs = []
        while out:
            msgs.append(out.popleft())
        self._pump.send_many(msgs)

    def _send(self, peer: bytes, msg: Any) -> None:
        # On this thread only (its own encoder).
        assert self._pump is not None
        frames = self.encoders.get(peer, self._enc).encode(msg)
        frames.insert(0, peer)
        self._pump.send(frames)

    def _to_engine(self, peer: bytes, msg: Any) -> None:
        if not self.threaded:
            self.server._dispatch(peer, msg)
            return
        self.inbox.append((time.monotonic(), peer, msg))
        if not self._in_scheduled:
            self._in_scheduled = True
            with contextlib.suppress(RuntimeError):  # the engine's loop is closed
                self._engine_loop.call_soon_threadsafe(self.server._drain_inbox)

    # -- receiving ----------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        self.server._peers[peer] = time.monotonic()
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
        if tp is fm.Submit and not self.threaded:  # inline: straight to the server
            self.server._on_submit(peer, msg)
        elif tp is fm.Heartbeat:
            self._pong(peer, msg)
        elif tp is fm.Control and msg.op == "health":
            # Liveness of the controller's view too: answered here, not by the engine.
            self.counters["control"] += 1
            self._send(peer, fm.ControlReply(seq=msg.seq, ok=True, status=self.server.status()))
        elif tp is fm.Error:
            self.counters["error_replies_received"] += 1
            log.warning(
                "client %r reports error %s on id %s: %s", peer, msg.code, msg.id, msg.message
            )
        elif tp is fm.Submit:
            self._submits_in += 1
            self._to_engine(peer, msg)
        elif tp is fm.Cancel:
            key = (peer, msg.id)
            if key in self.server._tasks:
                self._doomed.add(key)
                if len(self._doomed) > 4096:  # pruned at pongs; a peer may never ping
                    self._doomed_held()
            self._to_engine(peer, msg)
        else:  # other Control ops: the engine's
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
        s = self.server
        if peer in s._lost:
            self._report_lost(peer)
        # The engine's load, as what a new request would wait behind: Submits held or
        # queued for it, less those a Cancel already on its way will end (counted off
        # the waiting ones first).
        running = s._running
        held = len(s._tasks)
        doomed = self._doomed_held()
        if doomed:
            running = max(0, running - max(0, doomed - max(0, held - running)))
            held = max(0, held - doomed)
        queued = self.queued_submits()
        self._send(
            peer,
            fm.Heartbeat(
                sent_at=msg.sent_at,
                worker_id=s.worker_id,
                incarnation=s.incarnation,
                in_flight=held + queued,
                paused=s._paused,
                version=s.version,
                running=running,
                waiting=max(0, held - running) + queued + _engine_waiting(s),
                engine_lag=self.engine_lag(),
                **versions.STATED,
            ),
        )

    def _refuse(self, peer: bytes, why: str) -> None:
        """A peer whose pings state versions this worker cannot serve: one Error naming
        both sides' versions (at version 1, which every peer reads), and no pong, so it
        never takes this worker for one it can use."""
        if self._refused.get(peer) == why:
            return
        if len(self._refused) >= _MAX_ENCODERS:
            self._refused.clear()
        self._refused[peer] = why
        self.counters["incompatible_peers"] += 1
        text = f"worker {self.server.worker_id} cannot serve this client: {why}"
        log_counted(self.counters["incompatible_peers"], "client %r refused: %s", peer, text)
        self.encoders.pop(peer, None)
        metrics.WORKER_ERRORS.labels(code=fm.ErrorCode.UNSUPPORTED_VERSION.name).inc()
        assert self._pump is not None
        frames = versions.VERSION_1.encode(
            fm.Error(id=-1, code=int(fm.ErrorCode.UNSUPPORTED_VERSION), message=text)
        )
        self._pump.send([peer, *frames])

    def _report_lost(self, peer: bytes) -> None:
        assert self._pump is not None
        ids, replies = self.server._lost.pop(peer)
        # Undeliverable again (the peer left at once): noted again by _on_undeliverable.
        for id in ids:
            self._send_error(
                peer, id, fm.ErrorCode.LOST, "the worker gave up this submission; re-send it"
            )
        for reply in replies:
            self._pump.send([peer, *reply])

    def _send_error(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        metrics.WORKER_ERRORS.labels(code=code.name).inc()
        self._send(peer, fm.Error(id=id, code=int(code), message=text))

    def _bad(self, peer: bytes, id: int, code: fm.ErrorCode, text: str) -> None:
        self.counters["bad_messages"] += 1
        log_counted(self.counters["bad_messages"], "bad message from %r: %s", peer, text)
        if code == fm.ErrorCode.BAD_REQUEST:
            metrics.WORKER_REQUESTS.labels(outcome="rejected").inc()
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
        # The peer's connection is down: gone for good, or reset and about to reconnect
        # under the same routing id. Its running requests keep running (a reconnected
        # client gets their answers; one that stays silent is forgotten after
        # client_timeout); what is lost here is reported when it is heard from again.
        self.counters["undeliverable"] += 1
        peer = self.server._lost.note_undeliverable(frames)
        log_counted(
            self.counters["undeliverable"], "client %r unreachable: a reply is dropped", peer
        )

    def _on_drop(self, peer: Any) -> None:
        # The pump dropped a peer that stopped reading (its queue over the limit; the
        # pump logged it): its requests are cancelled by the engine's loop.
        self.counters["dropped_peers"] += 1
        self._to_engine(bytes(peer), DROPPED)

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        self.counters["handshake_failed"] += 1
        log_counted(
            self.counters["handshake_failed"],
            "refused a peer at the CURVE handshake (%s on %s)",
            zmq.Event(event["event"]).name,
            event["endpoint"],
        )

    def snapshot_counters(self) -> dict[str, int]:
        """This thread's counters (the pump's drop counts included)."""
        out = dict(self.counters)
        if self._pump is not None:
            out["discarded"] = self._pump.discarded
        return out


def _engine_waiting(server: Any) -> int:
    """Requests the engine holds and has not started (its ``queue_depth()``; 0 without one).
    A failing hook must not cost the pong."""
    load = server.engine_load
    if load is None:
        return 0
    try:
        return max(0, int(load()))
    except Exception:
        return 0
