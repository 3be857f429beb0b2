"""SocketPump's coalescing over real sockets: order kept, small messages batched, large
ones zero-copy frames, and every message decodes on the other side."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

import fastio
from fastio import LLMRequest, TokenArray
from fastio import fabric_msgs as fm
from tests.transport.conftest import await_for, wait_for
from transport.sockets import CurveConfig, SocketPump


def _messages() -> list[list[Any]]:
    """Submits whose ids say their order: mostly small, every 7th with a large token
    array (a buffer frame of its own), one header too large to batch."""
    out = []
    for i in range(300):
        n = 70_000 if i == 150 else 5000 if i % 7 == 0 else 3
        ids = TokenArray(np.full(n, i, dtype=np.int32))
        # A large inline array (in the header) makes one message too big to batch.
        meta = {"blob": np.zeros(20_000, np.uint8)} if i == 200 else {}
        enc = fastio.Encoder(inline_threshold=30_000 if i == 200 else 4096)
        out.append(enc.encode(fm.Submit(id=i, request=LLMRequest(input_ids=ids, metadata=meta))))
    return out


def burst_to_router(
    messages: list[list[Any]], send: Callable[[SocketPump, list[list[Any]]], None]
) -> tuple[list[list[zmq.Frame]], list[Any]]:
    """``send(pump, messages)`` from a DEALER's pump (``batch_frames``) to a ROUTER:
    the ZeroMQ messages the ROUTER received, and the fastio messages decoded from them."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    zmq_messages: list[list[zmq.Frame]] = []
    got: list[list[Any]] = []

    async def main() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        pump = SocketPump(dealer, lambda frames: None, batch_frames=True)
        send(pump, messages)

        def drained() -> bool:
            while router.poll(0):
                m = router.recv_multipart(copy=False)
                zmq_messages.append(m)
                got.extend(fm.split(m[1:]))
            return len(got) >= len(messages)

        await await_for(drained, what="every message arrived")
        pump.close()

    try:
        asyncio.run(main())
    finally:
        router.close(0)
        ctx.term()
    return zmq_messages, [fastio.decode(m, type=fm.CLIENT_TO_WORKER) for m in got]


def _send_each(pump: SocketPump, messages: list[list[Any]]) -> None:
    for frames in messages:  # back to back: the first goes at once, the rest are joined
        pump.send(frames)


def test_coalesced_burst_keeps_order_and_batches_small_messages() -> None:
    # One burst: the first goes at once, the rest are joined at the end of the loop
    # iteration (sends back to back start a burst).
    zmq_messages, decoded = burst_to_router(_messages(), _send_each)
    assert [d.id for d in decoded] == list(range(300))
    for d in decoded:
        assert np.all(d.request.input_ids.array == d.id)
    # Joined: far fewer ZeroMQ messages than fastio messages, and far fewer frames (small
    # ones share batch frames); large arrays stayed frames of their own.
    frames = sum(len(m) - 1 for m in zmq_messages)
    assert len(zmq_messages) <= 10
    assert any(bytes(f.buffer[:1]) == bytes([fm.BATCH_MARKER]) for m in zmq_messages for f in m)
    unbatched = sum(len(m) for m in _messages())
    assert frames < unbatched / 2


def test_split_batches_in_order_and_rejects_bad_ones() -> None:
    def hb(i: int) -> bytes:
        (frame,) = fastio.encode(fm.Heartbeat(sent_at=float(i)))
        return bytes(frame)

    big = fastio.encode(fm.Result(id=5, output_tokens=TokenArray(np.arange(5000))))
    assert len(big) == 2
    frames = [*big, fm.pack_batch([hb(1), hb(2)]), hb(3), fm.pack_batch([hb(4)]), *big]
    parts = fm.split(frames)
    kinds = [type(fastio.decode(p, type=fm.WORKER_TO_CLIENT)).__name__ for p in parts]
    assert kinds == ["Result", "Heartbeat", "Heartbeat", "Heartbeat", "Heartbeat", "Result"]
    assert [fastio.decode(p).sent_at for p in parts[1:5]] == [1.0, 2.0, 3.0, 4.0]
    # A lone batch frame is split too.
    assert len(fm.split([fm.pack_batch([hb(1), hb(2), hb(3)])])) == 3
    assert fm.split([fm.pack_batch([])]) == []
    # A batch marker followed by garbage is one bad message, for the decoder to reject.
    bad = b"\xc1\xff\xfe"
    assert fm.split([bad]) == [[bad]]
    try:
        fastio.decode([bad])
    except fastio.DecodeError as exc:
        assert "header" in str(exc)
    else:
        raise AssertionError("a bad batch frame decoded")
    # A header without its body still says its frame count: the messages behind it stay
    # their own (each gets its own answer), the bad one alone is rejected.
    cancel = fastio.encode(fm.Cancel(id=7))
    parts = fm.split([b"\x93\x02\x01", b"x", *cancel])
    assert parts == [[b"\x93\x02\x01", b"x"], cancel]
    with pytest.raises(fastio.DecodeError):
        fastio.decode(parts[0])
    assert fastio.decode(parts[1]) == fm.Cancel(id=7)


