"""Prometheus metrics of the fabric and the weight path (optional extra ``metrics``, else
no-ops: :data:`ENABLED`); a process shows the series of the roles :func:`expose` names
(every series: ``docs/metrics.md``).

>>> from transport import metrics
>>> metrics.CLIENT_RESENDS.inc()  # counts, or does nothing without prometheus-client
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = [
    "CLIENT_LATENCY", "CLIENT_RESENDS", "CLIENT_WORKER_DEATHS", "ENABLED", "FINISHED_REASONS",
    "PUBLISHER_BYTES", "PUBLISHER_FAILURES", "PUBLISHER_PHASE_SECONDS", "ROLES",
    "SUBSCRIBER_BYTES", "SUBSCRIBER_FAILURES", "SUBSCRIBER_PHASE_SECONDS", "WORKER_E2E",
    "WORKER_ERRORS", "WORKER_FINISHED", "WORKER_GENERATION_TOKENS", "WORKER_INFLIGHT",
    "WORKER_ITL", "WORKER_PAUSED", "WORKER_PAUSES", "WORKER_PROMPT_TOKENS",
    "WORKER_QUEUE_DEPTH", "WORKER_REQUESTS", "WORKER_TTFT", "WORKER_WEIGHT_VERSION", "expose",
    "on_scrape", "start_http_server", "stop_http_server",
]  # fmt: skip

_prom: Any
try:
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - exercised without the extra
    _prom = None

ENABLED: bool = _prom is not None
"""True when prometheus-client is installed and the metrics count."""


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def _ignore(self, value: float = 1.0) -> None:
        pass

    inc = dec = set = observe = _ignore


_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


#: The sides of the fabric whose series a process can expose (see :func:`expose`).
ROLES = ("worker", "client", "publisher", "subscriber")
#: Values of the ``finished_reason`` label (``"abort"``: also ABORTED errors).
FINISHED_REASONS = ("stop", "length", "interrupt", "abort")


class _Role:
    """One role's series (outside any registry until expose()) and its scrape hooks."""

    def __init__(self) -> None:
        self.metrics: list[Any] = []
        self.hooks: list[Callable[[], None]] = []
        self.exposed = False

    def collect(self) -> Any:
        for hook in list(self.hooks):
            hook()
        for metric in self.metrics:
            for family in metric.collect():  # no *_created twins
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


_ROLES = {role: _Role() for role in ROLES}


def _metric(kind: str, what: str, doc: str, *labels: str, **kw: Any) -> Any:
    # The series fastio_<role>_<what>, shown by its role once exposed.
    if not _prom:
        return _Noop()
    if kind == "Histogram":
        kw.setdefault("buckets", _LATENCY_BUCKETS)
    metric = getattr(_prom, kind)(f"fastio_{what}", doc, labels, registry=None, **kw)
    _ROLES[what.split("_")[0]].metrics.append(metric)
    return metric


_counter = functools.partial(_metric, "Counter")
_gauge = functools.partial(_metric, "Gauge")
_histogram = functools.partial(_metric, "Histogram")

# outcome: ok | error | cancelled | rejected
WORKER_REQUESTS = _counter(
    "worker_requests", "Requests finished by this worker, by outcome", "outcome"
)
WORKER_ERRORS = _counter("worker_errors", "Error replies sent, by code", "code")
WORKER_FINISHED = _counter(
    "worker_finished_requests",
    "Requests finished, by finish reason (stop, length, interrupt, abort)",
    "finished_reason",
)
for _reason in FINISHED_REASONS:  # every reason shows, at 0 before its first count
    WORKER_FINISHED.labels(_reason)
WORKER_PROMPT_TOKENS = _counter(
    "worker_prompt_tokens", "Prompt tokens of the requests answered with a Result"
)
WORKER_GENERATION_TOKENS = _counter(
    "worker_generation_tokens", "Tokens generated in the Results sent"
)
WORKER_INFLIGHT = _gauge("worker_in_flight", "Requests whose handler is running")
WORKER_QUEUE_DEPTH = _gauge("worker_queue_depth", "Requests waiting for a slot")
WORKER_TTFT = _histogram("worker_ttft_seconds", "Time from Submit to the first token")
WORKER_ITL = _histogram(
    "worker_inter_token_seconds", "Mean time between tokens per request", buckets=_TOKEN_BUCKETS
)
WORKER_E2E = _histogram("worker_e2e_seconds", "Time from Submit to the Result")
WORKER_PAUSES = _counter("worker_pauses", "Pauses (weight updates, controller)")
WORKER_WEIGHT_VERSION = _gauge("worker_weight_version", "Weight version the engine serves")
WORKER_PAUSED = _gauge("worker_paused", "1 while generation is paused, else 0")
CLIENT_RESENDS = _counter("client_resends", "Requests re-sent to another worker")
CLIENT_WORKER_DEATHS = _counter("client_worker_deaths", "Workers declared dead")
CLIENT_LATENCY = _histogram("client_latency_seconds", "agenerate: call to response")
PUBLISHER_PHASE_SECONDS = _histogram(
    "publisher_phase_seconds", "Weight update time per phase (pack, send, wait, total)", "phase"
)
PUBLISHER_BYTES = _counter("publisher_bytes", "Weight bytes published", "path")
PUBLISHER_FAILURES = _counter("publisher_failures", "Versions some worker failed")
SUBSCRIBER_PHASE_SECONDS = _histogram(
    "subscriber_phase_seconds",
    "Weight apply time per phase (receive, verify, apply, total)",
    "phase",
)
SUBSCRIBER_BYTES = _counter("subscriber_bytes", "Weight bytes applied", "path")
SUBSCRIBER_FAILURES = _counter("subscriber_failures", "Versions refused or failed")


def on_scrape(role: str, hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` before each scrape of ``role``'s series; returns what removes it."""
    hooks = _ROLES[role].hooks
    hooks.append(hook)
    return lambda: hooks.remove(hook) if hook in hooks else None


_lock = threading.Lock()
_servers: dict[int, ThreadingHTTPServer] = {}  # bound port -> server


def expose(*roles: str) -> None:
    """Show the series of ``roles`` (of :data:`ROLES`) in this process's exposition
    (idempotent; does nothing without prometheus-client).

    >>> expose("worker", "subscriber")
    """
    for role in roles:
        if role not in _ROLES:
            raise ValueError(f"unknown metrics role {role!r}; expected one of {ROLES}")
    with _lock:
        for role in roles:
            if _prom is not None and not _ROLES[role].exposed:
                _prom.REGISTRY.register(_ROLES[role])
                _ROLES[role].exposed = True


def start_http_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve ``GET /metrics`` on ``addr:port`` (``0``: a free port) from a daemon thread;
    returns the bound port. An ``ImportError`` names ``fastio[metrics]`` if
    prometheus-client is missing; an ``OSError`` names the address if it cannot bind."""
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
    with _lock:
        _servers[bound] = server
    name = f"fastio-metrics-{bound}"
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return bound


def stop_http_server(port: int) -> None:
    """Stop the endpoint :func:`start_http_server` started on ``port`` (if any)."""
    with _lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
