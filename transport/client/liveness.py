"""Busy or dead: heartbeats, deaths, re-sends, the wait for first answers, and failing
fast when no worker is there (docs/concepts.md: heartbeats, failover, a poison request)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from fastio import IncompatiblePeer, versions
from fastio import fabric_msgs as fm
from transport.client.calls import keep_streamed
from transport.client.config import ClientConfig
from transport.client.scheduling import Scheduler
from transport.client.workers import Call, Worker, log
from transport.errors import IncompatibleWorkers, NoWorkerAvailable, PoisonRequest, RemoteError

__all__ = ["Liveness", "resend_delay"]


def resend_delay(k: int, base: float, cap: float, rand: float | None = None) -> float:
    """Seconds before the ``k``-th re-send (k >= 1): ``min(cap, base * 2**(k-1))`` times
    a jitter factor in [0.5, 1] (``rand`` in [0, 1] picks it; random when None)."""
    r = random.random() if rand is None else rand
    return min(cap, base * 2.0 ** min(k - 1, 62)) * (0.5 + 0.5 * r)


class Liveness:
    """Which workers are alive, and what becomes of the calls of those that are not; it
    holds the scheduler's queue while none is alive and while first answers are due."""

    def __init__(self, config: ClientConfig, sched: Scheduler) -> None:
        self.config = config
        self.sched = sched
        self.n_alive = 0
        self.alive_at = 0.0  # last moment a worker was alive: connect_timeout runs from it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._last_tick = 0.0
        self._first_back = 0.0  # when the first came back after all had died
        self._warned_none = False  # said once per stretch without a live worker
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.alive_at = time.monotonic()
        self._later("heartbeat", 0, self._heartbeat)

    def close(self) -> None:
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()

    def _later(self, name: str, delay: float, fn: Callable[[], None]) -> None:
        assert self._loop is not None
        self._timers[name] = self._loop.call_later(delay, fn)

    def _cancel(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def watch(self, w: Worker) -> None:
        """Start pinging a new worker; while none is alive, calls wait for it too."""
        if not self.n_alive:
            self.alive_at = time.monotonic()  # a new worker gets its connect_timeout
            self.sched.hold()
        self._probe(w, 0.002)

    def _probe(self, w: Worker, delay: float) -> None:
        # Until it first answers: pings at growing intervals up to interval / 4.
        if w.alive or w.last_seen or self._closed or w.address not in self.sched.workers:
            return
        if self.sched.held:
            self.gate_check()  # a refused connection ends the wait for this one
        w.ping()
        assert self._loop is not None
        cap = self.config.heartbeat_interval / 4
        self._loop.call_later(delay, self._probe, w, min(delay * 2, cap))

    def _heartbeat(self) -> None:
        cfg = self.config
        now = time.monotonic()
        prev = self._last_tick
        expired = [c for c in self.sched.unfinished() if c.deadline <= now and c.timer is None]
        for call in expired:  # calls with no timer of their own
            self.sched.timed_out(call, call.timeout)
        for w in list(self.sched.order):
            w.pump.drain_now()  # our loop may lag the socket: read before judging
            if w.alive:  # counted in our ticks: a late tick of a busy loop is no death
                n = cfg.heartbeat_liveness
                if w.tick(prev, n, cfg.heartbeat_interval * n):
                    self.worker_died(w, f"no pong for {now - w.last_seen:.2f} s")
            else:
                w.poll_monitor()
            w.ping()
        if self.no_worker_expired():
            self._warn_none()
        self._last_tick = now
        self._later("heartbeat", cfg.heartbeat_interval, self._heartbeat)

    def on_pong(self, w: Worker, hb: fm.Heartbeat) -> None:
        """A pong: what ``w`` reads (or it is refused), how busy it is."""
        try:
            enc = versions.encoder_for(hb)
        except IncompatiblePeer as exc:
            name = f" ({hb.worker_id})" if hb.worker_id else ""
            self.refused_by(w, f"worker {w.address}{name}: {exc}")
            return
        if w.incompatible:
            log.info("worker %s now speaks a version this client reads", w.address)
        was = w.pong.incarnation
        if was and hb.incarnation != was and (w.inflight or w.sticky_queue):
            self.worker_died(w, "restarted")  # faster than the liveness timeout
        if not w.record_pong(hb, enc):
            return
        self.n_alive += 1
        self._warned_none = False
        self.sched.counters.add("workers_joined")
        log.info("worker %s (%s) joined", w.address, hb.worker_id)
        if not self.sched.held:
            self.sched.dispatch()
            return
        if not self._first_back:
            self._first_back = w.last_seen
            for o in self.sched.order:  # those that died with it may be back: ask now
                if not o.alive and o.last_seen and not o.draining:
                    o.ping()
        self.gate_check()

    def gate_check(self) -> None:
        """Release the held calls once no worker that may be up is still awaited."""
        if not self.sched.held or not self.n_alive or self._closed:
            return  # nothing to send to yet: checked again when one answers
        cfg = self.config
        grace = min(cfg.heartbeat_interval, cfg.connect_timeout)
        # Deaths of one outage are found within about a detection time of each other.
        outage = self.alive_at - 2 * cfg.heartbeat_interval * (cfg.heartbeat_liveness + 1)
        until = 0.0
        for w in self.sched.order:
            if w.alive or w.draining:
                continue
            if w.last_seen:  # died
                if w.died_at >= outage:
                    until = max(until, self._first_back + grace)
                continue
            w.poll_monitor()
            if not w.refused():
                until = max(until, w.added_at + grace)
        now = time.monotonic()
        if until > now:
            if "gate" not in self._timers:
                self._later("gate", until - now, self._gate_timeout)
            return
        self._first_back = 0.0
        self._cancel("gate")
        self.sched.release()

    def _gate_timeout(self) -> None:
        del self._timers["gate"]
        self.gate_check()

    def worker_died(self, w: Worker, why: str, crashed: bool = True) -> None:
        """``w`` is dead (or unusable): re-send its calls elsewhere; ``crashed`` counts
        against the calls it was running (``max_worker_deaths``)."""
        self.sched.counters.add("workers_died")
        if w.mark_dead():
            self.n_alive -= 1
            if not self.n_alive:
                self.alive_at = w.died_at
                self.sched.hold()  # the first back must not take the whole backlog
        running, waiting = w.take_calls()
        calls = running + waiting
        log.warning("worker %s is dead (%s): re-sending %d requests", w.address, why, len(calls))
        n_running = len(running) if crashed else 0
        for i, call in enumerate(calls):
            call.worker = None
            if not call.done:
                # Those waiting for it in this client were never there: no death of theirs.
                self.lose_attempt(call, w, "its worker died", died=i < n_running)
        self.sched.maybe_drop(w)
        self.sched.dispatch()
        self.watch_for_none()

    def lose_attempt(
        self, call: Call, w: Worker, why: str, code: int = 0, died: bool = False
    ) -> None:
        """The current attempt of ``call`` is lost (``died``: ``w`` died running it): keep
        what it streamed, re-send the rest after a back-off, or fail it past the limits."""
        call.resends += 1
        if died:
            call.died_on += (w.address,)
        out = keep_streamed(call)
        if out is not None:  # the streamed tokens were the whole answer
            self.sched.complete(call, out)
            return
        cfg = self.config
        if len(call.died_on) > cfg.max_worker_deaths:
            self._poisoned(call)
            return
        if call.resends > cfg.max_resends:
            why = f"request {call.orig.rid}: attempt {call.resends} lost ({why}); giving up"
            self.sched.fail(call, RemoteError(why, code=code, worker=w.address))
            return
        self.sched.counters.add("resent")
        assert self._loop is not None
        delay = resend_delay(call.resends, cfg.resend_backoff, cfg.resend_backoff_max)
        self.sched.back_off(call, self._loop.call_later(delay, self._resend_now, call))

    def _poisoned(self, call: Call) -> None:
        """``call`` was running on more than ``max_worker_deaths`` workers that died."""
        rid, dead = call.orig.rid, call.died_on
        m = self.config.max_worker_deaths
        msg = (
            f"request {rid}: {len(dead)} workers died while running it ({', '.join(dead)}); "
            "it may be what kills them (a poison request), so it is not sent to another. "
            f"ClientConfig.max_worker_deaths={m} allows {m} re-sends after such a death: "
            "raise it to allow more"
        )
        log.error("%s", msg)
        self.sched.fail(call, PoisonRequest(msg, rid=rid, workers=dead), also="poisoned")

    def _resend_now(self, call: Call) -> None:
        self.sched.back_off(call, None)
        if not call.done and not self._closed:
            self.sched.enqueue(call, front=True)
            self.watch_for_none()

    def no_worker_expired(self) -> bool:
        return not self.n_alive and time.monotonic() - self.alive_at >= self.config.connect_timeout

    def watch_for_none(self) -> None:
        """With calls waiting and no live worker, end the wait at ``connect_timeout``."""
        if self.n_alive or "none" in self._timers or self._closed:
            return
        if self.sched.queue or self.sched.backing_off:
            left = self.alive_at + self.config.connect_timeout - time.monotonic()
            self._later("none", max(left, 0.0), self._check_none)

    def _check_none(self) -> None:
        self._timers.pop("none", None)
        if self.no_worker_expired() and not self._closed:
            self._fail_waiting(self._warn_none())
        else:
            self.watch_for_none()

    def _warn_none(self) -> NoWorkerAvailable:
        """The no-worker error, logged once per stretch without a live worker."""
        err = self.no_worker_error()
        if not self._warned_none:
            self._warned_none = True
            log.warning("%s", err)
        return err

    def refused_by(self, w: Worker, why: str) -> None:
        """``w`` speaks no version this client reads: send it nothing; fail what waits
        if no worker is left."""
        if w.mark_incompatible(why):
            log.error("%s", why)
        if w.alive or w.inflight or w.sticky_queue:
            self.worker_died(w, "it speaks an incompatible protocol version", crashed=False)
        if not self.n_alive and self.all_incompatible():
            self._fail_waiting(self.no_worker_error(incompatible=True))

    def _fail_waiting(self, err: NoWorkerAvailable) -> None:
        for call in self.sched.take_waiting():
            self.sched.fail(call, type(err)(str(err), err.seen), also="no_worker")

    def all_incompatible(self) -> bool:
        return bool(self.sched.order) and all(w.incompatible for w in self.sched.order)

    def no_worker_error(self, incompatible: bool = False) -> NoWorkerAvailable:
        """What calls fail with: no worker alive for ``connect_timeout`` (or, with
        ``incompatible``, none this client can use), and what was seen where."""
        now, curve = time.monotonic(), self.config.curve is not None and not incompatible
        seen = {w.address: w.seen(now, curve) for w in self.sched.order}
        where = "; ".join(f"{a}: {s}" for a, s in seen.items()) or "no worker configured"
        if incompatible:
            return IncompatibleWorkers(f"no generation worker this client can use ({where})", seen)
        t = self.config.connect_timeout
        return NoWorkerAvailable(f"no generation worker alive for {t:g} s ({where})", seen)