def test_slow_sends_back_to_back_still_coalesce(monkeypatch: Any) -> None:
    # On a loaded machine a send that wakes libzmq's I/O thread can take hundreds of
    # microseconds (the I/O thread takes the core). Sends issued back to back must still
    # start a burst: the gap is measured from the end of the previous send, not its start
    # (which, with slow sends, never looked back to back, so nothing was coalesced).
    import transport.pump as sockets

    clock = [0.0]
    real_send = sockets.send_frames

    def slow_send(sock: zmq.Socket[Any], frames: list[Any]) -> None:
        clock[0] += 500e-6  # what the send costs, on a fake clock
        real_send(sock, frames)

    monkeypatch.setattr(sockets, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(sockets, "send_frames", slow_send)
    clock[0] = 1.0  # long after any earlier send
    n = 50
    zmq_messages, decoded = burst_to_router(
        [fastio.encode(fm.Cancel(id=i)) for i in range(n)], _send_each
    )
    assert [d.id for d in decoded] == list(range(n))
    # The first two go at once (the second starts the burst), the rest as one message.
    assert len(zmq_messages) <= 3


def test_requester_pump_defers_its_input_check_and_loses_nothing() -> None:
    # defer_check (the client's pumps): a wake-up handles one message and leaves the
    # rest, and the input check, to a drain behind the task that message woke; that
    # task sends at once and skips its own check. Each request here gets two answers
    # at once and the task goes on at the first: the second must still arrive, round
    # after round, whatever the timing.
    import threading

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if router.poll(50):
                peer, body = router.recv_multipart()
                router.send_multipart([peer, body + b"a"])
                router.send_multipart([peer, body + b"b"])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    got: list[bytes] = []
    rounds = 300

    async def main() -> None:
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[None]] = []

        def on_recv(frames: list[zmq.Frame]) -> None:
            got.append(frames[0].bytes)
            if got[-1].endswith(b"a"):
                waiting.pop().set_result(None)

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        pump = SocketPump(dealer, on_recv, defer_check=True)
        for i in range(rounds):
            fut = loop.create_future()
            waiting.append(fut)
            pump.send([b"%d" % i])
            await asyncio.wait_for(fut, 10)
        await await_for(lambda: len(got) == 2 * rounds, what="every second answer")
        pump.close()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()
    assert got == [b"%d%s" % (i, s) for i in range(rounds) for s in (b"a", b"b")]


def _recv_all(sock: zmq.Socket[Any], timeout_ms: int = 2000) -> list[list[bytes]]:
    """Every message that arrives on ``sock`` until none has for ``timeout_ms``."""
    out = []
    while sock.poll(timeout_ms):
        out.append(sock.recv_multipart())
        timeout_ms = 200  # the first may take a while; the rest come with it
    return out


def test_close_sends_the_replies_of_the_last_batch() -> None:
    # A worker's pump that replies to a message and closes in the same batch (a
    # shutdown request): the replies after the first are being joined when close()
    # comes; they must still be handed to libzmq, not dropped with the pump. (inproc:
    # what libzmq holds at a linger-0 close still reaches the peer, deterministically.)
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    undeliverable: list[list[Any]] = []

    async def main() -> None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind("inproc://pump-close")
        closed = asyncio.Event()

        def on_recv(frames: list[zmq.Frame]) -> None:
            peer = frames[0].bytes
            for body in (b"a", b"b", b"c"):
                pump.send([peer, body])
            pump.send([b"gone-peer", b"x"])  # never connected: undeliverable, no error
            pump.close()
            closed.set()

        pump = SocketPump(router, on_recv, router=True, on_undeliverable=undeliverable.append)
        client.connect("inproc://pump-close")
        client.send(b"bye")
        await asyncio.wait_for(closed.wait(), 10)

    try:
        asyncio.run(main())
        got = [part for m in _recv_all(client) for part in m]
    finally:
        client.close(0)
        ctx.term()
    assert got == [b"a", b"b", b"c"]
    assert undeliverable == [[b"gone-peer", b"x"]]


