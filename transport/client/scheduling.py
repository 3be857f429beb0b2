"""Where each call goes: sticky rids, the least-loaded live worker, the client's queue,
and taking a call back (cancel, timeout).

A worker's load is what a new request would wait behind there: this client's requests
in flight on it, which the client knows exactly, plus the other clients' requests the
worker reported in its last pong, counted only while that pong is current (it answers
the latest or the previous heartbeat ping; an older report may be long out of date, and
steering a whole burst by it piles the burst onto one worker). Cancels and other
control messages a worker has not yet handled are not load: its pong leaves them out.
Until every worker that is up has first answered (within
``min(heartbeat_interval, connect_timeout)`` of being added), new calls wait in the
client's queue, so a burst sent right after connecting is spread over them all; after
every worker died, the first back waits as long for those of the same outage.
"""

from __future__ import annotations

import itertools

from fastio import fabric_msgs as fm
from transport.client.base import ClientBase
from transport.client.calls import Call
from transport.client.workers import Worker
from transport.errors import RequestTimeout

__all__ = ["Scheduler"]


class Scheduler(ClientBase):
    """Scheduling part of :class:`transport.client.FabricClient`."""

    def _enqueue(self, call: Call, front: bool = False) -> None:
        w = self._target(call)
        if w is not None and not self._queue:
            self._send_call(w, call)
        else:
            if front:
                self._queue.appendleft(call)
            else:
                self._queue.append(call)
            self._dispatch()

    def _target(self, call: Call) -> Worker | None:
        """The worker to send ``call`` to now, or None: its rid's worker while that one
        lives (None when it is full), else the live worker with a free slot and the
        least load (ours in flight plus the others' it reported in its last pong)."""
        addr = self._sticky.get(call.orig.rid)
        if addr is not None:
            w = self._workers.get(addr)
            if w is not None and w.alive and not w.draining:
                if len(w.inflight) < w.limit and (not w.cool_until or w.warm()):
                    return w
                return None
        best: Worker | None = None
        best_load = 0
        order = self._order
        n = len(order)
        if n == 0 or self._gating:
            return None
        self._rr = (self._rr + 1) % n
        for i in range(n):
            w = order[(self._rr + i) % n]
            if w.alive and not w.draining and len(w.inflight) < w.limit and w.warm():
                load = len(w.inflight) + w.others
                if best is None or load < best_load:
                    best, best_load = w, load
        return best

    def _dispatch(self) -> None:
        q = self._queue
        while q:
            call = q[0]
            if call.done:
                q.popleft()
                continue
            addr = self._sticky.get(call.orig.rid)
            if addr is not None:
                w = self._workers.get(addr)
                if w is not None and w.alive and not w.draining and len(w.inflight) >= w.limit:
                    # Its worker is busy: wait there, do not block the others.
                    q.popleft()
                    w.sticky_queue.append(call)
                    continue
            target = self._target(call)
            if target is None:
                return
            q.popleft()
            self._send_call(target, call)

    def _send_call(self, w: Worker, call: Call) -> None:
        sub_id = next(self._ids)
        try:
            frames = w.enc.encode(  # what this worker reads
                fm.Submit(id=sub_id, request=call.segment, stream=self.config.stream)
            )
        except Exception as exc:
            # Encoded before it takes a slot: a request that cannot be sent (an
            # EncodeError, say) fails alone, whether sent by its caller or dispatched
            # from the queue inside a socket callback, and leaks nothing.
            self._finish_error(call, exc)
            return
        call.worker = w
        call.sub_id = sub_id
        call.seg_streamed = 0
        if call.chunks:
            call.chunks = []
        w.inflight[sub_id] = call
        sticky = self._sticky
        rid = call.orig.rid
        if sticky.get(rid) != w.address:
            if len(sticky) >= self.config.sticky_cache_size:
                # Forget the older half at once. (Deleting the oldest entry one at a
                # time costs O(n) per deletion: a dict's iteration skips the dead
                # slots at its front.)
                self._sticky = sticky = dict(
                    itertools.islice(sticky.items(), len(sticky) // 2, None)
                )
            sticky[rid] = w.address
        assert w.pump is not None
        w.pump.send(frames)

    def _slot_freed(self, w: Worker) -> None:
        sq = w.sticky_queue
        while sq and len(w.inflight) < w.limit and w.alive and not w.draining:
            call = sq.popleft()
            if not call.done:
                self._send_call(w, call)
        if w.draining:
            self._maybe_drop(w)
        if self._queue:
            self._dispatch()

    def _maybe_drop(self, w: Worker) -> None:
        if w.draining and not w.inflight:
            self._workers.pop(w.address, None)
            if w in self._order:
                self._order.remove(w)
            w.close()

    def _requeue(self, calls: list[Call]) -> None:
        for call in reversed(calls):
            if not call.done:
                call.worker = None
                self._queue.appendleft(call)

    # -- taking a call back -------------------------------------------------------------
    def _cancelled(self, call: Call) -> None:
        """The caller cancelled ``call``'s future: stop it here and on its worker."""
        if not call.done:
            self.stats["cancelled"] += 1
            self._abandon(call)

    def _detach(self, call: Call, send_cancel: bool) -> None:
        w = call.worker
        if w is not None and w.inflight.pop(call.sub_id, None) is not None:
            if send_cancel and w.pump is not None:
                w.pump.send(w.enc.encode(fm.Cancel(id=call.sub_id)))
            call.worker = None
            self._slot_freed(w)

    def _abandon(self, call: Call) -> None:
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        if call.backoff is not None:
            call.backoff.cancel()
            self._backing_off.discard(call)
        self._detach(call, send_cancel=True)

    def _on_timeout(self, call: Call, t: float) -> None:
        if call.done:
            return
        self.stats["timeouts"] += 1
        self._abandon(call)
        call.fut._call = None
        if not call.fut.done():
            call.fut.set_exception(RequestTimeout(f"request {call.orig.rid} not done within {t} s"))
