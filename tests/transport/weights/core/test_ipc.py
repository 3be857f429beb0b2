"""The ipc route's rules in the core: slot reuse and the fallback's choice of version
(no socket, no thread, no clock)."""

from __future__ import annotations

from fastio.weight_msgs import WeightAnnounce
from transport.weights.core.ipc import IpcFallback, SlotLedger


def announce(version: int) -> WeightAnnounce:
    return WeightAnnounce("p", 0, version, "xxh3_64", 0, [])


def test_a_slot_is_free_once_every_reader_acked_or_was_dropped() -> None:
    led = SlotLedger(2, 3)
    assert [led.slot(b) for b in range(3)] == [0, 1, 0]
    led.packed(0, ["a", "b"])
    led.released(0, "a")
    assert led.readers[0] == {"b"}
    led.released(7, "b")  # no such slot: ignored
    led.drop("b")
    assert not led.readers[0]


def test_the_slots_hold_a_version_whole_only_with_one_slot_per_bucket() -> None:
    two, whole = SlotLedger(2, 3), SlotLedger(3, 3)
    for led in (two, whole):
        led.packing()
        led.done(5)
    assert not two.holds(5) and whole.holds(5)
    whole.packing()  # packing again: the old version is no longer whole
    assert not whole.holds(5)


def test_the_newest_announce_is_kept_as_the_fallback() -> None:
    fb = IpcFallback()
    assert fb.keep(announce(2), 1, now=10.0) and fb.kept is not None
    assert fb.keep(announce(1), 1, now=11.0)  # not newer than the weights: not kept
    assert fb.keep(announce(3), 1, now=12.0) and fb.kept.version == 3
    assert fb.progress == 12.0
    fb.applied(3)
    assert fb.kept is None


def test_a_failed_version_is_fetched_from_its_kept_announce_once() -> None:
    fb = IpcFallback()
    fb.keep(announce(4), 3, now=0.0)
    step, ann = fb.on_failure(4, 3, None) or ("", None)
    assert step == "fetch" and ann is not None and ann.version == 4 and fb.kept is None
    assert fb.on_failure(4, 3, None) is None  # fell back already
    assert not fb.keep(announce(4), 3, now=1.0)  # never by ipc again: fetched now
    assert fb.on_failure(5, 3, None) == ("fail", None)  # never announced here
    assert fb.on_failure(6, 6, None) == ("none", None)  # applied already
    assert fb.on_failure(7, 3, 7) == ("none", None)  # shm/tcp fetches it already
    fb.reset()
    assert not fb.failed


def test_a_version_without_progress_is_overdue() -> None:
    fb = IpcFallback()
    fb.keep(announce(2), 1, now=0.0)
    assert fb.overdue(1, now=5.0, timeout=5.0) is None
    fb.progress = 4.0  # an IpcReady came
    assert fb.overdue(1, now=9.5, timeout=5.0) is not None
    assert 2 in fb.failed and fb.kept is None
    fb.keep(announce(3), 3, now=10.0)  # not newer than the weights: nothing to fetch
    assert fb.overdue(3, now=100.0, timeout=5.0) is None
