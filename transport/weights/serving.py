"""The publisher's serving thread (:class:`Serving`): one loop owns the sockets, answers
Hellos, Fetches and Acks, announces, sends heartbeats and packs between sends."""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from typing import Any, Union, cast

import msgspec
import zmq

import fastio
from fastio.ipc_msgs import IpcAck, IpcHello
from fastio.versions import VERSION_1
from fastio.weight_msgs import (
    SUBSCRIBER_TO_PUBLISHER,
    WeightAck,
    WeightBucket,
    WeightError,
    WeightFetch,
    WeightHeartbeat,
    WeightHello,
    WeightWelcome,
)
from transport import metrics
from transport.ratelog import RateLimitedLog
from transport.sockets import make_pair
from transport.weights.config import PublisherConfig
from transport.weights.routes import Tracker, shm, tcp
from transport.weights.routes import zmq as zmq_route
from transport.weights.routes.ipc import IpcOffering
from transport.weights.staging import Send, Staged, VersionStore

__all__ = ["Serving"]

log = logging.getLogger("transport.weights.publisher")

#: What the ROUTER accepts: the weight messages and the ipc route's Hello and Ack.
_FROM_SUBSCRIBER = Union[SUBSCRIBER_TO_PUBLISHER, IpcHello, IpcAck]  # noqa: UP007


