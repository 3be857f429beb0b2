"""The data link of the TCP path (``transport.weights.routes.tcp``): bucket bytes on a
plain TCP connection per worker, received straight where they go.

Real sockets throughout; worker processes where the bytes cross a process boundary.
The fault tests of ``drivers/test_faults.py`` (trainer or worker killed mid-update,
corrupted buckets) run over the link too, since it is on by default.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import (
    BUCKET,
    digest_of,
    equal,
    make_state,
    serving_with,
    subscriber_proc,
    zeros_like,
)
from transport.weights import BucketApplier, WeightPublisher, WeightSubscriber, pack_bucket
from transport.weights.bucket import checksum, dtype_name, plan_buckets
from transport.weights.routes import tcp as dl
from transport.weights.serving import Serving
from transport.weights.streaming import BucketStream


def _plan(src: dict[str, torch.Tensor]) -> Any:
    (info,) = plan_buckets(
        [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in src.items()], 1 << 30
    )
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    pack_bucket(info, src, buf)
    return info, buf.numpy()


@pytest.mark.parametrize("piece", [7, 4096, 300_000, 1 << 22])
def test_a_stream_received_from_a_socket_lands_as_if_fed(piece: int) -> None:
    """Straight into plain tensors, through scratch for padding and tied targets, kept
    whole for a cast one: the same bytes and checksum as feeding the bucket."""
    src = {
        "big": torch.randn(700, 301),  # > one 256 KiB block, odd size: padding after
        "tied": torch.randn(33, 7),
        "cast": torch.randn(100),
        "steps": torch.randint(0, 1 << 40, (5,)),
    }
    info, data = _plan(src)
    tied = torch.zeros(33, 7)
    dst = {
        "big": torch.zeros(700, 301),
        "tied": tied,
        "tied2": tied,
        "cast": torch.zeros(100, dtype=torch.bfloat16),
        "steps": torch.zeros(5, dtype=torch.int64),
    }
    dests = {"big": ["big"], "tied": ["tied", "tied2"], "cast": ["cast"], "steps": ["steps"]}
    a, b = socket.socketpair()
    writer = threading.Thread(target=a.sendall, args=(memoryview(data),), daemon=True)
    writer.start()
    rx = dl.DataReceiver(b, 10.0)
    st = BucketStream(info, dst, dests, "xxh3_64")
    assert [e.name for e in st.rest] == ["cast"]
    for lo in range(0, data.size, piece):
        st.take(min(piece, data.size - lo), rx.fill, rx.scratch(256 << 10))
    writer.join(10)
    a.close()
    rx.close()
    assert st.size == info.nbytes and st.hasher.digest() == checksum([data], "xxh3_64")
    BucketApplier(dst).apply(st.rest_info(), [torch.from_numpy(data)], dests)
    assert torch.equal(dst["big"], src["big"]) and torch.equal(tied, src["tied"])
    assert torch.equal(dst["steps"], src["steps"])
    assert torch.equal(dst["cast"], src["cast"].to(torch.bfloat16))


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_versions_reach_worker_processes_on_the_link(
    procs: Callable[..., Any], atomic: bool
) -> None:
    """Worker a takes the link, worker b declines it (ZeroMQ frames): both apply every
    version, and only a's bytes went over the link."""
    with WeightPublisher(bucket_bytes=BUCKET, shm=False, heartbeat_interval=0.1) as pub:
        procs(subscriber_proc, pub.endpoint, [("a", "good")], {"atomic": atomic})
        procs(
            subscriber_proc, pub.endpoint, [("b", "good")], {"atomic": atomic, "data_link": False}
        )
        pub.wait_for_workers(2, 60)
        for v in (1, 2):
            assert pub.publish_and_wait(make_state(v), v, timeout=60).ok
            for w in ("a", "b"):
                assert pub.workers()[w].digest == digest_of(v)
        assert pub.counters["data_links"] == 1
        n_buckets = len(
            plan_buckets(
                [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in make_state(1).items()], BUCKET
            )
        )
        # Every bucket of both versions went to a on the link (b got frames).
        assert pub.counters["data_link_pieces"] >= 2 * n_buckets


class BreakingServing(Serving):
    """Closes a worker's data link right after queueing the first piece of bucket 0 of
    version 1 (the connection shut mid-bucket, with more of it still to be packed)."""

    def _link_send(self, snd: Any, piece: Any) -> Any:
        sent = super()._link_send(snd, piece)
        if (piece.version, piece.index, piece.offset) == (1, 0, 0):
            assert self.link is not None
            with self.link.lock:
                sender = self.link.senders.get(snd.wid)
            if sender is not None:
                sender.close()
        return sent


class BreakingPublisher(WeightPublisher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with serving_with(BreakingServing):
            super().__init__(*args, **kwargs)


def two_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 20, generator=g), "v": torch.randn(1 << 18, generator=g)}


