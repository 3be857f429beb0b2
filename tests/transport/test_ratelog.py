"""The one rate-limited logger of the worker, the client and the weights."""

from __future__ import annotations

import logging

import pytest

from transport.ratelog import RateLimitedLog


def test_warning_logs_the_first_of_a_kind_then_a_summary_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("transport.ratelog.time.monotonic", lambda: now[0])
    rlog = RateLimitedLog(logging.getLogger("test.ratelog"), interval=30.0)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        rlog.warning("bad message", "bad message from %r: %s", "w1", "junk")
        for _ in range(4):
            now[0] += 5
            rlog.warning("bad message", "bad message from %r: %s", "w1", "junk")
        rlog.warning("publisher error", "weight publisher error: %s", "gone")
        now[0] += 15  # 35 s after the first: the summary is due
        rlog.warning("bad message", "bad message from %r: %s", "w1", "junk")
        now[0] += 1
        rlog.warning("bad message", "bad message from %r: %s", "w1", "junk")
    assert caplog.messages == [
        "bad message from 'w1': junk (further bad messages are counted, not logged)",
        "weight publisher error: gone (further publisher errors are counted, not logged)",
        "5 more bad messages in the last 35 s",
    ]


def test_counted_logs_the_first_ten_then_powers_of_two(caplog: pytest.LogCaptureFixture) -> None:
    rlog = RateLimitedLog(logging.getLogger("test.ratelog"))
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        for n in range(1, 70):
            rlog.counted(n, "bad message from %r: %s", "peer", "junk")
    logged = [int(m.rsplit(" ", 1)[1].rstrip(")")) for m in caplog.messages]
    assert logged == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64]
    assert caplog.messages[0] == "bad message from 'peer': junk (occurrence 1)"
