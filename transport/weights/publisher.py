"""Trainer side of weight updates: stage a version in flat buckets and serve it.

Sockets (see ``docs/PROTOCOL.md``, "Weight updates"):

* a ROUTER (``endpoint``) that answers Hello with Welcome (plus the latest manifest when
  the worker is behind: the snapshot of the zguide's Clone pattern), serves Fetch with
  the bucket's bytes as zero-copy frames, and collects Acks;
* a PUB (``pub_endpoint``, told to workers in the Welcome) carrying sequence-numbered
  Announce and Heartbeat notices only.

A version is staged in one buffer, a shared-memory segment when ``/dev/shm`` allows it
(same-host workers read it in place) and private memory otherwise. The buffer is the
version's snapshot: late joiners and re-fetches are served from it.

The buffer rule: a buffer that a worker's process may still read is never overwritten.
A shared-memory segment may be mapped by any same-host worker for as long as that
process lives (even one stopped, or declared lost), so each version gets a fresh
segment, and retiring a version only unlinks its name: a worker's mapping of the
unlinked file keeps that version's bytes (Linux frees them with the last mapping). A
private buffer is only read by this process's own zero-copy sends; it is reused for a
later version once no send may still read it (ZeroMQ's message trackers).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

import fastio
from fastio.weight_msgs import (
    SUBSCRIBER_TO_PUBLISHER,
    WeightAck,
    WeightAnnounce,
    WeightBucket,
    WeightBucketInfo,
    WeightError,
    WeightFetch,
    WeightHeartbeat,
    WeightHello,
    WeightWelcome,
)
from transport.sockets import CurveConfig, WorkerAuthenticator, apply_curve_server
from transport.weights import shm as _shm
from transport.weights.binding import FLOAT_DTYPES, parse_dtype
from transport.weights.bucket import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHECKSUM,
    Hasher,
    _flat_bytes,
    copy_tensor,
    dtype_from_name,
    dtype_name,
    named_tensors,
    plan_buckets,
    split_aliases,
)
from transport.weights.errors import UpdateIncomplete
from transport.weights.ratelog import RateLimitedLog

__all__ = ["DEFAULT_CHUNK_BYTES", "SubscriberInfo", "UpdateResult", "WeightPublisher"]

log = logging.getLogger("transport.weights.publisher")

#: Size of the pieces a bucket is cut into on the wire, one message each. One frame of
#: hundreds of MiB is several times slower (one huge fresh allocation per message on the
#: receiver), and separate messages let the I/O thread interleave workers and the worker
#: checksum a piece while the next arrives. 1 MiB rather than 4: measured here (184 MiB,
#: 2 workers, 2 cores) the last byte arrived after ~0.33 s instead of ~0.6 s, the
#: worker hashing each piece while the next is on the wire.
DEFAULT_CHUNK_BYTES = 1 << 20

#: I/O threads of the publisher's private context that carry the ROUTER's connections
#: (the bucket bytes); one more carries the PUB's.
_ROUTER_IO_THREADS = 2

#: Same-host workers get a "bytes ready" notice at most every this many chunks' worth
#: of packed bytes (8 MiB by default): one message per notice per worker, while the
#: bytes just packed are still in the last-level cache for the worker to hash.
_SHM_NOTICE_CHUNKS = 8


#: Packing granularity: a block is copied, then hashed while it is still in cache (L2:
#: measured here, 256 KiB blocks pack+hash at ~6 GB/s, 1 MiB blocks at ~5 GB/s).
_BLOCK = 256 << 10


@dataclass
class SubscriberInfo:
    """What the publisher knows of one subscriber (from its Hellos and Acks)."""

    worker_id: str
    host_id: str = ""
    pid: int = 0
    version: int = -1
    digest: int | None = None
    last_seen: float = 0.0
    alive: bool = True
    #: The one dtype it wants floating tensors in ("" if none declared).
    dtype: str = ""


@dataclass
class UpdateResult:
    """Outcome of one version across workers (:meth:`WeightPublisher.wait`).

    Attributes
    ----------
    version:
        The version waited for.
    applied:
        Worker id -> its Ack, for every worker that applied the version.
    failed:
        Worker id -> why it did not (its error, or that it was lost). A failed worker
        kept its previous weights.
    missing:
        Expected workers that had not answered when the timeout passed.
    elapsed_s:
        Seconds from the announcement to the last answer (or the timeout).
    """

    version: int
    applied: dict[str, WeightAck] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every expected worker applied the version."""
        return not self.failed and not self.missing and bool(self.applied)


