"""The weights benchmark runs its trainer with the workers' glibc tunable: in a child
process started with ``GLIBC_TUNABLES`` unless the caller has it set (even empty)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from bench import weights
from bench.common import FASTIO, Measurement

TUNED = "glibc.cpu.x86_non_temporal_threshold=131072"


def fake_measurements(quick: bool) -> list[Measurement]:
    """Stands in for ``bench.weights.cpu_measurements`` in the child: reports what the
    child process started with, and a nested extra that must survive the trip back."""
    return [
        Measurement.from_samples(
            "weights", "shm@1MiB", FASTIO, 1 << 20, [0.25, 0.5, 0.125],
            quick=quick,
            trainer_glibc_tunables=weights._start_env("GLIBC_TUNABLES"),
            pid=os.getpid(),
            buckets=[{"recv_s": 0.1, "verify_s": 0.2}],
        ),
        Measurement("weights", "shm@1MiB", "gloo", 1 << 20, 1.5, [1.5], {"size_unit": "bytes"}),
    ]  # fmt: skip


def failing_measurements(quick: bool) -> list[Measurement]:
    """Stands in for a benchmark that fails in the child."""
    raise ValueError("workers did not start: the marker 7f3a")


@pytest.mark.slow
def test_child_runs_with_the_tunable_and_returns_the_measurements() -> None:
    got = weights._cpu_measurements_in_child(
        True, target="tests.test_bench_weights_env:fake_measurements"
    )
    assert [(m.case, m.impl) for m in got] == [("shm@1MiB", FASTIO), ("shm@1MiB", "gloo")]
    ours = got[0]
    assert ours.extra["trainer_glibc_tunables"] == TUNED  # read from the child's start
    assert ours.extra["pid"] != os.getpid()
    assert ours.extra["quick"] is True
    assert ours.median_s == 0.25 and ours.samples == [0.25, 0.5, 0.125]
    assert ours.extra["buckets"] == [{"recv_s": 0.1, "verify_s": 0.2}]
    assert got[1].to_dict() == fake_measurements(True)[1].to_dict()


@pytest.mark.slow
def test_child_failure_raises_with_its_stderr() -> None:
    with pytest.raises(RuntimeError) as info:
        weights._cpu_measurements_in_child(
            False, target="tests.test_bench_weights_env:failing_measurements"
        )
    msg = str(info.value)
    assert "exited with 1" in msg and TUNED in msg
    assert "ValueError: workers did not start: the marker 7f3a" in msg


@pytest.mark.parametrize("env", [None, "", "glibc.malloc.check=0"])
def test_run_uses_a_child_only_without_glibc_tunables(monkeypatch: Any, env: str | None) -> None:
    calls: list[str] = []

    def here(quick: bool) -> list[Measurement]:
        calls.append("here")
        return []

    def child(quick: bool) -> list[Measurement]:
        calls.append("child")
        return []

    monkeypatch.setattr(weights, "cpu_measurements", here)
    monkeypatch.setattr(weights, "_cpu_measurements_in_child", child)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if env is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", env)
    assert weights.run(True) == []
    assert calls == (["child"] if env is None else ["here"])
