"""The publisher's protocol core: who is a worker, who must answer a version, how a
Fetch is answered, who may still read a buffer. No sockets, threads or clock."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastio.weight_msgs import WeightAck, WeightAnnounce, WeightFetch, WeightHello
from transport.counting import Counts
from transport.weights.core.process import process_alive, process_start_time
from transport.weights.results import SubscriberInfo, UpdateResult

__all__ = ["FetchAction", "PublisherCore", "Reader", "VersionLedger"]

#: A process that may read a segment: ``(worker_id, pid, start_time, visible)``;
#: ``visible`` is its start time when this host can see that pid, else 0.
Reader = tuple[str, int, int, int]

#: How many dropped versions keep their final result for :meth:`PublisherCore.result`.
KEEP_RESULTS = 64

#: What to do with a Fetch: ``("send", "", latest)``, ``("park", "", latest)`` (until the
#: ipc slots hold the version whole) or ``("refuse", why, the latest version to name)``.
FetchAction = tuple[Literal["send", "park", "refuse"], str, int]


@dataclass(slots=True, eq=False)
class VersionLedger:
    """Who must answer one version, who did, who may still read its buffer, and its
    manifest (``shm_name``: a segment holds it)."""

    version: int
    announce: WeightAnnounce | None = None
    announced_at: float = 0.0
    done_at: float = 0.0
    expected: set[str] = field(default_factory=set)
    acks: dict[str, WeightAck] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)
    readers: set[Reader] = field(default_factory=set)
    #: The answers being sent, by ``(worker id, bucket)`` (the driver's objects).
    answering: dict[tuple[str, int], Any] = field(default_factory=dict)
    failure_counted: bool = False  # in the metrics
    unstaged: bool = False  # published to ipc workers only: no buffer yet
    ipc_packing: bool = False  # being packed into the ipc slots

    def answered(self) -> bool:
        """Every expected worker acked the version or was lost."""
        return all(w in self.acks or w in self.lost for w in self.expected)

    def settled(self) -> bool:
        """Someone is expected and every one answered (what :meth:`wait` waits for)."""
        return bool(self.expected) and self.answered()

    def result(self, now: float) -> UpdateResult:
        res = UpdateResult(self.version)
        for w in sorted(self.expected | set(self.acks)):
            ack = self.acks.get(w)
            if ack is not None:
                res.paths[w] = ack.via
                if ack.ok:
                    res.applied[w] = ack
                else:
                    res.failed[w] = ack.error or "failed"
            elif w in self.lost:
                res.failed[w] = self.lost[w]
            else:
                res.missing.append(w)
        end = self.done_at if self.answered() and self.done_at else now
        res.elapsed_s = end - self.announced_at
        return res

    def answer(self, wid: str, ack: WeightAck, reader: tuple[str, int, int], now: float) -> None:
        self.forget_reader(reader)
        self.acks[wid] = ack
        self.expected.add(wid)
        self.check_done(now)

    def forget_reader(self, reader: tuple[str, int, int]) -> None:
        """``(worker id, pid, start time)`` reads the buffer no more."""
        self.readers = {r for r in self.readers if r[:3] != reader}

    def check_done(self, now: float) -> None:
        if not self.done_at and self.settled():
            self.done_at = now


class PublisherCore:
    """The publisher's state machine over workers and versions (``host_id``: this host;
    ``alive`` and ``start_time_of`` look a process up, in ``/proc`` by default)."""

    def __init__(
        self,
        host_id: str,
        worker_timeout: float,
        *,
        publisher_id: str = "",
        alive: Callable[[int, int], bool] = process_alive,
        start_time_of: Callable[[int], int | None] = process_start_time,
    ) -> None:
        self.host_id = host_id
        self.worker_timeout = worker_timeout
        self.publisher_id = publisher_id
        self._alive = alive
        self._start_time_of = start_time_of
        self.workers: dict[str, SubscriberInfo] = {}
        self.versions: dict[int, VersionLedger] = {}
        self.retired: dict[int, UpdateResult] = {}
        self.latest: VersionLedger | None = None
        self.counters = Counts()

    def count(self, key: str, n: int = 1) -> None:
        self.counters.add(key, n)

    @property
    def latest_version(self) -> int:
        """The latest announced version (``-1`` before the first)."""
        return self.latest.version if self.latest is not None else -1

    def check_newer(self, version: int) -> None:
        """A version to publish must be newer than any before (else ``ValueError``)."""
        if version <= (latest := self.latest_version):
            raise ValueError(f"version {version} is not newer than the latest ({latest})")

    def alive(self) -> set[str]:
        """Ids of the live workers."""
        return {w for w, i in self.workers.items() if i.alive}

    def wanted_dtype(self) -> str:
        """The floating dtype every live worker asked for (``""``: none, or not one)."""
        wanted = {i.dtype for i in self.workers.values() if i.alive}
        return wanted.pop() if len(wanted) == 1 else ""

    def announce(self, led: VersionLedger, now: float) -> None:
        """``led`` is the new latest version: every live worker must answer it."""
        led.announced_at = now
        led.expected = self.alive()
        self.versions[led.version] = led
        self.latest = led

    def expect(self, led: VersionLedger, workers: Iterable[str] | None) -> None:
        """Who must answer ``led``: ``workers`` (``None``: as announced)."""
        if workers is not None:
            led.expected = set(workers)

    def outcome(self, led: VersionLedger, now: float) -> tuple[UpdateResult, bool]:
        """``led``'s result, and whether this is the first look at its failure."""
        res = led.result(now)
        first = bool(res.failed) and not led.failure_counted
        led.failure_counted = led.failure_counted or first
        return res, first

    def on_fetch(self, wid: str, msg: WeightFetch, led: VersionLedger | None) -> FetchAction:
        """The fetch rule for ``led`` (``None``: not held); by shm, ``wid``'s process
        reads the buffer until it answers."""
        v, latest = msg.version, self.latest_version
        if led is None or led.announce is None:
            return "refuse", f"version {v} is not available (latest is {latest})", latest
        if led.unstaged and led.ipc_packing:
            self.count("fetches_deferred")
            return "park", "", latest
        if led.unstaged:
            return "refuse", f"version {v} is no longer held (latest is {latest})", latest
        if not 0 <= msg.index < len(led.announce.buckets):
            return "refuse", f"no bucket {msg.index} in version {v}", latest
        if msg.shm and not led.announce.shm_name:
            return "refuse", "no shared memory for this version", -1
        if msg.shm:
            led.readers.add(self.reader(wid, msg))
        return "send", "", latest

    def answering(self, led: VersionLedger, key: tuple[str, int], answer: Any) -> Any:
        """``answer`` to ``(worker, bucket)`` starts; returns the earlier one it ends."""
        old, led.answering[key] = led.answering.get(key), answer
        return old

    def answer_ended(self, led: VersionLedger, key: tuple[str, int], answer: Any) -> None:
        if led.answering.get(key) is answer:
            del led.answering[key]

    def reusable(self, led: VersionLedger, *, sending: bool) -> bool:
        """The buffer rule: whether ``led``'s buffer may be taken (``sending``: bytes of it
        still queued or still being packed; a segment rewritten only once
        :meth:`readers_done` too)."""
        return led is not self.latest and not sending and not led.answering and led.answered()

    def takeable(self, sending: Callable[[int], bool], keep: int = 0) -> list[int]:
        """The versions whose buffers may be taken, oldest first (``sending(version)``: see
        :meth:`reusable`); with ``keep``, only as many as are held beyond ``keep``."""
        free = [
            v for v, led in sorted(self.versions.items()) if self.reusable(led, sending=sending(v))
        ]
        return free[: max(len(self.versions) - keep, 0)]

    @staticmethod
    def fits(total: int, size: int) -> bool:
        """Whether a pooled segment of ``size`` bytes takes ``total`` without wasting half."""
        return total <= size <= 2 * total or total == size == 0

    def drop(self, version: int, now: float = 0.0) -> None:
        """Forget a retired version (its result stays a while: :meth:`result`)."""
        led = self.versions.pop(version, None)
        if led is None:
            return
        if led is self.latest:
            self.latest = None
        self.retired[version] = led.result(now or led.done_at or led.announced_at)
        while len(self.retired) > KEEP_RESULTS:
            del self.retired[next(iter(self.retired))]

    def close(self) -> None:
        """The publisher closes: it holds no version any more."""
        self.versions.clear()
        self.latest = None

    def touch(self, wid: str, now: float, *, hello: bool = False) -> SubscriberInfo:
        """A message from ``wid``: a Hello makes it a worker; any keeps a worker alive."""
        info = self.workers.get(wid)
        if info is None:
            if not hello:
                return SubscriberInfo(wid, alive=False)  # a stray: answered, not counted
            info = self.workers[wid] = SubscriberInfo(wid)
        info.last_seen = now
        if not info.alive:
            info.alive = True
            for led in self.versions.values():
                led.lost.pop(wid, None)
        return info

    def seen(self, wid: str, now: float) -> bool:
        """A route's message from ``wid`` (an ipc notice): whether it is a worker; its
        silence timer restarts, a worker lost stays lost (only weights messages revive)."""
        info = self.workers.get(wid)
        if info is not None:
            info.last_seen = now
        return info is not None

    def on_hello(self, wid: str, msg: WeightHello, now: float) -> VersionLedger | None:
        """Record a Hello; the latest version when the worker is behind it (the snapshot)."""
        info = self.touch(wid, now, hello=True)
        process = (msg.host_id, msg.pid, msg.start_time)
        if (info.host_id, info.pid, info.hello_start_time) != process:
            # Another process (a restart may even reuse the pid): its own start time, kept
            # only when this host sees that process (else 0: never taken for gone).
            here = msg.host_id == self.host_id and msg.pid > 0 and msg.start_time > 0
            seen = here and self._start_time_of(msg.pid) == msg.start_time
            info.start_time = msg.start_time if seen else 0
            info.hello_start_time = msg.start_time
        info.host_id, info.pid = msg.host_id, msg.pid
        info.version, info.digest, info.dtype = msg.version, msg.digest, msg.dtype
        # A version from another publisher instance (a restarted trainer's) is none of ours.
        held = msg.version if msg.source in ("", self.publisher_id) else -1
        latest = self.latest
        if latest is not None and held < latest.version and wid not in latest.acks:
            latest.expected.add(wid)
        for led in self.versions.values():
            if led.version > held:
                continue
            # A Hello at version >= v means v was applied even if its Ack was lost.
            if wid in led.expected and wid not in led.acks:
                ack = WeightAck(wid, led.version, True, msg.version, "", msg.digest, info.path)
                led.answer(wid, ack, (wid, msg.pid, msg.start_time), now)
            else:
                led.forget_reader((wid, msg.pid, msg.start_time))
        return latest if latest is not None and held < latest.version else None

    def on_ack(self, wid: str, msg: WeightAck, now: float) -> bool:
        """Record an Ack; False (ignored, counted) when ``wid`` never said Hello."""
        if wid not in self.workers:
            self.count("acks_from_strangers")
            return False
        info = self.touch(wid, now)
        led = self.versions.get(msg.version)
        if led is not None:
            led.answer(wid, msg, self.reader(wid, msg)[:3], now)
        info.version = msg.current_version
        if msg.via:
            info.path = msg.via
        if msg.digest is not None:
            info.digest = msg.digest
        return True

    def reader(self, wid: str, msg: WeightFetch | WeightAck) -> Reader:
        """The process behind a Fetch or Ack (named, else the one of the last Hello)."""
        info = self.workers.get(wid)
        if info is not None and (
            not msg.pid or (msg.pid, msg.start_time) == (info.pid, info.hello_start_time)
        ):
            return wid, info.pid, info.hello_start_time, info.start_time
        if msg.pid:
            seen = self._start_time_of(msg.pid) if msg.start_time > 0 else None
            return wid, msg.pid, msg.start_time, msg.start_time if seen == msg.start_time else 0
        return wid, 0, 0, 0

    def readers_done(self, led: VersionLedger) -> bool:
        """The buffer rule: whether no process may still read ``led``'s buffer (one this
        host sees is gone once it ended)."""
        led.readers = {r for r in led.readers if r[3] <= 0 or self._alive(r[1], r[3])}
        return not led.readers

    def tick(self, now: float, gone: Iterable[str] = ()) -> list[tuple[str, str]]:
        """Declare lost the workers in ``gone`` (seen by the ipc route) and those silent
        or whose process is gone; returns ``(id, reason)``."""
        lost: list[tuple[str, str]] = []
        seen_gone = set(gone)
        for w, info in self.workers.items():
            if not info.alive:
                continue
            if w in seen_gone or (info.start_time and not self._alive(info.pid, info.start_time)):
                reason = "worker lost: its process is gone"
            elif now - info.last_seen > self.worker_timeout:
                reason = f"worker lost: no message for {now - info.last_seen:.1f} s"
            else:
                continue
            info.alive = False
            lost.append((w, reason))
        for w, reason in lost:
            for led in self.versions.values():
                if w in led.expected and w not in led.acks:
                    led.lost[w] = reason
                    led.check_done(now)
        return lost

    def lookup(self, version: int) -> VersionLedger | UpdateResult:
        """``version``'s ledger, or its final result once retired (among the last
        :data:`KEEP_RESULTS`; else ``KeyError``)."""
        found = self.versions.get(version) or self.retired.get(version)
        if found is None:
            raise KeyError(f"version {version} was not published by this publisher")
        return found

    def result(self, version: int, now: float) -> UpdateResult:
        """Where ``version`` stands (see :meth:`lookup`)."""
        led = self.lookup(version)
        return led.result(now) if isinstance(led, VersionLedger) else led
