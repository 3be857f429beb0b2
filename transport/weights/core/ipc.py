"""The ipc route's rules (``docs/PROTOCOL.md``, "The ipc path"): when a slot may be packed
again, when the slots hold a version whole, which version a worker fetches by shm/tcp
when ipc does not deliver it. No sockets, threads or clock."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from fastio.weight_msgs import WeightAnnounce

__all__ = ["IpcFallback", "SlotLedger"]


class SlotLedger:
    """The trainer's ``n_slots`` slots for ``n_buckets`` buckets: bucket ``b`` goes into
    slot ``b % n_slots``, packed again once every worker sent its last IpcReady acked it
    or was dropped."""

    def __init__(self, n_slots: int, n_buckets: int) -> None:
        self.n_buckets = n_buckets
        #: Workers that may still read each slot.
        self.readers: list[set[str]] = [set() for _ in range(n_slots)]
        self._held = -1

    def slot(self, bucket: int) -> int:
        return bucket % len(self.readers)

    def packing(self) -> None:
        """A version's packing begins: the slots hold no version whole."""
        self._held = -1

    def packed(self, k: int, readers: Iterable[str]) -> None:
        """Slot ``k`` is packed; its IpcReady goes to ``readers``."""
        self.readers[k].update(readers)

    def done(self, version: int) -> None:
        """Every bucket of ``version`` is packed."""
        self._held = version if len(self.readers) >= self.n_buckets else -1

    def holds(self, version: int) -> bool:
        """Whether the slots hold ``version`` whole (one slot per bucket)."""
        return self._held == version

    def released(self, k: int, wid: str) -> None:
        if 0 <= k < len(self.readers):
            self.readers[k].discard(wid)

    def drop(self, wid: str) -> None:
        """``wid`` reads no slot any more (gone, or it let the slots go)."""
        for r in self.readers:
            r.discard(wid)


#: What a version that failed on ipc takes: fetched by shm/tcp from its kept Announce,
#: reported failed (never announced here), or nothing (applied, or fetched already).
Fallback = tuple[Literal["fetch", "fail", "none"], WeightAnnounce | None]


class IpcFallback:
    """A worker with the slots open keeps the newest Announce as the fallback of each
    version: fetched by shm/tcp once the version fails on ipc or makes no progress for a
    timeout; a version that fell back is never taken by ipc again."""

    def __init__(self) -> None:
        self.kept: WeightAnnounce | None = None
        self.failed: set[int] = set()
        self.progress = 0.0  # the time of the last IpcReady or kept Announce

    def keep(self, ann: WeightAnnounce, version: int, now: float) -> bool:
        """An Announce (``version``: the weights'): whether ipc may bring it (kept when
        newer), else it is fetched now."""
        if ann.version in self.failed:
            return False
        if ann.version > version and (self.kept is None or ann.version > self.kept.version):
            self.kept, self.progress = ann, now
        return True

    def applied(self, version: int) -> None:
        if self.kept is not None and self.kept.version <= version:
            self.kept = None

    def on_failure(self, version: int, current: int, fetching: int | None) -> Fallback | None:
        """``version`` failed on ipc (``current``: the weights' version, ``fetching``:
        the shm/tcp one in flight); ``None`` when it fell back already."""
        if version in self.failed:
            return None
        self.failed.add(version)
        if version <= current or fetching == version:
            return "none", None
        ann = self.kept
        if ann is not None and ann.version == version:
            self.kept = None
            return "fetch", ann
        return "fail", None

    def overdue(self, version: int, now: float, timeout: float) -> WeightAnnounce | None:
        """The kept Announce to fetch by shm/tcp: no progress for ``timeout`` seconds."""
        ann = self.kept
        if ann is None or ann.version <= version or now - self.progress <= timeout:
            return None
        self.kept = None
        self.failed.add(ann.version)
        return ann

    def reset(self) -> None:
        """A new publisher: its versions are other versions."""
        self.kept = None
        self.failed.clear()
