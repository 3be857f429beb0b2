"""The echo engine: answers with the prompt (for benchmarks and tests)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray
from transport.worker.context import RequestContext

__all__ = ["echo_handler"]


async def echo_handler(req: LLMRequest, ctx: RequestContext) -> LLMResponse:
    """Answers with the prompt as the output (for benchmarks and tests): logprobs 0, every
    token of the worker's current weight version."""
    n = len(req.input_ids)
    lp, ver = _echo_fill(n, ctx._server.version)
    return LLMResponse(
        input_tokens=req.input_ids,
        output_tokens=req.input_ids,
        output_logprobs=TokenArray._wrap(lp),
        output_versions=TokenArray._wrap(ver),
        stop_reason="stop",
    )


_echo_cache: dict[tuple[int, int], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}


def _echo_fill(n: int, version: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Read-only zero logprobs and constant versions of length ``n``, shared between
    echoes of the same length (they are only encoded): the benchmark's worker should
    spend its time on the fabric, not on allocating constant arrays."""
    key = (n, version)
    arrays = _echo_cache.get(key)
    if arrays is None:
        lp = np.zeros(n, dtype=np.float32)
        ver = np.full(n, version, dtype=np.int32)
        lp.flags.writeable = ver.flags.writeable = False
        arrays = (lp, ver)
        if n <= 4096:
            if len(_echo_cache) >= 256:
                _echo_cache.clear()
            _echo_cache[key] = arrays
    return arrays


#: It never blocks: served on the socket's loop (``WorkerConfig.inline``).
echo_handler.inline = True  # type: ignore[attr-defined]
