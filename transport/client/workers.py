"""The client's settings (:class:`ClientConfig`) and a :class:`Worker` per address."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from fastio import Encoder, versions
from fastio import fabric_msgs as fm
from transport.addresses import check_address
from transport.client.calls import Call
from transport.errors import BadAddress
from transport.options import NonNegative, NonNegativeSeconds, Port, Positive, Seconds
from transport.sockets import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE_SIZE,
    FRAME_CAP,
    CurveConfig,
    SocketPump,
    make_dealer,
    make_monitor,
)

__all__ = ["ClientConfig", "Worker", "WorkerInfo", "check_address"]


class ClientConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.FabricClient`, checked when the client is made
    (docs/concepts.md, "A request's life", says what each one does).

    Parameters
    ----------
    heartbeat_interval:
        Seconds between pings (and the longest the first calls wait for every worker).
    heartbeat_liveness:
        Silent heartbeat intervals after which a worker is dead (a slow answer never is).
    connect_timeout:
        Seconds without a live worker before calls fail with ``NoWorkerAvailable``.
    request_timeout:
        Default per-request timeout in seconds.
    max_in_flight_per_worker:
        Requests on one worker at once (keep it below the worker's ``max_pending``).
    max_resends, max_worker_deaths:
        Times a request may be re-sent after its worker died or lost it, and of those,
        after a worker died running it (the next such death fails it with
        :class:`~transport.errors.PoisonRequest`).
    resend_backoff, resend_backoff_max:
        The ``k``-th re-send waits ``min(resend_backoff * 2**(k-1), resend_backoff_max)``
        s times a random factor in [0.5, 1].
    stream:
        Ask workers to stream tokens (real ``ttft``/``itl``, ``on_chunk`` as they come).
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    sticky_cache_size:
        rid -> worker assignments kept (when full, the older half goes).
    metrics_port:
        Serve Prometheus metrics (and the latency histogram) on ``127.0.0.1`` at this
        port (0: any; ``None``: no endpoint).
    """

    heartbeat_interval: Seconds = 1.0
    heartbeat_liveness: Positive = 3
    connect_timeout: Seconds = 10.0
    request_timeout: Seconds = 3600.0
    max_in_flight_per_worker: Positive = 1024
    max_resends: NonNegative = 8
    max_worker_deaths: NonNegative = 2
    resend_backoff: NonNegativeSeconds = 0.05
    resend_backoff_max: NonNegativeSeconds = 5.0
    stream: bool = True
    max_message_size: Positive = DEFAULT_MAX_MESSAGE_SIZE
    hwm: NonNegative = DEFAULT_HWM
    curve: CurveConfig | None = None
    sticky_cache_size: NonNegative = 100_000
    metrics_port: Port | None = None


log = logging.getLogger("transport.client")

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
)
# Watched, to say why a worker was never heard from.
_MONITOR_EVENTS = sum(_HANDSHAKE_FAILED) | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
_MONITOR_EVENTS |= zmq.EVENT_HANDSHAKE_SUCCEEDED


@dataclass
class WorkerInfo:
    """What the client knows about one worker: ``running``, ``waiting`` and
    ``engine_lag`` from its last pong (``load_current``: recent enough to count in
    scheduling); ``seen``: what was seen at the address."""

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
    seen: str = ""
    load_current: bool = False