class DroppingSubscriber(WeightSubscriber):
    """Its end of the link fails at the second piece (as a 5 s stall would)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        link, receive, n = self.fetcher.tcp, self.fetcher.tcp.receive, [0]

        def dropping(f: Any, msg: Any = None) -> None:
            n[0] += 1
            if n[0] == 2:
                f.link_failed("injected by the test")
                return
            receive(f, msg)

        link.receive = dropping  # type: ignore[method-assign]


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
@pytest.mark.parametrize("side", ["trainer", "worker"])
def test_a_link_failing_mid_bucket_falls_back_to_frames(side: str, atomic: bool) -> None:
    """The link closes mid-bucket while the trainer is still packing: closed by the
    trainer (the rest of the bucket must not follow as frames into the stream the
    worker reads), or failing on the worker (which asks again as frames while the first
    answer is still going). One stream of the bucket must arrive: before, the worker
    took the mix for a bad checksum three times and failed the version. The next
    version opens the link again."""
    state = two_tensors(1)
    dst = zeros_like(state)
    pub_cls = BreakingPublisher if side == "trainer" else WeightPublisher
    sub_cls = DroppingSubscriber if side == "worker" else WeightSubscriber
    with (
        pub_cls(shm=False, heartbeat_interval=0.1, chunk_bytes=64 << 10) as pub,
        sub_cls(
            pub.endpoint, dst, shm=False, atomic=atomic, fetch_timeout=5.0, heartbeat_interval=0.1
        ) as sub,
    ):
        pub.wait_for_workers(1, 30)
        res = pub.publish_and_wait(state, 1, timeout=30)
        assert res.ok, res
        assert equal(dst, state)
        assert sub.counters["data_link_failures"] == 1 and "checksum_failures" not in sub.counters
        before = pub.counters["data_link_pieces"]
        state2 = two_tensors(2)
        assert pub.publish_and_wait(state2, 2, timeout=30).ok
        assert equal(dst, state2)
        assert sub.counters["data_links"] == 2
        assert pub.counters["data_link_pieces"] > before


def _hello(worker: str, token: bytes) -> bytes:
    wid = worker.encode()
    return dl.HELLO.pack(dl.HELLO_MAGIC, dl.PROTOCOL, len(wid), len(token)) + wid + token


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(10.0)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_listener_refuses_strangers_and_keeps_serving() -> None:
    """A made-up token, another worker's token, garbage, silence: each connection is
    closed, nothing registered; silent peers delay no one, and a real worker still
    gets its versions on the link."""
    state = make_state(3)
    dst = zeros_like(state)
    with WeightPublisher(shm=False, heartbeat_interval=0.1) as pub:
        assert pub.serving.link is not None
        addr = ("127.0.0.1", pub.serving.link.listener.port)
        silent = [socket.create_connection(addr) for _ in range(4)]  # never say a word
        with socket.create_connection(addr) as s:
            s.sendall(_hello("intruder", b"x" * 16))
            assert _closed_by_peer(s)
        with socket.create_connection(addr) as s:  # a's token is not b's
            s.sendall(_hello("b", pub.serving.link.token("a")))
            assert _closed_by_peer(s)
        with socket.create_connection(addr) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert _closed_by_peer(s)
        assert not pub.serving.link.senders
        with WeightSubscriber(pub.endpoint, dst, shm=False, heartbeat_interval=0.1) as sub:
            pub.wait_for_workers(1, 30)
            for v in (1, 2):
                assert pub.publish_and_wait(state, v, timeout=30).ok
            assert equal(dst, state) and sub.counters["data_links"] == 1
            assert "data_link_refused" not in sub.counters
            assert pub.counters["data_link_pieces"] >= 2
        for s in silent:
            assert _closed_by_peer(s)  # dropped after the handshake deadline
            s.close()
        wait_for(lambda: pub.serving.link.listener.rejected == 7, 10, "7 connections refused")


def test_the_answer_byte_comes_before_any_piece() -> None:
    """A piece queued the moment a link is registered (an answer already under way for
    that worker) still reaches the socket after the handshake's answer."""
    secret = b"s" * 16

    def admit(wid: str, sock: socket.socket) -> bool:
        sender = dl.DataSender(sock, wid, 5.0, lambda _: None, first=b"\x01")
        sender.send(
            dl.PIECE.pack(dl.PIECE_MAGIC, 1, 0, 0, 4, 7, True), np.arange(4, dtype=np.uint8)
        )
        return True

    lst = dl.DataListener("tcp://127.0.0.1:1", secret, admit)
    try:
        rx = dl.connect("tcp://127.0.0.1:1", lst.port, "w", dl.worker_token(secret, "w"), 5.0)
        p = rx.header()
        got = np.empty(4, dtype=np.uint8)
        rx.fill(got)
        assert (p.version, p.nbytes, p.checksum, p.last) == (1, 4, 7, True)
        assert got.tolist() == [0, 1, 2, 3]
        rx.close()
    finally:
        lst.close()


