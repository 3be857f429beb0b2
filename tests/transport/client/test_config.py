"""The client's settings: a ClientConfig Struct, or its fields as keywords, checked once
when the client is made; and its one set of counts, read as stats and fed to metrics."""

from __future__ import annotations

import re

import pytest

from transport import ClientConfig, FabricClient, SyncFabricClient, metrics
from transport.client.calls import Counters


def test_keywords_apply_over_the_config() -> None:
    client = FabricClient([], ClientConfig(stream=False, request_timeout=5), heartbeat_interval=0.5)
    assert client.config == ClientConfig(stream=False, request_timeout=5, heartbeat_interval=0.5)
    assert FabricClient([], hwm=10).config.hwm == 10
    assert FabricClient().config == ClientConfig()


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        (
            None,
            {"heartbeat_interval": 0},
            "client option heartbeat_interval=0: expected a number > 0",
        ),
        (ClientConfig(heartbeat_liveness=0), {}, "heartbeat_liveness=0: expected an integer >= 1"),
        (None, {"max_resends": -1}, "max_resends=-1: expected an integer >= 0"),
        (None, {"metrics_port": 70000}, "metrics_port=70000: expected an integer <= 65535"),
        (None, {"stream": "maybe"}, "stream='maybe': expected a boolean"),
        (None, {"heartbeat": 1.0}, "unknown client option 'heartbeat'; known: heartbeat_interval"),
    ],
)
def test_a_bad_setting_is_named(config: ClientConfig | None, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        FabricClient([], config, **options)


def test_config_must_be_a_client_config() -> None:
    with pytest.raises(TypeError, match="config must be a ClientConfig, got dict"):
        FabricClient([], {"stream": False})  # type: ignore[arg-type]


def test_sync_client_takes_the_same_keywords() -> None:
    with pytest.raises(ValueError, match="connect_timeout"):
        SyncFabricClient([], connect_timeout=-1)
    with SyncFabricClient([], connect_timeout=2.5) as client:
        assert client.client.config.connect_timeout == 2.5


def _resends_exported() -> float | None:
    if not metrics.ENABLED:
        return None
    import prometheus_client

    metrics.expose("client")
    return prometheus_client.REGISTRY.get_sample_value("fastio_client_resends_total")


def test_stats_are_the_counters_and_feed_the_metrics() -> None:
    client = FabricClient([])
    assert client.stats is client.counters.stats and client.stats["resent"] == 0
    counters = Counters()
    before = _resends_exported()
    assert counters.add("resent") == 1 and counters.add("resent", 2) == 3
    assert counters.add("completed") == 1 and counters.stats["resent"] == 3
    if before is not None:  # prometheus-client installed: the exported counter moved as much
        assert _resends_exported() == before + 3
    snap = counters.snapshot()  # read like the worker's Counters: a mapping, a snapshot
    assert counters["resent"] == 3 and dict(counters) == snap and snap is not counters.stats
    counters.add("completed")
    assert snap["completed"] == 1 and counters["completed"] == 2 and len(counters) == len(snap)
