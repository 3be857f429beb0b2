"""Prometheus metrics of the fabric and the weight path (optional extra ``metrics``).

Every metric below exists whether or not ``prometheus-client`` is installed: without it
they are no-ops, so instrumented code never branches on it (``ENABLED`` says which).
:func:`start_http_server` serves the exposition (``GET /metrics``) from a daemon thread
and needs the extra; it binds to loopback unless told otherwise.

The metrics live in prometheus-client's default registry, which belongs to the process:
each worker, client or trainer process serves its own figures on its own port, and a
scraper sums them (they are not shared across ``fork``).

Names follow Prometheus conventions (``fastio_<side>_<what>_<unit>``; counters gain
``_total`` in the exposition). Labels are kept to small fixed sets.

>>> from transport import metrics
>>> metrics.CLIENT_RESENDS.inc()  # counts, or does nothing without prometheus-client
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = [
    "CLIENT_LATENCY",
    "CLIENT_RESENDS",
    "CLIENT_WORKER_DEATHS",
    "ENABLED",
    "PUBLISHER_BYTES",
    "PUBLISHER_FAILURES",
    "PUBLISHER_PHASE_SECONDS",
    "SUBSCRIBER_BYTES",
    "SUBSCRIBER_FAILURES",
    "SUBSCRIBER_PHASE_SECONDS",
    "WORKER_E2E",
    "WORKER_ERRORS",
    "WORKER_INFLIGHT",
    "WORKER_ITL",
    "WORKER_PAUSES",
    "WORKER_QUEUE_DEPTH",
    "WORKER_REQUESTS",
    "WORKER_TTFT",
    "start_http_server",
    "stop_http_server",
]

_prom: Any
try:
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - exercised without the extra
    _prom = None

ENABLED: bool = _prom is not None
"""True when prometheus-client is installed and the metrics count."""


class _Noop:
    """Stands in for a metric when prometheus-client is missing."""

    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1.0) -> None:
        pass

    def dec(self, amount: float = 1.0) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    return _prom.Counter(name, doc, labels) if _prom else _Noop()


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    return _prom.Gauge(name, doc, labels) if _prom else _Noop()


def _histogram(
    name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
) -> Any:
    return _prom.Histogram(name, doc, labels, buckets=buckets) if _prom else _Noop()


# --- worker ---------------------------------------------------------------------------
WORKER_REQUESTS = _counter(
    "fastio_worker_requests", "Requests finished by this worker, by outcome", ("outcome",)
)  # outcome: ok | error | cancelled | rejected
WORKER_ERRORS = _counter("fastio_worker_errors", "Error replies sent, by code", ("code",))
WORKER_INFLIGHT = _gauge("fastio_worker_in_flight", "Requests whose handler is running")
WORKER_QUEUE_DEPTH = _gauge("fastio_worker_queue_depth", "Requests waiting for a slot")
WORKER_TTFT = _histogram(
    "fastio_worker_ttft_seconds", "Time from Submit to the first token", _LATENCY_BUCKETS
)
WORKER_ITL = _histogram(
    "fastio_worker_inter_token_seconds", "Mean time between tokens per request", _TOKEN_BUCKETS
)
WORKER_E2E = _histogram(
    "fastio_worker_e2e_seconds", "Time from Submit to the Result", _LATENCY_BUCKETS
)
WORKER_PAUSES = _counter("fastio_worker_pauses", "Pauses (weight updates, controller)")

# --- client ---------------------------------------------------------------------------
CLIENT_RESENDS = _counter("fastio_client_resends", "Requests re-sent to another worker")
CLIENT_WORKER_DEATHS = _counter("fastio_client_worker_deaths", "Workers declared dead")
CLIENT_LATENCY = _histogram(
    "fastio_client_latency_seconds", "agenerate: call to response", _LATENCY_BUCKETS
)

# --- weights --------------------------------------------------------------------------
PUBLISHER_PHASE_SECONDS = _histogram(
    "fastio_publisher_phase_seconds",
    "Weight update time per phase (pack, send, wait, total)",
    _LATENCY_BUCKETS,
    ("phase",),
)
PUBLISHER_BYTES = _counter("fastio_publisher_bytes", "Weight bytes published", ("path",))
PUBLISHER_FAILURES = _counter("fastio_publisher_failures", "Versions some worker failed")
SUBSCRIBER_PHASE_SECONDS = _histogram(
    "fastio_subscriber_phase_seconds",
    "Weight apply time per phase (receive, verify, apply, total)",
    _LATENCY_BUCKETS,
    ("phase",),
)
SUBSCRIBER_BYTES = _counter("fastio_subscriber_bytes", "Weight bytes applied", ("path",))
SUBSCRIBER_FAILURES = _counter("fastio_subscriber_failures", "Versions refused or failed")


_servers: dict[int, ThreadingHTTPServer] = {}  # bound port -> server, for stop_http_server
_servers_lock = threading.Lock()


def start_http_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve ``GET /metrics`` on ``addr:port`` from a daemon thread; return the bound port.

    Parameters
    ----------
    port
        TCP port; ``0`` picks a free one (read it from the return value).
    addr
        Address to bind. The default is loopback: the figures (request rates, weight
        versions) are for the operator's scraper, so exposing them on other interfaces
        (``"0.0.0.0"``, ``"::"``) is a deliberate choice.

    Raises
    ------
    ImportError
        prometheus-client is not installed (the message names ``fastio[metrics]``).
    OSError
        The port cannot be bound (the message names the address and port).

    >>> port = start_http_server(0)  # doctest: +SKIP
    >>> urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics")  # doctest: +SKIP
    """
    from fastio._optional import require

    require("prometheus_client", "metrics", "the metrics endpoint")
    from prometheus_client.exposition import MetricsHandler

    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class _Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    try:
        server = _Server((addr, port), MetricsHandler.factory(_prom.REGISTRY))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from exc
    bound = int(server.server_address[1])
    with _servers_lock:
        _servers[bound] = server
    threading.Thread(
        target=server.serve_forever, name=f"fastio-metrics-{bound}", daemon=True
    ).start()
    return bound


def stop_http_server(port: int) -> None:
    """Stop the endpoint :func:`start_http_server` started on ``port`` and free the port.

    Unknown ports are ignored, so shutdown paths may call it unconditionally.
    """
    with _servers_lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
