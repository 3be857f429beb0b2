"""Where each call goes and how it ends (docs/concepts.md, "Choosing a worker"), and which
workers are alive: heartbeats, failover, re-sends."""

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
from transport.client.calls import Call, Counters, GenerateFuture
from transport.client.workers import ClientConfig, Worker, log
from transport.errors import (
    ClientClosed,
    IncompatibleWorkers,
    NoWorkerAvailable,
    NoWorkers,
    PoisonRequest,
    RemoteError,
    RequestAborted,
    RequestTimeout,
)

__all__ = ["Scheduler", "resend_delay"]


def resend_delay(k: int, base: float, cap: float, rand: float | None = None) -> float:
    """Seconds before the ``k``-th re-send (k >= 1): ``min(cap, base * 2**(k-1))`` times
    a jitter factor in [0.5, 1] (``rand`` in [0, 1] picks it; random when None)."""
    r = random.random() if rand is None else rand
    return min(cap, base * 2.0 ** min(k - 1, 62)) * (0.5 + 0.5 * r)


class Scheduler:
    """The workers, which are alive, the calls waiting for one, where each goes, how it ends."""

    _loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(self, config: ClientConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.workers: dict[str, Worker] = {}
        self.order: list[Worker] = []  # the workers in the order they were added
        self.queue: collections.deque[Call] = collections.deque()
        self.backing_off: set[Call] = set()
        self.sticky: dict[str, str] = {}  # rid -> worker address
        # Calls wait in the queue while none is alive and while first answers are due.
        self.held = False
        self.n_alive = 0
        self.alive_at = 0.0  # last moment a worker was alive: connect_timeout runs from it
        self._ids = itertools.count(1)
        self._rr = 0
        self.closed = False
        self._last_tick = 0.0
        self._first_back = 0.0  # when the first came back after all had died
        self._warned_none = False  # said once per stretch without a live worker
        self._timers: dict[str, asyncio.TimerHandle] = {}  # heartbeat, gate, none

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.alive_at = time.monotonic()
        self._later("heartbeat", 0, self._heartbeat)

    def close(self) -> None:
        """Close every worker; the calls not done fail with :class:`ClientClosed`."""
        self.closed = True
        for timer in self._timers.values():
            timer.cancel()
        calls = list(self.unfinished())
        for w in self.order:
            w.close()
        self.workers.clear()
        self.order.clear()
        self.queue.clear()
        for call in calls:
            self.fail(call, ClientClosed("the client was closed"))

    def _later(self, name: str, delay: float, fn: Callable[[], None]) -> None:
        self._timers[name] = self._loop.call_later(delay, self._fire, name, fn)

    def _fire(self, name: str, fn: Callable[[], None]) -> None:
        del self._timers[name]
        fn()

    def add(self, w: Worker) -> None:
        """Start pinging ``w``; while none is alive, calls wait for it too."""
        self.workers[w.address] = w
        self.order.append(w)
        if not self.n_alive:
            self.alive_at = time.monotonic()  # a new worker gets its connect_timeout
            self.held = True
        self._probe(w, 0.002)

    def drain(self, address: str) -> None:
        """Send nothing more to ``address``; it closes once its calls are done."""
        w = self.workers.get(address)
        if w is not None:
            self.requeue(w.drain())
            self._maybe_drop(w)
            self.gate_check()  # its first answer is no longer awaited
            self.dispatch()

    def check_ready(self) -> None:
        """Raise what a new call fails with at once (NoWorkers, NoWorkerAvailable)."""
        if not self.workers:
            raise NoWorkers("no generation worker configured; add_worker() first")
        if not self.n_alive and ((expired := self._expired()) or self._all_incompatible()):
            self.counters.add("no_worker")
            raise self._no_worker_error(incompatible=not expired)

    def submit(self, call: Call) -> None:
        """A new call: its timer, then a worker (or the queue)."""
        t = call.timeout
        # Longer timeouts are checked on each heartbeat tick: no timer per request.
        if t < 30 * self.config.heartbeat_interval:
            call.timer = self._loop.call_later(t, self.timed_out, call, t)
        self.counters["submitted"] += 1  # not exported: Counters.add's checks not needed
        self.enqueue(call)
        if not self.n_alive:
            self.watch_for_none()

    def enqueue(self, call: Call, front: bool = False) -> None:
        if self.queue or not self._place(call):  # else it waits its turn: no worker to pick now
            if front:
                self.queue.appendleft(call)
            else:
                self.queue.append(call)
            self.dispatch()

    def requeue(self, calls: list[Call]) -> None:  # at the front, in their order
        self.queue.extendleft(call for call in reversed(calls) if not call.done)

    def _place(self, call: Call) -> bool:
        """Send ``call`` to its rid's worker (or wait there), else the least loaded; False: none."""
        addr = self.sticky.get(call.orig.rid)
        home = self.workers.get(addr) if addr is not None else None
        if home is not None and home.alive and not home.draining:
            if len(home.inflight) >= home.limit:
                home.queue_sticky(call)  # at its busy worker, not in front of the others
            elif not home.cool_until or home.warm():
                self._send(home, call)
            else:
                return False
            return True
        order = self.order
        n = len(order)
        if n == 0 or self.held:
            return False
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
        if best is None:
            return False
        self._send(best, call)
        return True

    def dispatch(self) -> None:  # queued calls while a worker can take them
        q = self.queue
        while q:
            call = q.popleft()
            if not call.done and not self._place(call):
                q.appendleft(call)
                return

    def _send(self, w: Worker, call: Call) -> None:
        sub_id = next(self._ids)
        try:
            frames = w.enc.encode(
                fm.Submit(id=sub_id, request=call.segment, stream=self.config.stream)
            )
        except Exception as exc:  # before it takes a slot: it fails alone, leaks nothing
            self.fail(call, exc)
            return
        call.sent(sub_id)
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
        self._maybe_drop(w)
        if self.queue:
            self.dispatch()

    def _maybe_drop(self, w: Worker) -> None:  # close a draining worker with nothing in flight
        if w.draining and not w.inflight:
            self.workers.pop(w.address, None)
            if w in self.order:
                self.order.remove(w)
            w.close()

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
        self._settle(call)
        for w in self.order:
            if w.cancel(call.sub_id):  # ids are never reused: only its running attempt's
                self.slot_freed(w)
                break
        if t is not None and not call.fut.done():
            call.fut.set_exception(RequestTimeout(f"request {call.orig.rid} not done within {t} s"))

    def _settle(self, call: Call) -> GenerateFuture:
        self.backing_off.discard(call)
        return call.settle()

    def complete(self, call: Call, out: LLMResponse) -> None:
        if call.backoff is not None:  # the usual call waits for no re-send
            self.backing_off.discard(call)
        fut = call.settle()
        self.counters["completed"] += 1  # not exported: add()'s checks not needed
        if self.counters.observe_latency:
            metrics.CLIENT_LATENCY.observe(out.latency)
        if not fut.done():
            fut.set_result(out)

    def fail(self, call: Call, exc: BaseException, also: str = "") -> None:
        """Fail ``call`` unless it ended already (counted as failed, and as ``also``)."""
        if call.done:
            return
        fut = self._settle(call)
        self.counters.add("failed")
        if also:
            self.counters.add(also)
        if not fut.done():
            fut.set_exception(exc)

    def on_error(self, w: Worker, err: fm.Error) -> None:
        """An Error from ``w``: the call it names fails, or goes again (OVERLOADED, LOST)."""
        if err.code == fm.ErrorCode.UNSUPPORTED_VERSION and err.id == -1 and not w.alive:
            self.refused_by(w, f"worker {w.address} refused this client: {err.message}")
            return
        call = w.end(err.id)
        if call is None:
            if err.code != fm.ErrorCode.LOST:  # LOST of a call already ended: stale
                log.warning("worker %s reports error %d: %s", w.address, err.code, err.message)
            return
        if err.code == fm.ErrorCode.OVERLOADED:
            self.counters.add("overloaded")
            call.refused()
            if w.overloaded():  # full with other clients' work: back off, do not spin
                self._loop.call_later(0.011, self.dispatch)
            self.requeue([call])
        elif err.code == fm.ErrorCode.ABORTED:
            self.fail(call, RequestAborted(err.message, code=err.code, worker=w.address))
        elif err.code == fm.ErrorCode.LOST:  # the worker gave it up: re-send it
            self._lose(call, w, "the worker lost it", code=err.code)
        else:
            why = f"worker {w.address}: {err.message}"
            self.fail(call, RemoteError(why, code=err.code, worker=w.address))
        self.slot_freed(w)

    def _probe(self, w: Worker, delay: float) -> None:
        # Until it first answers: pings at growing intervals up to interval / 4.
        if w.alive or w.last_seen or self.closed or w.address not in self.workers:
            return
        if self.held:
            self.gate_check()  # a refused connection ends the wait for this one
        w.ping()
        cap = self.config.heartbeat_interval / 4
        self._loop.call_later(delay, self._probe, w, min(delay * 2, cap))

    def _heartbeat(self) -> None:
        cfg = self.config
        now = time.monotonic()
        expired = [c for c in self.unfinished() if c.deadline <= now and c.timer is None]
        for call in expired:  # calls with no timer of their own
            self.timed_out(call, call.timeout)
        n = cfg.heartbeat_liveness
        for w in list(self.order):
            # Counted in our ticks: a late tick of a busy loop is no death.
            if w.tick(self._last_tick, n, cfg.heartbeat_interval * n):
                self.worker_died(w, f"no pong for {now - w.last_seen:.2f} s")
            w.ping()
        if self._expired():
            self._no_worker_error(warn=True)
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
        self.counters.add("workers_joined")
        log.info("worker %s (%s) joined", w.address, hb.worker_id)
        if not self.held:
            self.dispatch()
            return
        if not self._first_back:
            self._first_back = w.last_seen
            for o in self.order:  # those that died with it may be back: ask now
                if not o.alive and o.last_seen and not o.draining:
                    o.ping()
        self.gate_check()

    def gate_check(self) -> None:
        """Release the held calls once no worker that may be up is still awaited."""
        if not self.held or not self.n_alive or self.closed:
            return  # nothing to send to yet: checked again when one answers
        cfg = self.config
        grace = min(cfg.heartbeat_interval, cfg.connect_timeout)
        # Deaths of one outage are found within about a detection time of each other.
        outage = self.alive_at - 2 * cfg.heartbeat_interval * (cfg.heartbeat_liveness + 1)
        until = 0.0
        for w in self.order:
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
        self.held = False
        self.dispatch()

    def worker_died(self, w: Worker, why: str, crashed: bool = True) -> None:
        """``w`` is dead (or unusable): re-send its calls; ``crashed``: a death of theirs."""
        self.counters.add("workers_died")
        if w.mark_dead():
            self.n_alive -= 1
            if not self.n_alive:
                self.alive_at = w.died_at
                self.held = True  # the first back must not take the whole backlog
        running, waiting = w.take_calls()
        calls = running + waiting
        log.warning("worker %s is dead (%s): re-sending %d requests", w.address, why, len(calls))
        n_running = len(running) if crashed else 0
        for i, call in enumerate(calls):
            if not call.done:
                # Those waiting for it in this client were never there: no death of theirs.
                self._lose(call, w, "its worker died", died=i < n_running)
        self._maybe_drop(w)
        self.dispatch()
        self.watch_for_none()

    def _lose(self, call: Call, w: Worker, why: str, code: int = 0, died: bool = False) -> None:
        """``call``'s attempt is lost: re-send the rest after a back-off, or fail it past the limits."""
        out = call.lost(w.address if died else "")
        if out is not None:  # the streamed tokens were the whole answer
            self.complete(call, out)
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
            self.fail(call, PoisonRequest(msg, rid=rid, workers=dead), also="poisoned")
        elif call.resends > cfg.max_resends:
            why = f"request {rid}: attempt {call.resends} lost ({why}); giving up"
            self.fail(call, RemoteError(why, code=code, worker=w.address))
        else:
            self.counters.add("resent")
            delay = resend_delay(call.resends, cfg.resend_backoff, cfg.resend_backoff_max)
            call.backoff = self._loop.call_later(delay, self._resend_now, call)
            self.backing_off.add(call)

    def _resend_now(self, call: Call) -> None:
        call.backoff = None
        self.backing_off.discard(call)
        if not call.done and not self.closed:
            self.enqueue(call, front=True)
            self.watch_for_none()

    def _expired(self) -> bool:  # no worker alive for connect_timeout
        return not self.n_alive and time.monotonic() - self.alive_at >= self.config.connect_timeout

    def watch_for_none(self) -> None:
        """With calls waiting and no live worker, fail them at ``connect_timeout``."""
        if self.n_alive or "none" in self._timers or self.closed:
            return
        if self.queue or self.backing_off:
            left = self.alive_at + self.config.connect_timeout - time.monotonic()
            if left > 0:
                self._later("none", left, self.watch_for_none)
            else:
                self._fail_waiting(self._no_worker_error(warn=True))

    def refused_by(self, w: Worker, why: str) -> None:
        """``w`` speaks no version this client reads: fail what waits if no worker is left."""
        if w.mark_incompatible(why):
            log.error("%s", why)
        if w.alive or w.inflight or w.sticky_queue:
            self.worker_died(w, "it speaks an incompatible protocol version", crashed=False)
        if not self.n_alive and self._all_incompatible():
            self._fail_waiting(self._no_worker_error(incompatible=True))

    def _fail_waiting(self, err: NoWorkerAvailable) -> None:  # queued or backing off
        calls = [*self.queue, *self.backing_off]
        self.queue.clear()
        for call in calls:
            self.fail(call, type(err)(str(err), err.seen), also="no_worker")

    def _all_incompatible(self) -> bool:
        return bool(self.order) and all(w.incompatible for w in self.order)

    def _no_worker_error(self, incompatible: bool = False, warn: bool = False) -> NoWorkerAvailable:
        """What no live (or usable) worker fails calls with; ``warn``: logged once per stretch."""
        now = time.monotonic()
        seen = {w.address: w.seen(now) for w in self.order}
        where = "; ".join(f"{a}: {s}" for a, s in seen.items()) or "no worker configured"
        if incompatible:
            return IncompatibleWorkers(f"no generation worker this client can use ({where})", seen)
        t = self.config.connect_timeout
        err = NoWorkerAvailable(f"no generation worker alive for {t:g} s ({where})", seen)
        if warn and not self._warned_none:
            self._warned_none = True
            log.warning("%s", err)
        return err
