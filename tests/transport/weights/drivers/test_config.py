"""The weight publisher's and subscriber's settings: Structs beside the old keywords."""

from __future__ import annotations

import pytest
import torch

from transport.weights import WeightPublisher, WeightSubscriber
from transport.weights.config import PublisherConfig, SubscriberConfig, make_config


def test_keywords_become_the_struct_once_and_override_it() -> None:
    cfg = make_config(SubscriberConfig, SubscriberConfig(retries=5, window=3), {"window": 4})
    assert (cfg.retries, cfg.window) == (5, 4)
    assert make_config(SubscriberConfig, None, {"path": "tcp"}).route == "tcp"


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"windw": 2}, TypeError, "unknown subscriber setting 'windw'; known: worker_id"),
        ({"window": 0}, ValueError, r"window"),
        ({"fetch_timeout": -1.0}, ValueError, "fetch_timeout"),
        ({"path": "nfs"}, ValueError, "setting path='nfs': expected one of ipc, shm, tcp"),
    ],
)
def test_a_bad_setting_is_named(settings: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_config(SubscriberConfig, None, dict(settings))


def test_publisher_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="publisher setting ipc='nvlink': expected one of auto"):
        make_config(PublisherConfig, None, {"ipc": "nvlink"})
    with pytest.raises(ValueError, match="data_port"):
        make_config(PublisherConfig, None, {"data_port": 70000})


def test_drivers_take_either_form() -> None:
    target = {"w": torch.zeros(4)}
    sub = WeightSubscriber(
        "tcp://127.0.0.1:9", target, config=SubscriberConfig(shm=False), path="tcp"
    )
    assert sub.config.route == "tcp" and not sub.shm and sub.route == sub.path == ""
    pub = WeightPublisher(shm=False, keep_versions=3, ipc="off")
    try:
        assert pub.config.keep_versions == 3
    finally:
        pub.close()


@pytest.mark.parametrize("pub_endpoint", [None, ""])
def test_an_empty_pub_endpoint_means_next_to_the_router(pub_endpoint: str | None) -> None:
    with WeightPublisher("tcp://127.0.0.1:0", pub_endpoint=pub_endpoint) as pub:
        host, port = pub.pub_endpoint[len("tcp://") :].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0 and pub.pub_endpoint != pub.endpoint


def test_publisher_and_subscriber_share_one_lifecycle() -> None:
    import torch

    from transport.weights import WeightPublisher, WeightSubscriber

    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        assert pub.start() is pub  # started when made: start() again is a no-op
        sub = WeightSubscriber(pub.endpoint, {"w": torch.zeros(2)})
        with sub as entered:
            assert entered is sub and sub.start() is sub
    assert pub.start() is pub  # closed: not started again
