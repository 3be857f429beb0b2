"""Settings of the rollout client, checked once by :func:`client_config`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from fastio.tokens import TokenArray
from transport.options import NonNegative, NonNegativeSeconds, Port, Positive, Seconds, configure
from transport.sockets import DEFAULT_HWM, DEFAULT_MAX_MESSAGE_SIZE, CurveConfig

__all__ = ["ChunkCallback", "ClientConfig", "client_config"]

#: ``on_chunk(tokens, logprobs, versions)``: output tokens not delivered before.
ChunkCallback = Callable[[TokenArray, TokenArray, TokenArray], None]


class ClientConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.FabricClient`, checked when the client is made
    (docs/concepts.md, "A request's life", says what each one does).

    Parameters
    ----------
    heartbeat_interval:
        Seconds between pings (and the longest the first calls wait for every worker).
    heartbeat_liveness:
        Silent heartbeat intervals after which a worker is dead (a slow answer never is).
    connect_timeout:
        Seconds without a live worker before calls fail with ``NoWorkerAvailable``.
    request_timeout:
        Default per-request timeout in seconds.
    max_in_flight_per_worker:
        Requests on one worker at once (keep it below the worker's ``max_pending``).
    max_resends, max_worker_deaths:
        Times a request may be re-sent after its worker died or lost it, and of those,
        after a worker died running it (the next such death fails it with
        :class:`~transport.errors.PoisonRequest`).
    resend_backoff, resend_backoff_max:
        The ``k``-th re-send waits ``min(resend_backoff * 2**(k-1), resend_backoff_max)``
        s times a random factor in [0.5, 1].
    stream:
        Ask workers to stream tokens (real ``ttft``/``itl``, ``on_chunk`` as they come).
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    sticky_cache_size:
        rid -> worker assignments kept (when full, the older half goes).
    metrics_port:
        Serve Prometheus metrics (and the latency histogram) on ``127.0.0.1`` at this
        port (0: any; ``None``: no endpoint).
    """

    heartbeat_interval: Seconds = 1.0
    heartbeat_liveness: Positive = 3
    connect_timeout: Seconds = 10.0
    request_timeout: Seconds = 3600.0
    max_in_flight_per_worker: Positive = 1024
    max_resends: NonNegative = 8
    max_worker_deaths: NonNegative = 2
    resend_backoff: NonNegativeSeconds = 0.05
    resend_backoff_max: NonNegativeSeconds = 5.0
    stream: bool = True
    max_message_size: Positive = DEFAULT_MAX_MESSAGE_SIZE
    hwm: NonNegative = DEFAULT_HWM
    curve: CurveConfig | None = None
    sticky_cache_size: NonNegative = 100_000
    metrics_port: Port | None = None


def client_config(config: ClientConfig | None, options: Mapping[str, Any]) -> ClientConfig:
    """``config`` (default: all defaults) with ``options`` (field name -> value) applied
    and checked (:func:`transport.options.configure`); ``ValueError`` names a bad option."""
    return configure(ClientConfig, config, options, "client option")
