"""Where each call goes and how it ends (:class:`Scheduler`: docs/concepts.md, "Choosing a
worker"); which workers are alive (:class:`Liveness`: heartbeats, failover, re-sends)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import Callable, Iterator

from fastio import IncompatiblePeer, LLMResponse, versions
from fastio import fabric_msgs as fm
from transport import metrics
from transport.client.calls import Counters, keep_streamed
from transport.client.workers import Call, ClientConfig, GenerateFuture, Worker, log
from transport.errors import (
    IncompatibleWorkers,
    NoWorkerAvailable,
    PoisonRequest,
    RemoteError,
    RequestTimeout,
)

__all__ = ["Liveness", "Scheduler", "resend_delay"]


class Scheduler:
    """The workers in use, the calls waiting for one, where each goes and how it ends."""

    def __init__(self, config: ClientConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.backing_off: set[Call] = set()
        self.workers: dict[str, Worker] = {}
        self.order: list[Worker] = []  # the workers in the order they were added
        self.queue: collections.deque[Call] = collections.deque()
        self.sticky: dict[str, str] = {}  # rid -> worker address
        self.held = False  # calls wait in the queue until release()
        self._ids = itertools.count(1)
        self._rr = 0

    def add(self, w: Worker) -> None:
        self.workers[w.address] = w
        self.order.append(w)

    def drain(self, address: str) -> bool:
        """Send nothing more to ``address`` (closed once its calls are done); False if unknown."""
        w = self.workers.get(address)
        if w is None:
            return False
        self.requeue(w.drain())
        self.maybe_drop(w)
        return True

    def close(self) -> list[Call]:
        """Close every worker; returns the calls not done."""
        calls = list(self.unfinished())
        for w in self.order:
            w.close()
        self.workers.clear()
        self.order.clear()
        self.queue.clear()
        return calls

    def hold(self) -> None:  # calls wait in the queue until release()
        self.held = True

    def release(self) -> None:
        self.held = False
        self.dispatch()

    def back_off(self, call: Call, timer: asyncio.TimerHandle | None = None) -> None:
        """``call`` waits for ``timer`` to re-send it (None: the wait is over)."""
        call.backoff = timer
        if timer is not None:
            self.backing_off.add(call)
        else:
            self.backing_off.discard(call)

    def enqueue(self, call: Call, front: bool = False) -> None:
        if not self.queue:  # else it waits its turn: no worker to pick now
            w = self._target(call)
            if w is not None:
                self._send(w, call)
                return
        if front:
            self.queue.appendleft(call)
        else:
            self.queue.append(call)
        self.dispatch()

    def requeue(self, calls: list[Call]) -> None:  # at the front, in their order
        for call in reversed(calls):
            if not call.done:
                call.worker = None
                self.queue.appendleft(call)

    def _home(self, call: Call) -> Worker | None:
        """The worker ``call``'s rid went to, while it is alive and not draining."""
        addr = self.sticky.get(call.orig.rid)
        w = self.workers.get(addr) if addr is not None else None
        return w if w is not None and w.alive and not w.draining else None

    def _target(self, call: Call) -> Worker | None:
        """Its rid's worker while that one lives (None while full), else the least loaded."""
        home = self._home(call)
        if home is not None:
            room = len(home.inflight) < home.limit and (not home.cool_until or home.warm())
            return home if room else None
        order = self.order
        n = len(order)
        if n == 0 or self.held:
            return None
        best: Worker | None = None
        best_load = 0
        rr = self._rr = (self._rr + 1) % n
        for i in range(n):
            w = order[(rr + i) % n]
            if w.alive and not w.draining and (not w.cool_until or w.warm()):
                load = len(w.inflight)
                if load < w.limit:
                    load += w.others
                    if best is None or load < best_load:
                        best, best_load = w, load
        return best

    def dispatch(self) -> None:  # queued calls while a worker can take them
        q = self.queue
        while q:
            call = q[0]
            if call.done:
                q.popleft()
                continue
            home = self._home(call)
            if home is not None and len(home.inflight) >= home.limit:
                q.popleft()  # wait at its busy worker, not in front of the others
                home.queue_sticky(call)
                continue
            target = self._target(call)
            if target is None:
                return
            q.popleft()
            self._send(target, call)

    def _send(self, w: Worker, call: Call) -> None:
        sub_id = next(self._ids)
        try:
            frames = w.enc.encode(
                fm.Submit(id=sub_id, request=call.segment, stream=self.config.stream)
            )
        except Exception as exc:  # before it takes a slot: it fails alone, leaks nothing
            self.fail(call, exc)
            return
        call.worker = w
        call.sub_id = sub_id
        call.seg_streamed = 0
        call.chunks = ()
        rid = call.orig.rid
        if self.sticky.get(rid) != w.address:
            if len(self.sticky) >= self.config.sticky_cache_size:  # forget the older half
                items = itertools.islice(self.sticky.items(), len(self.sticky) // 2, None)
                self.sticky = dict(items)
            self.sticky[rid] = w.address
        w.begin(sub_id, call, frames)

    def slot_freed(self, w: Worker) -> None:
        """A call on ``w`` ended: send what waits for it, or for any worker."""
        while (call := w.next_sticky()) is not None:
            self._send(w, call)
        if w.draining:
            self.maybe_drop(w)
        if self.queue:
            self.dispatch()

    def maybe_drop(self, w: Worker) -> None:  # close a draining worker with nothing in flight
        if w.draining and not w.inflight:
            self.workers.pop(w.address, None)
            if w in self.order:
                self.order.remove(w)
            w.close()

    def take_waiting(self) -> list[Call]:  # queued or backing off
        calls = [*self.queue, *self.backing_off]
        self.queue.clear()
        return calls

    def unfinished(self) -> Iterator[Call]:  # waiting, or sent to (or waiting for) a worker
        yield from self.queue
        yield from self.backing_off
        for w in self.order:
            yield from w.inflight.values()
            yield from w.sticky_queue

    def timed_out(self, call: Call, t: float | None) -> None:
        """``call`` is not done within ``t`` s (None: cancelled): stop it, also there."""
        if call.done:
            return
        self.counters.add("cancelled" if t is None else "timeouts")
        self.settle(call)
        w = call.worker
        if w is not None and w.cancel(call.sub_id):
            call.worker = None
            self.slot_freed(w)
        if t is not None and not call.fut.done():
            call.fut.set_exception(RequestTimeout(f"request {call.orig.rid} not done within {t} s"))

    def settle(self, call: Call) -> GenerateFuture:  # done, its timers stopped
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        if call.backoff is not None:
            call.backoff.cancel()
            self.back_off(call, None)
        call.fut.unbind()
        return call.fut

    def complete(self, call: Call, out: LLMResponse) -> None:
        if call.timer is not None or call.backoff is not None:
            fut = self.settle(call)
        else:  # settle() without its timers: the usual call (one method call less)
            call.done = True
            fut = call.fut
            fut.unbind()
        self.counters["completed"] += 1  # not exported: add()'s checks not needed
        if self.counters.observe_latency:
            metrics.CLIENT_LATENCY.observe(out.latency)
        if not fut.done():
            fut.set_result(out)

    def fail(self, call: Call, exc: BaseException, also: str = "") -> None:
        """Fail ``call`` unless it ended already (counted as failed, and as ``also``)."""
        if call.done:
            return
        fut = self.settle(call)
        self.counters.add("failed")
        if also:
            self.counters.add(also)
        if not fut.done():
            fut.set_exception(exc)


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
        self._timers: dict[str, asyncio.TimerHandle] = {}  # heartbeat, gate, none

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
        self._timers[name] = self._loop.call_later(delay, self._fire, name, fn)

    def _fire(self, name: str, fn: Callable[[], None]) -> None:
        del self._timers[name]
        fn()

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
        n = cfg.heartbeat_liveness
        for w in list(self.sched.order):
            # Counted in our ticks: a late tick of a busy loop is no death.
            if w.tick(prev, n, cfg.heartbeat_interval * n):
                self.worker_died(w, f"no pong for {now - w.last_seen:.2f} s")
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
                self._later("gate", until - now, self.gate_check)
            return
        self._first_back = 0.0
        if (gate := self._timers.pop("gate", None)) is not None:
            gate.cancel()
        self.sched.release()

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
        cfg, rid, dead = self.config, call.orig.rid, call.died_on
        if len(dead) > cfg.max_worker_deaths:
            m = cfg.max_worker_deaths
            msg = (
                f"request {rid}: {len(dead)} workers died while running it ({', '.join(dead)}); "
                "it may be what kills them (a poison request), so it is not sent to another. "
                f"ClientConfig.max_worker_deaths={m} allows {m} re-sends after such a death: "
                "raise it to allow more"
            )
            log.error("%s", msg)
            self.sched.fail(call, PoisonRequest(msg, rid=rid, workers=dead), also="poisoned")
        elif call.resends > cfg.max_resends:
            why = f"request {rid}: attempt {call.resends} lost ({why}); giving up"
            self.sched.fail(call, RemoteError(why, code=code, worker=w.address))
        else:
            self.sched.counters.add("resent")
            assert self._loop is not None
            delay = resend_delay(call.resends, cfg.resend_backoff, cfg.resend_backoff_max)
            self.sched.back_off(call, self._loop.call_later(delay, self._resend_now, call))

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
