"""The weight protocol's core, without a socket or a thread: every rule of
``docs/PROTOCOL.md`` ("Weight updates") that decides who answers, what a worker
reports and when a buffer may be reused, driven by messages and a fake clock."""

from __future__ import annotations

import msgspec
import pytest

from fastio.weight_msgs import WeightAck, WeightAnnounce, WeightBucketInfo, WeightFetch, WeightHello
from transport.weights.core.publisher import PublisherCore, VersionLedger
from transport.weights.core.subscriber import (
    MIXED,
    FetchSchedule,
    PauseLease,
    SubscriberCore,
    choose_atomic,
)

HOST = "host/boot"


def hello(wid: str, version: int = -1, pid: int = 100, start: int = 7) -> WeightHello:
    return WeightHello(wid, HOST, pid, version, None, "", start)


def ack(wid: str, version: int, ok: bool = True, pid: int = 0, start: int = 0) -> WeightAck:
    return WeightAck(
        wid, version, ok, version if ok else -1, "" if ok else "boom", None, "shm", {}, pid, start
    )


class Procs:
    """A fake process table: ``(pid, start_time)`` pairs that run."""

    def __init__(self) -> None:
        self.running: set[tuple[int, int]] = set()

    def alive(self, pid: int, start: int) -> bool:
        return (pid, start) in self.running

    def start_time(self, pid: int) -> int | None:
        return next((s for p, s in self.running if p == pid), None)


def core(procs: Procs | None = None, timeout: float = 10.0) -> PublisherCore:
    p = procs or Procs()
    return PublisherCore(HOST, timeout, alive=p.alive, start_time_of=p.start_time)


def announce(c: PublisherCore, version: int, now: float = 0.0) -> VersionLedger:
    led = VersionLedger(version)
    c.announce(led, now)
    return led


# -- publisher ---------------------------------------------------------------------------
def test_an_ack_from_a_stranger_is_ignored_and_cannot_fail_a_version() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    announce(c, 1)
    assert not c.on_ack("stranger", ack("stranger", 1, ok=False), 0.1)
    assert c.counters["acks_from_strangers"] == 1
    assert c.on_ack("w", ack("w", 1), 0.2)
    res = c.result(1, 0.3)
    assert res.ok and list(res.applied) == ["w"] and not res.failed


def test_a_version_waits_for_the_workers_alive_at_its_announcement() -> None:
    c = core()
    c.on_hello("a", hello("a"), 0.0)
    c.on_hello("b", hello("b"), 0.0)
    announce(c, 1, now=1.0)
    c.on_ack("a", ack("a", 1), 1.5)
    res = c.result(1, 2.0)
    assert not res.ok and res.missing == ["b"] and res.elapsed_s == pytest.approx(1.0)
    c.on_ack("b", ack("b", 1, ok=False), 2.5)
    res = c.result(1, 9.0)
    assert res.failed == {"b": "boom"} and res.paths == {"a": "shm", "b": "shm"}
    assert res.elapsed_s == pytest.approx(1.5)  # to the last answer, not to now


def test_a_dropped_version_keeps_its_final_result_for_a_while() -> None:
    from transport.weights.core.publisher import KEEP_RESULTS

    c = core()
    c.on_hello("w", hello("w"), 0.0)
    announce(c, 1, now=1.0)
    c.on_ack("w", ack("w", 1), 1.25)
    c.drop(1, now=5.0)
    assert 1 not in c.versions
    res = c.result(1, 9.0)
    assert res.ok and list(res.applied) == ["w"] and res.elapsed_s == pytest.approx(0.25)
    for v in range(2, KEEP_RESULTS + 2):
        announce(c, v)
        c.drop(v)
    with pytest.raises(KeyError, match="version 1 was not published by this publisher"):
        c.result(1, 9.0)  # the oldest result goes once more than KEEP_RESULTS are kept
    assert c.result(KEEP_RESULTS + 1, 9.0).missing == ["w"]
    assert c.lookup(KEEP_RESULTS + 1) is c.retired[KEEP_RESULTS + 1]
    led = announce(c, KEEP_RESULTS + 2)
    assert c.lookup(KEEP_RESULTS + 2) is led  # held: its ledger


def test_a_hello_at_the_version_counts_as_its_lost_ack() -> None:
    c = core()
    c.on_hello("w", hello("w", version=0), 0.0)
    announce(c, 1)
    assert c.on_hello("w", hello("w", version=1), 0.5) is None
    assert c.result(1, 1.0).ok


