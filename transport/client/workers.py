"""The client's table entries: one per worker and one per ``agenerate`` call (each
holds the other: a worker its calls in flight, a call the worker it is on), what a
caller may see of a worker, and the check of worker addresses."""

from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from fastio import Encoder, LLMRequest, versions
from fastio.tokens import TokenArray
from transport.client.config import ChunkCallback
from transport.client.future import GenerateFuture
from transport.errors import BadAddress
from transport.sockets import SocketPump

__all__ = ["MONITOR_EVENTS", "Call", "Worker", "WorkerInfo", "check_address"]

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
)
#: Socket monitor events the client watches on each DEALER (to say why a worker was
#: never heard from).
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)

_SCHEMES = ("tcp", "ipc", "inproc")
_ADDRESS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


def check_address(address: str) -> str:
    """Return ``address`` if a client can connect to it, else raise :class:`BadAddress`
    saying what is wrong: ``tcp://host:port`` (port 1-65535), ``ipc://path`` or
    ``inproc://name``."""
    if not isinstance(address, str):
        raise BadAddress(f"worker address must be a str, got {type(address).__name__}")
    m = _ADDRESS.fullmatch(address)
    if m is None:
        raise BadAddress(
            f"worker address {address!r} has no scheme: expected tcp://host:port, "
            "ipc://path or inproc://name"
        )
    scheme, rest = m.group(1), m.group(2)
    if scheme not in _SCHEMES:
        raise BadAddress(
            f"worker address {address!r}: transport {scheme!r} is not supported "
            f"(use one of {', '.join(_SCHEMES)})"
        )
    if not rest:
        raise BadAddress(f"worker address {address!r} names no endpoint after {scheme}://")
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        if not sep or not host:
            raise BadAddress(f"worker address {address!r} needs a port: tcp://host:port")
        if host == "*":
            raise BadAddress(f"worker address {address!r}: '*' binds, a client needs a host")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise BadAddress(
                f"worker address {address!r}: port {port!r} is not a number in 1-65535"
            )
    return address


@dataclass
class WorkerInfo:
    """What the client knows about one worker.

    ``running``, ``waiting`` and ``engine_lag`` are the worker's own figures from its
    last pong (requests in its handlers, requests waiting there, seconds its engine is
    behind its sockets), over all its clients. ``load_current``: those figures answer
    this client's latest or previous ping, and so count where it sends requests; an
    older report is not used (see :class:`transport.client.scheduling.Scheduler`).
    """

    address: str
    alive: bool
    draining: bool
    in_flight: int
    worker_id: str
    incarnation: str
    version: int
    paused: bool
    last_seen_s_ago: float
    running: int = 0
    waiting: int = 0
    engine_lag: float = 0.0
    #: What was seen at the address (answers, connection, handshake refusals).
    seen: str = ""
    load_current: bool = False


