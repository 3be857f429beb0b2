"""Hostile and malformed input to either side: error replies, counters, no disturbance."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

import fastio
from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
from fastio import fabric_msgs as fm
from tests.transport.conftest import WorkerProc
from transport import ClientConfig, FabricClient, FabricController, RemoteError

# A long liveness (10 s): these tests count requests exactly, and a pong late on a loaded
# machine must not make a client take its worker for dead and re-send.
FAST = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=100, request_timeout=20)
LIMIT = 100_000  # the worker's --max-message-size in these tests


def raw(body: Any) -> list[bytes]:
    """A message whose header is valid and whose body is any msgpack value."""
    return [b"\x93\x01\x00" + msgspec.msgpack.encode(body)]


def recv_error(sock: zmq.Socket[Any], timeout: float = 5.0) -> fm.Error:
    assert sock.poll(timeout * 1000), "no error reply"
    (frames,) = fm.split(sock.recv_multipart())  # one reply per ZeroMQ message here
    msg = fastio.decode(frames, type=fm.WORKER_TO_CLIENT)
    assert isinstance(msg, fm.Error)
    return msg


def test_garbage_to_worker_gets_error_replies_and_others_unaffected(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--max-message-size", str(LIMIT))
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(w.address)
    big = np.zeros(LIMIT // 8, dtype=np.int32)  # two of these: each frame fits, the sum does not
    hb = fastio.encode(fm.Heartbeat(sent_at=1.0))[0]
    cases: list[tuple[list[Any], fm.ErrorCode, int]] = [
        ([b"\xff\x00garbage"], fm.ErrorCode.BAD_MESSAGE, -1),
        ([b""], fm.ErrorCode.BAD_MESSAGE, -1),
        ([b"\x93\x63" + hb[2:]], fm.ErrorCode.UNSUPPORTED_VERSION, -1),  # protocol version 99
        (fastio.encode(LLMResponse(output_tokens=[1])), fm.ErrorCode.UNKNOWN_KIND, -1),
        (raw([39, 1, 2]), fm.ErrorCode.UNKNOWN_KIND, -1),
        (raw([20, 7, "not a request"]), fm.ErrorCode.BAD_REQUEST, 7),
        (raw([20, 8, [2, "rid", "ids?"]]), fm.ErrorCode.BAD_REQUEST, 8),
        (raw({"a": 1}), fm.ErrorCode.BAD_MESSAGE, -1),
        # Batch frames (0xc1 + msgpack array of bin): unparseable, or carrying garbage.
        ([b"\xc1garbage"], fm.ErrorCode.BAD_MESSAGE, -1),
        ([fm.pack_batch([b"\xff\x00junk"])], fm.ErrorCode.BAD_MESSAGE, -1),
        ([fm.pack_batch(raw([20, 11, "not a request"]))], fm.ErrorCode.BAD_REQUEST, 11),
        (
            fastio.encode(
                fm.Submit(id=9, request=LLMRequest(input_ids=[1], metadata={"a": big, "b": big}))
            ),
            fm.ErrorCode.TOO_LARGE,
            9,
        ),
    ]

    async def main() -> None:
        async with FabricClient([w.address], FAST) as client:
            # Honest traffic in flight while the garbage arrives.
            tasks = [
                asyncio.ensure_future(client.agenerate(LLMRequest(input_ids=[i])))
                for i in range(300)
            ]
            for frames, code, id in cases:
                bad.send_multipart(frames)
                err = await asyncio.to_thread(recv_error, bad)
                assert (err.code, err.id) == (code, id), err
                assert err.message
            # One frame above ZMQ_MAXMSGSIZE: libzmq drops that connection, no reply.
            bad.send_multipart(
                fastio.encode(
                    fm.Submit(id=10, request=LLMRequest(input_ids=np.zeros(LIMIT, np.int32)))
                )
            )
            resps = await asyncio.gather(*tasks)
            assert [int(r.output_tokens[0]) for r in resps] == list(range(300))
            assert (await client.agenerate(LLMRequest(input_ids=[5]))).output_tokens == [5]

    try:
        asyncio.run(main())
        with FabricController([w.address]) as ctl:
            st = ctl.health(timeout=5)[w.address]
            assert st.counters["bad_messages"] == len(cases)
            assert st.counters["completed"] == 301
            with pytest.raises(Exception, match="unknown control op"):
                ctl.request("reboot", timeout=5)
    finally:
        bad.close(0)
        ctx.term()


class FakeWorker:
    """A ROUTER in a thread that answers heartbeats properly and Submits with garbage
    (except for requests whose rid is ``"good"``)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.errors_received: list[fm.Error] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            for one in fm.split(frames):  # a client may coalesce messages
                self._serve(ident, fastio.decode(one, type=fm.CLIENT_TO_WORKER))

    def _serve(self, ident: bytes, msg: Any) -> None:
        def send(fr: list[Any]) -> None:
            self.sock.send_multipart([ident, *fr])

        if isinstance(msg, fm.Heartbeat):
            send(
                fastio.encode(fm.Heartbeat(sent_at=msg.sent_at, worker_id="fake", incarnation="x"))
            )
        elif isinstance(msg, fm.Error):
            self.errors_received.append(msg)
        elif isinstance(msg, fm.Submit):
            if msg.request.rid == "good":
                send(fastio.encode(fm.Result(id=msg.id, output_tokens=TokenArray([42]))))
                return
            send([b"\x00\x01 garbage"])
            send(fastio.encode(LLMRequest(input_ids=[1])))  # a kind no client accepts
            send(raw([21, 12345, 1]))  # a Result for nobody, malformed
            send(raw([21, msg.id, "not a response"]))  # the answer, malformed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_garbage_to_client_fails_only_that_request() -> None:
    fake = FakeWorker()

    async def main() -> None:
        async with FabricClient([fake.address], FAST) as client:
            with pytest.raises(RemoteError, match="malformed response") as info:
                await client.agenerate(LLMRequest(rid="bad", input_ids=[1]))
            assert info.value.code == fm.ErrorCode.BAD_RESPONSE
            r = await client.agenerate(LLMRequest(rid="good", input_ids=[1]))
            assert r.output_tokens == [42]
            assert client.stats["bad_messages"] == 4
            assert client.workers[0].alive

    try:
        asyncio.run(main())
        assert any(e.code == fm.ErrorCode.BAD_RESPONSE for e in fake.errors_received)
    finally:
        fake.close()


def test_handler_error_is_reported(spawn: Callable[..., WorkerProc]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--vocab-size", "64")

    async def main() -> None:
        async with FabricClient([w.address], FAST) as client:
            with pytest.raises(RemoteError, match="input ids") as info:
                await client.agenerate(LLMRequest(input_ids=[999]))
            assert info.value.code == fm.ErrorCode.HANDLER_ERROR
            ok = LLMRequest(input_ids=[9], gconfig=GenerationHyperparameters(max_new_tokens=4))
            assert (await client.agenerate(ok)).output_len == 4

    asyncio.run(main())
