"""Busy or dead: heartbeats, deaths, re-sends with back-off, and failing fast when no
worker is there.

Only silence kills: a worker is dead after ``heartbeat_liveness`` of this client's
heartbeat ticks without any message from it (and at least ``interval * liveness``
seconds). A worker that answers pings is alive however long its engine takes; its
pongs carry how busy it is (``running``, ``waiting``, ``engine_lag``), which the
scheduler uses, and nothing is ever re-sent because a worker is slow. A lost attempt
(death, or the worker's own LOST report) is re-sent after an exponential back-off with
jitter, so a worker that keeps dying and rejoining cannot make the client re-send in a
storm.
"""

from __future__ import annotations

import logging
import random
import time

from fastio import fabric_msgs as fm
from transport import metrics
from transport.client.calls import Call, keep_streamed
from transport.client.scheduling import Scheduler
from transport.client.workers import Worker
from transport.errors import NoWorkerAvailable, RemoteError

__all__ = ["Liveness", "resend_delay"]

log = logging.getLogger("transport.client")


def resend_delay(k: int, base: float, cap: float, rand: float | None = None) -> float:
    """Seconds before the ``k``-th re-send (k >= 1) of a request:
    ``min(cap, base * 2**(k-1))`` times a jitter factor in [0.5, 1] (``rand`` in [0, 1]
    picks it; random when None)."""
    r = random.random() if rand is None else rand
    return min(cap, base * 2.0 ** min(k - 1, 62)) * (0.5 + 0.5 * r)


