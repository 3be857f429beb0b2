"""The publisher's serving thread: one loop that owns the sockets.

It answers Hellos (Welcome, plus the snapshot of the latest version), Fetches (bucket
pieces as zero-copy frames, or "ready" notices for same-host workers) and Acks,
announces versions, sends heartbeats, declares silent workers lost, and runs the
packing of the version being published step by step in between, so that bucket k is
on the wire while the rest is packed. :class:`PublisherService` is the part of
:class:`transport.weights.WeightPublisher` that runs in that thread.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Any

import zmq

import fastio
from fastio.ipc_msgs import IpcAck, IpcHello
from fastio.weight_msgs import (
    WeightAck,
    WeightBucket,
    WeightError,
    WeightFetch,
    WeightHeartbeat,
    WeightHello,
    WeightWelcome,
)
from transport import metrics
from transport.weights import shm as _shm
from transport.weights.core.publisher import PublisherCore
from transport.weights.datalink import (
    PIECE,
    PIECE_MAGIC,
    DataListener,
    DataSender,
    Sent,
    worker_token,
)
from transport.weights.ipc import IpcExporter
from transport.weights.ratelog import RateLimitedLog
from transport.weights.staging import Send, Staged

__all__ = ["SHM_NOTICE_BYTES", "PublisherService"]

log = logging.getLogger("transport.weights.publisher")

#: Same-host workers get a "bytes ready" notice at most every this many packed bytes:
#: one message per notice per worker, while the bytes just packed are still in the
#: last-level cache for the worker to hash.
SHM_NOTICE_BYTES = 8 << 20


class PublisherService:
    """The serving half of :class:`transport.weights.WeightPublisher` (its thread)."""

    # Set by WeightPublisher.__init__.
    publisher_id: str
    host_id: str
    pub_endpoint: str
    chunk_bytes: int
    heartbeat_interval: float
    worker_timeout: float
    core: PublisherCore
    _rlog: RateLimitedLog
    _router: zmq.Socket[Any]
    _pub: zmq.Socket[Any]
    _wake_r: zmq.Socket[Any]
    _encoder: fastio.Encoder
    _decoder: fastio.Decoder
    _cond: threading.Condition
    _versions: dict[int, Staged]
    _latest: Staged | None
    _pending: list[Staged]
    _seq: int
    _closed: bool
    _probe: _shm.Probe | None
    _ipc: IpcExporter | None
    _ipc_hellos: dict[str, IpcHello]
    _outbox: list[tuple[bytes, list[Any]]]
    #: Fetches of a version still being packed into the ipc slots (answered after).
    _parked: list[tuple[bytes, str, WeightFetch]]
    _senders: dict[str, DataSender]
    _data_token: bytes
    _listener: DataListener | None

    def _retire(self) -> None:
        raise NotImplementedError

    def _stage_late(self, st: Staged) -> bool:
        raise NotImplementedError

    def _ipc_reader(self, wid: str) -> bool:
        """Whether worker ``wid`` has the ipc slots open (it reads versions there)."""
        with self._cond:
            w = self._ipc.workers.get(wid) if self._ipc is not None else None
            return w is not None and w.opened

    # -- serving thread ----------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self.core.count(key, n)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_hb = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_hb:
                self._heartbeat(now)
                next_hb = now + self.heartbeat_interval
            packing = self._pack_step()
            try:
                wait_ms = 0 if packing else int(max(0.0, next_hb - now) * 1000) + 1
                events = dict(poller.poll(wait_ms))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                while True:
                    try:
                        self._wake_r.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                with self._cond:
                    if self._closed:
                        return
                    pending, self._pending = self._pending, []
                    outbox, self._outbox = self._outbox, []
                    parked, self._parked = self._parked, []
                for ident, out in outbox:
                    self._reply(ident, out)
                for ident, wid, fetch in parked:
                    self._serve_fetch(ident, wid, fetch)
                for st in pending:
                    self._announce(st)
                self._advance_all()
            if self._router in events:
                for _ in range(256):  # bounded, so heartbeats keep their rhythm
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception:  # one bad request must not stop the service
                        self._count("internal_errors")
                        log.exception("weight publisher: error serving a request")

    def _pack_step(self) -> bool:
        """Run one step of the version being packed; False when none is."""
        st = self._latest
        if st is None or st.job is None:
            with self._cond:  # an older version staged late (from the ipc slots)
                st = next((v for v in self._versions.values() if v.job is not None), None)
            if st is None or st.job is None:
                return False
        try:
            next(st.job)
        except StopIteration:
            done = True
        except Exception as exc:  # reported to the publish() caller
            st.error = exc
            done = True
        else:
            done = False
        if done:
            with self._cond:
                st.job = None
                self._cond.notify_all()
        self._advance_all()
        return not done

    def _announce(self, st: Staged) -> None:
        assert st.announce is not None
        with self._cond:
            self._seq += 1
            st.announce.seq = self._seq
            self.core.announce(st.ledger, time.monotonic())
            self._versions[st.version] = st
            self._latest = st
            self._retire()
            self._cond.notify_all()
        frames = self._encoder.encode(st.announce)
        self._pub.send_multipart(frames, copy=False)
        # Also straight to every known worker over the ROUTER: a SUB that has just
        # connected misses PUB messages (the slow joiner).
        for w in sorted(st.ledger.expected):
            self._reply(w.encode(), frames)

    def _advance_all(self) -> None:
        with self._cond:
            work = [(st, snd) for st in self._versions.values() for snd in st.active]
        for st, snd in work:
            self._advance(st, snd)

    def _heartbeat(self, now: float) -> None:
        with self._cond:
            # An ipc worker whose process is gone has its slots released now.
            gone = self._ipc.reap() if self._ipc is not None else []
            for w, reason in self.core.tick(now, gone):
                log.warning("weight subscriber %s %s", w, reason)
            latest = self._latest.version if self._latest else -1
            self._retire()
            self._cond.notify_all()
        hb = WeightHeartbeat(self.publisher_id, self._seq, latest)
        self._pub.send_multipart(self._encoder.encode(hb), copy=False)

    def _reply(self, ident: bytes, frames: list[Any], track: bool = False) -> Any:
        try:
            tracker = self._router.send_multipart(
                [ident, *frames], zmq.NOBLOCK, copy=False, track=track
            )
            return tracker if track else True
        except zmq.Again:
            self._count("send_busy")
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._count("send_unroutable")
        return None if track else False

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        wid = ident.decode("utf-8", "replace")
        try:
            msg = self._decoder.decode(frames[1:])
        except fastio.DecodeError as exc:
            self._count("bad_messages")
            self._rlog.warning("bad message", "bad message from weight subscriber %r: %s", wid, exc)
            err = WeightError(-1, -1, f"bad message: {exc}")
            self._reply(ident, self._encoder.encode(err))
            return
        now = time.monotonic()
        if isinstance(msg, (IpcHello, IpcAck)):
            self._handle_ipc(ident, wid, msg, now)
            return
        behind: Staged | None = None
        with self._cond:
            if isinstance(msg, WeightHello):
                led = self.core.on_hello(wid, msg, now)
                behind = self._versions.get(led.version) if led is not None else None
            elif isinstance(msg, WeightAck):
                if not self.core.on_ack(wid, msg, now):
                    self._rlog.warning(
                        "Ack from a stranger", "ignored an Ack from %r, which never said Hello", wid
                    )
                    return
            else:
                self.core.touch(wid, now)
            self._cond.notify_all()
        if isinstance(msg, WeightHello):
            announce = None
            if behind is not None:
                # A worker behind a version that went to ipc workers only: stage it
                # now, so that the snapshot names its segment.
                if not self._ipc_reader(wid):
                    self._stage_late(behind)
                announce = behind.announce
            welcome = WeightWelcome(
                self.publisher_id,
                self.host_id,
                self.pub_endpoint,
                self._seq,
                self._probe.name if self._probe else "",
                self._probe.token if self._probe else "",
                announce,
                self._listener.port if self._listener is not None else 0,
                worker_token(self._data_token, wid) if self._listener is not None else b"",
            )
            self._reply(ident, self._encoder.encode(welcome))
        elif isinstance(msg, WeightFetch):
            self._serve_fetch(ident, wid, msg)
        elif isinstance(msg, WeightAck) and not msg.ok:
            log.warning("worker %s failed version %d: %s", wid, msg.version, msg.error)

    def _handle_ipc(self, ident: bytes, wid: str, msg: IpcHello | IpcAck, now: float) -> None:
        """The ipc path's Hello (offer the slots, or remember it until the first
        version that takes the path) and Ack (a slot released, a version's last bucket
        done: the worker's WeightAck reports the version itself)."""
        if msg.worker_id != wid:  # only a peer's own id counts
            self._count("ipc_foreign_ids")
            return
        offer = None
        with self._cond:
            info = self.core.workers.get(wid)
            if info is not None:
                info.last_seen = now
            if isinstance(msg, IpcHello):
                if info is None:
                    return  # a WeightHello comes first
                self._ipc_hellos[wid] = msg
                if self._ipc is not None:
                    offer = self._ipc.offer(msg)
            elif self._ipc is not None:
                self._ipc.handle_ack(msg)
                if msg.bucket == -2:
                    self._ipc_hellos.pop(wid, None)
            self._cond.notify_all()
        if offer is not None:
            self._reply(ident, self._encoder.encode(offer))

    def _serve_fetch(self, ident: bytes, wid: str, msg: WeightFetch) -> None:
        with self._cond:
            st = self._versions.get(msg.version)
            latest = self._latest.version if self._latest else -1
        if st is None or st.announce is None:
            err = WeightError(
                msg.version,
                msg.index,
                f"version {msg.version} is not available (latest is {latest})",
                latest,
            )
            self._reply(ident, self._encoder.encode(err))
            return
        if st.unstaged and not self._stage_late(st):
            if st.ipc_packing:
                # The slots do not hold it whole yet: answered once they do (the
                # publishing thread wakes this one), not at the worker's next Fetch.
                self._count("fetches_deferred")
                with self._cond:
                    self._parked = [
                        p
                        for p in self._parked
                        if (p[1], p[2].version, p[2].index) != (wid, msg.version, msg.index)
                    ]
                    self._parked.append((ident, wid, msg))
                return
            err = WeightError(
                msg.version,
                msg.index,
                f"version {msg.version} is no longer held (latest is {latest})",
                latest,
            )
            self._reply(ident, self._encoder.encode(err))
            return
        if not 0 <= msg.index < len(st.announce.buckets):
            err = WeightError(
                msg.version, msg.index, f"no bucket {msg.index} in version {msg.version}", latest
            )
            self._reply(ident, self._encoder.encode(err))
            return
        if msg.shm and st.seg is None:
            err = WeightError(msg.version, msg.index, "no shared memory for this version")
            self._reply(ident, self._encoder.encode(err))
            return
        snd = Send(ident, msg)
        with self._cond:
            # Checked again under the lock that publish() takes to reuse buffers: the
            # version may have been retired (its segment recycled) since the look-up.
            held = self._versions.get(msg.version) is st and not (msg.shm and st.seg is None)
            if held:
                # A Fetch asked again (a timeout, a broken link) ends the earlier answer
                # of that bucket to that worker: two streams of one bucket would mix.
                for old in st.active:
                    if old.wid == snd.wid and old.fetch.index == msg.index:
                        old.cancelled = True
                st.active = [a for a in st.active if not a.cancelled]
                st.active.append(snd)
                if msg.shm:
                    # It reads the segment from the first notice until it answers: the
                    # segment is not packed again before (the buffer rule).
                    st.ledger.readers.add(self.core.reader(wid, msg))
        if not held:
            err = WeightError(
                msg.version, msg.index, f"version {msg.version} is no longer held", latest
            )
            self._reply(ident, self._encoder.encode(err))
            return
        self._advance(st, snd)

    def _link_send(self, snd: Send, piece: WeightBucket) -> Sent | None:
        """Queue ``piece`` (one chunk) on the worker's data link; None without one."""
        with self._cond:
            sender = self._senders.get(snd.wid)
        if sender is None:
            return None
        (chunk,) = piece.chunks
        head = PIECE.pack(
            PIECE_MAGIC,
            piece.version,
            piece.index,
            piece.offset,
            memoryview(chunk).nbytes,
            piece.checksum,
            piece.last,
        )
        sent = sender.send(head, chunk)
        if sent is not None:
            self._count("data_link_pieces")
        return sent

    def _advance(self, st: Staged, snd: Send) -> None:
        """Send what is packed of the bucket ``snd`` asks for, from where it stopped.

        Over TCP, pieces of ``chunk_bytes`` (the bytes, zero-copy from the buffer); for
        a same-host worker, notices "bytes [offset, offset+nbytes) are ready" that it
        hashes in shared memory as they come. The last piece carries the checksum.
        """
        assert st.announce is not None
        if snd.cancelled:
            return
        info = st.announce.buckets[snd.fetch.index]
        with self._cond:
            ready = min(max(st.packed - info.shm_offset, 0), info.nbytes)
            complete = info.index < st.buckets_done
            checksum = info.checksum
        step = self.chunk_bytes
        v, k = snd.fetch.version, snd.fetch.index
        while True:
            start = snd.cursor
            if snd.shm:
                end = ready
                if not complete and end - start < max(step, SHM_NOTICE_BYTES):
                    break
            else:
                end = min(start + step, info.nbytes)
                if end > ready:
                    break
            last = complete and end == info.nbytes
            if end == start and not last:
                break
            if snd.shm:
                piece = WeightBucket(v, k, start, checksum if last else 0, last, [], end - start)
                ok = self._reply(snd.ident, self._encoder.encode(piece)) is not False
            else:
                chunk = st.view()[info.shm_offset + start : info.shm_offset + end]
                tracker = None
                if snd.fetch.data and snd.linked is not False:
                    piece = WeightBucket(v, k, start, checksum if last else 0, last, [chunk])
                    tracker = self._link_send(snd, piece)
                    if tracker is None and snd.linked:
                        # The link closed mid-bucket: this answer ends here (the worker
                        # sees its link close and asks again, as frames).
                        self._count("sends_ended_by_link")
                        with self._cond:
                            if snd in st.active:
                                st.active.remove(snd)
                        return
                    snd.linked = tracker is not None
                if tracker is None:  # no data link: ZeroMQ frames
                    piece = WeightBucket(v, k, start, checksum if last else 0, last, [chunk])
                    tracker = self._reply(snd.ident, self._encoder.encode(piece), track=True)
                ok = tracker is not None
                if ok:
                    with self._cond:
                        st.trackers.append(tracker)
            if not ok:
                # Not queued (HWM or peer gone): the worker's fetch times out and it asks
                # again; the pieces it got are discarded there as incomplete.
                last = True
            snd.cursor = end
            if last:
                with self._cond:
                    if snd in st.active:
                        st.active.remove(snd)
                if ok:
                    self._count("buckets_sent")
                    self._count("bytes_sent", 0 if snd.shm else info.nbytes)
                    metrics.PUBLISHER_BYTES.labels(path="shm" if snd.shm else "tcp").inc(
                        info.nbytes
                    )
                return
