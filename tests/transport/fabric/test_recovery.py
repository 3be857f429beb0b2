"""Recovery paths of the fabric found by review: requests that cannot be encoded, handler
output that does not validate, and submissions a worker gives up on by itself (a client
whose loop stalled, a connection reset) must end with an answer, never with silence."""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from fastio import EncodeError, GenerationHyperparameters, LLMRequest
from fastio import fabric_msgs as fm
from tests.transport.conftest import WorkerProc, await_for, wait_for
from tests.transport.recovery_plugins import (
    BAD_STOP,
    FAIL_LATE,
    GOOD,
    NO_LOGPROBS,
    NOT_A_RESPONSE,
    SHORT_VERSIONS,
)
from transport import ClientConfig, FabricClient, FabricController, RemoteError
from transport.sockets import SocketPump, make_dealer, make_router

STEADY = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, request_timeout=30)


def req(ids: list[int], n: int = 8, **meta: Any) -> LLMRequest:
    return LLMRequest(
        input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=n), metadata=meta
    )


def test_unencodable_request_fails_alone_and_frees_its_slot(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01")
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, max_in_flight_per_worker=1)

    async def main() -> None:
        async with FabricClient([w.address], cfg) as client:
            await await_for(lambda: client.workers[0].alive, what="worker alive")
            # Sent at once by its caller: the caller gets the error, no slot is taken.
            with pytest.raises(EncodeError):
                await client.agenerate(req([1], obj=object()), timeout=10)
            assert client.pending == 0 and client.workers[0].in_flight == 0
            # Dispatched from the queue (inside the pump's receive callback, when the
            # slow request ahead of it ends): it fails alone, the next one still runs.
            slow = asyncio.ensure_future(client.agenerate(req([1, 2], n=20), timeout=10))
            await await_for(lambda: client.workers[0].in_flight == 1, what="slot taken")
            bad = asyncio.ensure_future(client.agenerate(req([3], obj=object()), timeout=10))
            good = asyncio.ensure_future(client.agenerate(req([4, 5], n=4), timeout=10))
            assert (await slow).output_len == 20
            with pytest.raises(EncodeError):
                await bad
            assert (await good).output_len == 4
            assert client.pending == 0 and client.stats["failed"] == 2

    asyncio.run(main())


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        (NO_LOGPROBS, r"equal lengths, got 3, 0 and 3"),
        (SHORT_VERSIONS, r"equal lengths, got 3, 3 and 1"),
        (BAD_STOP, r"stop_reason must be one of .*'finished'"),
        (NOT_A_RESPONSE, r"returned dict, not an LLMResponse"),
    ],
)
def test_invalid_handler_output_is_a_handler_error(
    spawn: Callable[..., WorkerProc], mode: int, match: str
) -> None:
    engine = "tests.transport.recovery_plugins:faulty_engine"
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", engine)

    async def main() -> None:
        async with FabricClient([w.address], STEADY) as client:
            with pytest.raises(RemoteError, match=match) as info:
                await client.agenerate(req([mode]), timeout=10)
            assert info.value.code == fm.ErrorCode.HANDLER_ERROR
            # The worker keeps serving.
            ok = await client.agenerate(req([GOOD]), timeout=10)
            assert ok.output_tokens == [7, 8, 9] and ok.stop_reason == "stop"
            assert client.stats["bad_messages"] == 0

    asyncio.run(main())


