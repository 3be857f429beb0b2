"""What a weight update reports: per worker, per version, per worker's last update
(plain dataclasses, apart so that no driver imports another for a type)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastio.weight_msgs import WeightAck

__all__ = ["SubscriberInfo", "UpdateResult", "UpdateStats"]


@dataclass
class SubscriberInfo:
    """What the publisher knows of one subscriber (from its Hellos and Acks)."""

    worker_id: str
    host_id: str = ""
    pid: int = 0
    #: Its process's start time as this host sees it (0: not on this host, or its pid
    #: is not visible here): with ``pid``, tells when that process is gone.
    start_time: int = 0
    #: The start time its last Hello gave (with ``pid``, which process that is, even
    #: when this host cannot see it).
    hello_start_time: int = 0
    version: int = -1
    digest: int | None = None
    last_seen: float = 0.0
    alive: bool = True
    #: The one dtype it wants floating tensors in ("" if none declared).
    dtype: str = ""
    #: The route its last answered version took: ``"ipc"``, ``"shm"`` or ``"tcp"``.
    path: str = ""

    @property
    def route(self) -> str:
        """The route its last answered version took (the field's name is ``path``)."""
        return self.path


@dataclass
class UpdateResult:
    """Outcome of one version across workers (:meth:`transport.weights.WeightPublisher.wait`).

    Attributes
    ----------
    version:
        The version waited for.
    applied:
        Worker id -> its Ack, for every worker that applied the version.
    failed:
        Worker id -> why it did not (its error, or that it was lost). A failed worker
        kept its previous weights unless its error says they are mixed (then it
        reports version ``-1`` until a later version completes).
    missing:
        Expected workers that had not answered when the timeout passed.
    elapsed_s:
        Seconds from the announcement to the last answer (or the timeout).
    paths:
        Worker id -> the route its answer came by (``"ipc"``, ``"shm"`` or ``"tcp"``;
        ``""`` when it failed before choosing one), for every worker that answered;
        also :attr:`routes`.
    """

    version: int
    applied: dict[str, WeightAck] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every expected worker applied the version."""
        return not self.failed and not self.missing and bool(self.applied)

    @property
    def routes(self) -> dict[str, str]:
        """Worker id -> the route its answer came by (the same dict as :attr:`paths`)."""
        return self.paths


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
