"""The benchmarks' echo engine (``--engine bench.echo:engine``): the answer of
:func:`transport.echo_handler`, with its fillers cached per weight version and sent as
shared ZeroMQ frames of their own (as the raw echo's padding), so that the benchmark's
worker spends its time on the fabric."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray
from transport.constant import constant
from transport.engines.api import GenerationContext
from transport.zmqio import tune_malloc

__all__ = ["echo_handler", "engine", "frame_constant"]

tune_malloc()  # the worker process of the suite opts in, as the clients' (bench.transport)
_frames: dict[tuple[Any, Any, int], npt.NDArray[Any]] = {}
_MAX_FRAMES = 16  # arrays kept
_MAX_FRAME_BYTES = 4 << 20  # per array: the table holds at most 64 MiB


def frame_constant(n: int, dtype: Any, value: Any = 0) -> npt.NDArray[Any]:
    """As :func:`transport.constant.constant`, over a ``zmq.Frame`` of its own: the
    fabric sends it as that frame (libzmq shares it: neither copied nor lent per
    message). Up to 16 arrays are kept, then the table starts afresh (thread-safe); one
    over 4 MiB is ``constant``'s view. Never make it writable: every later reply shares it.
    """
    n = max(n, 0)
    if n * np.dtype(dtype).itemsize > _MAX_FRAME_BYTES:
        return constant(n, dtype, value)
    key = (dtype, value, n)
    a = _frames.get(key)
    if a is None:
        if len(_frames) >= _MAX_FRAMES:
            _frames.clear()
        frame: Any = zmq.Frame(constant(n, dtype, value), copy=True)
        a = _frames[key] = np.frombuffer(frame, dtype)
        a.flags.writeable = False
    return a


async def echo_handler(req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
    """:func:`transport.echo_handler`'s answer, from shared fillers."""
    ids = req.input_ids
    n = len(ids)
    version = ctx.version
    fill = _fill  # read once: another thread's worker may replace it
    if n <= _FILL_LEN and fill[0] == version:
        lp, ver = TokenArray.wrap(fill[1][:n]), TokenArray.wrap(fill[2][:n])
    else:
        lp, ver = _echo_fill(n, version)
    return LLMResponse(
        input_tokens=ids,
        output_tokens=ids,
        output_logprobs=lp,
        output_versions=ver,
        stop_reason="stop",
        itl=_NO_ITL,
    )


_NO_ITL = TokenArray.wrap(constant(0, np.float64))
# Prompts up to this length take their fillers from _fill: (version, logprobs, versions).
_FILL_LEN = 4096
_fill = (0, constant(_FILL_LEN, np.float32), constant(_FILL_LEN, np.int32, 0))


def _echo_fill(n: int, version: int) -> tuple[TokenArray, TokenArray]:
    """Read-only zero logprobs and constant versions of length ``n``, as shared frames."""
    global _fill
    if n <= _FILL_LEN:  # the next ones of this version take the short path
        _fill = (version, constant(_FILL_LEN, np.float32), constant(_FILL_LEN, np.int32, version))
    return (
        TokenArray.wrap(frame_constant(n, np.float32)),
        TokenArray.wrap(frame_constant(n, np.int32, version)),
    )


#: It never blocks: served on the socket's loop (``WorkerConfig.inline``).
echo_handler.inline = True  # type: ignore[attr-defined]


def engine(opts: dict[str, str]) -> Any:
    """The engine factory of ``--engine bench.echo:engine`` (no options)."""
    if opts:
        raise ValueError("--engine bench.echo:engine takes no --engine-opt")
    return echo_handler
