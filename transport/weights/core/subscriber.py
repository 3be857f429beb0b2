"""The subscriber's protocol core: which version to try, what to fetch next, what to
report, the pause lease. No sockets, threads or clock."""

from __future__ import annotations

from typing import Literal

from transport.counting import Counts

__all__ = ["MIXED", "FetchSchedule", "Notice", "PauseLease", "SubscriberCore", "choose_atomic"]

#: The notices of a publisher's state, numbered in one sequence.
Notice = Literal["welcome", "heartbeat", "announce"]

#: Added to the error of a version that left the weights mixed.
MIXED = "weights are mixed (atomic=False): not serving until a version completes"


def choose_atomic(atomic: bool | None, refuses_mixed: bool, loader: bool) -> bool:
    """One pass (``False``) only under a lock that ``refuses_mixed`` and without a loader."""
    if atomic is None:
        return loader or not refuses_mixed
    if loader and not atomic:
        raise ValueError("a loader takes whole versions: it needs atomic=True")
    return atomic


class SubscriberCore:
    """The subscriber's state machine (``version`` at start; ``retries`` per version)."""

    def __init__(self, version: int = -1, retries: int = 3) -> None:
        self.version = version
        self.retries = max(1, retries)
        self._consistent = True
        self.publisher_id = ""
        self.source = ""  # the publisher instance ``version`` came from ("": the initial one)
        self.last_seq = 0
        self.last_heard = 0.0
        self.counters = Counts()
        self._attempts: dict[tuple[str, int], int] = {}
        self._given_up: set[tuple[str, int]] = set()

    def count(self, key: str) -> None:
        self.counters.add(key)

    @property
    def consistent(self) -> bool:
        """The weights hold one complete version."""
        return self._consistent

    def mark_mixed(self) -> None:
        """A first write, or a copy or load failed part-way: no complete version until one is."""
        self._consistent = False

    @property
    def held_version(self) -> int:
        """``version`` as the publisher followed now counts it: ``-1`` when it came from
        another publisher instance (a restarted trainer's versions are all new to it)."""
        return self.version if self.source in ("", self.publisher_id) else -1

    @property
    def reported_version(self) -> int:
        """The version reported in Hellos and Acks: ``-1`` while the weights are mixed."""
        return self.version if self._consistent else -1

    def notice(
        self, publisher_id: str, kind: Notice, seq: int, now: float
    ) -> Literal["handshake", "hello", "handle"]:
        """A Welcome, Heartbeat or Announce numbered ``seq``: ``"handshake"`` (a new publisher
        instance, whose numbers start at ``seq``), ``"hello"`` (one not shaken hands with, or
        a Heartbeat past a lost Announce: ask its state) or ``"handle"``."""
        if publisher_id != self.publisher_id:
            if kind != "welcome":
                return "hello"
            self.publisher_id, self.last_seq, self.last_heard = publisher_id, seq, now
            return "handshake"
        self.last_heard = now
        # A Welcome leaves last_seq: an Announce lost on PUB is still counted at the next
        # Heartbeat when a Welcome brought its state first (at the cost of one Hello).
        if kind == "welcome" or seq <= self.last_seq:
            return "handle"
        if kind == "heartbeat" or seq > self.last_seq + 1:
            self.count("gaps")  # an Announce skipping numbers is itself the latest state
        self.last_seq = seq
        return "hello" if kind == "heartbeat" else "handle"

    def forget_publisher(self) -> None:
        """The handshake with the publisher failed part-way: the next Welcome is new."""
        self.publisher_id = ""

    def silent(self, now: float, timeout: float) -> bool:
        """No word from the publisher for ``timeout`` seconds (after a first one)."""
        return bool(self.last_heard) and now - self.last_heard > timeout

    def consider(self, publisher_id: str, version: int, in_flight: int | None) -> tuple[bool, bool]:
        """An Announce: ``(supersede, attempt)`` the version in flight, and this one (an
        older or equal one too when the weights came from another publisher instance)."""
        held = self.version if self.source in ("", publisher_id) else -1
        if (self._consistent and version <= held) or (
            in_flight is not None and in_flight >= version
        ):
            return False, False
        key = (publisher_id, version)
        if key not in self._given_up:
            self._attempts[key] = self._attempts.get(key, 0) + 1
            if self._attempts[key] > self.retries:
                self._given_up.add(key)
        return in_flight is not None, key not in self._given_up

    def give_up(self, publisher_id: str, version: int) -> None:
        """A version that cannot fit this model: never tried again."""
        self._given_up.add((publisher_id, version))

    def applied(self, version: int) -> None:
        """The weights are now all of ``version``, from the publisher followed now."""
        self.version = version
        self.source = self.publisher_id
        self._consistent = True
        self._attempts = {k: n for k, n in self._attempts.items() if k[1] > version}
        self._given_up = {k for k in self._given_up if k[1] > version}

    def failed(self, error: str) -> str:
        """A version failed: the error to report (naming mixed weights if they are)."""
        if not self._consistent and "weights are mixed" not in error:
            error += f"; {MIXED}"
        self.count("versions_failed")
        return error


