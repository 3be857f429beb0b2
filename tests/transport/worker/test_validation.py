"""What a worker does with Submits it cannot take as they are: invalid bodies get
BAD_REQUEST naming the field and the rule, a duplicate in-flight id is a re-send (one
answer), a negative id is refused (docs/PROTOCOL.md, "Behaviour of a worker")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

import fastio
from fastio import LLMRequest
from fastio import fabric_msgs as fm
from tests.transport.conftest import WorkerProc
from transport import FabricController, WorkerConfig, WorkerServer, echo_handler


def replies(sock: zmq.Socket[Any], seconds: float) -> list[Any]:
    """Every message received within ``seconds`` (decoded)."""
    out: list[Any] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(left * 1000):
            out += [
                fastio.decode(p, type=fm.WORKER_TO_CLIENT) for p in fm.split(sock.recv_multipart())
            ]
    return out


def submit(id: int, ids: list[int]) -> list[Any]:
    return fastio.encode(fm.Submit(id=id, request=LLMRequest(input_ids=ids)))


def test_duplicate_in_flight_id_is_a_resend_and_negative_id_is_refused(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "tests.transport.plugins:slow_engine",
        "--engine-opt", "seconds=1",
    )  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(w.address)
        s.send_multipart(submit(5, [1, 2]))
        s.send_multipart(submit(5, [1, 2]))  # the same submission again, still running
        s.send_multipart(submit(-1, [3]))
        got = replies(s, 4.0)
        for5 = [m for m in got if getattr(m, "id", None) == 5]
        # Exactly one answer for id 5, its Result: the original was not disturbed and
        # the duplicate got no Error the client would take as the end of the call.
        assert [type(m) for m in for5] == [fm.Result]
        assert for5[0].output_tokens.tolist() == [1, 2]
        (neg,) = [m for m in got if isinstance(m, fm.Error)]
        assert (neg.id, neg.code) == (-1, fm.ErrorCode.BAD_REQUEST)
        assert "id" in neg.message and ">= 0" in neg.message
        with FabricController([w.address]) as ctl:
            st = ctl.health(timeout=5)[w.address]
        assert st.counters["duplicates"] == 1 and st.counters["completed"] == 1
        # Once answered, the id is free again: the same id is a new submission.
        s.send_multipart(submit(5, [9]))
        (again,) = [m for m in replies(s, 3.0) if getattr(m, "id", None) == 5]
        assert isinstance(again, fm.Result) and again.output_tokens.tolist() == [9]
    finally:
        ctx.destroy(linger=0)


def test_invalid_submit_gets_bad_request_naming_the_field(
    spawn: Callable[..., WorkerProc],
) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")
    (frame,) = fastio.encode(fm.Submit(id=3, request=LLMRequest(input_ids=[1])))
    msg = msgspec.msgpack.decode(frame)
    msg[2][2][3][2] = "10"  # Submit.request.gconfig.max_new_tokens as a string
    bad = [msgspec.msgpack.encode(msg)]
    try:
        fastio.decode(bad, type=fm.CLIENT_TO_WORKER)
    except fastio.DecodeError as exc:
        words = str(exc)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(w.address)
        s.send_multipart(bad)
        assert s.poll(10_000)
        (err,) = [fastio.decode(p, type=fm.WORKER_TO_CLIENT) for p in fm.split(s.recv_multipart())]
        assert isinstance(err, fm.Error)
        assert (err.id, err.code) == (3, fm.ErrorCode.BAD_REQUEST)
        # The decoder's own words, which name the field and the rule.
        assert words in err.message
        assert "max_new_tokens" in err.message and "int" in err.message
        # The worker keeps serving.
        s.send_multipart(submit(4, [7]))
        assert s.poll(10_000)
        (ok,) = [fastio.decode(p, type=fm.WORKER_TO_CLIENT) for p in fm.split(s.recv_multipart())]
        assert isinstance(ok, fm.Result) and ok.id == 4
    finally:
        ctx.destroy(linger=0)


def test_a_config_out_of_range_is_refused_at_construction() -> None:
    """WorkerConfig's constraints are checked when the server is built, naming the field;
    its fields by name are accepted too (strings converted)."""
    with pytest.raises(ValueError, match="worker option max_pending=0: expected an integer >= 1"):
        WorkerServer(echo_handler, WorkerConfig(max_pending=0))
    with pytest.raises(TypeError, match="unknown worker option 'colour'; known: "):
        WorkerServer(echo_handler, {"colour": "red"})
    server = WorkerServer(echo_handler, {"max_concurrency": "8", "client_timeout": "2.5"})
    assert server.config == WorkerConfig(max_concurrency=8, client_timeout=2.5)
