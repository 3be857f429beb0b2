"""How :func:`transport.zmqio.send_frames` hands buffers to libzmq on the fabric's
ROUTERs and DEALERs: copied below ``COPY_BELOW``, lent above it, and a received frame
sent on as itself. Over ``inproc://``, where libzmq passes a message's memory through
unchanged, so what arrives shows whether the sender's buffer was copied or shared."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from tests.helpers import wait_for
from transport.sockets import make_dealer, make_router
from transport.zmqio import COPY_BELOW, nbytes, recv_frames, send_frames


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A DEALER (sends first) and the ROUTER it is connected to."""
    zctx: zmq.Context[Any] = zmq.Context()
    b, _ = make_router(zctx, "inproc://zmqio-test")
    a = make_dealer(zctx, "inproc://zmqio-test", routing_id=b"A")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        zctx.term()


def _recv(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    out: list[list[zmq.Frame]] = []

    def ready() -> bool:
        try:
            out.append(recv_frames(sock))
        except zmq.Again:
            return False
        return True

    wait_for(ready, timeout=5)
    return out[0]


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


def test_a_frame_under_the_threshold_is_copied_at_send(pair: Any) -> None:
    a, b = pair
    assert a.copy_threshold == COPY_BELOW
    arr = np.full((COPY_BELOW - 4) // 4, 7, np.int32)  # 128 KiB and more: lent by pyzmq
    send_frames(a, [b"h", arr])
    arr[:] = 9  # after the send: a copy does not see it
    got = _recv(b)
    assert np.frombuffer(got[2], np.int32).max() == 7
    assert _address(got[2]) != arr.ctypes.data


def test_a_frame_at_the_threshold_is_lent(pair: Any) -> None:
    a, b = pair
    arr = np.full(COPY_BELOW // 4, 7, np.int32)
    send_frames(a, [b"h", arr])
    got = _recv(b)
    assert _address(got[2]) == arr.ctypes.data  # the sender's memory, not a copy


@pytest.mark.parametrize("nbytes", [4096, COPY_BELOW * 2])
def test_a_view_of_a_whole_received_frame_goes_as_that_frame(pair: Any, nbytes: int) -> None:
    a, b = pair
    send_frames(a, [b"h", np.arange(nbytes // 4, dtype=np.int32)])
    first = _recv(b)[2]
    view = np.frombuffer(first, np.int32)  # as the decoder makes a token array
    send_frames(b, [b"A", b"again", view])
    again = _recv(a)
    assert again[0].bytes == b"again"
    assert _address(again[1]) == _address(first)  # shared, neither copied nor lent
    assert np.array_equal(np.frombuffer(again[1], np.int32), np.arange(nbytes // 4))


def test_a_view_of_part_of_a_frame_is_sent_as_its_own_bytes(pair: Any) -> None:
    a, b = pair
    send_frames(a, [b"h", np.arange(1000, dtype=np.int32)])
    first = _recv(b)[2]
    part = np.frombuffer(first, np.int32)[10:20]
    send_frames(b, [b"A", part])
    got = _recv(a)
    assert len(got) == 1
    assert np.frombuffer(got[0], np.int32).tolist() == list(range(10, 20))


def test_nbytes_counts_bytes_of_every_frame_type() -> None:
    frames = [
        b"peer", np.zeros(1000, np.float64), np.zeros((3, 5), np.int16), memoryview(b"abc"),
        zmq.Frame(b"x" * 30), bytearray(7),
    ]  # fmt: skip
    assert nbytes(frames) == 4 + 8000 + 30 + 3 + 30 + 7