class Worker:
    """The client's entry for one worker: its DEALER, its requests, its liveness."""

    __slots__ = (
        "added_at",
        "address",
        "alive",
        "connect_retries",
        "connected",
        "cool_until",
        "died_at",
        "draining",
        "enc",
        "engine_lag",
        "handshake_failed",
        "handshake_ok",
        "incarnation",
        "incompatible",
        "inflight",
        "last_seen",
        "limit",
        "load_at",
        "load_current",
        "missed",
        "monitor",
        "others",
        "paused",
        "pump",
        "running",
        "sticky_queue",
        "unresolved",
        "version",
        "waiting",
        "worker_id",
    )  # fmt: skip

    def __init__(self, address: str) -> None:
        self.address = address
        #: When the client started using it (its first pongs are waited for from here).
        self.added_at = 0.0
        self.alive = False
        self.draining = False
        self.inflight: dict[int, Call] = {}
        self.sticky_queue: collections.deque[Call] = collections.deque()
        self.incarnation = ""
        self.worker_id = ""
        self.version = 0
        self.paused = False
        self.last_seen = 0.0
        #: Why the address's host name does not resolve ("" while it does, or unknown).
        self.unresolved = ""
        self.missed = 0
        self.pump: SocketPump | None = None
        self.monitor: zmq.Socket[Any] | None = None
        # In-flight bound, lowered to what the worker accepted when it answers
        # OVERLOADED (it serves other clients too), raised again by one per answer.
        self.limit = 0
        self.cool_until = 0.0
        self.died_at = 0.0
        # Busy figures of the last pong (received at ``load_at``); ``others``: its
        # requests not from this client, 0 once that pong is a heartbeat round old
        # (``load_current`` false).
        self.load_at = 0.0
        self.load_current = False
        self.running = 0
        self.waiting = 0
        self.engine_lag = 0.0
        self.others = 0
        # Socket monitor findings, for NoWorkerAvailable.
        self.connected = False
        self.connect_retries = 0
        self.handshake_ok = False
        self.handshake_failed: list[str] = []
        #: The encoder this worker reads (from the versions its pongs state; version 1
        #: until it answers), and why it cannot be used ("" when it can).
        self.enc: Encoder = versions.VERSION_1
        self.incompatible = ""

    def load(self) -> int:
        """Requests ahead of a new one there: ours in flight plus the others' it
        reported in a pong that is still current (0 once it is not)."""
        return len(self.inflight) + self.others

    def refused(self) -> bool:
        """Never answered, and the connection or its handshake was refused: not up."""
        return not self.last_seen and (
            bool(self.handshake_failed) or (self.connect_retries > 0 and not self.connected)
        )

    def warm(self) -> bool:
        """Not in a short back-off after an OVERLOADED answer."""
        return not self.cool_until or self.cool_until <= time.monotonic()

    def poll_monitor(self) -> None:
        """Read the socket monitor's events (non-blocking)."""
        mon = self.monitor
        if mon is None:
            return
        while True:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            assert isinstance(ev, dict)
            e = ev["event"]
            if e in _HANDSHAKE_FAILED:
                name = str(zmq.Event(e).name)
                what = f"{name} {ev['value']}" if e == zmq.EVENT_HANDSHAKE_FAILED_AUTH else name
                if len(self.handshake_failed) < 100:
                    self.handshake_failed.append(what)
            elif e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_ok = True
            elif e == zmq.EVENT_CONNECTED:
                self.connected = True
            elif e == zmq.EVENT_CONNECT_RETRIED:
                self.connect_retries += 1

    def close(self) -> None:
        if self.pump is not None:
            if self.monitor is not None:
                self.monitor.close(linger=0)
                self.monitor = None
            self.pump.close()

    def seen(self, now: float, curve: bool) -> str:
        """One line on what was seen at this address."""
        if self.incompatible:
            return f"incompatible: {self.incompatible}"
        if self.last_seen:
            state = "alive" if self.alive else "dead"
            return f"{state}, last answered {now - self.last_seen:.1f} s ago"
        if self.handshake_failed:
            n = len(self.handshake_failed)
            mech = "CURVE" if curve else "ZMTP (it may expect CURVE)"
            return (
                f"never answered: it refused the {mech} handshake "
                f"({self.handshake_failed[-1]}; {n}{'+' if n >= 100 else ''} times)"
            )
        if self.handshake_ok or self.connected:
            return "never answered: connected, but no pong came back"
        if self.unresolved:
            return f"never answered: {self.unresolved}"
        if self.connect_retries:
            return f"never answered: no connection ({self.connect_retries} attempts refused)"
        return "never answered: no connection"

    def info(self, now: float, curve: bool) -> WorkerInfo:
        return WorkerInfo(
            self.address, self.alive, self.draining, len(self.inflight), self.worker_id,
            self.incarnation, self.version, self.paused,
            now - self.last_seen if self.last_seen else float("inf"),
            self.running, self.waiting, self.engine_lag, self.seen(now, curve),
            self.load_current,
        )  # fmt: skip


_Chunk = tuple[TokenArray, TokenArray, TokenArray]


class Call:
    """One ``agenerate`` call, across re-sends and resumptions."""

    __slots__ = (
        "backoff",
        "chunks",
        "deadline",
        "delivered",
        "done",
        "fut",
        "interrupts",
        "on_chunk",
        "orig",
        "out_lp",
        "out_tok",
        "out_ver",
        "resends",
        "seg_streamed",
        "segment",
        "sub_id",
        "t0",
        "timeout",
        "timer",
        "times",
        "worker",
    )  # fmt: skip

    def __init__(
        self, req: LLMRequest, fut: GenerateFuture, on_chunk: ChunkCallback | None
    ) -> None:
        self.orig = req
        self.segment = req  # what the current attempt asks for
        self.fut = fut
        self.t0 = time.perf_counter()
        self.timer: asyncio.TimerHandle | None = None
        self.backoff: asyncio.TimerHandle | None = None  # a re-send waiting its turn
        self.deadline = float("inf")
        self.timeout = float("inf")
        self.worker: Worker | None = None
        self.sub_id = -1
        # Output of the finished segments (None until one ends with more to come).
        self.out_tok: TokenArray | None = None
        self.out_lp: TokenArray | None = None
        self.out_ver: TokenArray | None = None
        self.times: list[float] = []  # arrival time of every accumulated/streamed token
        self.chunks: list[_Chunk] = []  # streamed chunks of the current attempt
        self.seg_streamed = 0  # tokens streamed by the current attempt
        self.delivered = 0  # output positions handed to on_chunk
        self.resends = 0
        self.interrupts = 0
        self.done = False
        self.on_chunk = on_chunk

    @property
    def base(self) -> int:
        """Output position where the current attempt's tokens start."""
        return len(self.out_tok) if self.out_tok is not None else 0
