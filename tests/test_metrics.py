"""transport.metrics: the Prometheus endpoint scraped over HTTP, and no-ops without the extra."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import parse, value
from transport import metrics
from transport.worker.counters import Counters

ROOT = Path(__file__).resolve().parents[1]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


@pytest.fixture(scope="module")
def endpoint() -> Iterator[int]:
    pytest.importorskip("prometheus_client")
    metrics.expose(*metrics.ROLES)  # every side, as a process running them all would
    port = metrics.start_http_server(0)
    yield port
    metrics.stop_http_server(port)


def test_scrape_counts_what_was_recorded(endpoint: int) -> None:
    # The registry is the process's: other tests may have counted already, so compare
    # a scrape before with one after.
    before = scrape(endpoint)
    metrics.WORKER_REQUESTS.labels(outcome="ok").inc(3)
    metrics.WORKER_REQUESTS.labels(outcome="error").inc()
    metrics.WORKER_ERRORS.labels(code="bad_request").inc()
    # A worker started in this process earlier binds these gauges to itself (read when
    # scraped), which a plain set() would not override: bind them here the same way.
    metrics.WORKER_INFLIGHT.set_function(lambda: 7)
    metrics.WORKER_QUEUE_DEPTH.set_function(lambda: 2)
    metrics.WORKER_TTFT.observe(0.003)  # bucket le=0.005
    metrics.WORKER_E2E.observe(0.2)
    metrics.WORKER_ITL.observe(0.0007)
    metrics.WORKER_PAUSES.inc()
    metrics.CLIENT_RESENDS.inc(2)
    metrics.CLIENT_WORKER_DEATHS.inc()
    metrics.CLIENT_LATENCY.observe(1.5)
    metrics.PUBLISHER_PHASE_SECONDS.labels(phase="pack").observe(0.04)
    metrics.PUBLISHER_BYTES.labels(path="shm").inc(1 << 30)
    metrics.PUBLISHER_FAILURES.inc()
    metrics.SUBSCRIBER_PHASE_SECONDS.labels(phase="apply").observe(0.02)
    metrics.SUBSCRIBER_BYTES.labels(path="tcp").inc(4096)
    metrics.SUBSCRIBER_FAILURES.inc()
    metrics.WORKER_PAUSED.set_function(lambda: 1)
    metrics.WORKER_WEIGHT_VERSION.set_function(lambda: 12)
    # A worker keeps its counts as plain ints, added to the metrics when scraped.
    counters = Counters()
    remove = metrics.on_scrape("worker", counters.export)
    shard = counters.loop
    shard.prompt_tokens += 5 + 3
    shard.generation_tokens += 7 + 2
    for reason in ("length", "interrupt", "abort"):
        shard.finished[reason] += 1
    try:
        after = scrape(endpoint)
    finally:
        remove()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("fastio_worker_requests_total", outcome="ok") == 3
    assert delta("fastio_worker_requests_total", outcome="error") == 1
    assert delta("fastio_worker_errors_total", code="bad_request") == 1
    assert value(after, "fastio_worker_in_flight") == 7
    assert value(after, "fastio_worker_queue_depth") == 2
    assert delta("fastio_worker_ttft_seconds_count") == 1
    assert delta("fastio_worker_ttft_seconds_sum") == pytest.approx(0.003)
    assert delta("fastio_worker_ttft_seconds_bucket", le="0.0025") == 0
    assert delta("fastio_worker_ttft_seconds_bucket", le="0.005") == 1
    assert delta("fastio_worker_ttft_seconds_bucket", le="+Inf") == 1
    assert delta("fastio_worker_e2e_seconds_bucket", le="0.25") == 1
    assert delta("fastio_worker_e2e_seconds_bucket", le="0.1") == 0
    assert delta("fastio_worker_inter_token_seconds_bucket", le="0.001") == 1
    assert delta("fastio_worker_pauses_total") == 1
    assert delta("fastio_client_resends_total") == 2
    assert delta("fastio_client_worker_deaths_total") == 1
    assert delta("fastio_client_latency_seconds_bucket", le="2.5") == 1
    assert delta("fastio_client_latency_seconds_bucket", le="1.0") == 0
    assert delta("fastio_publisher_phase_seconds_count", phase="pack") == 1
    assert delta("fastio_publisher_bytes_total", path="shm") == 1 << 30
    assert delta("fastio_publisher_failures_total") == 1
    assert delta("fastio_subscriber_phase_seconds_sum", phase="apply") == pytest.approx(0.02)
    assert delta("fastio_subscriber_bytes_total", path="tcp") == 4096
    assert delta("fastio_subscriber_failures_total") == 1
    assert value(after, "fastio_worker_paused") == 1
    assert value(after, "fastio_worker_weight_version") == 12
    assert delta("fastio_worker_prompt_tokens_total") == 8
    assert delta("fastio_worker_generation_tokens_total") == 9
    for reason, n in (("stop", 0), ("length", 1), ("interrupt", 1), ("abort", 1)):
        assert delta("fastio_worker_finished_requests_total", finished_reason=reason) == n
    assert not [k for k in after if k[0].startswith("fastio_") and k[0].endswith("_created")]


# The documented names: dashboards depend on them, so a rename fails here.
EXPOSED = {
    "CLIENT_LATENCY": ("fastio_client_latency_seconds", "histogram"),
    "CLIENT_RESENDS": ("fastio_client_resends_total", "counter"),
    "CLIENT_WORKER_DEATHS": ("fastio_client_worker_deaths_total", "counter"),
    "PUBLISHER_BYTES": ("fastio_publisher_bytes_total", "counter"),
    "PUBLISHER_FAILURES": ("fastio_publisher_failures_total", "counter"),
    "PUBLISHER_PHASE_SECONDS": ("fastio_publisher_phase_seconds", "histogram"),
    "SUBSCRIBER_BYTES": ("fastio_subscriber_bytes_total", "counter"),
    "SUBSCRIBER_FAILURES": ("fastio_subscriber_failures_total", "counter"),
    "SUBSCRIBER_PHASE_SECONDS": ("fastio_subscriber_phase_seconds", "histogram"),
    "WORKER_E2E": ("fastio_worker_e2e_seconds", "histogram"),
    "WORKER_ERRORS": ("fastio_worker_errors_total", "counter"),
    "WORKER_FINISHED": ("fastio_worker_finished_requests_total", "counter"),
    "WORKER_GENERATION_TOKENS": ("fastio_worker_generation_tokens_total", "counter"),
    "WORKER_INFLIGHT": ("fastio_worker_in_flight", "gauge"),
    "WORKER_ITL": ("fastio_worker_inter_token_seconds", "histogram"),
    "WORKER_PAUSED": ("fastio_worker_paused", "gauge"),
    "WORKER_PAUSES": ("fastio_worker_pauses_total", "counter"),
    "WORKER_PROMPT_TOKENS": ("fastio_worker_prompt_tokens_total", "counter"),
    "WORKER_QUEUE_DEPTH": ("fastio_worker_queue_depth", "gauge"),
    "WORKER_REQUESTS": ("fastio_worker_requests_total", "counter"),
    "WORKER_TTFT": ("fastio_worker_ttft_seconds", "histogram"),
    "WORKER_WEIGHT_VERSION": ("fastio_worker_weight_version", "gauge"),
}


def test_every_metric_is_exposed(endpoint: int) -> None:
    """Each metric of ``__all__`` is exposed under its documented name and type."""
    constants = {"ENABLED", "FINISHED_REASONS", "ROLES"}
    assert {n for n in metrics.__all__ if n.isupper() and n not in constants} == set(EXPOSED)
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for attr, (name, kind) in EXPOSED.items():
        # Labelled metrics show no sample before their first use; the TYPE line is there.
        assert types.get(name) == kind, (attr, name)


_ROLES_ONLY_WHEN_EXPOSED = textwrap.dedent(
    """
    import json
    import urllib.request
    from transport import metrics

    metrics.CLIENT_RESENDS.inc()  # counted, not shown: this process runs no client yet
    port = metrics.start_http_server(0)

    def names():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {l.split("{")[0].split()[0] for l in lines if l.startswith("fastio_")}

    print("BEFORE", json.dumps(sorted(names())))
    metrics.expose("worker")
    metrics.expose("worker")  # idempotent
    print("WORKER", json.dumps(sorted(names())))
    metrics.expose("client")
    print("CLIENT", json.dumps(sorted(names())))
    try:
        metrics.expose("trainer")
    except ValueError as exc:
        print("BAD", exc)
    """
)


def test_a_process_shows_only_the_roles_it_runs() -> None:
    pytest.importorskip("prometheus_client")
    out = subprocess.run(
        [sys.executable, "-c", _ROLES_ONLY_WHEN_EXPOSED],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["BEFORE"] == "[]"
    worker = json.loads(lines["WORKER"])
    assert "fastio_worker_requests_total" not in worker  # labelled: no sample before use
    assert "fastio_worker_paused" in worker and "fastio_worker_prompt_tokens_total" in worker
    assert all(n.startswith("fastio_worker_") for n in worker), worker
    client = json.loads(lines["CLIENT"])
    assert "fastio_client_resends_total" in client  # the count from before it was shown
    assert not [n for n in client if n.endswith("_created")], client
    assert "unknown metrics role 'trainer'" in lines["BAD"]


def test_endpoint_is_loopback_by_default_and_stops() -> None:
    pytest.importorskip("prometheus_client")
    port = metrics.start_http_server(0)
    assert metrics._servers[port].server_address[0] == "127.0.0.1"
    assert scrape(port)
    metrics.stop_http_server(port)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    metrics.stop_http_server(port)  # a second stop is a no-op


def test_port_in_use_names_the_address() -> None:
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=re.escape(f"127.0.0.1:{port}")):
            metrics.start_http_server(port)
    with pytest.raises(ValueError, match=re.escape("0..65535")):
        metrics.start_http_server(70000)


_WITHOUT_PROMETHEUS = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "prometheus_client" or name.startswith("prometheus_client."):
                raise ImportError(f"blocked {name}")
            return None

    sys.meta_path.insert(0, Block())
    from transport import metrics

    assert not metrics.ENABLED
    metrics.WORKER_REQUESTS.labels(outcome="ok").inc()
    metrics.WORKER_INFLIGHT.inc(); metrics.WORKER_INFLIGHT.dec(); metrics.WORKER_QUEUE_DEPTH.set(3)
    metrics.WORKER_TTFT.observe(0.1)
    metrics.PUBLISHER_PHASE_SECONDS.labels(phase="pack").observe(0.1)
    metrics.CLIENT_RESENDS.inc()
    try:
        metrics.start_http_server(0)
    except ImportError as exc:
        print("IMPORTERROR", exc)
    else:
        raise SystemExit("start_http_server served without prometheus_client")
    assert "prometheus_client" not in sys.modules
    """
)


def test_noops_without_prometheus_client() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PROMETHEUS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout
    assert "pip install 'fastio[metrics]'" in out.stdout
