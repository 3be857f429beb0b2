"""The echo engine: answers with the prompt (for benchmarks and tests)."""

from __future__ import annotations

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray
from transport.engines.api import GenerationContext

__all__ = ["echo_handler"]


async def echo_handler(req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
    """Answers with the prompt as the output (for benchmarks and tests): logprobs 0, every
    token of the worker's current weight version."""
    ids = req.input_ids
    lp, ver = _echo_fill(len(ids), ctx.version)
    return LLMResponse(
        input_tokens=ids,
        output_tokens=ids,
        output_logprobs=lp,
        output_versions=ver,
        stop_reason="stop",
        itl=_NO_ITL,
    )


_echo_cache: dict[tuple[int, int], tuple[TokenArray, TokenArray]] = {}

#: The echo measures no inter-token latency (the worker never sends it: only encoded).
_NO_ITL = TokenArray._wrap(np.empty(0, np.float64))
_NO_ITL._a.flags.writeable = False


def _echo_fill(n: int, version: int) -> tuple[TokenArray, TokenArray]:
    """Read-only zero logprobs and constant versions of length ``n``, shared between
    echoes of the same length (the server only encodes them): the benchmark's worker
    should spend its time on the fabric, not on allocating constant arrays."""
    key = (n, version)
    arrays = _echo_cache.get(key)
    if arrays is None:
        lp = np.zeros(n, dtype=np.float32)
        ver = np.full(n, version, dtype=np.int32)
        lp.flags.writeable = ver.flags.writeable = False
        arrays = (TokenArray._wrap(lp), TokenArray._wrap(ver))
        if n <= 4096:
            if len(_echo_cache) >= 256:
                _echo_cache.clear()
            _echo_cache[key] = arrays
    return arrays


#: It never blocks: served on the socket's loop (``WorkerConfig.inline``).
echo_handler.inline = True  # type: ignore[attr-defined]