class Liveness(Scheduler):
    """Liveness part of :class:`transport.client.FabricClient`."""

    def _probe(self, w: Worker, delay: float) -> None:
        # Until a worker first answers, ping it at growing intervals from a few ms up to
        # a quarter heartbeat interval, so a new client starts sending without waiting a
        # whole interval. (Pings sent before the connection is up are dropped: the
        # DEALER has ZMQ_IMMEDIATE; a busy loop can also make the early ones late.)
        if w.alive or w.last_seen or self._closed or w.address not in self._workers:
            return
        if self._gating:
            self._gate_check()  # a refused connection ends the wait for this one
        self._ping(w)
        assert self._loop is not None
        cap = self.config.heartbeat_interval / 4
        self._loop.call_later(delay, self._probe, w, min(delay * 2, cap))

    def _heartbeat(self) -> None:
        assert self._loop is not None
        cfg = self.config
        now = time.monotonic()
        dead_after = cfg.heartbeat_interval * cfg.heartbeat_liveness
        prev = self._last_tick
        self._sweep_deadlines(now)
        for w in list(self._order):
            if w.pump is not None:
                # Our own loop may lag behind the socket: read what has arrived before
                # judging a worker silent.
                w.pump.drain_now()
            if w.alive:
                # Paranoid Pirate: count silent intervals as *our* ticks, so a busy
                # client loop (late ticks) does not mistake its own lag for a death.
                w.missed = w.missed + 1 if w.last_seen < prev else 0
                if w.load_at < prev and w.load_current:
                    # No pong since the last tick: its load figures are a heartbeat
                    # round old. Go by our own requests there until the next pong.
                    w.load_current = False
                    w.others = 0
                if w.missed >= cfg.heartbeat_liveness and now - w.last_seen > dead_after:
                    self._worker_died(w, f"no pong for {now - w.last_seen:.2f} s")
            else:
                w.poll_monitor()
            self._ping(w)
        if not self._n_alive and not self._warned_none and self._no_worker_expired():
            self._warned_none = True  # said once per stretch without a live worker
            log.warning("%s", self._no_worker_error())
        self._last_tick = now
        self._hb_timer = self._loop.call_later(cfg.heartbeat_interval, self._heartbeat)

    def _sweep_deadlines(self, now: float) -> None:
        expired = [c for c in self._queue if c.deadline <= now and c.timer is None]
        expired += [c for c in self._backing_off if c.deadline <= now and c.timer is None]
        for w in self._order:
            for group in (w.inflight.values(), w.sticky_queue):
                expired += [c for c in group if c.deadline <= now and c.timer is None]
        for call in expired:
            self._on_timeout(call, call.timeout)

    def _on_heartbeat(self, w: Worker, hb: fm.Heartbeat) -> None:
        if w.incarnation and hb.incarnation != w.incarnation and (w.inflight or w.sticky_queue):
            # Restarted faster than the liveness timeout: what it had is lost.
            self._worker_died(w, "restarted")
        w.worker_id = hb.worker_id
        w.incarnation = hb.incarnation
        w.version = hb.version
        w.paused = hb.paused
        w.running = hb.running
        w.waiting = hb.waiting
        w.engine_lag = hb.engine_lag
        w.others = max(0, max(hb.in_flight, hb.running + hb.waiting) - len(w.inflight))
        w.load_at = w.last_seen  # set as this message arrived
        w.load_current = True
        w.missed = 0
        if not w.alive:
            w.alive = True
            self._n_alive += 1
            self._warned_none = False
            self.stats["workers_joined"] += 1
            log.info("worker %s (%s) joined", w.address, hb.worker_id)
            if self._gating:
                if not self._first_back:
                    self._first_back = w.last_seen
                    # Those that died with it may be back too: ask now, not next tick.
                    for o in self._order:
                        if not o.alive and o.last_seen and not o.draining:
                            self._ping(o)
                self._gate_check()
            else:
                self._dispatch()

    # -- the first answers --------------------------------------------------------------
    def _gate_check(self) -> None:
        """End the wait for first answers once no worker that may be up is still
        unheard from within its grace, and send what waited. The grace is
        ``min(heartbeat_interval, connect_timeout)``: from when a worker was added
        (never heard from), or from when the first came back (all had died).

        A worker that is up answers the first pings within milliseconds; one whose
        connection (or handshake) was refused is not up and is not waited for; one
        that stays silent costs the waiting calls that grace, once. Of the dead, only
        those that fell silent with the last one (the same outage) are waited for."""
        if not self._gating or not self._n_alive:
            return  # nothing to send to yet: checked again when one answers
        cfg = self.config
        grace = min(cfg.heartbeat_interval, cfg.connect_timeout)
        # Deaths of one outage are found within about a detection time of each other.
        outage = self._alive_at - 2 * cfg.heartbeat_interval * (cfg.heartbeat_liveness + 1)
        now = time.monotonic()
        until = 0.0
        for w in self._order:
            if w.alive or w.draining:
                continue
            if w.last_seen:  # died
                if w.died_at >= outage:
                    until = max(until, self._first_back + grace)
                continue
            w.poll_monitor()
            if not w.refused():
                until = max(until, w.added_at + grace)
        if until > now:
            if self._gate_timer is None:
                assert self._loop is not None
                self._gate_timer = self._loop.call_later(until - now, self._gate_timeout)
            return
        self._gating = False
        self._first_back = 0.0
        if self._gate_timer is not None:
            self._gate_timer.cancel()
            self._gate_timer = None
        self._dispatch()

    def _gate_timeout(self) -> None:
        self._gate_timer = None
        if not self._closed:
            self._gate_check()

    # -- losing an attempt --------------------------------------------------------------
    def _worker_died(self, w: Worker, why: str) -> None:
        self.stats["workers_died"] += 1
        metrics.CLIENT_WORKER_DEATHS.inc()
        if w.alive:
            w.alive = False
            w.died_at = time.monotonic()
            self._n_alive -= 1
            if not self._n_alive:
                self._alive_at = time.monotonic()
                self._gating = True  # the first back must not take the whole backlog
        calls = list(w.inflight.values()) + list(w.sticky_queue)
        if w.pump is not None:
            w.pump.discard_queued()
        for sub_id in w.inflight:
            # In case it is only stalled, not dead: stop it working for nobody.
            self._try_send(w, fm.Cancel(id=sub_id))
        w.inflight.clear()
        w.sticky_queue.clear()
        log.warning("worker %s is dead (%s): re-sending %d requests", w.address, why, len(calls))
        for call in calls:
            call.worker = None
            if not call.done:
                self._lose_attempt(call, w, "its worker died")
        self._maybe_drop(w)
        self._dispatch()
        self._watch_for_none()

    def _lose_attempt(self, call: Call, w: Worker, why: str, code: int = 0) -> None:
        """The current attempt of ``call`` is lost: keep what it streamed, and re-send
        the rest after a back-off, or fail the call past ``max_resends``."""
        call.resends += 1
        out = keep_streamed(call)
        if out is not None:  # the streamed tokens were the whole answer
            self._complete(call, out)
            return
        if call.resends > self.config.max_resends:
            self._finish_error(
                call,
                RemoteError(
                    f"request {call.orig.rid}: attempt {call.resends} lost ({why}); giving up",
                    code=code,
                    worker=w.address,
                ),
            )
            return
        self.stats["resent"] += 1
        metrics.CLIENT_RESENDS.inc()
        cfg = self.config
        assert self._loop is not None
        delay = resend_delay(call.resends, cfg.resend_backoff, cfg.resend_backoff_max)
        self._backing_off.add(call)
        call.backoff = self._loop.call_later(delay, self._resend_now, call)

    def _resend_now(self, call: Call) -> None:
        call.backoff = None
        self._backing_off.discard(call)
        if not call.done and not self._closed:
            self._enqueue(call, front=True)
            self._watch_for_none()

    # -- no worker at all ---------------------------------------------------------------
    def _no_worker_error(self) -> NoWorkerAvailable:
        now = time.monotonic()
        curve = self.config.curve is not None
        seen = {}
        for w in self._order:
            w.poll_monitor()
            seen[w.address] = w.seen(now, curve)
        t = self.config.connect_timeout
        where = "; ".join(f"{a}: {s}" for a, s in seen.items()) or "no worker configured"
        return NoWorkerAvailable(f"no generation worker alive for {t:g} s ({where})", seen)

    def _no_worker_expired(self) -> bool:
        return (
            not self._n_alive and time.monotonic() - self._alive_at >= self.config.connect_timeout
        )

    def _watch_for_none(self) -> None:
        """With calls waiting and no live worker, make sure a timer ends the wait at
        ``connect_timeout``."""
        if self._n_alive or self._nw_timer is not None or self._closed:
            return
        if not self._queue and not self._backing_off:
            return
        assert self._loop is not None
        left = self._alive_at + self.config.connect_timeout - time.monotonic()
        self._nw_timer = self._loop.call_later(max(left, 0.0), self._check_none)

    def _check_none(self) -> None:
        self._nw_timer = None
        if self._closed or self._n_alive:
            return
        if not self._no_worker_expired():
            self._watch_for_none()
            return
        err = self._no_worker_error()
        if not self._warned_none:
            self._warned_none = True  # said once per stretch without a live worker
            log.warning("%s", err)
        calls = list(self._queue) + list(self._backing_off)
        self._queue.clear()
        for call in calls:
            if not call.done:
                self.stats["no_worker"] += 1
                self._finish_error(call, NoWorkerAvailable(str(err), err.seen))
