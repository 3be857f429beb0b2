"""Worker side of weight updates: follow a publisher, fetch, verify, apply, acknowledge.

A subscriber runs one background thread that owns its sockets: a DEALER to the
publisher's ROUTER (Hello heartbeats, Fetch, Ack) and a SUB on its PUB (Announce and
Heartbeat notices, sequence-numbered).

Never a mixed version (the trade-off chosen)
---------------------------------------------
Applying bucket k of version N before bucket k+1 has arrived and been verified would
leave a mixed model if the rest never comes (publisher killed, corrupt bytes). Keeping
the previous weights in that case needs *some* full copy: either an undo copy of what
was overwritten or the new bytes held until all of them are verified. This module holds
the new bytes, and only where they already are:

* same host (shared memory): the publisher's segment *is* the staging area. The worker
  verifies every bucket's checksum in place, then copies into its parameters: no extra
  memory on the worker, one copy per byte.
* over TCP: received buckets stay in the frames they arrived in (no copy); bucket k is
  verified while bucket k+1 is on the wire, and once all are verified they are copied
  into the parameters. The worker holds at most one version's frames, transiently.

Either way the metadata (names, shapes, dtypes, layout) is checked before a byte is
fetched, the parameters are written in place (references held by the engine stay valid)
and the version is switched only after the last copy. ``atomic=False`` trades the
guarantee for memory: each verified bucket is applied as it arrives (at most ``window``
buckets held); if the version then fails the worker reports its weights as mixed, and
:attr:`WeightSubscriber.consistent` is false until a later version completes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

import fastio
from fastio.weight_msgs import (
    PUBLISHER_TO_SUBSCRIBER,
    WeightAck,
    WeightAnnounce,
    WeightBucket,
    WeightError,
    WeightFetch,
    WeightHeartbeat,
    WeightHello,
    WeightWelcome,
)
from transport.sockets import CurveConfig, apply_curve_client
from transport.weights import shm as _shm
from transport.weights.binding import (
    Binding,
    DtypeSpec,
    Rename,
    advertised_dtype,
    parse_dtype_spec,
)
from transport.weights.bucket import (
    CHECKSUM_ALGOS,
    BucketApplier,
    Hasher,
    named_tensors,
    state_digest,
)
from transport.weights.errors import WeightUpdateError
from transport.weights.ratelog import RateLimitedLog

__all__ = ["UpdateStats", "WeightSubscriber"]

log = logging.getLogger("transport.weights.subscriber")


@dataclass
class UpdateStats:
    """Timings of the last update on this worker (seconds, monotonic clock).

    ``buckets`` holds one dict per bucket: ``recv_s`` (from the update's start to its
    arrival), ``verify_s`` and ``apply_s``.
    """

    version: int = -1
    via: str = ""
    bytes: int = 0
    fetch_s: float = 0.0
    verify_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    buckets: list[dict[str, float]] = field(default_factory=list)

    def flat(self) -> dict[str, float]:
        """A flat ``str -> float`` form for the Ack."""
        out = {
            "bytes": float(self.bytes),
            "fetch_s": self.fetch_s,
            "verify_s": self.verify_s,
            "apply_s": self.apply_s,
            "total_s": self.total_s,
        }
        for i, b in enumerate(self.buckets):
            for k, v in b.items():
                out[f"b{i}_{k}"] = v
        return out


class _Update:
    """State of one version being fetched over TCP."""

    def __init__(self, ann: WeightAnnounce, seg: _shm.ShmSegment | None, binding: Binding) -> None:
        self.ann = ann
        self.seg = seg
        self.binding = binding
        self.t0 = time.monotonic()
        self.todo = list(range(len(ann.buckets)))
        self.todo.reverse()  # pop() from the end gives bucket 0 first
        self.outstanding: dict[int, float] = {}
        self.attempts: dict[int, int] = {}
        self.received: dict[int, list[torch.Tensor]] = {}
        self.stats = UpdateStats(ann.version, "tcp" if seg is None else "shm", ann.total_bytes)
        self.stats.buckets = [{} for _ in ann.buckets]
        self.applied: set[int] = set()
        self.partial: dict[int, _Partial] = {}


class _Partial:
    """A bucket whose pieces are arriving: the checksum so far, the frames kept."""

    def __init__(self, hasher: Hasher) -> None:
        self.hasher = hasher
        self.size = 0
        self.verify_s = 0.0
        self.chunks: list[torch.Tensor] = []


class WeightSubscriber:
    """Keeps a model's weights at the latest version a :class:`WeightPublisher` serves.

    Parameters
    ----------
    endpoint:
        The publisher's ROUTER address.
    target:
        An ``nn.Module`` (its state dict is updated in place) or a mapping of name ->
        tensor to overwrite. CPU or CUDA tensors. ``None`` with a ``loader`` that takes
        every tensor.
    worker_id:
        Unique id of this worker (default: a random one). A restarted worker may reuse
        its id: the publisher then counts it as the same worker.
    version:
        The version the model holds now (``-1``: none).
    shm:
        Read same-host versions from shared memory when the handshake shows it works.
    atomic:
        Never leave mixed weights (see the module docstring); ``False`` applies buckets
        as they arrive.
    window:
        Buckets requested ahead over TCP.
    fetch_timeout:
        Seconds before an unanswered Fetch is sent again.
    retries:
        Attempts per bucket (timeouts and checksum failures) before the version fails.
    heartbeat_interval:
        Seconds between Hellos to the publisher.
    publisher_timeout:
        With no message from the publisher for this long, a version in progress fails.
    lock:
        Held while copying into the parameters (e.g. the engine's forward lock). If
        entering it raises, the version fails on this worker, which keeps its weights.
    on_applied:
        Called with the new version once it is in the weights, under ``lock`` and
        before the Ack is sent (in the subscriber's thread).
    on_progress:
        Called with ``(version, bucket_index)`` when a bucket arrived and was verified.
    report_digest:
        Send a digest of the weights (:func:`state_digest`) in Hellos and Acks.
    strict:
        The update must cover every tensor of ``target``.
    dtype:
        The dtypes wanted (see :mod:`transport.weights.binding`): ``None`` (exact
        match), ``"auto"`` (each target's own dtype), one dtype for every floating
        tensor, or a dict engine name -> dtype. Casts are bit-identical to
        ``tensor.to(dtype)``; the trainer casts when every worker wants the same
        narrower dtype (advertised in the Hello), else this worker casts in its copy.
    rename:
        Trainer name -> engine name: a dict (names not in it stay) or a callable
        (returning ``None`` skips the tensor).
    loader:
        Called with an iterable of ``(engine name, tensor)`` for every tensor of a
        version (aliases included, in the wanted dtype) once the whole version has
        verified and the in-place copy (into ``target``) is done, under ``lock``: the
        shape ``model.load_weights(...)`` takes. The tensors are read-only and valid
        only during the call (copy what must outlive it). If it raises, the version
        fails on this worker and is reported to the trainer; the engine's weights are
        then in whatever state the loader left them (possibly mixed),
        :attr:`consistent` is false and :attr:`version` stays the previous one until a
        later version completes.
    context:
        ZeroMQ context (default: the global instance).
    max_message_size:
        Largest frame accepted from the publisher (``ZMQ_MAXMSGSIZE``).
    tune_malloc:
        Opt-in, process-wide: on glibc, keep the allocator from returning freed memory
        to the kernel between versions (:func:`transport.weights.malloc.tune_malloc`):
        received TCP frames then reuse warm pages instead of faulting in fresh zeroed
        ones (see bench/results for the effect).
    curve:
        CurveZMQ keys (:class:`transport.CurveConfig`: this worker's ``.key_secret`` and
        the publisher's public ``.key`` as ``server_public_key_file``).

    Examples
    --------
    >>> sub = WeightSubscriber("tcp://127.0.0.1:5555", model).start()  # doctest: +SKIP
    >>> sub.wait_version(1, timeout=30)  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        endpoint: str,
        target: Any,
        *,
        worker_id: str | None = None,
        version: int = -1,
        shm: bool = True,
        atomic: bool = True,
        window: int = 2,
        fetch_timeout: float = 5.0,
        retries: int = 3,
        heartbeat_interval: float = 0.5,
        publisher_timeout: float = 10.0,
        lock: Any = None,
        on_applied: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        report_digest: bool = False,
        strict: bool = True,
        dtype: DtypeSpec = None,
        rename: Rename = None,
        loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
        context: zmq.Context[Any] | None = None,
        max_message_size: int = 1 << 30,
        tune_malloc: bool = False,
        curve: CurveConfig | None = None,
    ) -> None:
        self.endpoint = endpoint
        if tune_malloc:
            _tune_malloc()
        if target is None and loader is None:
            raise ValueError("a WeightSubscriber needs a target, a loader or both")
        if loader is not None and not atomic:
            raise ValueError("a loader takes whole versions: it needs atomic=True")
        self.targets = named_tensors(target) if target is not None else {}
        self.dtype = parse_dtype_spec(dtype)
        self.rename = rename
        self.loader = loader
        self._hello_dtype = advertised_dtype(self.dtype, self.targets)
        self.worker_id = worker_id or f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.shm = shm
        self.atomic = atomic
        self.window = max(1, window)
        self.fetch_timeout = fetch_timeout
        self.retries = max(1, retries)
        self.heartbeat_interval = heartbeat_interval
        self.publisher_timeout = publisher_timeout
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.on_applied = on_applied
        self.on_progress = on_progress
        self.report_digest = report_digest
        self.strict = strict
        self.max_message_size = max_message_size
        if curve is not None and curve.server_public_key_file is None:
            raise ValueError("CurveConfig.server_public_key_file is needed to subscribe")
        self.curve = curve
        #: Counters: bad messages, gaps, retries, versions applied / failed.
        self.counters: dict[str, int] = {}
        self._rlog = RateLimitedLog(log)
        #: Error text of the last failed version ("" if none).
        self.last_error = ""
        #: Timings of the last applied version.
        self.last_stats = UpdateStats()
        self._version = version
        self._consistent = True
        self._digest: int | None = state_digest(self.targets) if report_digest else None
        self._applier = BucketApplier(self.targets)
        self._ctx = context or zmq.Context.instance()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_hello = 0.0
        self._host = _shm.host_id()
        self._encoder = fastio.Encoder()
        self._decoder = fastio.Decoder(
            PUBLISHER_TO_SUBSCRIBER, max_message_size=max_message_size + (1 << 20)
        )
        # per publisher instance
        self._pub_id = ""
        self._pub_endpoint = ""
        self._shm_ok = False
        self._last_seq = 0
        self._last_heard = 0.0
        self._update: _Update | None = None
        self._attempts: dict[tuple[str, int], int] = {}
        self._given_up: set[tuple[str, int]] = set()
        self._segments: dict[str, _shm.ShmSegment] = {}

    # -- public API --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version the weights hold (last one applied completely)."""
        return self._version

    @property
    def consistent(self) -> bool:
        """False only in ``atomic=False`` mode after a version failed half-applied."""
        return self._consistent

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def last_heard(self) -> float:
        """``time.monotonic()`` of the last message from the publisher (0: none yet)."""
        return self._last_heard

    def start(self) -> WeightSubscriber:
        """Start the background thread (returns ``self``)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weights-subscriber-{self.worker_id}", daemon=True
            )
            self._thread.start()
        return self

    def wait_version(self, version: int, timeout: float) -> bool:
        """Wait until the weights are at ``version`` or newer; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        with self._cond:
            self._closed = True
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> WeightSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _run(self) -> None:
        self._dealer = self._ctx.socket(zmq.DEALER)
        apply_curve_client(self._dealer, self.curve)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.ROUTING_ID, self.worker_id.encode())
        self._dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_size)
        self._dealer.setsockopt(zmq.RCVHWM, 10_000)
        # Nothing is queued while the publisher is down: a restarted publisher must not
        # receive a burst of stale Fetches meant for its predecessor.
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)
        self._dealer.connect(self.endpoint)
        self._sub = self._ctx.socket(zmq.SUB)
        apply_curve_client(self._sub, self.curve)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        next_hello = 0.0
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                now = time.monotonic()
                if now >= next_hello:
                    self._hello()
                    next_hello = now + self.heartbeat_interval
                    self._check_timeouts(now)
                timeout = min(next_hello - now, 0.2)
                events = dict(poller.poll(int(max(0.0, timeout) * 1000)))
                if self._sub in events:
                    self._drain(self._sub)
                if self._dealer in events:
                    self._drain(self._dealer)
        except Exception:  # the thread must not die silently
            log.exception("weight subscriber %s crashed", self.worker_id)
            raise
        finally:
            self._dealer.close(linger=0)
            self._sub.close(linger=0)
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frames)
            except fastio.DecodeError as exc:
                self._count("bad_messages")
                self._rlog.warning("bad message", "bad message from the weight publisher: %s", exc)
                continue
            try:
                self._dispatch(msg)
            except Exception as exc:  # keep following the publisher; report the version
                self._count("internal_errors")
                log.exception("weight subscriber %s: error handling a message", self.worker_id)
                if self._update is not None:
                    self._fail(self._update.ann.version, f"internal error: {exc!r}")

    def _send(self, msg: Any) -> None:
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    def _keepalive(self) -> None:
        """A Hello if one is due, from inside a long commit (or a lock's wait): a
        worker silent for the publisher's ``worker_timeout`` is declared lost, and the
        shared memory it still copies from could be reused for the next version."""
        if time.monotonic() - self._last_hello >= self.heartbeat_interval:
            self._hello()

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        self._send(
            WeightHello(
                self.worker_id,
                self._host,
                os.getpid(),
                self._version,
                self._digest,
                self._hello_dtype,
            )
        )

    def _dispatch(self, msg: Any) -> None:
        if (
            isinstance(msg, (WeightWelcome, WeightHeartbeat, WeightAnnounce))
            and msg.publisher_id != self._pub_id
        ):
            if not isinstance(msg, WeightWelcome):
                # A notice from a publisher we have not shaken hands with (it was
                # restarted): ask it for its state.
                self._hello()
                return
            self._new_publisher(msg)
        self._last_heard = time.monotonic()
        if isinstance(msg, WeightWelcome):
            if msg.announce is not None:
                self._consider(msg.announce)
        elif isinstance(msg, WeightHeartbeat):
            if msg.seq > self._last_seq:
                self._count("gaps")  # an Announce was lost: ask for the snapshot
                self._last_seq = msg.seq
                self._hello()
        elif isinstance(msg, WeightAnnounce):
            if msg.seq > self._last_seq + 1:
                self._count("gaps")
            self._last_seq = max(self._last_seq, msg.seq)
            self._consider(msg)
        elif isinstance(msg, WeightBucket):
            self._on_bucket(msg)
        elif isinstance(msg, WeightError):
            self._on_error(msg)

    def _new_publisher(self, w: WeightWelcome) -> None:
        if self._update is not None:
            self._fail(self._update.ann.version, "the publisher was restarted mid-update")
        self._pub_id = w.publisher_id
        self._last_seq = w.seq
        self._shm_ok = (
            self.shm and w.host_id == self._host and _shm.read_probe(w.shm_probe, w.shm_token)
        )
        if w.pub_endpoint != self._pub_endpoint:
            if self._pub_endpoint:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(self._pub_endpoint)
            self._pub_endpoint = w.pub_endpoint
            self._sub.connect(w.pub_endpoint)
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()

    # -- a version -------------------------------------------------------------------
    def _consider(self, ann: WeightAnnounce) -> None:
        if ann.version <= self._version and self._consistent:
            return
        if self._update is not None:
            if self._update.ann.version >= ann.version:
                return
            self._abandon(f"superseded by version {ann.version}")
        key = (ann.publisher_id, ann.version)
        if key in self._given_up:
            return
        n = self._attempts[key] = self._attempts.get(key, 0) + 1
        if n > self.retries:
            self._given_up.add(key)
            return
        try:
            if ann.checksum_algo not in CHECKSUM_ALGOS:
                raise WeightUpdateError(f"checksum {ann.checksum_algo!r} not available here")
            binding = Binding(
                ann.buckets,
                self.targets,
                aliases=ann.aliases,
                rename=self.rename,
                dtype=self.dtype,
                strict=self.strict,
                loader=self.loader is not None,
            )
        except WeightUpdateError as exc:
            self._given_up.add(key)  # a mismatch will not go away by retrying
            self._fail(ann.version, str(exc), transport="")
            return
        seg = None
        if self._shm_ok and ann.shm_name:
            try:
                seg = self._segment(ann.shm_name)
            except OSError as exc:
                log.info("shared memory %s unusable (%s); fetching over TCP", ann.shm_name, exc)
                self._count("shm_fallbacks")
        self._update = _Update(ann, seg, binding)
        self._pump()

    def _segment(self, name: str) -> _shm.ShmSegment:
        # Each version has its own segment (never rewritten while mapped here); the
        # mapping is dropped when the version is done with (_drop_segment).
        seg = self._segments.get(name)
        if seg is None:
            seg = self._segments[name] = _shm.ShmSegment.open(name)
        return seg

    def _drop_segment(self, up: _Update) -> None:
        if up.seg is not None:
            seg = self._segments.pop(up.seg.name, None)
            if seg is not None:
                seg.close()

    def _pump(self) -> None:
        """Keep ``window`` fetches in flight."""
        up = self._update
        if up is None:
            return
        now = time.monotonic()
        shm = up.seg is not None
        # Through shared memory nothing but a "ready" notice comes back: ask for all.
        window = len(up.ann.buckets) if shm else self.window
        while up.todo and len(up.outstanding) < window:
            i = up.todo.pop()
            up.outstanding[i] = now
            up.attempts[i] = up.attempts.get(i, 0) + 1
            self._send(WeightFetch(up.ann.version, i, shm))

    def _on_bucket(self, msg: WeightBucket) -> None:
        up = self._update
        if up is None or msg.version != up.ann.version or msg.index not in up.outstanding:
            self._count("stale_pieces")
            return
        i = msg.index
        info = up.ann.buckets[i]
        t = time.monotonic()
        if up.seg is not None:
            self._on_shm_ready(up, msg, t)
            return
        part = up.partial.get(i)
        if part is None:
            part = up.partial[i] = _Partial(Hasher(up.ann.checksum_algo))
        up.outstanding[i] = t  # progress: the fetch timeout counts from the last piece
        ok = msg.offset == part.size
        for c in msg.chunks:
            if not ok:
                break
            if not isinstance(c, np.ndarray) or c.dtype != np.uint8 or c.ndim != 1:
                ok = False
                break
            part.hasher.update(c)
            part.size += c.nbytes
            part.chunks.append(_u8(c))
        ok = ok and part.size <= info.nbytes
        dt = time.monotonic() - t
        up.stats.verify_s += dt
        part.verify_s += dt
        if ok and not msg.last:
            return
        del up.outstanding[i]
        del up.partial[i]
        ok = ok and part.size == info.nbytes and part.hasher.digest() == msg.checksum
        if not ok:
            self._count("checksum_failures")
            if up.attempts.get(i, 0) >= self.retries:
                self._fail(
                    up.ann.version,
                    f"bucket {i} of version {up.ann.version} failed its checksum "
                    f"{up.attempts[i]} times",
                )
                return
            self._count("refetches")
            up.todo.append(i)
            self._pump()
            return
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        self._landed(up, i, part.chunks)

    def _on_shm_ready(self, up: _Update, msg: WeightBucket, t: float) -> None:
        """Bytes of bucket ``msg.index`` are packed in the segment: hash them in place
        as they come; on the last notice compare with the checksum."""
        assert up.seg is not None
        i = msg.index
        info = up.ann.buckets[i]
        part = up.partial.get(i)
        if part is None:
            part = up.partial[i] = _Partial(Hasher(up.ann.checksum_algo))
        up.outstanding[i] = t
        lo = info.shm_offset + msg.offset
        if (
            msg.chunks
            or msg.offset != part.size
            or msg.nbytes < 0
            or msg.offset + msg.nbytes > info.nbytes
            or info.shm_offset + info.nbytes > up.seg.size
        ):
            self._fail(up.ann.version, f"bad shared-memory notice for bucket {i}", "shm")
            return
        part.hasher.update(up.seg.tensor[lo : lo + msg.nbytes].numpy())
        part.size += msg.nbytes
        dt = time.monotonic() - t
        part.verify_s += dt
        up.stats.verify_s += dt
        if not msg.last:
            return
        del up.outstanding[i]
        del up.partial[i]
        up.stats.buckets[i].update(recv_s=t - up.t0, verify_s=part.verify_s)
        if part.size != info.nbytes or part.hasher.digest() != msg.checksum:
            # The segment is the snapshot itself: fetching again would read the same bytes.
            self._count("checksum_failures")
            self._fail(
                up.ann.version,
                f"bucket {i} of version {up.ann.version} fails its checksum in shared memory",
                "shm",
            )
            return
        self._landed(up, i, [up.seg.tensor[info.shm_offset : info.shm_offset + info.nbytes]])

    def _landed(self, up: _Update, i: int, chunks: list[torch.Tensor]) -> None:
        """Bucket ``i`` arrived and is verified: keep it (or apply it, ``atomic=False``)."""
        info = up.ann.buckets[i]
        up.received[i] = chunks
        if self.on_progress is not None:
            self.on_progress(up.ann.version, i)
        if not self.atomic:
            ta = time.monotonic()
            with self.lock:
                self._consistent = False  # from here until the commit, weights are mixed
                self._applier.apply(info, chunks, up.binding.dests)
                self._applier.finish()
            up.stats.buckets[i]["apply_s"] = time.monotonic() - ta
            up.stats.apply_s += up.stats.buckets[i]["apply_s"]
            up.applied.add(i)
            up.received[i] = []  # applied: the frames can go
        self._pump()
        if not up.todo and not up.outstanding:
            self._update = None
            up.stats.fetch_s = time.monotonic() - up.t0
            try:
                self._commit(
                    up,
                    [
                        (b, up.received[b.index])
                        for b in up.ann.buckets
                        if b.index not in up.applied
                    ],
                )
            finally:
                up.received.clear()
                self._drop_segment(up)

    def _commit(self, up: _Update, parts: list[tuple[Any, list[torch.Tensor]]]) -> None:
        ann, stats, t0 = up.ann, up.stats, up.t0
        try:
            self.lock.__enter__()
        except Exception as exc:  # e.g. the worker could not stop generating in time
            self._fail(ann.version, f"not applied, the weights were not free: {exc}")
            return
        try:  # the lock's body (not a `with`: a lock that refuses fails the version)
            try:
                for b, chunks in parts:
                    ta = time.monotonic()
                    self._applier.apply(b, chunks, up.binding.dests)
                    dt = time.monotonic() - ta
                    stats.apply_s += dt
                    stats.buckets[b.index]["apply_s"] = dt
                    self._keepalive()
                self._applier.finish()
            except Exception as exc:
                # A copy failed half-way (device error, out of memory): the weights are
                # now mixed, and say so until a later version completes.
                self._consistent = False
                self._fail(ann.version, f"applying failed, weights are mixed: {exc!r}")
                return
            if self.loader is not None:
                ta = time.monotonic()
                try:
                    self.loader(up.binding.named_tensors(parts))
                except Exception as exc:
                    self._consistent = False
                    self._count("loader_failures")
                    self._fail(
                        ann.version,
                        f"the loader raised {exc!r}; the engine's weights may be mixed",
                    )
                    return
                stats.apply_s += time.monotonic() - ta
            with self._cond:
                self._version = ann.version
                self._consistent = True
                self._cond.notify_all()
            # Still under the lock and before the Ack: once the trainer hears "applied",
            # the engine already stamps the new version on what it generates.
            if self.on_applied is not None:
                self.on_applied(ann.version)
        finally:
            self.lock.__exit__(None, None, None)
        parts.clear()  # drop the frames now, not at the next update
        for key in [k for k in self._attempts if k[1] <= ann.version]:
            del self._attempts[key]
        self._given_up = {k for k in self._given_up if k[1] > ann.version}
        stats.total_s = time.monotonic() - t0
        self.last_stats = stats
        self.last_error = ""
        self._count("versions_applied")
        if self.report_digest:
            self._digest = state_digest(self.targets)
        self._send(
            WeightAck(
                self.worker_id,
                ann.version,
                True,
                ann.version,
                "",
                self._digest,
                stats.via,
                stats.flat(),
            )
        )

    def _fail(self, version: int, error: str, transport: str = "tcp") -> None:
        if self._update is not None and self._update.ann.version == version:
            if self._update.applied:
                self._consistent = False
                error += "; weights are mixed (atomic=False) until a later version completes"
            self._drop_segment(self._update)
            self._update = None
        self.last_error = error
        self._count("versions_failed")
        log.warning(
            "weight version %d not applied (%s); keeping version %d", version, error, self._version
        )
        self._send(
            WeightAck(self.worker_id, version, False, self._version, error, self._digest, transport)
        )

    def _abandon(self, why: str) -> None:
        up = self._update
        if up is not None:
            self._fail(up.ann.version, why)

    def _on_error(self, msg: WeightError) -> None:
        up = self._update
        self._count("errors_received")
        if up is None or msg.version != up.ann.version:
            self._rlog.warning("publisher error", "weight publisher error: %s", msg.reason)
            return
        self._fail(up.ann.version, f"publisher: {msg.reason}")
        # A newer version exists: the next Hello brings its manifest.
        self._hello()

    def _check_timeouts(self, now: float) -> None:
        up = self._update
        if up is None:
            return
        if self._last_heard and now - self._last_heard > self.publisher_timeout:
            self._fail(
                up.ann.version,
                f"publisher silent for {now - self._last_heard:.1f} s (dead?) mid-update",
            )
            return
        for i, sent in list(up.outstanding.items()):
            if now - sent < self.fetch_timeout:
                continue
            if up.attempts.get(i, 0) >= self.retries:
                self._fail(
                    up.ann.version,
                    f"bucket {i} of version {up.ann.version}: no answer "
                    f"after {up.attempts[i]} fetches",
                )
                return
            self._count("refetches")
            del up.outstanding[i]
            up.partial.pop(i, None)
            up.todo.append(i)
        self._pump()


_MALLOC_TUNED = False


def _tune_malloc() -> None:
    """glibc only: serve allocations up to 32 MiB from the heap, and trim the heap only
    above 1 GiB free at its top.

    libzmq allocates every received message with ``malloc``. A version's pieces are held
    until the commit and then freed together; with glibc's defaults those pages go back
    to the kernel, and the next version's pieces fault in fresh zeroed pages (measured
    here: 0.45 s instead of 0.18 s for 184 MiB to two workers). 32 MiB is the largest
    mmap threshold glibc itself would adopt dynamically.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        log.debug("mallopt unavailable; allocator left as it is")


def _u8(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    """A uint8 tensor over a received chunk, no copy (frames from zmq are writable)."""
    if not arr.flags.writeable:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)