def test_close_sends_joined_messages_and_never_raises(monkeypatch: Any) -> None:
    # Sends back to back from a task start a burst whose end is a loop callback; a
    # close() before that callback must send what was joined, and a close on a socket
    # that is already closed under the pump must not raise.
    import transport.pump as sockets

    clock = [1.0]  # a fake clock: every send is back to back with the one before
    monkeypatch.setattr(sockets, "_perf_counter", lambda: clock[0])
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://pump-close-dealer")
    n = 20

    async def main() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect("inproc://pump-close-dealer")
        pump = SocketPump(dealer, lambda frames: None, batch_frames=True)
        for i in range(n):
            pump.send(fastio.encode(fm.Cancel(id=i)))
        pump.close()

        broken = ctx.socket(zmq.DEALER)
        broken.connect("inproc://pump-close-dealer")
        pump2 = SocketPump(broken, lambda frames: None)
        for body in (b"first", b"starts-the-burst", b"joined"):
            pump2.send([body])
        broken.close(0)  # under the pump
        pump2.close()
        assert pump2.discarded == 1

    try:
        asyncio.run(main())
        arrived = _recv_all(router)
    finally:
        router.close(0)
        ctx.term()
    raw = [m[1:] for m in arrived if m[1] in (b"first", b"starts-the-burst")]
    assert raw == [[b"first"], [b"starts-the-burst"]]  # not b"joined": closed under it
    got = [p for m in arrived if m[1:] not in raw for p in fm.split(m[1:])]
    decoded = [fastio.decode(p, type=fm.CLIENT_TO_WORKER) for p in got]
    assert [d.id for d in decoded if isinstance(d, fm.Cancel)] == list(range(n))


def test_make_socket_sets_options_and_closes_on_a_bad_one() -> None:
    from transport.sockets import FRAME_CAP, bind_all, make_socket

    ctx = zmq.Context()
    pub = make_socket(ctx, zmq.PUB, hwm=10, max_message_size=None, curve_server=True)
    sub = make_socket(ctx, zmq.SUB, hwm=None, options={zmq.SUBSCRIBE: b"w"})
    try:
        (endpoint,) = bind_all(pub, "tcp://127.0.0.1:0")
        assert not endpoint.endswith(":0")
        sub.connect(endpoint)
        assert (pub.linger, pub.sndhwm, pub.getsockopt(zmq.MAXMSGSIZE)) == (0, 10, -1)
        # libzmq's cap is twice the limit: a message between them reaches the decoder.
        assert (sub.rcvhwm, sub.getsockopt(zmq.MAXMSGSIZE)) == (1000, FRAME_CAP << 30)

        def arrived() -> bool:
            pub.send(b"weights")  # a SUB misses what was sent before it joined
            return bool(sub.poll(10))

        wait_for(arrived, what="a published message")
        assert sub.recv() == b"weights"
        with pytest.raises(zmq.ZMQError):
            make_socket(ctx, zmq.PUSH, options={zmq.SUBSCRIBE: b""})  # not a SUB option
        with pytest.raises(ValueError, match="server_public_key_file"):
            make_socket(ctx, zmq.DEALER, curve=CurveConfig(secret_key_file="x"))
    finally:
        pub.close(0)
        sub.close(0)
    ctx.term()  # would hang on a socket left open by the failed calls


_HELD_AND_FREED = """
import resource, sys
import numpy as np
from transport.zmqio import tune_malloc
print(tune_malloc(), file=sys.stderr)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [np.ones(3 << 18, dtype=np.int32) for _ in range(12)]  # 12 x 3 MiB, written
    del held
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def _faults(tune: str) -> tuple[int, str]:
    env = dict(os.environ, FASTIO_TUNE_MALLOC=tune)
    p = subprocess.run(
        [sys.executable, "-c", _HELD_AND_FREED], env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout), p.stderr.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_tuned_allocator_reuses_freed_message_memory() -> None:
    # Large blocks held together and then freed (a gathered batch of responses) go back
    # to the kernel with glibc's defaults, so the next batch faults in fresh pages.
    tuned, said = _faults("1")
    assert said == "True"
    untuned, said = _faults("0")
    assert said == "False"
    assert tuned * 4 < untuned, (tuned, untuned)


def test_old_allocator_names_warn_and_still_tune(monkeypatch: pytest.MonkeyPatch) -> None:
    import transport.zmqio as zmqio

    monkeypatch.setenv("FASTIO_TUNE_MALLOC", "0")  # the names, not the process's malloc
    for old in (zmqio.tune_allocator, zmqio.set_malloc):
        with pytest.warns(DeprecationWarning, match="use tune_malloc"):
            assert old(32 << 20, 256 << 20) is False