def test_a_version_from_another_publisher_instance_is_none_of_ours() -> None:
    c = PublisherCore(HOST, 10.0, publisher_id="p2")
    c.on_hello("w", hello("w", version=0), 0.0)
    announce(c, 1)
    # The worker holds version 5 of the trainer before the restart ("p1"): no ack of 1,
    # and the snapshot (version 1) is its to fetch.
    led = c.on_hello("w", msgspec.structs.replace(hello("w", version=5), source="p1"), 0.5)
    assert led is not None and led.version == 1 and c.result(1, 1.0).missing == ["w"]
    for source in ("p2", ""):  # ours, or a peer that does not say: the version counts
        c2 = PublisherCore(HOST, 10.0, publisher_id="p2")
        c2.on_hello("w", hello("w", version=0), 0.0)
        announce(c2, 1)
        assert c2.on_hello("w", msgspec.structs.replace(hello("w", 5), source=source), 0.5) is None
        assert c2.result(1, 1.0).ok


def test_a_worker_behind_gets_the_snapshot_and_is_expected() -> None:
    c = core()
    announce(c, 3)
    led = c.on_hello("late", hello("late", version=1), 0.0)
    assert led is not None and led.version == 3
    assert c.result(3, 0.1).missing == ["late"]


def test_silent_and_dead_workers_are_lost_and_come_back() -> None:
    procs = Procs()
    procs.running.add((200, 9))
    c = core(procs, timeout=10.0)
    c.on_hello("silent", hello("silent", pid=100, start=7), 0.0)  # not visible here
    c.on_hello("dead", hello("dead", pid=200, start=9), 0.0)  # visible: same host
    announce(c, 1, now=0.0)
    procs.running.clear()
    assert c.tick(1.0) == [("dead", "worker lost: its process is gone")]
    lost = c.tick(11.0)
    assert [w for w, _ in lost] == ["silent"] and "no message for 11.0 s" in lost[0][1]
    res = c.result(1, 11.0)
    assert set(res.failed) == {"dead", "silent"} and not res.missing
    c.on_hello("silent", hello("silent"), 12.0)  # back (restarted): expected again
    assert c.workers["silent"].alive and "silent" not in c.versions[1].lost


def test_a_route_notice_restarts_the_silence_timer_but_revives_no_lost_worker() -> None:
    c = core(timeout=10.0)
    c.on_hello("w", hello("w"), 0.0)
    announce(c, 1, now=0.0)
    assert c.seen("w", 5.0) and not c.seen("stranger", 5.0)
    assert c.tick(11.0) == []  # heard from at 5.0: not silent yet
    assert [w for w, _ in c.tick(16.0)] == ["w"]
    assert c.versions[1].settled()
    assert c.seen("w", 17.0)  # an ipc goodbye, say: still lost, the version settled
    assert not c.workers["w"].alive and c.versions[1].settled()


def test_gone_from_the_ipc_path_is_lost_at_once() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    announce(c, 1)
    assert c.tick(0.1, gone=["w"]) == [("w", "worker lost: its process is gone")]
    assert c.tick(0.2, gone=["w"]) == []


def test_the_buffer_rule_a_reader_is_a_process_not_a_worker_id() -> None:
    """A replacement under the same id does not answer for its predecessor."""
    procs = Procs()
    procs.running |= {(100, 7), (101, 8)}
    c = core(procs)
    c.on_hello("w", hello("w", pid=100, start=7), 0.0)
    led = announce(c, 1)
    c.versions[1].readers.add(c.reader("w", WeightFetch(1, 0, True, 100, 7)))
    assert not c.readers_done(c.versions[1])
    # The replacement (pid 101) says Hello at version 1 and acks it: not the reader.
    c.on_hello("w", hello("w", version=1, pid=101, start=8), 0.5)
    c.on_ack("w", ack("w", 1, pid=101, start=8), 0.6)
    assert not c.readers_done(c.versions[1])
    # The reader's process ends: it reads no more.
    procs.running.discard((100, 7))
    assert c.readers_done(c.versions[1])
    assert led is c.versions[1]


def test_the_buffer_rule_a_reader_answering_frees_the_buffer() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    announce(c, 1)
    c.versions[1].readers.add(c.reader("w", WeightFetch(1, 0, True)))  # the Hello's process
    assert not c.readers_done(c.versions[1])
    c.on_ack("w", ack("w", 1, ok=False), 0.2)  # a failed answer is an answer too
    assert c.readers_done(c.versions[1])


def test_a_reader_this_host_cannot_see_is_never_taken_for_gone() -> None:
    c = core()  # an empty process table: nothing is visible
    c.on_hello("w", hello("w", pid=5, start=3), 0.0)
    announce(c, 1)
    r = c.reader("w", WeightFetch(1, 0, True, 5, 3))
    assert r == ("w", 5, 3, 0)
    c.versions[1].readers.add(r)
    assert not c.readers_done(c.versions[1])


