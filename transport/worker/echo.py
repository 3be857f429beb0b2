"""The echo engine: answers with the prompt (for tests and trying the fabric out)."""

from __future__ import annotations

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray
from transport.constant import constant
from transport.engines.api import GenerationContext

__all__ = ["echo_handler"]


async def echo_handler(req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
    """Answers with the prompt as the output: logprobs 0, every token of the worker's
    current weight version (read-only views of shared arrays: nothing allocated per
    request)."""
    ids = req.input_ids
    n = len(ids)
    return LLMResponse(
        input_tokens=ids,
        output_tokens=ids,
        output_logprobs=TokenArray.wrap(constant(n, np.float32)),
        output_versions=TokenArray.wrap(constant(n, np.int32, ctx.version)),
        stop_reason="stop",
        itl=TokenArray.wrap(constant(0, np.float64)),
    )


#: It never blocks: served on the socket's loop (``WorkerConfig.inline``).
echo_handler.inline = True  # type: ignore[attr-defined]