def test_echo_handler_output_is_consistent(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")

    async def main() -> None:
        async with FabricClient([w.address], STEADY) as client:
            r = await client.agenerate(req([4, 5, 6]), timeout=10)
            assert r.output_tokens == [4, 5, 6]
            assert r.output_logprobs.tolist() == [0.0] * 3
            assert r.output_versions.tolist() == [0] * 3

    asyncio.run(main())


def test_client_stalled_past_client_timeout_gets_its_requests_back(
    spawn: Callable[..., WorkerProc],
) -> None:
    # The worker takes the client for dead after 1 s of silence and cancels its
    # request; the client must learn it (Error LOST on its next ping) and re-send. (Not
    # shorter: a loaded machine can stall the client's pings for half a second, and a
    # second presumed death would cancel the re-sent request too.)
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.02",
        "--client-timeout", "1",
    )  # fmt: skip
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=50)

    async def main() -> None:
        async with FabricClient([w.address], cfg) as client:
            with FabricController([w.address]) as ctl:

                def status() -> Any:
                    return ctl.health(timeout=5)[w.address]

                await await_for(lambda: client.workers[0].alive, what="worker alive")
                chunks: list[int] = []
                task = asyncio.ensure_future(
                    client.agenerate(
                        req([1, 2, 3], n=150), timeout=15, on_chunk=lambda *a: chunks.append(1)
                    )
                )
                await await_for(lambda: chunks, what="generation started")
                # Block this client's loop (a synchronous reward computation, say) until
                # the worker has given the client up and cancelled its request.
                wait_for(lambda: status().counters["dead_peers"] == 1, what="client presumed dead")
                assert status().running == 0
                r = await task
                assert r.output_len == 150 and r.stop_reason == "length"
                assert client.stats["resent"] == 1 and client.stats["workers_died"] == 0
                assert status().counters["lost"] == 1

    asyncio.run(main())


def _reset(s: socket.socket) -> None:
    # Linger 0: close with a TCP RST, as a reset connection would end.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