def test_who_must_answer_is_the_callers_list_when_given() -> None:
    c = core()
    c.on_hello("a", hello("a"), 0.0)
    led = announce(c, 1)
    assert not led.settled()
    c.expect(led, None)  # the workers alive at the announcement
    assert led.expected == {"a"}
    c.expect(led, ["a", "b"])
    c.on_ack("a", ack("a", 1), 0.1)
    assert not led.settled()  # "b" never answered
    c.expect(led, ["a"])
    assert led.settled()


def test_a_failure_is_counted_once() -> None:
    c = core()
    c.on_hello("a", hello("a"), 0.0)
    led = announce(c, 1)
    c.on_ack("a", ack("a", 1, ok=False), 0.1)
    assert [c.outcome(led, 0.2)[1] for _ in range(3)] == [True, False, False]


def test_the_fetch_rule_refuses_parks_or_answers_as_a_reader() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    led = announce(c, 1)
    f = WeightFetch(1, 0, True)
    assert c.on_fetch("w", WeightFetch(0, 0, True), None) == (
        "refuse", "version 0 is not available (latest is 1)", 1
    )  # fmt: skip
    assert c.on_fetch("w", f, led)[1] == "version 1 is not available (latest is 1)"  # no manifest
    led.announce = WeightAnnounce("p", 0, 1, "xxh3_64", 8, [WeightBucketInfo(0, 8, 0, [])])
    led.unstaged = led.ipc_packing = True  # ipc workers only, still packed into the slots
    assert c.on_fetch("w", f, led)[0] == "park"
    assert c.counters.get("fetches_deferred") == 1
    led.ipc_packing = False
    assert c.on_fetch("w", f, led)[1].endswith("no longer held (latest is 1)")
    led.unstaged = False
    assert c.on_fetch("w", WeightFetch(1, 1, False), led)[1] == "no bucket 1 in version 1"
    assert c.on_fetch("w", f, led) == ("refuse", "no shared memory for this version", -1)
    assert c.readers_done(led)
    led.announce.shm_name = "segment"
    assert c.on_fetch("w", f, led) == ("send", "", 1)
    assert not c.readers_done(led)  # it reads the segment until it answers


def test_a_fetch_asked_again_ends_the_earlier_answer_of_that_bucket() -> None:
    c = core()
    led = announce(c, 1)
    first, second, other = object(), object(), object()
    assert c.answering(led, ("w", 0), first) is None
    assert c.answering(led, ("w", 1), other) is None
    assert c.answering(led, ("w", 0), second) is first
    c.answer_ended(led, ("w", 0), first)  # the ended one's end frees nothing
    assert led.answering == {("w", 0): second, ("w", 1): other}
    c.answer_ended(led, ("w", 0), second)
    assert list(led.answering) == [("w", 1)]


def test_the_buffer_rule_a_buffer_is_taken_only_when_no_one_needs_it() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    led = announce(c, 1)
    c.on_ack("w", ack("w", 1), 0.1)
    assert not c.reusable(led, sending=False)  # the latest
    led2 = announce(c, 2)
    announce(c, 3)
    assert not c.reusable(led2, sending=False)  # "w" has not answered
    assert c.reusable(led, sending=False)
    assert not c.reusable(led, sending=True)
    c.answering(led, ("late", 0), object())
    assert not c.reusable(led, sending=False)


def test_the_oldest_takeable_buffers_beyond_those_kept_are_taken() -> None:
    c = core()
    c.on_hello("w", hello("w"), 0.0)
    for v in (1, 2, 3, 4):
        announce(c, v)
    for v in (1, 3, 4):
        c.on_ack("w", ack("w", v), 0.1)
    assert c.takeable(lambda v: False) == [1, 3]  # 2 unanswered, 4 the latest
    assert c.takeable(lambda v: v == 1) == [3]  # bytes of 1 still queued
    assert c.takeable(lambda v: False, keep=3) == [1]
    assert c.takeable(lambda v: False, keep=4) == []
    # A pooled segment is taken when it fits without wasting half of it.
    assert PublisherCore.fits(100, 100) and PublisherCore.fits(100, 200)
    assert not PublisherCore.fits(100, 99) and not PublisherCore.fits(100, 201)
    assert PublisherCore.fits(0, 0) and not PublisherCore.fits(0, 1)


