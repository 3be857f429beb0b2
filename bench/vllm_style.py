"""A vLLM-style asyncio client and echo server: the peer baseline of the transport suite.

Written here in the technique of vLLM V1's ``AsyncMPClient`` and engine core (not vLLM's
code): the client holds a ``zmq.asyncio`` DEALER per engine, ``await``s
``send_multipart(copy=False)`` of msgspec-encoded requests whose token arrays travel as
extra zero-copy frames (:class:`bench.codec.VllmStyleEncoder`), and one *output handler*
task per socket receives, decodes and resolves the future of each request by its id.
The server is a blocking loop on a ROUTER (``recv_multipart(copy=False)``, decode,
answer, encode, ``send_multipart(copy=False)``), as the fabric's echo worker serves its
socket on its handler's loop (no thread hand-offs on either side).

The echo answers what the fabric's echo answers: the prompt as output tokens, zero
float32 logprobs and int32 versions (read-only shared arrays on both sides), so both
move the same bytes. The client builds its response around the caller's request with
the latency measured, as the fabric's client does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from bench.codec import VllmStyleDecoder, VllmStyleEncoder, VRequest, VResponse

__all__ = ["VOutput", "VSubmit", "VllmStyleClient", "serve"]

VLLM = "vllm-style"


class VSubmit(msgspec.Struct, array_like=True, gc=False):
    """A request on the wire: the client's id and the request."""

    id: int
    request: VRequest


class VOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine answers (vLLM's ``EngineCoreOutput``, reduced to the echo)."""

    id: int
    output_tokens: np.ndarray  # type: ignore[type-arg]
    output_logprobs: np.ndarray  # type: ignore[type-arg]
    output_versions: np.ndarray  # type: ignore[type-arg]
    stop_reason: str = "stop"


class VllmStyleClient:
    """``await client.generate(req)`` over one DEALER per engine, round robin."""

    def __init__(self, addresses: list[str]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.RCVHWM, 100_000)
            s.connect(a)
            self.socks.append(s)
        self.enc = VllmStyleEncoder()
        self.dec = VllmStyleDecoder(VOutput)
        self.pending: dict[int, tuple[asyncio.Future[VResponse], VRequest, float]] = {}
        self.ids = itertools.count()
        self.rr = itertools.cycle(self.socks)
        self.handlers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the output handler tasks (in the running loop)."""
        self.handlers = [asyncio.ensure_future(self._output_handler(s)) for s in self.socks]

    async def generate(self, req: VRequest) -> VResponse:
        """Send ``req`` and wait for its response."""
        rid = next(self.ids)
        fut: asyncio.Future[VResponse] = asyncio.get_running_loop().create_future()
        self.pending[rid] = (fut, req, time.perf_counter())
        await next(self.rr).send_multipart(self.enc.encode(VSubmit(rid, req)), copy=False)
        return await fut

    async def _output_handler(self, sock: zmq.asyncio.Socket) -> None:
        dec = self.dec
        pending = self.pending
        while True:
            frames = await sock.recv_multipart(copy=False)
            out: VOutput = dec.decode(frames)
            fut, req, t0 = pending.pop(out.id)
            latency = time.perf_counter() - t0
            if not fut.done():
                fut.set_result(
                    VResponse(
                        input_tokens=req.input_ids,
                        output_tokens=out.output_tokens,
                        output_logprobs=out.output_logprobs,
                        output_versions=out.output_versions,
                        stop_reason=out.stop_reason,
                        latency=latency,
                        ttft=latency,
                    )
                )

    def close(self) -> None:
        """Stop the handlers and close the sockets."""
        for t in self.handlers:
            t.cancel()
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def serve() -> None:
    """The echo engine: a blocking ROUTER loop (run as ``python -m bench.vllm_style``)."""
    from transport.zmqio import tune_malloc

    tune_malloc()  # as every process of the suite: the comparison is not of malloc
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.bind("tcp://127.0.0.1:*")
    print(json.dumps({"ready": [s.getsockopt_string(zmq.LAST_ENDPOINT)]}), flush=True)
    enc = VllmStyleEncoder()
    dec = VllmStyleDecoder(VSubmit)
    zeros = np.zeros(1 << 20, np.float32)
    versions = np.zeros(1 << 20, np.int32)
    for a in (zeros, versions):
        a.flags.writeable = False
    while True:
        frames = s.recv_multipart(copy=False)
        sub: VSubmit = dec.decode(frames[1:])
        ids = sub.request.input_ids
        n = len(ids)
        if n > len(zeros):
            zeros = np.zeros(n, np.float32)
            versions = np.zeros(n, np.int32)
        out = enc.encode(VOutput(sub.id, ids, zeros[:n], versions[:n]))
        out.insert(0, frames[0])
        s.send_multipart(out, copy=False)


if __name__ == "__main__":
    sys.exit(serve())
