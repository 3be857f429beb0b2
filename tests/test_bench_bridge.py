"""bench.bridge runs end to end (tiny sizes): both ways answer, figures are reported."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bridge_bench_measures_both_ways() -> None:
    from bench.bridge import run

    ms = run(requests=3, tokens=4, concurrency=2, total=6)
    impls = {(m.case, m.impl) for m in ms}
    assert impls == {
        ("sequential 4 tokens", "direct-http"), ("sequential 4 tokens", "fastio"),
        ("2 in flight", "direct-http"), ("2 in flight", "fastio"),
    }  # fmt: skip
    for m in ms:
        assert m.median_s > 0
    seq = [m for m in ms if m.case.startswith("sequential")]
    assert all(len(m.samples) == 3 for m in seq)
    assert "paired_overhead_median_s" in next(m for m in seq if m.impl == "fastio").extra
