"""The echo engine: answers with the prompt (for benchmarks and tests)."""

from __future__ import annotations

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray
from transport.constant import constant, frame_constant
from transport.engines.api import GenerationContext

__all__ = ["echo_handler"]


async def echo_handler(req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
    """Answers with the prompt as the output (for benchmarks and tests): logprobs 0, every
    token of the worker's current weight version."""
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
    """Read-only zero logprobs and constant versions of length ``n``, shared and sent as
    frames of their own (as the raw echo's padding), so the benchmark's worker spends
    its time on the fabric."""
    global _fill
    if n <= _FILL_LEN:  # the next ones of this version take the short path
        _fill = (version, constant(_FILL_LEN, np.float32), constant(_FILL_LEN, np.int32, version))
    return (
        TokenArray.wrap(frame_constant(n, np.float32)),
        TokenArray.wrap(frame_constant(n, np.int32, version)),
    )


#: It never blocks: served on the socket's loop (``WorkerConfig.inline``).
echo_handler.inline = True  # type: ignore[attr-defined]
