"""bench.hf_engine runs (tiny model): one JSON row per batch and weight_left setting,
every rate positive."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_hf_engine_bench_reports_both_linear_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.hf_engine import main

    main(["--sizes", "tiny", "--batches", "1,2", "--new-tokens", "2", "--device", "cpu"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    keys = [(r["size"], r["weight_left"], r["batch"]) for r in rows]
    assert keys == [("tiny", False, 1), ("tiny", False, 2), ("tiny", True, 1), ("tiny", True, 2)]
    assert all(isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0 for r in rows)