class FetchSchedule:
    """Which buckets of a version to ask for (in order, ``window`` at a time) and when again
    (``retries`` at most); ``shm``: all at once, a bad checksum final (same bytes again)."""

    def __init__(
        self, version: int, n_buckets: int, window: int, retries: int, *, shm: bool = False
    ) -> None:
        self.version = version
        self.shm = shm
        self.window = max(1, n_buckets if shm else window)
        self.retries = max(1, retries)
        self.todo = list(range(n_buckets - 1, -1, -1))  # pop() gives bucket 0 first
        self.outstanding: dict[int, float] = {}
        self.attempts: dict[int, int] = {}

    def due(self, now: float) -> list[int]:
        """The buckets to ask for now (each counted as an attempt)."""
        out: list[int] = []
        while self.todo and len(self.outstanding) < self.window:
            i = self.todo.pop()
            self.outstanding[i] = now
            self.attempts[i] = self.attempts.get(i, 0) + 1
            out.append(i)
        return out

    def progress(self, i: int, now: float) -> None:
        self.outstanding[i] = now

    def done(self, i: int) -> None:
        """Bucket ``i`` arrived (checked or not: see :meth:`again`)."""
        del self.outstanding[i]

    def again(self, i: int) -> str | None:
        """Bucket ``i`` failed its check: ``None`` (asked again) or why the version fails."""
        self.outstanding.pop(i, None)
        if self.shm:
            return f"bucket {i} of version {self.version} fails its checksum in shared memory"
        n = self.attempts.get(i, 0)
        if n >= self.retries:
            return f"bucket {i} of version {self.version} failed its checksum {n} times"
        self.todo.append(i)
        return None

    def requeue(self, i: int) -> None:
        """Ask bucket ``i`` again without counting a failure (its channel broke)."""
        del self.outstanding[i]
        self.todo.append(i)

    def timeouts(self, now: float, fetch_timeout: float) -> tuple[list[int], str | None]:
        """Buckets asked again for lack of an answer, or why the version fails."""
        again: list[int] = []
        for i, sent in list(self.outstanding.items()):
            if now - sent < fetch_timeout:
                continue
            n = self.attempts.get(i, 0)
            if n >= self.retries:
                return again, f"bucket {i} of version {self.version}: no answer after {n} fetches"
            self.requeue(i)
            again.append(i)
        return again, None

    @property
    def finished(self) -> bool:
        return not self.todo and not self.outstanding


class PauseLease:
    """A pause is a lease held by a live trainer: a worker paused (not by its own copy)
    whose publisher is silent for ``lease`` seconds resumes, unless its weights are mixed."""

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self._since: float | None = None

    def tick(
        self, now: float, *, paused: bool, copying: bool, mixed: bool, last_heard: float
    ) -> float | None:
        """Seconds of silence when the worker should resume now, else ``None``."""
        if not paused or copying or mixed:
            self._since = None
            return None
        if self._since is None:
            self._since = now
        quiet = now - max(self._since, last_heard)
        if quiet < self.lease:
            return None
        self._since = None
        return quiet
