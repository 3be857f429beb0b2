"""Routes: where a version's bytes travel between a trainer and a worker.

Every route carries the same buckets under the same control messages
(:mod:`transport.weights.core`); only where the bytes live differs. Each module holds
both sides of its route:

* :mod:`~transport.weights.routes.shm`: a shared-memory segment on the trainer's host;
* :mod:`~transport.weights.routes.tcp`: the data link, a plain TCP connection per worker;
* :mod:`~transport.weights.routes.zmq`: ZeroMQ frames on the control sockets, the
  fallback of both;
* :mod:`~transport.weights.routes.ipc`: the trainer's own memory (CUDA IPC or torch
  shared storage), its worker side in :mod:`~transport.weights.routes.ipc_worker`.

The receiving sides of shm, tcp and zmq share one step:
:func:`~transport.weights.routes.receive.take`.
"""

from typing import Any, Protocol

__all__ = ["Receiver"]


class Receiver(Protocol):
    """What a route's receiving side calls on the worker's version in flight
    (:class:`~transport.weights.fetching.VersionFetcher`; ``up`` is its ``InFlight``,
    ``part`` a bucket arriving)."""

    update: Any
    core: Any

    def partial(self, up: Any, i: int) -> Any: ...

    def hold(self, up: Any) -> bool: ...

    def chunk_done(
        self, up: Any, i: int, part: Any, t: float, ok: bool, last: bool, checksum: int
    ) -> None: ...

    def landed(self, up: Any, i: int, chunks: list[Any], stream: Any) -> None: ...

    def fail(self, version: int, error: str, route: str = "tcp") -> None: ...

    def link_failed(self, why: str) -> None: ...
