"""Busy or dead, re-send back-off and load-aware scheduling, against scripted workers.

A :class:`ScriptedWorker` is a real ROUTER socket served by its own thread, speaking the
fabric protocol with behaviour a test sets: how long it holds a request, what load its
pongs report, whether it answers pings at all, whether it gives every request up.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
import zmq

from fastio import Decoder, Encoder, GenerationHyperparameters, LLMRequest
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from tests.transport.conftest import await_for
from transport import ClientConfig, FabricClient, RemoteError

FAST = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=10, request_timeout=30)


class ScriptedWorker(threading.Thread):
    """A fabric worker whose behaviour the test scripts (see the module docstring)."""

    def __init__(
        self,
        *,
        hold: float = 0.0,
        running: int = 0,
        waiting: int = 0,
        engine_lag: float = 0.0,
        lose: bool = False,
        stream_then_die: int = 0,
    ) -> None:
        super().__init__(daemon=True)
        self.hold, self.lose = hold, lose
        self.stream_then_die = stream_then_die
        self.running, self.waiting, self.engine_lag = running, waiting, engine_lag
        self.pong = True
        self.submits: list[tuple[float, int]] = []  # (arrival, id)
        self.requests: list[LLMRequest] = []
        self.cancels: list[int] = []
        self.pings = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._halt = threading.Event()
        self._incarnation = uuid.uuid4().hex
        self.start()

    def run(self) -> None:
        enc, dec = Encoder(), Decoder(fm.CLIENT_TO_WORKER)
        pending: list[tuple[float, bytes, int, LLMRequest]] = []
        sock = self._sock
        while not self._halt.is_set():
            now = time.monotonic()
            due = [p for p in pending if p[0] <= now]
            for p in due:
                pending.remove(p)
                _, peer, sid, req = p
                n = len(req.input_ids)
                res = fm.Result(
                    id=sid,
                    output_tokens=req.input_ids,
                    output_logprobs=TokenArray(np.zeros(n, dtype=np.float32)),
                    output_versions=TokenArray(np.zeros(n, dtype=np.int32)),
                )
                sock.send_multipart([peer, *enc.encode(res)])
            if not sock.poll(10):
                continue
            peer, *body = sock.recv_multipart()
            for frames in fm.split(body):
                msg = dec.decode(frames)
                if isinstance(msg, fm.Heartbeat):
                    self.pings += 1
                    if self.pong:
                        hb = fm.Heartbeat(
                            sent_at=msg.sent_at, worker_id="scripted",
                            incarnation=self._incarnation, in_flight=len(pending),
                            running=self.running, waiting=self.waiting,
                            engine_lag=self.engine_lag,
                        )  # fmt: skip
                        sock.send_multipart([peer, *enc.encode(hb)])
                elif isinstance(msg, fm.Submit):
                    self.submits.append((time.monotonic(), msg.id))
                    self.requests.append(msg.request)
                    if self.stream_then_die:
                        # Streams some tokens, then falls silent holding the request.
                        k = self.stream_then_die
                        chunk = fm.Stream(
                            id=msg.id, seq=0,
                            output_tokens=TokenArray(np.arange(100, 100 + k, dtype=np.int32)),
                            output_logprobs=TokenArray(np.full(k, -0.5, dtype=np.float32)),
                            output_versions=TokenArray(np.full(k, 3, dtype=np.int32)),
                        )  # fmt: skip
                        sock.send_multipart([peer, *enc.encode(chunk)])
                        self.pong = False
                    elif self.lose:
                        err = fm.Error(id=msg.id, code=int(fm.ErrorCode.LOST), message="lost")
                        sock.send_multipart([peer, *enc.encode(err)])
                    else:
                        pending.append((time.monotonic() + self.hold, peer, msg.id, msg.request))
                elif isinstance(msg, fm.Cancel):
                    self.cancels.append(msg.id)
        sock.close(0)
        self._ctx.term()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


@pytest.fixture
def scripted() -> Any:
    made: list[ScriptedWorker] = []

    def make(**kw: Any) -> ScriptedWorker:
        w = ScriptedWorker(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


@pytest.mark.slow
def test_busy_worker_is_not_declared_dead_and_nothing_is_resent(scripted: Any) -> None:
    # Each holds its request 20x longer than a silent worker would live (0.15 s), but
    # answers every ping and says it is busy: the client waits, and re-sends nothing.
    a = scripted(hold=3.0, running=1, engine_lag=2.5)
    b = scripted(hold=3.0, running=1, engine_lag=2.5)

    async def main() -> None:
        async with FabricClient([a.address, b.address], FAST) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="alive")
            outs = await asyncio.gather(
                client.agenerate(LLMRequest(input_ids=[1, 2])),
                client.agenerate(LLMRequest(input_ids=[3])),
            )
            assert [o.output_tokens.tolist() for o in outs] == [[1, 2], [3]]
            assert client.stats["workers_died"] == 0 and client.stats["resent"] == 0
            info = client.workers[0]
            assert info.alive and info.running == 1 and info.engine_lag == 2.5
        assert len(a.submits) + len(b.submits) == 2 and not a.cancels and not b.cancels

    asyncio.run(main())


def test_silent_worker_still_dies_and_its_request_moves(scripted: Any) -> None:
    a, b = scripted(hold=30.0), scripted(hold=0.0)

    async def main() -> None:
        async with FabricClient([a.address], FAST) as client:
            await await_for(lambda: client.workers[0].alive, what="alive")
            fut = client.agenerate(LLMRequest(input_ids=[7]))
            await await_for(lambda: a.submits, what="submitted")
            client.add_worker(b.address)
            await await_for(lambda: client.workers[1].alive, what="b alive")
            a.pong = False
            assert (await fut).output_tokens == [7]
            assert client.stats["workers_died"] == 1 and client.stats["resent"] == 1
        assert len(b.submits) == 1

    asyncio.run(main())


def _collect(into: list[int]) -> Any:
    def on_chunk(t: Any, lp: Any, v: Any) -> None:
        into.extend(t.tolist())

    return on_chunk


def test_lost_attempt_keeps_its_streamed_tokens_and_the_resend_continues(
    scripted: Any,
) -> None:
    a, b = scripted(stream_then_die=4), scripted()
    prompt, n = [1, 2, 3], 10
    got: list[int] = []

    async def main() -> None:
        async with FabricClient([a.address], FAST) as client:
            await await_for(lambda: client.workers[0].alive, what="a alive")
            g = GenerationHyperparameters(max_new_tokens=n, min_new_tokens=6)
            fut = client.agenerate(LLMRequest(input_ids=prompt, gconfig=g), on_chunk=_collect(got))
            await await_for(lambda: a.submits, what="a has it")
            client.add_worker(b.address)  # where the rest will go
            r = await fut
            assert client.stats["workers_died"] == 1 and client.stats["resent"] == 1
        cont = b.requests[0]
        assert cont.input_ids == [*prompt, 100, 101, 102, 103]  # prompt + what streamed
        assert cont.gconfig.max_new_tokens == n - 4 and cont.gconfig.min_new_tokens == 2
        assert r.output_tokens[:4] == [100, 101, 102, 103]
        assert r.output_tokens == got  # each position delivered once
        assert r.output_versions[:4] == [3, 3, 3, 3] and r.input_tokens == prompt

    asyncio.run(main())


def test_lost_attempt_that_streamed_everything_completes_without_resend(
    scripted: Any,
) -> None:
    a, b = scripted(stream_then_die=5), scripted()
    got: list[int] = []

    async def main() -> None:
        async with FabricClient([a.address], FAST) as client:
            await await_for(lambda: client.workers[0].alive, what="a alive")
            g = GenerationHyperparameters(max_new_tokens=5)
            fut = client.agenerate(LLMRequest(input_ids=[9], gconfig=g), on_chunk=_collect(got))
            await await_for(lambda: a.submits, what="a has it")
            client.add_worker(b.address)  # would take a re-send
            r = await fut
            assert r.output_tokens == [100, 101, 102, 103, 104] == got
            assert r.stop_reason == "length" and client.stats["resent"] == 0
        assert not b.submits

    asyncio.run(main())


def test_resends_back_off_exponentially(scripted: Any) -> None:
    # A worker that gives every request up at once: without a back-off the client
    # would re-send it as fast as the round trip allows.
    w = scripted(lose=True)
    cfg = ClientConfig(
        heartbeat_interval=0.05, max_resends=4, resend_backoff=0.05, resend_backoff_max=10.0
    )

    async def main() -> None:
        async with FabricClient([w.address], cfg) as client:
            with pytest.raises(RemoteError, match="giving up"):
                await client.agenerate(LLMRequest(input_ids=[1]))
            assert client.stats["resent"] == 4

    asyncio.run(main())
    times = [t for t, _ in w.submits]
    assert len(times) == 5
    gaps = np.diff(times)
    for k, gap in enumerate(gaps, start=1):
        assert gap >= 0.5 * 0.05 * 2 ** (k - 1) * 0.95, (k, gaps)


def test_resend_delay_is_exponential_jittered_and_bounded() -> None:
    from transport.client.scheduling import resend_delay

    assert resend_delay(1, 0.1, 5.0, rand=1.0) == pytest.approx(0.1)
    assert resend_delay(1, 0.1, 5.0, rand=0.0) == pytest.approx(0.05)
    assert resend_delay(4, 0.1, 5.0, rand=1.0) == pytest.approx(0.8)
    assert resend_delay(50, 0.1, 5.0, rand=1.0) == pytest.approx(5.0)
    assert resend_delay(10_000, 0.1, 5.0, rand=0.0) == pytest.approx(2.5)
    assert all(0.025 <= resend_delay(2, 0.05, 1.0) <= 0.1 for _ in range(100))


def test_a_worker_keeps_its_own_liveness_state() -> None:
    """Misses, deaths, the load of other clients, the in-flight limit and the calls there,
    as a Worker's own methods keep them (no worker process, no traffic)."""
    from fastio import versions
    from transport.client.calls import Call, GenerateFuture
    from transport.client.workers import Worker

    async def main() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        w = Worker("inproc://nobody", ctx, ClientConfig(max_in_flight_per_worker=3), b"c", print)
        try:
            hb = fm.Heartbeat(worker_id="a", incarnation="1", running=3, waiting=2, in_flight=1)
            assert w.mark_incompatible("old") and not w.mark_incompatible("old")
            assert w.record_pong(hb, versions.VERSION_1) and w.alive and not w.incompatible
            assert w.others == 5 and w.load_current and not w.record_pong(hb, versions.VERSION_1)
            assert not w.tick(prev=1.0, ticks=2, seconds=0.0)  # one silent tick: not yet
            assert w.missed == 1 and not w.load_current and w.others == 0  # a stale load
            assert w.tick(prev=1.0, ticks=2, seconds=0.0)  # two: dead
            assert w.mark_dead() and not w.alive and w.died_at > 0 and not w.mark_dead()
            assert w.overloaded() and w.limit == 1 and not w.warm()  # none of ours: cool
            calls = [Call(LLMRequest(input_ids=[1]), GenerateFuture(), None, 1.0) for _ in range(4)]
            for i, call in enumerate(calls[:3]):
                w.begin(i, call, [b"submit"])  # the scheduler keeps to the limit, not begin()
            for i, limit in enumerate((2, 3, 3)):
                assert w.answered(i) is calls[i]
                assert w.limit == limit  # back up one per answer, to the configured limit
            assert w.answered(0) is None and w.end(0) is None and not w.cancel(0)  # stale
            assert w.limit == 3 and not w.inflight
            w.begin(7, calls[3], [b"submit"])
            assert w.cancel(7) and not w.inflight
            calls[2].done = True
            for call in (calls[2], calls[3], calls[1]):
                w.queue_sticky(call)
            assert w.next_sticky() is None  # dead: sends it nothing
            assert w.record_pong(hb, versions.VERSION_1)
            assert w.next_sticky() is calls[3]  # the done one skipped
            w.begin(8, calls[3], [b"submit"])
            assert not w.overloaded() and w.limit == 1  # one of ours runs: full, not cooling
            assert w.next_sticky() is None and len(w.sticky_queue) == 1
            assert w.end(8) is calls[3] and w.next_sticky() is calls[1]
            assert w.drain() == [] and w.draining and w.drain(False) == [] and not w.draining
        finally:
            w.close()
            ctx.term()

    asyncio.run(main())