def test_a_version_is_cast_to_the_dtype_every_live_worker_asked_for() -> None:
    c = core()
    assert c.wanted_dtype() == ""  # no worker
    c.on_hello("a", WeightHello("a", HOST, 100, -1, None, "bfloat16", 7), 0.0)
    assert c.wanted_dtype() == "bfloat16"
    c.on_hello("b", hello("b"), 0.0)  # asks for none
    assert c.wanted_dtype() == ""
    c.tick(0.0, gone=["b"])
    assert c.wanted_dtype() == "bfloat16"  # only the live ones count
    c.on_hello("b", WeightHello("b", HOST, 101, -1, None, "float16", 8), 0.0)
    assert c.wanted_dtype() == ""  # not one dtype


def test_a_version_must_be_newer_than_the_latest() -> None:
    c = core()
    assert c.latest_version == -1
    c.check_newer(0)
    announce(c, 3)
    assert c.latest_version == 3
    c.check_newer(4)
    for v in (2, 3):
        with pytest.raises(ValueError, match=rf"version {v} is not newer than the latest \(3\)"):
            c.check_newer(v)


# -- subscriber --------------------------------------------------------------------------
def test_notices_from_an_unknown_publisher_ask_for_a_hello() -> None:
    s = SubscriberCore()
    assert s.notice("p1", "heartbeat", 5, 1.0) == s.notice("p1", "announce", 5, 1.0) == "hello"
    assert s.last_heard == 0.0
    assert s.notice("p1", "welcome", 5, 2.0) == "handshake"
    assert (s.publisher_id, s.last_seq) == ("p1", 5)
    assert s.notice("p1", "announce", 6, 3.0) == "handle" and s.last_heard == 3.0
    assert s.notice("p1", "welcome", 6, 3.5) == "handle"  # the same instance: no new handshake
    assert s.notice("p2", "welcome", 1, 4.0) == "handshake" and s.last_seq == 1  # restarted


def test_a_heartbeat_ahead_means_a_lost_announce() -> None:
    s = SubscriberCore()
    s.notice("p", "welcome", 1, 1.0)
    assert s.notice("p", "heartbeat", 1, 2.0) == "handle"
    assert s.notice("p", "heartbeat", 2, 2.0) == "hello" and s.counters["gaps"] == 1
    # An Announce that skips numbers: counted, nothing to repair; an old one changes nothing.
    assert s.notice("p", "announce", 5, 3.0) == "handle"
    assert s.counters["gaps"] == 2 and s.last_seq == 5
    assert s.notice("p", "announce", 4, 3.0) == "handle" and s.last_seq == 5
    assert s.notice("p", "heartbeat", 5, 3.0) == "handle" and s.counters["gaps"] == 2


def test_a_handshake_that_failed_is_shaken_again() -> None:
    s = SubscriberCore()
    assert s.notice("p", "welcome", 1, 1.0) == "handshake"
    s.forget_publisher()  # the driver's setup raised
    assert s.notice("p", "heartbeat", 1, 1.5) == "hello"
    assert s.notice("p", "welcome", 1, 2.0) == "handshake"


def test_versions_of_another_publisher_instance_are_tried_whatever_their_number() -> None:
    s = SubscriberCore(version=3)  # initial weights: trusted against any publisher
    assert s.consider("p1", 3, None) == (False, False)
    s.notice("p1", "welcome", 1, 0.0)
    s.applied(5)
    assert s.source == "p1" and s.consider("p1", 4, None) == (False, False)
    s.notice("p2", "welcome", 1, 1.0)  # the trainer restarted from an earlier checkpoint
    assert s.consider("p2", 2, None) == (False, True) and s.consider("p2", 5, None)[1]
    s.applied(2)
    assert (s.version, s.source) == (2, "p2") and s.consider("p2", 2, None) == (False, False)


def test_versions_are_tried_when_newer_at_most_retries_times() -> None:
    s = SubscriberCore(version=2, retries=2)
    assert s.consider("p", 2, None) == (False, False)
    assert s.consider("p", 3, None) == (False, True)
    assert s.consider("p", 3, None) == (False, True)
    assert s.consider("p", 3, None) == (False, False)  # given up
    assert s.consider("p2", 3, None) == (False, True)  # another publisher instance
    assert s.consider("p", 4, 3) == (True, True)  # supersedes the one in flight
    assert s.consider("p", 4, 4) == (False, False)
    s.give_up("p", 5)  # the manifest does not fit the model
    assert s.consider("p", 5, 4) == (True, False)


