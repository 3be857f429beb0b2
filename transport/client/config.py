"""Settings of the rollout client."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastio.tokens import TokenArray
from transport.sockets import DEFAULT_HWM, DEFAULT_MAX_MESSAGE_SIZE, CurveConfig

__all__ = ["ChunkCallback", "ClientConfig"]

#: ``on_chunk(tokens, logprobs, versions)``: output tokens not delivered before.
ChunkCallback = Callable[[TokenArray, TokenArray, TokenArray], None]


@dataclass
class ClientConfig:
    """Settings of a :class:`~transport.FabricClient`.

    Parameters
    ----------
    heartbeat_interval:
        Seconds between pings to each worker. A worker's report of other clients'
        load counts in scheduling while its pong answers the latest or the previous
        ping. Requests made before any worker answered wait for every worker that may
        be up to answer first (a refused connection is not waited for), at most this
        long (or ``connect_timeout`` if shorter), so the first burst is spread; after
        every worker died, the first back waits as long for the others.
    heartbeat_liveness:
        Intervals without a pong after which a worker is dead (the zguide's Paranoid
        Pirate uses 3). Detection takes at most ``interval * (liveness + 1)``. Only
        silence counts: a worker that answers pings is alive however long its
        requests take.
    connect_timeout:
        Seconds without any live worker after which waiting requests, and new calls,
        fail with :class:`~transport.NoWorkerAvailable`.
    request_timeout:
        Default per-request timeout in seconds.
    max_in_flight_per_worker:
        Requests on one worker at once; the rest queue in the client. Keep it below the
        worker's ``max_pending``.
    max_resends:
        Times a request may be re-sent after its worker died (or gave it up) before it
        fails.
    resend_backoff, resend_backoff_max:
        The ``k``-th re-send of a request waits ``resend_backoff * 2**(k-1)`` seconds,
        at most ``resend_backoff_max``, times a random factor in [0.5, 1] (so requests
        of one dead worker do not return in one burst, and a worker that keeps dying
        cannot make the client re-send in a storm).
    stream:
        Ask workers to stream tokens (real ``ttft``/``itl``, ``on_chunk``, and a
        re-send resumes after the tokens already received); off saves a message per
        loop iteration of the worker per request.
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    sticky_cache_size:
        How many rid -> worker assignments are remembered (when full, the older half
        is forgotten).
    metrics_port:
        Serve Prometheus metrics (:mod:`transport.metrics`) on ``127.0.0.1`` at this
        port when the client starts (0: any free port, see
        ``FabricClient.metrics_port``); ``None`` serves none. Needs the ``metrics``
        extra. Re-sends and worker deaths are always counted in
        :mod:`transport.metrics`; the latency histogram is recorded only when this is
        set (it costs a few microseconds per request).
    """

    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3
    connect_timeout: float = 10.0
    request_timeout: float = 3600.0
    max_in_flight_per_worker: int = 1024
    max_resends: int = 8
    resend_backoff: float = 0.05
    resend_backoff_max: float = 5.0
    stream: bool = True
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    hwm: int = DEFAULT_HWM
    curve: CurveConfig | None = None
    sticky_cache_size: int = 100_000
    metrics_port: int | None = None