def test_scheduler_prefers_the_less_loaded_worker(scripted: Any) -> None:
    # Worker a reports 50 requests of other clients; b none: new work goes to b.
    a = scripted(hold=1.0, running=40, waiting=10)
    b = scripted(hold=1.0)

    async def main() -> None:
        async with FabricClient([a.address, b.address], FAST) as client:
            await await_for(
                lambda: all(i.alive for i in client.workers) and client.workers[0].running == 40,
                what="both alive, a's load known",
            )
            futs = [client.agenerate(LLMRequest(input_ids=[i])) for i in range(6)]
            await asyncio.gather(*futs)
        assert len(b.submits) == 6 and not a.submits

    asyncio.run(main())


def test_a_load_view_older_than_a_heartbeat_is_not_used(scripted: Any) -> None:
    # a reported 50 requests of other clients, then fell silent (a late pong, a link
    # slow to heal): alive still, but its figure is older than one heartbeat interval
    # and may be long gone. The client goes by what it knows exactly, its own requests
    # in flight, and spreads the burst; it does not pile it onto b.
    a = scripted(hold=1.0, running=40, waiting=10)
    b = scripted(hold=1.0)
    cfg = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=40, request_timeout=30)

    async def main() -> None:
        async with FabricClient([a.address, b.address], cfg) as client:
            await await_for(
                lambda: all(i.alive for i in client.workers) and client.workers[0].running == 40,
                what="both alive, a's load known",
            )
            a.pong = False
            await await_for(lambda: client.workers[0].last_seen_s_ago > 3 * 0.05, what="a silent")
            # Dropped at the first tick without a pong since the one before.
            await await_for(lambda: not client.workers[0].load_current, what="a's view old")
            futs = [client.agenerate(LLMRequest(input_ids=[i])) for i in range(20)]
            await asyncio.gather(*futs)
            assert client.stats["workers_died"] == 0
        assert len(a.submits) >= 6 and len(b.submits) >= 6, (len(a.submits), len(b.submits))

    asyncio.run(main())