class Serving:
    """The serving loop of a :class:`~transport.weights.WeightPublisher`: ``welcome`` is
    what every Hello gets; ``link``: serve TCP workers' bytes on the data link."""

    def __init__(
        self,
        config: PublisherConfig,
        store: VersionStore,
        ipc: IpcOffering,
        router: zmq.Socket[Any],
        pub: zmq.Socket[Any],
        welcome: WeightWelcome,
        *,
        link: bool = False,
    ) -> None:
        self.config = config
        self.core = store.core
        self.store = store
        self.ipc = ipc
        self.cond = store.cond
        self.router = router
        self.pub = pub
        self.notices = shm.NoticeSender(self)
        self.frames = zmq_route.FrameSender(self)
        self.link: tcp.LinkSender | None = None
        if link:
            endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            try:
                self.link = tcp.LinkSender(
                    endpoint, config.data_port, config.worker_timeout, self.core.count
                )
                welcome = msgspec.structs.replace(welcome, data_port=self.link.port)
            except OSError as exc:
                log.warning("no data link (%s); TCP workers get ZeroMQ frames", exc)
        self.welcome = welcome
        wake = f"inproc://fastio-weights-wake-{welcome.publisher_id}"
        self._wake_r, self._wake_w = make_pair(router.context, wake)
        self._wake_lock = threading.Lock()
        self.encoder = VERSION_1
        self._decoder = fastio.Decoder(_FROM_SUBSCRIBER, max_message_size=8 << 20)
        self._rlog = RateLimitedLog(log)
        self.pending: list[Staged] = []
        # Fetches of a version still packed into the ipc slots, by (worker, version, bucket).
        self.parked: dict[tuple[str, int, int], tuple[bytes, str, WeightFetch]] = {}
        self.seq = 0
        self.closed = False

    def wake(self) -> None:
        """Wake the serving thread (from any thread)."""
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_w.send(b"", zmq.NOBLOCK)

    def submit(self, st: Staged) -> None:
        """Hand a staged version to the loop, which announces and packs it; returns once
        it did or stopped (from any thread)."""
        with self.cond:
            self.pending.append(st)
            self.wake()
            while (st in self.pending or st.job is not None) and not self.closed:
                self.cond.wait(1.0)

    def stop(self) -> bool:
        """Tell the loop to stop (from any thread); False when it was told already."""
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            self.cond.notify_all()
        self.wake()
        return True

    def close(self) -> None:
        """Close the data link and the sockets (the loop has stopped)."""
        if self.link is not None:
            self.link.close()
        for sock in (self.router, self.pub, self._wake_r, self._wake_w):
            sock.close(linger=0)

    # -- serving thread ----------------------------------------------------------------
    def run(self) -> None:
        """The loop (the publisher's thread)."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_hb = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_hb:
                self._heartbeat(now)
                next_hb = now + self.config.heartbeat_interval
            wait_ms = 0 if self._pack_step() else max(0, int((next_hb - now) * 1000)) + 1
            try:
                events = dict(poller.poll(wait_ms))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        self._wake_r.recv(zmq.NOBLOCK)
                with self.cond:
                    if self.closed:
                        return
                    pending, self.pending = self.pending, []
                    outbox = self.ipc.take_outbox()
                    parked, self.parked = self.parked, {}
                for ident, out in outbox:
                    self.reply(ident, out)
                for args in parked.values():
                    self._serve_fetch(*args)
                for st in pending:
                    self._announce(st)
                self._advance_all()
            for _ in range(256 if self.router in events else 0):  # heartbeats keep rhythm
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._handle(frames)
                except Exception:  # one bad request must not stop the service
                    self.core.count("internal_errors")
                    log.exception("weight publisher: error serving a request")

    def _pack_step(self) -> bool:
        """Run one step of the version being packed; False when none is."""
        with self.cond:  # the latest first, then older versions staged late
            st = next(
                (v for v in reversed(self.store.versions.values()) if v.job is not None), None
            )
        if st is None:
            return False
        more = st.pack_step(self.cond)
        self._advance_all()
        return more

    def _announce(self, st: Staged) -> None:
        assert st.announce is not None
        with self.cond:
            self.seq += 1
            st.announce.seq = self.seq
            self.core.announce(st, time.monotonic())
            self.store.retire()
            self.cond.notify_all()
        frames = self.encoder.encode(st.announce)
        self.pub.send_multipart(frames, copy=False)
        for w in sorted(st.expected):
            self.reply(w.encode(), frames)

    def _advance_all(self) -> None:
        with self.cond:
            work = [(st, a) for st in self.store.versions.values() for a in st.answering.values()]
        for st, snd in work:
            self._advance(st, snd)

    def _heartbeat(self, now: float) -> None:
        with self.cond:
            gone = self.ipc.reap()  # an ipc worker whose process is gone frees its slots
            for w, reason in self.core.tick(now, gone):
                log.warning("weight subscriber %s %s", w, reason)
            latest = self.core.latest_version
            self.store.retire()
            self.cond.notify_all()
        hb = WeightHeartbeat(self.welcome.publisher_id, self.seq, latest)
        self.pub.send_multipart(self.encoder.encode(hb), copy=False)

    def reply(self, ident: bytes, frames: list[Any], track: bool = False) -> Any:
        """Send to one worker without blocking: its tracker (``track``) or True; None or
        False when not queued."""
        try:
            tracker = self.router.send_multipart(
                [ident, *frames], zmq.NOBLOCK, copy=False, track=track
            )
            return tracker if track else True
        except zmq.Again:
            self.core.count("send_busy")
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.core.count("send_unroutable")
        return None if track else False

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        wid = ident.decode("utf-8", "replace")
        try:
            msg = self._decoder.decode(frames[1:])
        except fastio.DecodeError as exc:
            self.core.count("bad_messages")
            self._rlog.warning("bad message", "bad message from weight subscriber %r: %s", wid, exc)
            self.reply(ident, self.encoder.encode(WeightError(-1, -1, f"bad message: {exc}")))
            return
        now = time.monotonic()
        if isinstance(msg, (IpcHello, IpcAck)):
            offer = self.ipc.handle(wid, msg, now)
            if offer is not None:
                self.reply(ident, self.encoder.encode(offer))
            return
        behind: Staged | None = None
        with self.cond:
            if isinstance(msg, WeightHello):
                behind = cast("Staged | None", self.core.on_hello(wid, msg, now))
            elif isinstance(msg, WeightAck):
                if not self.core.on_ack(wid, msg, now):
                    self._rlog.warning(
                        "Ack from a stranger", "ignored an Ack from %r, which never said Hello", wid
                    )
                    return
            else:
                self.core.touch(wid, now)
            self.cond.notify_all()
        if isinstance(msg, WeightHello):
            # Behind an ipc-only version: staged now, so the snapshot names its segment.
            if behind is not None and not self.ipc.reader(wid):
                self.store.stage_late(behind, self.ipc, self.config.chunk_bytes)
            ann = behind.announce if behind else None
            token = self.link.token(wid) if self.link is not None else b""
            welcome = msgspec.structs.replace(
                self.welcome, seq=self.seq, announce=ann, data_token=token
            )
            self.reply(ident, self.encoder.encode(welcome))
        elif isinstance(msg, WeightFetch):
            self._serve_fetch(ident, wid, msg)
        elif isinstance(msg, WeightAck) and not msg.ok:
            log.warning("worker %s failed version %d: %s", wid, msg.version, msg.error)

    def _serve_fetch(self, ident: bytes, wid: str, msg: WeightFetch) -> None:
        with self.cond:
            st = self.store.versions.get(msg.version)
        if st is not None and st.unstaged:
            self.store.stage_late(st, self.ipc, self.config.chunk_bytes)
        snd = Send(ident, wid, msg)
        with self.cond:  # the look-up again: a version may be retired meanwhile
            st = self.store.versions.get(msg.version)
            act, why, named = self.core.on_fetch(wid, msg, st)
            if act == "park":
                self.parked[(wid, msg.version, msg.index)] = (ident, wid, msg)
            elif act == "send" and st is not None:
                old = self.core.answering(st, (wid, msg.index), snd)
                if old is not None:
                    old.cancelled = True
        if act == "refuse":
            self.reply(ident, self.encoder.encode(WeightError(msg.version, msg.index, why, named)))
        elif act == "send" and st is not None:
            self._advance(st, snd)

    def _ended(self, st: Staged, snd: Send) -> None:
        with self.cond:
            self.core.answer_ended(st, (snd.wid, snd.fetch.index), snd)

    def _link_send(self, snd: Send, msg: WeightBucket) -> Tracker | None:
        """Queue ``msg`` (one chunk) on the worker's data link; None without one."""
        return self.link.send(snd.ident, snd.wid, msg) if self.link is not None else None

    def _advance(self, st: Staged, snd: Send) -> None:
        """Send what is packed of ``snd``'s bucket from where it stopped (chunks, or
        "bytes ready" notices); the last carries the checksum."""
        assert st.announce is not None
        if snd.cancelled:
            return
        info, shm = st.announce.buckets[snd.fetch.index], snd.fetch.shm
        with self.cond:
            ready = min(max(st.packed - info.shm_offset, 0), info.nbytes)
            complete = info.index < st.buckets_done
        v, k, n, step = snd.fetch.version, snd.fetch.index, info.nbytes, self.config.chunk_bytes
        route = self.notices if shm else self.frames
        while (end := route.span(snd.cursor, ready, n, complete, step)) is not None:
            start, last = snd.cursor, complete and end == n
            if end == start and not last:
                return
            chunks = [] if shm else [st.np[info.shm_offset + start : info.shm_offset + end]]
            checksum = info.checksum if last else 0
            msg = WeightBucket(v, k, start, checksum, last, chunks, end - start if shm else 0)
            tracker = None
            if snd.fetch.data and not shm and snd.linked is not False:
                tracker = self._link_send(snd, msg)
                if tracker is None and snd.linked:  # closed mid-bucket: the worker asks again
                    self.core.count("sends_ended_by_link")
                    self._ended(st, snd)
                    return
                snd.linked = tracker is not None
            if tracker is None:  # no data link: ZeroMQ frames (or the notice)
                tracker = route.send(snd.ident, snd.wid, msg)
            if tracker is not None:
                with self.cond:
                    st.trackers.append(tracker)
            snd.cursor = end
            if last or tracker is None:  # not queued (HWM or peer gone): the worker asks again
                self._ended(st, snd)
                if tracker is not None:
                    self.core.count("buckets_sent")
                    self.core.count("bytes_sent", 0 if shm else n)
                    metrics.PUBLISHER_BYTES.labels(path="shm" if shm else "tcp").inc(n)
                return
