"""``tune_gc``: the cyclic collector's first threshold raised, never lowered, and left
alone when asked."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from transport import tune_gc


@pytest.fixture(autouse=True)
def _restore(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FASTIO_TUNE_GC", raising=False)
    before, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()
    if not enabled:
        gc.disable()


def test_raises_the_first_threshold_only() -> None:
    gc.set_threshold(700, 11, 12)
    assert tune_gc(20_000) is True
    assert gc.get_threshold() == (20_000, 11, 12)


def test_never_lowers_a_higher_threshold_nor_enables_a_disabled_collector() -> None:
    gc.set_threshold(80_000, 10, 10)
    assert tune_gc(20_000) is False
    assert gc.get_threshold() == (80_000, 10, 10)
    gc.set_threshold(0, 10, 10)  # threshold 0: collection off
    assert tune_gc(20_000) is False
    assert gc.get_threshold()[0] == 0


def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTIO_TUNE_GC", "0")
    gc.set_threshold(700, 10, 10)
    frozen = gc.get_freeze_count()
    assert tune_gc(freeze=True) is False
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == frozen


def test_freeze_moves_what_is_alive_out_of_the_passes() -> None:
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # containers alive now
    assert tune_gc(freeze=True) is True
    assert gc.get_freeze_count() >= len(kept)


def test_fewer_passes_over_objects_held_in_flight() -> None:
    """What a client with thousands of requests in flight allocates: containers that
    live until their reply, none of them garbage."""
    passes = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes[0] += 1

    def hold(n: int) -> int:
        held = [{"call": [i], "times": []} for i in range(n)]
        return len(held)

    gc.callbacks.append(count)
    try:
        gc.set_threshold(700, 10, 10)
        gc.collect()
        passes[0] = 0
        hold(20_000)
        default = passes[0]
        tune_gc()
        passes[0] = 0
        hold(20_000)
        tuned = passes[0]
    finally:
        gc.callbacks.remove(count)
    assert default >= 50  # one every 700 net allocations
    assert tuned <= 1