def test_never_a_mixed_version_reported() -> None:
    s = SubscriberCore(version=1)
    assert s.consider("p", 2, None) == (False, True)
    s.mark_mixed()  # one pass: the first write
    assert s.reported_version == -1
    error = s.failed("publisher silent")
    assert MIXED in error and s.reported_version == -1 and s.version == 1
    # The same version, fetched again, is tried though it is not newer: mixed weights.
    assert s.consider("p", 1, None) == (False, True)
    s.applied(2)
    assert s.reported_version == 2 and s.consistent


def test_a_failed_copy_or_load_marks_the_weights_mixed_until_a_version_lands() -> None:
    s = SubscriberCore(version=3)
    s.mark_mixed()  # the driver's copy or the engine's loader failed part-way
    assert not s.consistent and s.reported_version == -1
    assert s.consider("p", 3, None) == (False, True)  # the same version is wanted again
    s.applied(3)
    assert s.consistent and s.reported_version == 3
    with pytest.raises(AttributeError):
        s.consistent = True  # type: ignore[misc]  # decided by the core only


def test_a_version_failing_before_its_first_write_keeps_the_weights() -> None:
    s = SubscriberCore(version=1)
    error = s.failed("bucket 0 failed its checksum")
    assert error == "bucket 0 failed its checksum" and s.reported_version == 1
    assert s.counters["versions_failed"] == 1


def test_one_pass_only_under_a_lock_that_refuses_mixed_weights() -> None:
    assert choose_atomic(None, refuses_mixed=True, loader=False) is False
    assert choose_atomic(None, refuses_mixed=False, loader=False) is True
    assert choose_atomic(None, refuses_mixed=True, loader=True) is True
    assert choose_atomic(False, refuses_mixed=False, loader=False) is False
    with pytest.raises(ValueError, match="atomic=True"):
        choose_atomic(False, refuses_mixed=True, loader=True)


def test_fetches_keep_a_window_and_retry_a_bad_bucket() -> None:
    f = FetchSchedule(7, 4, window=2, retries=2)
    assert f.due(0.0) == [0, 1] and f.due(0.0) == []
    f.done(0)
    assert f.due(0.1) == [2]
    assert f.again(1) is None  # asked again
    assert f.due(0.2) == [1]  # a bucket asked again goes first
    assert f.attempts[1] == 2
    assert f.again(1) == "bucket 1 of version 7 failed its checksum 2 times"


def test_shm_fetches_all_at_once_and_a_bad_checksum_is_final() -> None:
    f = FetchSchedule(2, 3, window=1, retries=3, shm=True)
    assert f.due(0.0) == [0, 1, 2]
    assert f.again(1) == "bucket 1 of version 2 fails its checksum in shared memory"


def test_fetches_time_out_then_fail() -> None:
    f = FetchSchedule(3, 2, window=2, retries=2)
    f.due(0.0)
    f.progress(0, 4.0)  # a piece arrived: its clock restarts
    again, error = f.timeouts(5.0, 5.0)
    assert again == [1] and error is None
    assert f.due(5.0) == [1]
    again, error = f.timeouts(10.0, 5.0)
    assert error == "bucket 1 of version 3: no answer after 2 fetches"


def test_a_broken_channel_requeues_in_order() -> None:
    f = FetchSchedule(1, 3, window=3, retries=3)
    f.due(0.0)
    f.requeue(2)
    f.requeue(1)
    f.done(0)
    assert f.due(1.0) == [1, 2]
    f.done(1)
    f.done(2)
    assert f.finished


def test_the_pause_lease_resumes_a_paused_worker_with_a_silent_publisher() -> None:
    lease = PauseLease(30.0)
    kw = {"paused": True, "copying": False, "mixed": False, "last_heard": 0.0}
    assert lease.tick(100.0, **kw) is None  # the lease starts now
    assert lease.tick(129.0, **kw) is None
    assert lease.tick(130.0, **kw) == pytest.approx(30.0)
    assert lease.tick(131.0, **kw) is None  # resumed: a new lease


def test_the_pause_lease_waits_for_a_live_publisher_a_copy_and_mixed_weights() -> None:
    lease = PauseLease(30.0)
    kw = {"paused": True, "copying": False, "mixed": False}
    assert lease.tick(0.0, last_heard=0.0, **kw) is None
    assert lease.tick(40.0, last_heard=20.0, **kw) is None  # heard 20 s ago
    assert lease.tick(51.0, last_heard=20.0, **kw) == pytest.approx(31.0)
    for state in ({"mixed": True}, {"copying": True}, {"paused": False}):
        lease = PauseLease(30.0)
        args = {**kw, **state}
        assert lease.tick(0.0, last_heard=0.0, **args) is None
        assert lease.tick(100.0, last_heard=0.0, **args) is None