def test_the_link_listens_on_the_port_asked_for() -> None:
    """A fixed port (firewalls, container port maps): offered and used."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = make_state(4)
    dst = zeros_like(state)
    with WeightPublisher(shm=False, data_port=port, heartbeat_interval=0.1) as pub:
        assert pub.serving.link is not None and pub.serving.link.listener.port == port
        with WeightSubscriber(pub.endpoint, dst, shm=False, heartbeat_interval=0.1) as sub:
            pub.wait_for_workers(1, 30)
            assert pub.publish_and_wait(state, 1, timeout=30).ok
            assert equal(dst, state) and sub.counters["data_links"] == 1


def test_no_link_with_curve_unless_asked(tmp_path: Any) -> None:
    """The link is not encrypted: with CurveZMQ it is off unless asked for; an ipc://
    endpoint has no host to offer one on."""
    import zmq.auth

    from transport.sockets import CurveConfig

    _, secret = zmq.auth.create_certificates(str(tmp_path), "trainer")
    curve = CurveConfig(secret_key_file=secret)
    with WeightPublisher(shm=False, curve=curve) as pub:
        assert pub.serving.link is None
    with WeightPublisher(shm=False, curve=curve, data_link=True) as pub:
        assert pub.serving.link is not None
    with WeightPublisher(shm=False) as pub:
        assert pub.serving.link is not None
    with WeightPublisher("ipc://" + str(tmp_path / "w.sock"), shm=False) as pub:
        assert pub.serving.link is None


def big_worker(endpoint: str, wid: str, freeze: bool) -> None:
    """A worker process on :func:`big_state`; with ``freeze`` it stops itself (SIGSTOP)
    once bucket 0 of version 1 is in: its data link stops being read with more
    buckets in flight."""
    torch.set_num_threads(1)

    def progress(version: int, bucket: int) -> None:
        if freeze and (version, bucket) == (1, 0):
            os.kill(os.getpid(), signal.SIGSTOP)

    WeightSubscriber(
        endpoint,
        zeros_like(big_state(1)),
        worker_id=wid,
        shm=False,
        report_digest=True,
        heartbeat_interval=0.1,
        window=4,
        on_progress=progress,
    ).start()
    threading.Event().wait()


def big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(12)}  # 48 MiB


@pytest.mark.slow
def test_a_worker_that_stops_reading_holds_up_no_one(procs: Callable[..., Any]) -> None:
    """Worker b freezes mid-version with megabytes queued for it: worker a still gets
    the version at once, b is declared lost, its link closed (the buffer is not held
    for it), and once it runs again it completes the version."""
    with WeightPublisher(
        bucket_bytes=4 << 20, shm=False, heartbeat_interval=0.1, worker_timeout=2.0
    ) as pub:
        procs(big_worker, pub.endpoint, "a", False)
        b = procs(big_worker, pub.endpoint, "b", True)
        pub.wait_for_workers(2, 60)
        pub.publish(big_state(1), 1)
        res = pub.wait(1, 60)
        assert res.applied.keys() == {"a"} and "lost" in res.failed["b"], res
        wait_for(lambda: "b" not in pub.serving.link.senders, 20, "b's data link closed")
        assert b.pid is not None
        os.kill(b.pid, signal.SIGCONT)
        want = digest_of_big(1)
        wait_for(lambda: pub.workers()["b"].digest == want, 60, "b completing version 1")


def digest_of_big(seed: int) -> int:
    from transport.weights import state_digest

    return state_digest(big_state(seed))


def test_a_receiver_reports_a_closed_or_malformed_link() -> None:
    a, b = socket.socketpair()
    rx = dl.DataReceiver(b, 5.0)
    a.sendall(b"XXXX" + bytes(dl.PIECE.size - 4))
    with pytest.raises(dl.DataLinkError, match="bad piece header"):
        rx.header()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(dl.DataLinkError, match="closed"):
        rx.fill(np.empty(10, dtype=np.uint8))
    rx.close()


def test_the_worker_plugin_can_decline_the_link() -> None:
    from transport.weights.update import subscriber_options

    base = {"weights_endpoint": "tcp://127.0.0.1:1"}
    assert subscriber_options({**base, "weights_data_link": "0"}, None)["data_link"] is False
    assert "data_link" not in subscriber_options(base, None)  # the subscriber's default: on


def test_the_old_module_name_still_imports_deprecated() -> None:
    import importlib
    import sys

    sys.modules.pop("transport.weights.datalink", None)
    with pytest.warns(DeprecationWarning, match=r"import transport\.weights\.routes\.tcp"):
        old = importlib.import_module("transport.weights.datalink")
    assert old.DataSender is dl.DataSender and old.__all__ == dl.__all__
