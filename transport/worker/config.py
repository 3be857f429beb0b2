"""What a worker is configured with: :class:`WorkerConfig`, checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from transport.options import NonNegative, Positive, Seconds, configure
from transport.sockets import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_PEER_QUEUE_LIMIT,
    CurveConfig,
)

__all__ = ["WorkerConfig", "checked_config"]


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.WorkerServer`, checked when it is built.

    Parameters
    ----------
    bind:
        Addresses to bind (``tcp://127.0.0.1:0`` picks a free port; ``ipc://path``).
    worker_id:
        Name in heartbeats and status (default ``host:pid``).
    max_concurrency, max_pending:
        Handlers running at once; running plus waiting (a Submit beyond: ``OVERLOADED``).
    client_timeout:
        Seconds of silence after which a client's requests are cancelled (``LOST``).
    max_message_size, hwm, curve, peer_queue_limit:
        See :mod:`transport.sockets` (a client holding more replies is dropped).
    extra:
        Options for plugins (``--plugin-opt key=value``).
    eager_start:
        Run each handler's first step in the callback that took its Submit (False for
        handlers that need ``asyncio.current_task()`` to be their request's task).
    latency_metrics:
        Record the latency histograms (on with ``--metrics-port``).
    inline:
        Serve the socket on the handler's loop, for handlers that never block (``None``:
        the handler's ``inline`` attribute decides; the echo sets it).
    """

    bind: str | list[str] = "tcp://127.0.0.1:0"
    worker_id: str = ""
    max_concurrency: Positive = 4096
    max_pending: Positive = 65536
    client_timeout: Seconds = 10.0
    max_message_size: Positive = DEFAULT_MAX_MESSAGE_SIZE
    hwm: NonNegative = DEFAULT_HWM
    curve: CurveConfig | None = None
    peer_queue_limit: Positive = DEFAULT_PEER_QUEUE_LIMIT
    extra: dict[str, str] = msgspec.field(default_factory=dict)
    eager_start: bool = True
    inline: bool | None = None
    latency_metrics: bool = False


def checked_config(config: WorkerConfig | Mapping[str, Any] | None = None) -> WorkerConfig:
    """``config`` (or its fields by name, strings allowed) checked: ``ValueError`` names a
    bad field (``worker option max_pending=0: expected an integer >= 1``), ``TypeError``
    an unknown one."""
    if isinstance(config, WorkerConfig):
        return configure(WorkerConfig, config, {}, "worker option")
    return configure(WorkerConfig, None, config or {}, "worker option")
