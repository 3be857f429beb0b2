"""Old and new peers on real sockets: a live worker answered with the recorded bytes
of earlier releases' clients, today's client against a simulated old worker (recorded
pongs without the version fields, recorded Results), and peers of versions that cannot
talk, which get one clear error at connect time (``tests/fastio/wire_vectors``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import fastio
from fastio import LLMRequest, versions
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind
from tests.helpers import ERA_READS, ERAS, ext_codes, load
from tests.transport.conftest import WorkerProc
from transport import ClientConfig, FabricClient, IncompatibleWorkers

# A long liveness (10 s): these tests count requests exactly, and a pong late on a loaded
# machine must not make a client take its worker for dead and re-send.
FAST = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=100, request_timeout=20)


@pytest.fixture(scope="module")
def echo_worker() -> Iterator[str]:
    """One echo worker process for the tests of this module (each uses its own
    connections)."""
    w = WorkerProc(["--bind", "tcp://127.0.0.1:0", "--engine", "echo"])
    try:
        yield w.wait_ready()
    finally:
        w.kill()


def recv_messages(sock: zmq.Socket[Any], timeout: float = 5.0) -> list[list[Any]]:
    """The fastio messages of the next ZeroMQ message (a worker may join several)."""
    assert sock.poll(timeout * 1000), "no reply"
    return fm.split(sock.recv_multipart())


def dealer(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.mark.slow  # the module's worker process
@pytest.mark.parametrize("era", ERAS)
def test_old_client_bytes_against_a_live_worker(era: str, echo_worker: str) -> None:
    """An old release's client, replayed byte for byte on a raw DEALER: every reply is
    version 1 with token arrays in codes that release reads, large arrays included
    (before and after its first ping)."""
    ctx = zmq.Context()
    sock = dealer(ctx, echo_worker)
    try:

        def result_of(submit: str) -> fm.Result:
            sock.send_multipart(load(era, submit))
            while True:
                for frames in recv_messages(sock):
                    version, codes = ext_codes(frames)
                    assert version == 1, (era, submit)
                    assert codes <= ERA_READS[era], (era, submit, codes - ERA_READS[era])
                    msg = fastio.decode(frames)
                    assert isinstance(msg, (fm.Result, fm.Stream)), msg
                    if isinstance(msg, fm.Result):
                        return msg

        # Before any ping (a peer not heard from), then after the old ping.
        res = result_of("submit_large")
        assert res.id == 1 and res.output_tokens == list(range(1, 3001))
        sock.send_multipart(load(era, "ping"))
        (pong,) = recv_messages(sock)
        assert ext_codes(pong)[0] == 1
        hb = fastio.decode(pong)
        assert isinstance(hb, fm.Heartbeat) and hb.sent_at == 1.5
        assert (hb.protocol, hb.protocol_min) == (fastio.PROTOCOL_VERSION, 1)
        for submit, n in (("submit_large", 3000), ("submit_small", 10)):
            res = result_of(submit)
            assert res.output_tokens == list(range(1, n + 1))
            assert len(res.output_logprobs) == len(res.output_versions) == n
    finally:
        sock.close(0)
        ctx.term()


class OldWorker:
    """A ROUTER in a thread that speaks as an old release's worker did: its recorded
    pong (no version fields), its recorded Result for any Submit it can read; a Submit
    in codes that release does not read gets the Error that release sent
    (``BAD_REQUEST`` naming the unknown code). ``stated`` replaces the pong by one
    stating those versions (``protocol``, ``protocol_min``, ``token_encodings``);
    ``refuse`` answers pings with that ``UNSUPPORTED_VERSION`` message instead."""

    def __init__(
        self, era: str = "ext4", stated: tuple[int, int, int] | None = None, refuse: str = ""
    ) -> None:
        self.era = era
        self.refuse = refuse
        self.pong = load(era, "pong")
        if stated is not None:
            p, lo, enc = stated
            hb = fm.Heartbeat(
                worker_id="future",
                incarnation="f",
                protocol=p,
                protocol_min=lo,
                token_encodings=enc,
            )
            self.pong = versions.VERSION_1.encode(hb)
        self.result = load(era, "result_large")
        # The recorded Result's id is byte 5 of its header: 93 01 03 | 96 15 <id>.
        assert self.result[0][:6] == b"\x93\x01\x03\x96\x15\x01"
        self.submits: list[tuple[int, set[int]]] = []  # (header version, ext codes)
        self.pings = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            for one in fm.split(frames):
                self._serve(ident, one)

    def _serve(self, ident: bytes, frames: list[bytes]) -> None:
        version, codes = ext_codes(frames)
        body = msgpack.unpackb(frames[0], ext_hook=lambda c, d: None, strict_map_key=False)[2]
        if body[0] == MsgKind.FABRIC_HEARTBEAT:
            self.pings += 1
            if self.refuse:
                err = fm.Error(
                    id=-1, code=int(fm.ErrorCode.UNSUPPORTED_VERSION), message=self.refuse
                )
                self.sock.send_multipart([ident, *versions.VERSION_1.encode(err)])
            else:
                self.sock.send_multipart([ident, *self.pong])
        elif body[0] == MsgKind.FABRIC_SUBMIT:
            sub_id = body[1]
            self.submits.append((version, codes))
            unknown = sorted(codes - ERA_READS[self.era])
            if version != 1:
                text = f"unsupported protocol version {version}; this decoder speaks version 1"
                err = fm.Error(id=-1, code=int(fm.ErrorCode.UNSUPPORTED_VERSION), message=text)
            elif unknown:
                text = f"invalid Submit: unknown extension type code {unknown[0]}"
                err = fm.Error(id=sub_id, code=int(fm.ErrorCode.BAD_REQUEST), message=text)
            else:
                assert 0 < sub_id < 128
                header = bytearray(self.result[0])
                header[5] = sub_id
                self.sock.send_multipart([ident, bytes(header), *self.result[1:]])
                return
            self.sock.send_multipart([ident, *versions.VERSION_1.encode(err)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.parametrize("era", ERAS)
def test_today_s_client_against_an_old_worker(era: str) -> None:
    """The old worker's pong states nothing: the client writes version 1 and ext 4 to
    it, which it reads, and reads its recorded answers (large arrays in its frames)."""
    old = OldWorker(era)

    async def main() -> None:
        async with FabricClient([old.address], FAST) as client:
            for n in (10, 3000):
                req = LLMRequest(input_ids=np.arange(1, n + 1, dtype=np.int32))
                resp = await client.agenerate(req)
                assert resp.output_tokens == list(range(100, 3100))
                assert resp.output_logprobs.dtype == np.float32
                assert resp.input_tokens == list(range(1, n + 1))

    try:
        asyncio.run(main())
        assert [v for v, _ in old.submits] == [1, 1]
        assert all(codes <= {4} for _, codes in old.submits)
    finally:
        old.close()


def _errors(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.ERROR and text in r.getMessage())


def test_client_refuses_a_worker_of_a_newer_major_version_at_connect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that reads versions 3-3 only: the call fails at once (not at the
    connect timeout) naming both sides' versions, said once in the log, and nothing
    is sent to it."""
    new = OldWorker(stated=(3, 3, 7))
    cfg = ClientConfig(heartbeat_interval=0.05, connect_timeout=30)

    async def main() -> None:
        async with FabricClient([new.address], cfg) as client:
            t0 = time.monotonic()
            with pytest.raises(IncompatibleWorkers) as info:
                await client.agenerate(LLMRequest(input_ids=[1, 2]))
            assert time.monotonic() - t0 < 10
            text = str(info.value)
            assert "protocol 3 (reads versions 3-3" in text
            assert f"protocol {fastio.PROTOCOL_VERSION} (reads versions 1-" in text
            # Later calls fail at once too; the worker keeps answering pings.
            pings = new.pings
            while new.pings < pings + 5:
                await asyncio.sleep(0.02)
            with pytest.raises(IncompatibleWorkers):
                await client.agenerate(LLMRequest(input_ids=[1]))
            assert not client.workers[0].alive
            assert client.workers[0].seen.startswith("incompatible: ")

    try:
        with caplog.at_level(logging.ERROR, logger="transport.client"):
            asyncio.run(main())
        assert _errors(caplog, "protocol 3 (reads versions 3-3") == 1
        assert new.submits == []
    finally:
        new.close()


