"""Where each call goes (its rid's worker, else the least-loaded live one, else the
client's queue: docs/concepts.md, "Choosing a worker") and how it ends."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Iterator

from fastio import LLMResponse
from fastio import fabric_msgs as fm
from transport import metrics
from transport.client.calls import Counters
from transport.client.config import ClientConfig
from transport.client.workers import Call, GenerateFuture, Worker
from transport.errors import RequestTimeout

__all__ = ["Scheduler"]


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

    def hold(self) -> None:
        """Keep calls in the queue until :meth:`release`."""
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

    def requeue(self, calls: list[Call]) -> None:
        """Put ``calls`` back at the front of the queue, in their order."""
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

    def dispatch(self) -> None:
        """Send queued calls while a worker can take them."""
        q = self.queue
        while q:
            call = q[0]
            if call.done:
                q.popleft()
                continue
            home = self._home(call)
            if home is not None and len(home.inflight) >= home.limit:
                q.popleft()  # wait at its busy worker, not in front of the others
                home.sticky_queue.append(call)
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
        w.inflight[sub_id] = call
        rid = call.orig.rid
        if self.sticky.get(rid) != w.address:
            if len(self.sticky) >= self.config.sticky_cache_size:  # forget the older half
                items = itertools.islice(self.sticky.items(), len(self.sticky) // 2, None)
                self.sticky = dict(items)
            self.sticky[rid] = w.address
        w.pump.send(frames)

    def slot_freed(self, w: Worker) -> None:
        """A call on ``w`` ended: send what waits for it, or for any worker."""
        sq = w.sticky_queue
        while sq and len(w.inflight) < w.limit and w.alive and not w.draining:
            call = sq.popleft()
            if not call.done:
                self._send(w, call)
        if w.draining:
            self.maybe_drop(w)
        if self.queue:
            self.dispatch()

    def maybe_drop(self, w: Worker) -> None:
        """Close a draining worker once nothing is in flight there."""
        if w.draining and not w.inflight:
            self.workers.pop(w.address, None)
            if w in self.order:
                self.order.remove(w)
            w.close()

    def take_waiting(self) -> list[Call]:
        """Take the calls not on a worker: queued or backing off."""
        calls = [*self.queue, *self.backing_off]
        self.queue.clear()
        return calls

    def unfinished(self) -> Iterator[Call]:
        """Every call not done: waiting, or sent to (or waiting for) a worker."""
        yield from self.queue
        yield from self.backing_off
        for w in self.order:
            yield from w.inflight.values()
            yield from w.sticky_queue

    def cancelled(self, call: Call) -> None:
        """The caller cancelled ``call``'s future: stop it here and on its worker."""
        self.timed_out(call, None)

    def timed_out(self, call: Call, t: float | None) -> None:
        """``call`` is not done within ``t`` s (None: cancelled): stop it, also there."""
        if call.done:
            return
        self.counters.add("cancelled" if t is None else "timeouts")
        self.settle(call)
        w = call.worker
        if w is not None and w.inflight.pop(call.sub_id, None) is not None:
            w.send(fm.Cancel(id=call.sub_id))
            call.worker = None
            self.slot_freed(w)
        if t is not None and not call.fut.done():
            call.fut.set_exception(RequestTimeout(f"request {call.orig.rid} not done within {t} s"))

    def settle(self, call: Call) -> GenerateFuture:
        """Mark ``call`` done and stop its timers; returns its future."""
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
