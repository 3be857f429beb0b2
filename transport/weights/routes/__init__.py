"""Routes: where a version's bytes travel between a trainer and a worker
(``docs/weights.md``, "Route interface"): :mod:`~.shm`, :mod:`~.tcp`, :mod:`~.zmq` and
:mod:`~.ipc`. The trainer side of shm, tcp and zmq is a :class:`Sender`, the worker side
an :class:`Inbound` that calls back a :class:`Receiver`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastio.weight_msgs import WeightAnnounce, WeightBucket
    from transport.weights.core.subscriber import SubscriberCore
    from transport.weights.routes.inflight import InFlight, Partial

__all__ = ["Inbound", "Receiver", "Replies", "Sender", "Tracker"]


class Tracker(Protocol):
    """A queued send: ``done`` once the staged buffer it reads may be written again."""

    @property
    def done(self) -> bool: ...


class Replies(Protocol):
    """The trainer's control socket: ``reply`` queues frames to one worker (its tracker
    with ``track``; None or False when not queued)."""

    def reply(self, ident: bytes, frames: list[object], track: bool = False) -> object: ...


class Sender(Protocol):
    """A route's trainer side: the chunks of one bucket to one worker, zero-copy."""

    def span(self, start: int, ready: int, total: int, complete: bool, step: int) -> int | None:
        """Where the chunk from ``start`` ends, ``ready`` bytes of ``total`` packed;
        None when it must wait for more."""

    def send(self, ident: bytes, wid: str, msg: WeightBucket) -> Tracker | None:
        """Queue one chunk to worker ``wid``; None when it was not queued."""

    def close(self) -> None: ...


class Receiver(Protocol):
    """What a route's worker side calls on the version in flight (the subscriber's
    :class:`~transport.weights.fetching.VersionFetcher`)."""

    @property
    def update(self) -> InFlight | None: ...

    @property
    def core(self) -> SubscriberCore: ...

    def partial(self, up: InFlight, i: int) -> Partial: ...

    def hold(self, up: InFlight) -> bool: ...

    def chunk_done(
        self, up: InFlight, i: int, part: Partial, t: float, ok: bool, last: bool, checksum: int
    ) -> None: ...

    def fail(self, version: int, error: str, route: str = "tcp") -> None: ...

    def link_failed(self, why: str) -> None: ...

    def consider(self, ann: WeightAnnounce) -> None: ...

    def abandon(self, why: str) -> None: ...


class Inbound(Protocol):
    """A route's worker side: takes what arrived into the views of ``f.update``."""

    def receive(self, f: Receiver, msg: WeightBucket | None) -> None:
        """One chunk: ``msg`` from the control socket, or (``None``) read from the
        route's own connection."""

    def close(self) -> None: ...