class _Send:
    """One Fetch being answered: where the next piece starts."""

    __slots__ = ("corrupt", "cursor", "fetch", "ident", "shm")

    def __init__(self, ident: bytes, fetch: WeightFetch, corrupt: bool) -> None:
        self.ident = ident
        self.fetch = fetch
        self.shm = fetch.shm
        self.cursor = 0
        self.corrupt = corrupt


class _Staged:
    """One version's buffer, manifest and bookkeeping."""

    def __init__(self, version: int, buf: torch.Tensor, seg: _shm.ShmSegment | None) -> None:
        self.version = version
        self.buf = buf
        self.seg = seg
        self.announce: WeightAnnounce | None = None
        self.announced_at = 0.0
        self.trackers: list[zmq.MessageTracker] = []
        self.expected: set[str] = set()
        self.acks: dict[str, WeightAck] = {}
        self.lost: dict[str, str] = {}
        self.done_at = 0.0
        #: Bytes of the buffer packed so far (buckets are packed in order).
        self.packed = 0
        #: Buckets packed completely, their checksum known.
        self.buckets_done = 0
        #: Fetches being answered, piece by piece as packing progresses.
        self.active: list[_Send] = []
        #: The packing still to do (run by the serving thread), and its failure.
        self.job: Iterator[None] | None = None
        self.error: BaseException | None = None

    @property
    def capacity(self) -> int:
        return int(self.buf.numel())

    def sends_done(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return not self.trackers

    def answered(self) -> bool:
        return all(w in self.acks or w in self.lost for w in self.expected)

    def release(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        if self.seg is not None:
            self.seg.close()
            self.seg = None


class WeightPublisher:
    """Publishes versions of a model's weights to :class:`WeightSubscriber` workers.

    Parameters
    ----------
    endpoint:
        ROUTER address to bind (``tcp://127.0.0.1:*`` picks a free port; see
        :attr:`endpoint` for the bound one). Workers connect here.
    pub_endpoint:
        PUB address to bind; by default next to ``endpoint`` (a free port, or
        ``<ipc path>.pub``).
    bucket_bytes:
        Upper bound of a flat bucket.
    chunk_bytes:
        Size of the frames a bucket travels in over TCP (same-host workers get a
        "bytes ready" notice every 8 such chunks).
    shm:
        Stage versions in ``/dev/shm`` so same-host workers read them without a socket
        (``None``: when available). Falls back to private memory when it cannot.
    checksum:
        ``"xxh3_64"`` or ``"crc32"``.
    heartbeat_interval:
        Seconds between Heartbeat notices on PUB.
    worker_timeout:
        A worker silent this long (no Hello, Fetch or Ack) is declared lost.
    keep_versions:
        How many recent versions keep their buffer when no one needs them any more.
    context:
        ZeroMQ context (default: a private one, terminated at :meth:`close`).
    curve:
        CurveZMQ on both sockets (:class:`transport.CurveConfig`: this side's
        ``.key_secret`` and, to admit only known workers, ``authorized_clients_dir``).
        Off by default (loopback); turn it on whenever workers connect across hosts. A
        worker with a wrong or missing key gets nothing, not even the announcements.

    Examples
    --------
    >>> pub = WeightPublisher("tcp://127.0.0.1:*")  # doctest: +SKIP
    >>> pub.publish(model.state_dict(), version=1)  # doctest: +SKIP
    >>> pub.wait(1, timeout=30).ok  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        pub_endpoint: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        shm: bool | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        heartbeat_interval: float = 0.5,
        worker_timeout: float = 10.0,
        keep_versions: int = 2,
        context: zmq.Context[Any] | None = None,
        curve: CurveConfig | None = None,
        _fault_hook: Callable[[str, int, int], str | None] | None = None,
    ) -> None:
        Hasher(checksum)  # validates the name now rather than at the first publish
        self.bucket_bytes = bucket_bytes
        self.chunk_bytes = max(1, chunk_bytes)
        self.checksum_algo = checksum
        self.heartbeat_interval = heartbeat_interval
        self.worker_timeout = worker_timeout
        self.keep_versions = max(1, keep_versions)
        self.publisher_id = secrets.token_hex(8)
        self.host_id = _shm.host_id()
        #: Counters: bad messages, fetches served, bytes sent, ...
        self.counters: dict[str, int] = {}
        self._rlog = RateLimitedLog(log)
        # Test and chaos hook: (worker, version, bucket) -> None, "corrupt" or "die".
        self._fault_hook = _fault_hook
        self._use_shm = _shm.available() if shm is None else bool(shm and _shm.available())
        if self._use_shm:
            _shm.cleanup_stale()
        self._probe: _shm.Probe | None = None
        if self._use_shm:
            try:
                self._probe = _shm.write_probe()
            except OSError as exc:
                log.warning("no shared-memory fast path (%s); workers will use TCP", exc)
                self._use_shm = False

        # A private context by default: its I/O threads serve only the weights, and
        # close() can terminate it without touching the application's sockets. The
        # kernel copies of the bucket sends run in the I/O threads, so workers'
        # connections must be spread over them: libzmq gives a new connection to the
        # least loaded thread (counting listeners and every connection), which with two
        # threads put both workers' ROUTER connections on one thread and their SUB
        # connections on the other (measured: one I/O thread doing all 2 GiB of sends
        # for 1 GiB to 2 workers). Hence thread 0 for the PUB (small notices) and
        # threads 1..n for the ROUTER, whose connections then alternate between them.
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = context or zmq.Context(io_threads=1 + _ROUTER_IO_THREADS)
        self._auth: WorkerAuthenticator | None = None
        if curve is not None:
            # The ZAP handler must run before the sockets bind.
            self._auth = WorkerAuthenticator(self._ctx, curve)
        self._router = self._ctx.socket(zmq.ROUTER)
        if self._own_ctx:
            self._router.setsockopt(zmq.AFFINITY, ((1 << _ROUTER_IO_THREADS) - 1) << 1)
        apply_curve_server(self._router, curve)
        self._router.setsockopt(zmq.LINGER, 0)
        # At the HWM a ROUTER drops silently; MANDATORY turns that into EAGAIN, which
        # is answered as "busy" instead (workers bound their fetches by a window).
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted worker reuses its id; it takes the route over from the dead one.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.SNDHWM, 10_000)
        self._router.setsockopt(zmq.RCVHWM, 10_000)
        # Workers only send small messages; anything larger is hostile: disconnect.
        self._router.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        self._router.bind(endpoint)
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = self._ctx.socket(zmq.PUB)
        if self._own_ctx:
            self._pub.setsockopt(zmq.AFFINITY, 1)
        apply_curve_server(self._pub, curve)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self._pub.bind(pub_endpoint or _sibling(self.endpoint))
        self.pub_endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_addr = f"inproc://fastio-weights-wake-{self.publisher_id}"
        self._wake_r = self._ctx.socket(zmq.PAIR)
        self._wake_r.bind(wake_addr)
        self._wake_w = self._ctx.socket(zmq.PAIR)
        self._wake_w.connect(wake_addr)
        self._wake_lock = threading.Lock()

        self._encoder = fastio.Encoder()
        self._decoder = fastio.Decoder(SUBSCRIBER_TO_PUBLISHER, max_message_size=8 << 20)
        self._cond = threading.Condition()
        self._workers: dict[str, SubscriberInfo] = {}
        self._versions: dict[int, _Staged] = {}
        self._latest: _Staged | None = None
        self._pending: list[_Staged] = []
        self._seq = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"weights-publisher-{self.publisher_id}", daemon=True
        )
        self._thread.start()

    # -- public API ------------------------------------------------------------------
    @property
    def latest_version(self) -> int:
        """The latest published version (``-1`` before the first)."""
        with self._cond:
            return self._latest.version if self._latest else -1

    def workers(self) -> dict[str, SubscriberInfo]:
        """A snapshot of the known workers, by id."""
        with self._cond:
            return {k: SubscriberInfo(**vars(v)) for k, v in self._workers.items()}

    def wait_for_workers(self, n: int, timeout: float) -> list[str]:
        """Wait until at least ``n`` live workers said Hello; returns their ids.

        Raises ``TimeoutError`` when fewer are there after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                alive = sorted(w for w, i in self._workers.items() if i.alive)
                if len(alive) >= n:
                    return alive
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(alive)} of {n} weight subscribers connected")
                self._cond.wait(left)

    def publish(self, state: Any, version: int) -> WeightAnnounce:
        """Stage ``state`` as ``version`` and announce it to every worker.

        Parameters
        ----------
        state:
            An ``nn.Module``, a state dict or an iterable of ``(name, tensor)`` (e.g.
            ``model.named_parameters()``); CPU or CUDA tensors of any supported dtype.
        version:
            Must be greater than every version published before.

        Returns
        -------
        WeightAnnounce
            The manifest sent to the workers. Returns once every bucket is packed (the
            caller may then change its tensors); workers fetch meanwhile, and
            :meth:`wait` collects their answers.
        """
        tensors, aliases = split_aliases(named_tensors(state))
        with self._cond:
            if self._closed:
                raise RuntimeError("publisher is closed")
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(
                    f"version {version} is not newer than the latest ({self._latest.version})"
                )
        plan = self._plan(tensors)
        total = plan[-1].shm_offset + plan[-1].nbytes if plan else 0
        staged = self._acquire(version, total)
        staged.announce = WeightAnnounce(
            publisher_id=self.publisher_id,
            seq=0,  # assigned by the serving thread, which owns the sequence
            version=version,
            checksum_algo=self.checksum_algo,
            total_bytes=total,
            buckets=plan,
            shm_name=staged.seg.name if staged.seg is not None else "",
            aliases=aliases,
        )
        # The serving thread announces, then packs chunk by chunk, answering fetches in
        # between: bucket k's pieces are on the wire while the rest is being packed.
        # (Packing in this thread instead would fight the serving thread for the GIL at
        # every block: measured 20x slower.) Checksums are filled in as buckets are
        # packed; the last piece of each bucket carries its checksum.
        staged.job = _pack_steps(self, staged, plan, tensors)
        with self._cond:
            self._pending.append(staged)
        self._wake()
        with self._cond:
            while (staged in self._pending or staged.job is not None) and not self._closed:
                self._cond.wait(1.0)
            if staged.error is not None:
                raise staged.error
            if self._closed:
                raise RuntimeError("publisher closed while publishing")
        return staged.announce

    def wait(
        self, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """Wait until every expected worker answered ``version``, or ``timeout`` passed.

        Parameters
        ----------
        version:
            A published version.
        timeout:
            Seconds to wait at most.
        workers:
            The worker ids to wait for; default: the workers alive when the version
            was announced, plus any that answered it since.

        Returns
        -------
        UpdateResult
            Never raises for workers' failures: ``result.ok`` says whether all applied.
            (:meth:`publish_and_wait` raises instead.)
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._versions.get(version)
            if st is None or st.announce is None:
                raise KeyError(f"version {version} was not published by this publisher")
            if workers is not None:
                st.expected = set(workers)
            while True:
                if st.answered() and st.expected:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            res = UpdateResult(version)
            for w in sorted(st.expected | set(st.acks)):
                ack = st.acks.get(w)
                if ack is not None and ack.ok:
                    res.applied[w] = ack
                elif ack is not None:
                    res.failed[w] = ack.error or "failed"
                elif w in st.lost:
                    res.failed[w] = st.lost[w]
                else:
                    res.missing.append(w)
            end = st.done_at if st.answered() and st.done_at else time.monotonic()
            res.elapsed_s = end - st.announced_at
            return res

    def publish_and_wait(
        self, state: Any, version: int, timeout: float, *, workers: Iterable[str] | None = None
    ) -> UpdateResult:
        """:meth:`publish` then :meth:`wait`; raises :class:`UpdateIncomplete` unless every
        expected worker applied the version (the exception carries the result)."""
        self.publish(state, version)
        res = self.wait(version, timeout, workers=workers)
        if not res.ok:
            raise UpdateIncomplete(
                f"version {version}: applied by {sorted(res.applied)}, failed "
                f"{res.failed}, no answer from {res.missing}",
                res,
            )
        return res

    def close(self) -> None:
        """Stop serving, close the sockets and free every staged buffer."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(5.0)
        for s in (self._router, self._pub, self._wake_r, self._wake_w):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()
        with self._cond:
            for st in self._versions.values():
                st.release()
            self._versions.clear()
            self._latest = None
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- staging -----------------------------------------------------------------------
    def _plan(self, tensors: dict[str, torch.Tensor]) -> list[WeightBucketInfo]:
        """The buckets of a version, in the dtypes it travels in.

        When every live worker asked for the same floating dtype and it is narrower
        than a tensor's, the tensor is cast here while packing (fewer bytes to move);
        otherwise it travels as it is and each worker casts during its copy.
        """
        with self._cond:
            wanted = {i.dtype for i in self._workers.values() if i.alive}
        cast = parse_dtype(wanted.pop()) if len(wanted) == 1 and "" not in wanted else None
        wire: dict[str, torch.dtype] = {}
        for n, t in tensors.items():
            narrower = cast is not None and cast.itemsize < t.dtype.itemsize
            wire[n] = cast if cast is not None and narrower and t.dtype in FLOAT_DTYPES else t.dtype
        plan = plan_buckets(
            ((n, dtype_name(wire[n]), tuple(t.shape)) for n, t in tensors.items()),
            self.bucket_bytes,
        )
        for b in plan:
            b.tensors = [
                e
                if wire[e.name] == tensors[e.name].dtype
                else msgspec.structs.replace(e, src_dtype=dtype_name(tensors[e.name].dtype))
                for e in b.tensors
            ]
        return plan

    def _acquire(self, version: int, total: int) -> _Staged:
        """A buffer for a new version (the buffer rule, see the module docstring).

        A shared-memory segment is never reused: a worker may hold a mapping of it for
        as long as its process lives (stopped, slow, declared lost), so every version
        gets a fresh segment and a retired one is only unlinked. A private buffer is
        read only by this process's zero-copy sends, so it is reused once none of
        them may still read it.
        """
        with self._cond:
            for v, st in sorted(self._versions.items()):
                if st is self._latest or st.seg is not None or st.capacity < total:
                    continue
                if st.sends_done() and not st.active and st.answered():
                    del self._versions[v]
                    return _Staged(version, st.buf, None)
        seg: _shm.ShmSegment | None = None
        if self._use_shm:
            try:
                seg = _shm.ShmSegment.create(total)
            except OSError as exc:
                log.warning(
                    "cannot stage %d bytes in /dev/shm (%s); using private memory", total, exc
                )
        self._count("buffers_created")
        if seg is not None:
            return _Staged(version, seg.tensor, seg)
        return _Staged(version, torch.empty(total, dtype=torch.uint8), None)

    def _retire(self) -> None:
        """Free buffers of old versions that no one can still need (lock held)."""
        old = [v for v in sorted(self._versions) if self._versions[v] is not self._latest]
        excess = len(self._versions) - self.keep_versions
        for v in old:
            if excess <= 0:
                break
            st = self._versions[v]
            if st.sends_done() and st.answered():
                st.release()
                del self._versions[v]
                excess -= 1

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_w.send(b"", zmq.NOBLOCK)

    # -- serving thread ----------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

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

    def _announce(self, st: _Staged) -> None:
        assert st.announce is not None
        with self._cond:
            self._seq += 1
            st.announce.seq = self._seq
            st.announced_at = time.monotonic()
            st.expected = {w for w, i in self._workers.items() if i.alive}
            self._versions[st.version] = st
            self._latest = st
            self._retire()
            self._cond.notify_all()
        frames = self._encoder.encode(st.announce)
        self._pub.send_multipart(frames, copy=False)
        # Also straight to every known worker over the ROUTER: a SUB that has just
        # connected misses PUB messages (the slow joiner); the heartbeat's sequence
        # number would catch that, but only one heartbeat later.
        for w in sorted(st.expected):
            self._reply(w.encode(), frames)

    def _advance_all(self) -> None:
        with self._cond:
            work = [(st, snd) for st in self._versions.values() for snd in st.active]
        for st, snd in work:
            self._advance(st, snd)

    def _heartbeat(self, now: float) -> None:
        with self._cond:
            for w, info in self._workers.items():
                if info.alive and now - info.last_seen > self.worker_timeout:
                    info.alive = False
                    reason = f"worker lost: no message for {now - info.last_seen:.1f} s"
                    log.warning("weight subscriber %s %s", w, reason)
                    for st in self._versions.values():
                        if w in st.expected and w not in st.acks:
                            st.lost[w] = reason
                            self._check_done(st)
            latest = self._latest.version if self._latest else -1
            self._retire()
            self._cond.notify_all()
        hb = WeightHeartbeat(self.publisher_id, self._seq, latest)
        self._pub.send_multipart(self._encoder.encode(hb), copy=False)

    def _check_done(self, st: _Staged) -> None:
        if not st.done_at and st.expected and st.answered():
            st.done_at = time.monotonic()

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
        hello = isinstance(msg, WeightHello)
        if isinstance(msg, WeightAck) and wid not in self._workers:
            # Only a Hello makes a peer a worker: an Ack from any other peer (a stray
            # or spoofed one) must not fail an update. Counted, not recorded.
            self._count("acks_from_strangers")
            self._rlog.warning(
                "Ack from a stranger", "ignored an Ack from %r, which never said Hello", wid
            )
            return
        with self._cond:
            info = self._workers.get(wid)
            if info is None:
                if not hello:
                    # Only a Hello makes a peer a worker (and expected to apply versions);
                    # a stray Fetch is still answered below.
                    info = SubscriberInfo(wid, alive=False)
                else:
                    info = self._workers[wid] = SubscriberInfo(wid)
            info.last_seen = now
            if not info.alive and wid in self._workers:
                info.alive = True
                # Back from the dead (restarted): it is expected to catch up again.
                for old in self._versions.values():
                    old.lost.pop(wid, None)
            if isinstance(msg, WeightHello):
                info.host_id, info.pid = msg.host_id, msg.pid
                info.version, info.digest = msg.version, msg.digest
                info.dtype = msg.dtype
                latest = self._latest
                if latest is not None and msg.version < latest.version and wid not in latest.acks:
                    latest.expected.add(wid)
                # A Hello at version >= v means v was applied even when its Ack was lost
                # (a subscriber drops a send its socket cannot take): count it as the Ack.
                for st in self._versions.values():
                    if st.version <= msg.version and wid in st.expected and wid not in st.acks:
                        st.acks[wid] = WeightAck(wid, st.version, True, msg.version, "", msg.digest)
                        self._check_done(st)
                self._cond.notify_all()
        if isinstance(msg, WeightHello):
            announce = None
            if latest is not None and msg.version < latest.version:
                announce = latest.announce
            welcome = WeightWelcome(
                self.publisher_id,
                self.host_id,
                self.pub_endpoint,
                self._seq,
                self._probe.name if self._probe else "",
                self._probe.token if self._probe else "",
                announce,
            )
            self._reply(ident, self._encoder.encode(welcome))
        elif isinstance(msg, WeightFetch):
            self._serve_fetch(ident, wid, msg)
        elif isinstance(msg, WeightAck):
            with self._cond:
                acked = self._versions.get(msg.version)
                if acked is not None:
                    acked.acks[wid] = msg
                    acked.expected.add(wid)
                    self._check_done(acked)
                info.version = msg.current_version
                if msg.digest is not None:
                    info.digest = msg.digest
                self._cond.notify_all()
            if not msg.ok:
                log.warning("worker %s failed version %d: %s", wid, msg.version, msg.error)

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
        fault = self._fault_hook(wid, msg.version, msg.index) if self._fault_hook else None
        if fault == "die":  # chaos testing: a publisher dying mid-update
            os.kill(os.getpid(), 9)
        snd = _Send(ident, msg, fault == "corrupt")
        with self._cond:
            st.active.append(snd)
        self._advance(st, snd)

    def _advance(self, st: _Staged, snd: _Send) -> None:
        """Send what is packed of the bucket ``snd`` asks for, from where it stopped.

        Over TCP, pieces of ``chunk_bytes`` (the bytes, zero-copy from the buffer); for
        a same-host worker, notices "bytes [offset, offset+nbytes) are ready" that it
        hashes in shared memory as they come. The last piece carries the checksum.
        """
        assert st.announce is not None
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
                if not complete and end - start < step * _SHM_NOTICE_CHUNKS:
                    break
            else:
                end = min(start + step, info.nbytes)
                if end > ready:
                    break
            last = complete and end == info.nbytes
            if end == start and not last:
                break
            if snd.shm:
                # (A "corrupt" fault stands for bytes changed after they were hashed.)
                crc = checksum ^ 1 if last and snd.corrupt else checksum
                piece = WeightBucket(v, k, start, crc if last else 0, last, [], end - start)
                ok = self._reply(snd.ident, self._encoder.encode(piece)) is not False
            else:
                chunk = st.buf[info.shm_offset + start : info.shm_offset + end].numpy()
                if snd.corrupt and start == 0 and chunk.size:
                    chunk = chunk.copy()  # never touch the staged snapshot itself
                    chunk[chunk.size // 2] ^= 0xFF
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
                    st.active.remove(snd)
                if ok:
                    self._count("buckets_sent")
                    self._count("bytes_sent", 0 if snd.shm else info.nbytes)
                return


def _pack_steps(
    pub: WeightPublisher, st: _Staged, plan: list[Any], tensors: dict[str, torch.Tensor]
) -> Iterator[None]:
    """Pack and hash bucket after bucket, block by block (a block is hashed while still
    in cache), yielding to the serving loop after every ``chunk_bytes`` of progress.

    The loop works on numpy views made once per tensor: slicing a torch tensor costs a
    few microseconds, which over the thousands of blocks of a GiB added tens of ms.
    """
    block = _BLOCK
    told = 0
    for info in plan:
        base = info.shm_offset
        bucket = st.buf[base : base + info.nbytes]
        bnp = bucket.numpy()
        h = Hasher(pub.checksum_algo)
        cur = 0  # bytes of this bucket hashed so far
        for e in info.tensors:
            if e.offset > cur:
                bnp[cur : e.offset] = 0
            t = tensors[e.name].detach()
            if e.src_dtype:  # cast for the workers (on the GPU for CUDA tensors)
                t = t.to(dtype_from_name(e.dtype))
            if t.device.type == "cpu" and t.is_contiguous():
                src = _flat_bytes(t).numpy()
                off = e.offset
                for a in range(0, e.nbytes, block):
                    b = min(a + block, e.nbytes)
                    np.copyto(bnp[off + a : off + b], src[a:b])
                    end = off + b
                    h.update(bnp[cur:end])
                    cur = end
                    if base + cur - told >= pub.chunk_bytes:
                        told = base + cur
                        with pub._cond:
                            st.packed = told
                        yield
            else:  # device or strided tensors: one copy, then hash the region
                copy_tensor(bucket[e.offset : e.offset + e.nbytes], t)
                for a in range(cur, e.offset + e.nbytes, block):
                    h.update(bnp[a : min(a + block, e.offset + e.nbytes)])
                cur = e.offset + e.nbytes
        if info.nbytes > cur:
            bnp[cur:] = 0
            h.update(bnp[cur:])
        with pub._cond:
            info.checksum = h.digest()
            told = st.packed = base + info.nbytes
            st.buckets_done = info.index + 1
        yield


def _sibling(endpoint: str) -> str:
    """A PUB address next to the ROUTER's: same host with a free port, or ``.pub``."""
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    return endpoint + ".pub"
