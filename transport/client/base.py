"""State every part of the client shares, and the ways a call ends."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
import uuid
from typing import Any

import zmq

from fastio import Decoder, LLMResponse, versions
from fastio import fabric_msgs as fm
from transport import metrics
from transport.client.calls import Call
from transport.client.config import ClientConfig
from transport.client.workers import Worker

__all__ = ["ClientBase"]

_STATS = (
    "submitted", "completed", "failed", "resent", "interrupted", "timeouts", "cancelled",
    "stale", "bad_messages", "overloaded", "workers_died", "workers_joined", "no_worker",
)  # fmt: skip


class ClientBase:
    """The client's tables; see :class:`transport.client.FabricClient`."""

    def __init__(self, config: ClientConfig | None) -> None:
        self.config = config or ClientConfig()
        self._workers: dict[str, Worker] = {}
        self._order: list[Worker] = []
        self._queue: collections.deque[Call] = collections.deque()
        self._backing_off: set[Call] = set()  # lost attempts waiting to be re-sent
        self._sticky: dict[str, str] = {}
        self._ids = itertools.count(1)
        # One routing id per client, on every DEALER: a worker knows this client by it
        # across reconnects, so answers survive a reset connection, and what the worker
        # gave up on while we were away is reported back (Error LOST) to the right peer.
        self._identity = b"fc-" + uuid.uuid4().hex.encode()
        self._rr = 0
        # Pings, and Cancels to a worker presumed dead: version 1, which every worker
        # reads (a worker's own encoder, Worker.enc, is chosen from its pongs).
        self._enc = versions.VERSION_1
        self._dec = Decoder(fm.WORKER_TO_CLIENT, max_message_size=self.config.max_message_size)
        self._ctx: zmq.Context[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hb_timer: asyncio.TimerHandle | None = None
        self._nw_timer: asyncio.TimerHandle | None = None
        self._last_tick = 0.0
        # Last moment some worker was alive (or one was added): the connect_timeout
        # window runs from here.
        self._alive_at = 0.0
        self._n_alive = 0
        # While no worker is alive (none has answered yet, or all died), calls wait
        # in the queue, and when one answers, for every other worker that may be up
        # (see Liveness._gate_check): the first to answer must not take them all.
        self._gating = False
        # When the first worker came back while gating after all had died.
        self._first_back = 0.0
        self._gate_timer: asyncio.TimerHandle | None = None
        self._warned_none = False
        self._closed = False
        # A histogram observation costs a few microseconds per request (a sizeable part
        # of the client's own cost per request): only where this client serves metrics.
        self._observe_latency = self.config.metrics_port is not None
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)

    # -- how a call ends ----------------------------------------------------------------
    def _complete(self, call: Call, out: LLMResponse) -> None:
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        self.stats["completed"] += 1
        if self._observe_latency:
            metrics.CLIENT_LATENCY.observe(out.latency)
        fut = call.fut
        fut._call = None
        if not fut.done():
            fut.set_result(out)

    def _finish_error(self, call: Call, exc: BaseException) -> None:
        if call.done:
            return
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        if call.backoff is not None:
            call.backoff.cancel()
            self._backing_off.discard(call)
        self.stats["failed"] += 1
        fut = call.fut
        fut._call = None
        if not fut.done():
            fut.set_exception(exc)

    # -- messages whose loss is harmless -----------------------------------------------
    def _ping(self, w: Worker) -> None:
        self._try_send(w, fm.Heartbeat(sent_at=time.time(), **versions.STATED))

    def _try_send(self, w: Worker, msg: Any) -> None:
        # Pings, and cancels to a worker presumed dead: never queued, so nothing piles
        # up for a worker that is down.
        if w.pump is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            w.pump.sock.send_multipart(self._enc.encode(msg), zmq.NOBLOCK, copy=False)
        # A send can consume the edge of ZeroMQ's FD: look for input at once.
        w.pump.poke()
