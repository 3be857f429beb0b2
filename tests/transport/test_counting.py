"""The one counts type (:class:`transport.counting.Counts`), as the client, the worker's
threads and the weights' cores use it."""

from __future__ import annotations

from transport.client.calls import Counters
from transport.counting import Counts
from transport.weights.core.publisher import PublisherCore


class Metric:
    """A Prometheus counter's ``inc``, recorded."""

    def __init__(self) -> None:
        self.total = 0

    def inc(self, n: float = 1) -> None:
        self.total += int(n)


def test_counts_add_read_as_a_dict_and_a_name_not_counted_reads_zero() -> None:
    c = Counts(["a"])
    assert c.add("a") == 1 and c.add("b", 3) == 3 and c.add("a", 2) == 3
    assert c["never"] == 0 and "never" not in c
    assert c.snapshot() == {"a": 3, "b": 3} and type(c.snapshot()) is dict


def test_add_exports_at_once_and_a_plain_write_does_not() -> None:
    m = Metric()
    c = Counts(["sent", "other"], {"sent": m})
    c.add("sent", 2)
    assert m.total == 2  # at once
    c["sent"] += 5  # counted, not exported
    c.add("other")
    assert m.total == 2 and c["sent"] == 7


def test_the_client_and_the_weights_core_count_with_it() -> None:
    client = Counters()
    assert isinstance(client, Counts) and client.stats is client
    assert client.add("resent") == 1 and client["completed"] == 0
    core = PublisherCore("host", worker_timeout=5.0)
    core.count("acks_from_strangers")
    assert isinstance(core.counters, Counts) and core.counters["acks_from_strangers"] == 1