def test_first_burst_does_not_wait_for_a_refused_or_silent_worker(scripted: Any) -> None:
    # The first calls wait for every worker that may be up to answer, but not for one
    # whose connection is refused (nothing listens there), and for a silent one only
    # min(heartbeat_interval, connect_timeout).
    live = scripted()
    silent = scripted()
    silent.pong = False
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        refused = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    cfg = ClientConfig(heartbeat_interval=30.0, connect_timeout=30.0, request_timeout=60)

    async def burst(addresses: list[str], config: ClientConfig) -> float:
        async with FabricClient(addresses, config) as client:
            t = time.monotonic()
            await asyncio.gather(*(client.agenerate(LLMRequest(input_ids=[i])) for i in range(10)))
            return time.monotonic() - t

    # The grace here is 30 s: a burst done well within it did not wait for the refused.
    took = asyncio.run(burst([live.address, refused], cfg))
    assert took < 10.0, took
    short = ClientConfig(heartbeat_interval=0.5, heartbeat_liveness=60, request_timeout=60)
    took = asyncio.run(burst([live.address, silent.address], short))
    assert 0.4 <= took < 10.0, took
    assert len(live.submits) == 20 and not silent.submits


def test_backlog_after_all_workers_died_is_spread_when_they_come_back(scripted: Any) -> None:
    # Both workers fall silent (a partition, say) and are declared dead; calls made
    # meanwhile wait in the client. When both answer again, the first pong must not
    # take the whole backlog.
    a, b = scripted(hold=0.5), scripted(hold=0.5)
    cfg = ClientConfig(
        heartbeat_interval=0.05, heartbeat_liveness=3, connect_timeout=30, request_timeout=30
    )

    async def main() -> None:
        async with FabricClient([a.address, b.address], cfg) as client:
            await await_for(lambda: all(i.alive for i in client.workers), what="both alive")
            a.pong = b.pong = False
            await await_for(lambda: client.stats["workers_died"] == 2, what="both dead")
            futs = [client.agenerate(LLMRequest(input_ids=[i])) for i in range(20)]
            a.pong = b.pong = True
            await asyncio.gather(*futs)
        assert len(a.submits) >= 6 and len(b.submits) >= 6, (len(a.submits), len(b.submits))

    asyncio.run(main())
