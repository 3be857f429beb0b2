"""What a weight update reports: per worker, per version, per worker's last update."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastio.weight_msgs import WeightAck

__all__ = ["SubscriberInfo", "UpdateResult", "UpdateStats"]


@dataclass
class SubscriberInfo:
    """What the publisher knows of one subscriber (from its Hellos and Acks):
    ``start_time`` as this host sees its process (0: not visible), ``hello_start_time``
    as its Hello gave it; ``path``: :attr:`route`'s older name."""

    worker_id: str
    host_id: str = ""
    pid: int = 0
    start_time: int = 0
    hello_start_time: int = 0
    version: int = -1
    digest: int | None = None
    last_seen: float = 0.0
    alive: bool = True
    dtype: str = ""
    path: str = ""

    @property
    def route(self) -> str:
        """The route its last answered version took: ``"ipc"``, ``"shm"`` or ``"tcp"``."""
        return self.path


@dataclass
class UpdateResult:
    """Outcome of one version across workers (:meth:`WeightPublisher.wait`):
    ``applied`` (id -> Ack), ``failed`` (id -> why), ``missing``, ``elapsed_s`` (from the
    announcement to the last answer), ``paths`` (:attr:`routes`' older name)."""

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
    """Timings of the last update on this worker (seconds), and per bucket."""

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
        keys = ("fetch_s", "verify_s", "apply_s", "total_s")
        out = {"bytes": float(self.bytes), **{k: getattr(self, k) for k in keys}}
        for i, b in enumerate(self.buckets):
            out.update({f"b{i}_{k}": v for k, v in b.items()})
        return out