class ResettableProxy:
    """A TCP forwarder between a client and a worker whose connections the test resets
    (both processes stay up), and which can refuse connections for a while."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepting = True
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _close(self, s: socket.socket) -> None:
        peer = self._pairs.pop(s, None)
        if peer is not None:
            self._pairs.pop(peer, None)
            _reset(peer)
        _reset(s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._cut.is_set():
                for s in list(self._pairs):
                    if s in self._pairs:
                        self._close(s)
                self._cut.clear()
            readable, _, _ = select.select([self.listener, *self._pairs], [], [], 0.01)
            for s in readable:
                if s is self.listener:
                    conn, _ = s.accept()
                    if not self.accepting:
                        _reset(conn)
                        continue
                    up = socket.create_connection(self.target)
                    self._pairs[conn], self._pairs[up] = up, conn
                elif s in self._pairs:
                    try:
                        data = s.recv(1 << 16)
                        if data:
                            self._pairs[s].sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        self._close(s)
        for s in list(self._pairs):
            s.close()
        self.listener.close()

    def reset_all(self) -> None:
        """Reset every connection now (returns once done)."""
        self._cut.set()
        wait_for(lambda: not self._cut.is_set(), what="connections reset")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_connection_reset_keeps_the_client_and_its_answers(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01")
    proxy = ResettableProxy(int(w.address.rsplit(":", 1)[1]))
    # Liveness of 5 s: the client never takes the worker for dead here, so only the
    # worker can tell it what was lost.
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=50)

    async def main() -> None:
        async with FabricClient([proxy.address], cfg) as client:
            with FabricController([w.address]) as ctl:
                await await_for(lambda: client.workers[0].alive, what="worker alive")
                chunks: list[int] = []

                def on_chunk(*a: Any) -> None:
                    chunks.append(1)

                # 1. Reset mid-generation, reconnected at once: the client keeps its
                # routing id, so the answer reaches it as if nothing had happened.
                task = asyncio.ensure_future(
                    client.agenerate(req([1, 2, 3], n=100), timeout=10, on_chunk=on_chunk)
                )
                await await_for(lambda: chunks, what="generation started")
                proxy.reset_all()
                r = await task
                assert r.output_len == 100 and r.stop_reason == "length"
                assert client.stats["resent"] == 0

                # 2. The answer is sent while the client cannot reconnect: the worker
                # reports the submission lost once the client is back; it is re-sent.
                chunks.clear()
                proxy.accepting = False
                task = asyncio.ensure_future(
                    client.agenerate(req([4, 5], n=30), timeout=10, on_chunk=on_chunk)
                )
                await await_for(lambda: chunks, what="generation started")
                proxy.reset_all()
                await await_for(
                    lambda: ctl.health(timeout=5)[w.address].counters["lost"] == 1,
                    what="answer undeliverable",
                )
                proxy.accepting = True
                r = await task
                assert r.output_len == 30 and r.stop_reason == "length"
                assert client.stats["resent"] == 1 and client.stats["workers_died"] == 0
                assert client.stats["failed"] == 0

    try:
        asyncio.run(main())
    finally:
        proxy.close()


def test_pump_backs_off_while_its_peer_is_down_then_delivers(tmp_path: Any) -> None:
    address = f"ipc://{tmp_path}/w.sock"

    async def main() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        router = None
        pump = SocketPump(make_dealer(ctx, address), lambda frames: None)
        try:
            pump.send([b"hello"])  # no connection (ZMQ_IMMEDIATE): queued in the pump
            assert len(pump.queue) == 1
            # Retried ever less often instead of every 2 ms while nothing gets through.
            await await_for(lambda: pump._retry_s >= 0.05, what="retry backed off")
            assert len(pump.queue) == 1
            router, _ = make_router(ctx, address)
            await await_for(lambda: not pump.queue, what="queued message sent")
            assert router.poll(5000)
            assert router.recv_multipart()[1:] == [b"hello"]
            await await_for(lambda: pump._retry_s == 0.002, what="retry interval reset")
        finally:
            pump.close()
            if router is not None:
                router.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_error_reply_sent_while_disconnected_is_replayed(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", engine_of_faults())
    proxy = ResettableProxy(int(w.address.rsplit(":", 1)[1]))
    cfg = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=50)

    async def main() -> None:
        async with FabricClient([proxy.address], cfg) as client:
            with FabricController([w.address]) as ctl:

                def counters() -> dict[str, int]:
                    return ctl.health(timeout=5)[w.address].counters

                await await_for(lambda: client.workers[0].alive, what="worker alive")
                proxy.accepting = False
                task = asyncio.ensure_future(client.agenerate(req([FAIL_LATE]), timeout=10))
                await await_for(lambda: counters()["received"] == 1, what="submission received")
                proxy.reset_all()
                await await_for(lambda: counters()["lost"] == 1, what="error undeliverable")
                proxy.accepting = True
                # The worker's own answer, not a re-send: the handler failed.
                with pytest.raises(RemoteError, match="failed late") as info:
                    await task
                assert info.value.code == fm.ErrorCode.HANDLER_ERROR
                assert client.stats["resent"] == 0 and counters()["received"] == 1

    try:
        asyncio.run(main())
    finally:
        proxy.close()


def engine_of_faults() -> str:
    return "tests.transport.recovery_plugins:faulty_engine"


def test_messages_over_the_size_limit_fail_their_call_not_the_worker(
    spawn: Callable[..., WorkerProc],
) -> None:
    # 100 kB limits on both sides: a 120 kB request is refused TOO_LARGE (libzmq's cap is
    # twice the limit, so the worker's decoder sees it); a reply over the client's limit
    # fails its call. The worker keeps serving and the client keeps it alive.
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--max-message-size", "100000")

    async def main() -> None:
        cfg = ClientConfig(heartbeat_interval=0.2, max_message_size=100_000)
        async with FabricClient([w.address], cfg) as client:
            with pytest.raises(RemoteError, match="exceeds the limit") as big:
                await client.agenerate(req(list(range(30_000))), timeout=20)
            assert big.value.code == fm.ErrorCode.TOO_LARGE
            # 10,000 tokens in (40 kB), out with their logprobs and versions (over 100 kB).
            with pytest.raises(RemoteError, match="exceeds the limit of 100000 bytes"):
                await client.agenerate(req(list(range(10_000))), timeout=20)
            assert (await client.agenerate(req([1, 2, 3]), timeout=20)).output_tokens == [1, 2, 3]
            assert client.counters["workers_died"] == 0

    asyncio.run(main())
