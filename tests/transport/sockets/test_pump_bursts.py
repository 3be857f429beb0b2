"""SocketPump bursts, per destination and by size: a lone reply is not held behind
another peer's, and large messages are never joined into one ZeroMQ message."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import zmq

import fastio
from fastio import LLMRequest, TokenArray
from fastio import fabric_msgs as fm
from tests.transport.conftest import await_for
from tests.transport.sockets.test_sockets import burst_to_router
from transport.sockets import SocketPump


def test_lone_reply_to_a_second_peer_leaves_before_the_batch_ends() -> None:
    # A worker's batch answers peer A, then sends one message to peer B: B's is the
    # first to B in the burst and must go at once, not wait in the pump until the
    # batch has read everything that is waiting.
    ctx = zmq.Context()
    a = ctx.socket(zmq.DEALER)
    b = ctx.socket(zmq.DEALER)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    seen_in_batch: list[bool] = []

    async def main() -> None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("inproc://pump-lone")
        b.setsockopt(zmq.ROUTING_ID, b"peer-b")
        for s in (a, b):
            s.connect("inproc://pump-lone")
        b.send(b"hello")  # the router learns B
        learned = asyncio.Event()

        def on_recv(frames: list[zmq.Frame]) -> None:
            if frames[1].bytes == b"hello":
                learned.set()
                return
            pump.send([frames[0].bytes, b"to-a"])
            pump.send([b"peer-b", b"to-b"])
            # Still inside the batch: B's message must already be on its way.
            seen_in_batch.append(bool(b.poll(2000)))

        pump = SocketPump(router, on_recv, router=True)
        await asyncio.wait_for(learned.wait(), 10)
        a.send(b"go")
        await await_for(lambda: seen_in_batch, what="the batch")
        pump.close()

    try:
        asyncio.run(main())
        assert b.recv() == b"to-b"
        assert a.poll(2000) and a.recv() == b"to-a"
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
    assert seen_in_batch == [True]


def _submit(i: int, n_tokens: int) -> list[Any]:
    ids = TokenArray(np.full(n_tokens, i, dtype=np.int32))
    return fastio.encode(fm.Submit(id=i, request=LLMRequest(input_ids=ids)))


def test_large_messages_are_not_joined_and_joined_ones_are_bounded() -> None:
    # A burst of large messages (1 MiB token arrays): each its own ZeroMQ message, so
    # the receiver starts on the first while the rest are on the wire. A burst of
    # medium ones (64 KiB) is joined, but into messages of bounded size.
    sizes = [1 << 18] * 5 + [1 << 14] * 40  # tokens: 1 MiB each, then 64 KiB each
    messages = [_submit(i, n) for i, n in enumerate(sizes)]
    zmq_messages, decoded = burst_to_router(messages, SocketPump.send_many)
    assert [d.id for d in decoded] == list(range(len(sizes)))
    assert all(np.all(d.request.input_ids.array == d.id) for d in decoded)
    per_message = [sum(len(f) for f in m[1:]) for m in zmq_messages]
    # The five large ones alone; the medium ones joined, at most 256 KiB plus one.
    assert per_message[:5] == [
        sum(memoryview(f).nbytes for f in _submit(i, 1 << 18)) for i in range(5)
    ]
    assert 40 // 5 <= len(per_message) - 5 < 40
    assert max(per_message[5:]) < (256 + 65) << 10


def test_a_burst_to_two_peers_sends_each_first_at_once_and_joins_the_rest() -> None:
    # In a batch, and in a send_many: each peer's first message of the burst goes at
    # once (the first peer's as well as later ones), the rest to that peer are joined
    # into one ZeroMQ message, and every peer gets its own in order.
    ctx = zmq.Context()
    peers = {name: ctx.socket(zmq.DEALER) for name in (b"peer-a", b"peer-b")}
    got: dict[bytes, list[list[int]]] = {name: [] for name in peers}
    on_way: list[bool] = []

    def cancel(i: int) -> bytes:
        frames = fastio.encode(fm.Cancel(id=i))
        assert len(frames) == 1
        return bytes(frames[0])

    def burst(base: int) -> list[list[Any]]:
        return [[name, cancel(base + 10 * k + j)] for k in range(4) for j, name in enumerate(peers)]

    def receive(n: int) -> bool:
        for name, s in peers.items():
            while s.poll(0):
                m = s.recv_multipart(copy=False)
                ids = [fastio.decode(b, type=fm.CLIENT_TO_WORKER).id for b in fm.split(m)]
                got[name].append(ids)
        return sum(len(ids) for per in got.values() for ids in per) >= n

    async def main() -> None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("inproc://pump-two-peers")
        for name, s in peers.items():
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, name)
            s.connect("inproc://pump-two-peers")
            s.send(b"hello")
        hellos = asyncio.Event()
        seen = set()

        def on_recv(frames: list[zmq.Frame]) -> None:
            if frames[1].bytes == b"hello":
                seen.add(frames[0].bytes)
                if len(seen) == 2:
                    hellos.set()
                return
            for frames_out in burst(0):
                pump.send(frames_out)
            # Still inside the batch: both firsts are on their way, the rest held.
            on_way.append(all(s.poll(2000) for s in peers.values()))

        pump = SocketPump(router, on_recv, router=True, batch_frames=True)
        await asyncio.wait_for(hellos.wait(), 10)
        peers[b"peer-a"].send(b"go")
        await await_for(lambda: receive(8), what="the batch's replies")
        pump.send_many(burst(100))
        await await_for(lambda: receive(16), what="the send_many's messages")
        pump.close()

    try:
        asyncio.run(main())
    finally:
        for s in peers.values():
            s.close(0)
        ctx.term()
    assert on_way == [True]
    for j, name in enumerate(peers):
        assert got[name] == [
            ids for b in (0, 100) for ids in ([b + j], [b + j + 10 * k for k in range(1, 4)])
        ]