class Worker:
    """One worker as the client sees it; ``on_message(worker, frames)`` gets what arrives."""

    def __init__(
        self,
        address: str,
        zctx: zmq.Context[Any],
        config: ClientConfig,
        identity: bytes,
        on_message: Callable[[Worker, list[zmq.Frame]], None],
    ) -> None:
        self.address = address
        self.curve = config.curve is not None
        try:
            # libzmq's cap at least the default's: a reply over max_message_size fails its
            # call (the decoder's MessageTooLarge), not the connection of a healthy worker.
            cap = max(config.max_message_size, DEFAULT_MAX_MESSAGE_SIZE // FRAME_CAP)
            sock = make_dealer(
                zctx, address, hwm=config.hwm, max_message_size=cap, curve=config.curve,
                routing_id=identity,
            )  # fmt: skip
        except zmq.ZMQError as exc:
            raise BadAddress(f"cannot connect to worker address {address!r}: {exc}") from exc
        self.monitor: zmq.Socket[Any] | None = make_monitor(sock, _MONITOR_EVENTS)
        self._on_message = on_message
        self.pump = SocketPump(sock, self._received, batch_frames=True, defer_check=True)
        self.added_at = time.monotonic()  # its first pongs are waited for from here
        self.alive = self.draining = False
        self.inflight: dict[int, Call] = {}
        self.sticky_queue: collections.deque[Call] = collections.deque()
        self.pong = fm.Heartbeat()  # the last one, received at pong_at
        self.pong_at = self.last_seen = self.died_at = 0.0
        self.missed = 0  # heartbeat ticks without a message from it
        self.limit = self._max_limit = config.max_in_flight_per_worker
        self.cool_until = 0.0
        self.others = 0  # its requests from other clients, by a current pong
        self.load_current = self.connected = False
        self.connect_retries = 0
        self.handshake_failed: list[str] = []
        self.unresolved = ""  # why its host name does not resolve
        self.enc: Encoder = versions.VERSION_1
        self.incompatible = ""  # why it cannot be used (its versions)

    def _received(self, frames: list[zmq.Frame]) -> None:
        self.last_seen = time.monotonic()
        self._on_message(self, frames)

    def tick(self, prev: float, ticks: int, seconds: float) -> bool:
        """A heartbeat tick (the last at ``prev``); True if silent ``ticks`` ticks and ``seconds``."""
        self.pump.drain_now()  # our loop may lag the socket: read before judging
        if not self.alive:
            self.poll_monitor()
            return False
        self.missed = self.missed + 1 if self.last_seen < prev else 0
        if self.load_current and self.pong_at < prev:
            self.load_current = False  # go by this client's own count
            self.others = 0
        return self.missed >= ticks and time.monotonic() - self.last_seen > seconds

    def record_pong(self, hb: fm.Heartbeat, enc: Encoder) -> bool:
        """A pong, from a worker that reads ``enc``; True if it was not alive before."""
        self.enc, self.incompatible, self.pong = enc, "", hb
        self.pong_at = self.last_seen  # set as this message arrived
        self.others = max(0, max(hb.in_flight, hb.running + hb.waiting) - len(self.inflight))
        self.load_current = True
        self.missed = 0
        was_alive, self.alive = self.alive, True
        return not was_alive

    def mark_dead(self) -> bool:
        """It is dead (or unusable); True if it was alive until now."""
        was_alive, self.alive = self.alive, False
        if was_alive:
            self.died_at = time.monotonic()
        return was_alive

    def mark_incompatible(self, why: str) -> bool:
        """It speaks no version this client reads (``why``); True if that is news."""
        was, self.incompatible = self.incompatible, why
        return was != why

    def take_calls(self) -> tuple[list[Call], list[Call]]:
        """Take its calls, running (cancelled there: it may only be stalled) and waiting."""
        running, waiting = list(self.inflight.values()), list(self.sticky_queue)
        self.pump.discard_queued()
        for sub_id in self.inflight:
            self.send_quiet(fm.Cancel(id=sub_id))
        self.inflight.clear()
        self.sticky_queue.clear()
        return running, waiting

    def drain(self, draining: bool = True) -> list[Call]:
        """Send it nothing more (False: again); returns the calls waiting for it."""
        self.draining = draining
        calls = list(self.sticky_queue) if draining else []
        self.sticky_queue.clear()
        return calls

    def begin(self, sub_id: int, call: Call, frames: list[Any]) -> None:
        """``call`` runs here as ``sub_id``: send its ``frames`` (its encoded Submit)."""
        self.inflight[sub_id] = call
        self.pump.send(frames)

    def end(self, sub_id: int) -> Call | None:
        """The call running here as ``sub_id`` ended (None: none does, it is stale)."""
        return self.inflight.pop(sub_id, None)

    def answered(self, sub_id: int) -> Call | None:
        """A result for ``sub_id``: :meth:`end`, and one more may go here (up to the limit)."""
        call = self.inflight.pop(sub_id, None)
        if call is not None:
            self.limit = min(self.limit + 1, self._max_limit)
        return call

    def cancel(self, sub_id: int) -> bool:
        """:meth:`end` ``sub_id`` and cancel it on the worker; False if it was not running."""
        if self.inflight.pop(sub_id, None) is None:
            return False
        self.send(fm.Cancel(id=sub_id))
        return True

    def queue_sticky(self, call: Call) -> None:  # it waits for a slot here, its rid's worker
        self.sticky_queue.append(call)

    def next_sticky(self) -> Call | None:
        """The next call waiting here while this worker can take it (None: none or no room)."""
        sq = self.sticky_queue
        while sq and len(self.inflight) < self.limit and self.alive and not self.draining:
            call = sq.popleft()
            if not call.done:
                return call
        return None

    def overloaded(self) -> bool:
        """It answered OVERLOADED: take no more than ours there; True if none (it cools 10 ms)."""
        self.limit = max(1, len(self.inflight))
        if not self.inflight:
            self.cool_until = time.monotonic() + 0.01
        return not self.inflight

    def resolved(self, lookup: asyncio.Future[str]) -> None:
        """The lookup of its host name ended (``resolve_problem``'s answer)."""
        if not lookup.cancelled() and lookup.exception() is None:
            self.unresolved = lookup.result()
            if self.unresolved:
                log.warning("worker %s: %s; retrying until it does", self.address, self.unresolved)

    def refused(self) -> bool:
        """Never answered, and the connection or its handshake was refused: not up."""
        refused = bool(self.handshake_failed) or (self.connect_retries > 0 and not self.connected)
        return not self.last_seen and refused

    def warm(self) -> bool:
        """Not in a short back-off after an OVERLOADED answer."""
        return not self.cool_until or self.cool_until <= time.monotonic()

    def send(self, msg: Any) -> None:
        """Send ``msg`` in the version this worker reads (queued at the HWM)."""
        self.pump.send(self.enc.encode(msg))

    def send_quiet(self, msg: Any) -> None:
        """Send ``msg`` in version 1 (every worker reads it) or drop it: never queued."""
        with contextlib.suppress(zmq.ZMQError):
            frames = versions.VERSION_1.encode(msg)
            self.pump.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self.pump.poke()  # a send can consume the edge of ZeroMQ's FD

    def ping(self) -> None:
        self.send_quiet(fm.Heartbeat(sent_at=time.time(), **versions.STATED))

    def poll_monitor(self) -> None:  # non-blocking
        while self.monitor is not None:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            e = ev["event"]
            if e in _HANDSHAKE_FAILED:
                name = str(zmq.Event(e).name)
                what = f"{name} {ev['value']}" if e == zmq.EVENT_HANDSHAKE_FAILED_AUTH else name
                if len(self.handshake_failed) < 100:
                    self.handshake_failed.append(what)
            elif e in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self.connected = True
            elif e == zmq.EVENT_CONNECT_RETRIED:
                self.connect_retries += 1

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
        self.pump.close()

    def seen(self, now: float) -> str:
        """One line on what was seen at this address."""
        if self.incompatible:
            return f"incompatible: {self.incompatible}"
        if self.last_seen:
            state = "alive" if self.alive else "dead"
            return f"{state}, last answered {now - self.last_seen:.1f} s ago"
        self.poll_monitor()
        if self.handshake_failed:
            n = len(self.handshake_failed)
            mech = "CURVE" if self.curve else "ZMTP (it may expect CURVE)"
            return (
                f"never answered: it refused the {mech} handshake "
                f"({self.handshake_failed[-1]}; {n}{'+' if n >= 100 else ''} times)"
            )
        if self.connected:
            return "never answered: connected, but no pong came back"
        if self.unresolved:
            return f"never answered: {self.unresolved}"
        if self.connect_retries:
            return f"never answered: no connection ({self.connect_retries} attempts refused)"
        return "never answered: no connection"

    def info(self, now: float) -> WorkerInfo:
        p = self.pong
        return WorkerInfo(
            self.address, self.alive, self.draining, len(self.inflight), p.worker_id,
            p.incarnation, p.version, p.paused,
            now - self.last_seen if self.last_seen else float("inf"),
            p.running, p.waiting, p.engine_lag, self.seen(now), self.load_current,
        )  # fmt: skip
