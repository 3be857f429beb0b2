"""The raw pyzmq baseline of the transport suite: an echo ROUTER script and a blocking
client of DEALERs, moving the fabric's bytes with nothing on top."""

from __future__ import annotations

import time

import zmq

__all__ = ["RAW_ECHO", "RawClient"]

# A raw echo ROUTER: what a worker does with no fabric on top. It sends each request
# back, plus one frame that makes the reply as large as the fabric's (a Result carries
# tokens, logprobs and versions: about 3x the request's payload). argv[1] maps a
# request's size in bytes (frames after the identity) to that extra size. It runs with
# the allocator settings fastio's processes use (transport.zmqio.tune_malloc), as
# does the client's process: the comparison is of the fabric, not of malloc.
RAW_ECHO = """
import sys, json, zmq
from transport.zmqio import tune_malloc
tune_malloc()  # the allocator settings of every process of the suite
pads = {int(k): zmq.Frame(bytes(v)) for k, v in json.loads(sys.argv[1]).items() if v > 0}
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.SNDHWM, 100000); s.setsockopt(zmq.RCVHWM, 100000)
s.bind("tcp://127.0.0.1:*")
print(json.dumps({"ready": [s.getsockopt_string(zmq.LAST_ENDPOINT)]}), flush=True)
recv, send = s.recv_multipart, s.send_multipart
while True:
    m = recv(copy=False)
    pad = pads.get(sum(len(f) for f in m[1:]))
    if pad is not None:
        m.append(pad)
    send(m, copy=False)
"""


class RawClient:
    """Blocking DEALERs to raw echo workers: the baseline's client side."""

    def __init__(self, addresses: list[str]) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100000)
            s.setsockopt(zmq.RCVHWM, 100000)
            s.connect(a)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)

    def rtt(self, frames: list[bytes], number: int) -> float:
        s = self.socks[0]
        t0 = time.perf_counter()
        for _ in range(number):
            s.send_multipart(frames, copy=False)
            s.recv_multipart(copy=False)
        return (time.perf_counter() - t0) / number

    def rtt_once(self, frames: list[bytes]) -> None:
        """One round trip."""
        s = self.socks[0]
        s.send_multipart(frames, copy=False)
        s.recv_multipart(copy=False)

    def pipelined(self, frames: list[bytes], number: int, window: int, hold: bool = True) -> float:
        """``number`` requests, at most ``window`` in flight; seconds per request.

        ``hold``: keep every reply until all are in, then release them (inside the
        timing), as a caller of the fabric holds its responses (``asyncio.gather``'s
        list). ``hold=False`` drops each reply at once, so the next one is received into
        the same cache-hot buffer: a reader of its replies never gets that.
        """
        socks = self.socks
        sent = done = k = 0
        kept: list[list[zmq.Frame]] = _new_list()
        keep = kept.append if hold else _drop
        t0 = time.perf_counter()
        while sent < min(window, number):
            socks[k % len(socks)].send_multipart(frames, copy=False)
            k += 1
            sent += 1
        while done < number:
            for s, _ in self.poller.poll():
                while True:
                    try:
                        keep(s.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
                    done += 1
                    if sent < number:
                        s.send_multipart(frames, copy=False)
                        sent += 1
        kept.clear()
        return (time.perf_counter() - t0) / number

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def _drop(msg: list[zmq.Frame]) -> None:
    """A reply not kept."""


# The list that holds the replies (a name, so a test can watch it).
_new_list = list