@pytest.mark.slow  # the module's worker process
def test_client_fails_over_from_a_worker_that_refuses_it(
    echo_worker: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that refuses this client's versions (as a future one reading only
    version 3 would, with an Error to the ping) is reported once and never used; the
    requests go to the worker that can serve them."""
    msg = "unsupported protocol version 1; this decoder reads versions 3-3"
    future = OldWorker(refuse=msg)

    async def main() -> None:
        async with FabricClient([future.address, echo_worker], FAST) as client:
            resps = await asyncio.gather(
                *(client.agenerate(LLMRequest(input_ids=[i, i])) for i in range(20))
            )
            assert [r.output_tokens[0] for r in resps] == list(range(20))
            while future.pings < 5:
                await asyncio.sleep(0.02)
            info = {w.address: w for w in client.workers}
            assert info[future.address].seen == (
                f"incompatible: worker {future.address} refused this client: {msg}"
            )
            assert info[echo_worker].alive

    try:
        with caplog.at_level(logging.ERROR, logger="transport.client"):
            asyncio.run(main())
        assert _errors(caplog, msg) == 1
        assert future.submits == []
    finally:
        future.close()


@pytest.mark.slow  # the module's worker process
def test_live_worker_refuses_a_client_it_cannot_serve_once(echo_worker: str) -> None:
    """A client reading versions 3-3 only: one Error (UNSUPPORTED_VERSION) naming both
    sides' versions, no pong (it never takes the worker for usable), and the worker
    serves everyone else."""
    ctx = zmq.Context()
    future, plain = dealer(ctx, echo_worker), dealer(ctx, echo_worker)
    ping = fm.Heartbeat(sent_at=2.0, protocol=3, protocol_min=3, token_encodings=7)
    try:
        future.send_multipart(versions.VERSION_1.encode(ping))
        ((frames),) = recv_messages(future)
        err = fastio.decode(frames)
        assert isinstance(err, fm.Error)
        assert (err.code, err.id) == (fm.ErrorCode.UNSUPPORTED_VERSION, -1)
        assert "protocol 3 (reads versions 3-3" in err.message
        assert f"protocol {fastio.PROTOCOL_VERSION} (reads versions 1-" in err.message
        # Its next pings get nothing; a plain ping on another connection its pong.
        future.send_multipart(versions.VERSION_1.encode(ping))
        plain.send_multipart(versions.VERSION_1.encode(fm.Heartbeat(sent_at=3.0)))
        ((frames),) = recv_messages(plain)
        assert fastio.decode(frames).sent_at == 3.0
        assert ext_codes(frames)[0] == 1  # it stated nothing: version 1
        # A peer of this version is answered in version 2.
        plain.send_multipart(versions.VERSION_1.encode(fm.Heartbeat(**versions.STATED)))
        ((frames),) = recv_messages(plain)
        assert ext_codes(frames)[0] == 2
        assert not future.poll(300)
    finally:
        future.close(0)
        plain.close(0)
        ctx.term()


@pytest.mark.slow  # the module's worker process
def test_submit_announcing_more_frames_than_arrive_is_bad_message(echo_worker: str) -> None:
    """The Error table: a wrong frame count is BAD_MESSAGE (1), attributed to the
    Submit whose id can be read, so its caller hears of it."""
    ctx = zmq.Context()
    sock = dealer(ctx, echo_worker)
    sub = fm.Submit(id=7, request=LLMRequest(input_ids=np.arange(3000, dtype=np.int32)))
    try:
        header, *buffers = fastio.encode(sub)
        assert len(buffers) == 1
        sock.send_multipart([header])  # announces one buffer frame, none follows
        ((frames),) = recv_messages(sock)
        err = fastio.decode(frames)
        assert isinstance(err, fm.Error)
        assert (err.code, err.id) == (fm.ErrorCode.BAD_MESSAGE, 7)
        assert "wrong frame count: header announces 1 buffers, got 0" in err.message
    finally:
        sock.close(0)
        ctx.term()
