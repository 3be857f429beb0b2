"""Engines of tests/transport/fabric/test_recovery.py (``--engine module:function``)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastio import LLMResponse

#: ``input_ids[0]`` of a request picks what the handler returns.
GOOD, NO_LOGPROBS, SHORT_VERSIONS, BAD_STOP, NOT_A_RESPONSE, FAIL_LATE = range(6)


def faulty_engine(opts: dict[str, str]) -> Any:
    """A handler returning invalid output in the ways a worker must catch."""

    async def generate(req: Any, ctx: Any) -> Any:
        mode = int(req.input_ids[0])
        out = [7, 8, 9]
        if mode == FAIL_LATE:
            await asyncio.sleep(0.5)  # stands in for generation time
            raise ValueError("failed late")
        if mode == NOT_A_RESPONSE:
            return {"output_tokens": out}
        if mode == NO_LOGPROBS:
            return LLMResponse(output_tokens=out, output_versions=[0] * 3)
        if mode == SHORT_VERSIONS:
            return LLMResponse(output_tokens=out, output_logprobs=[0.0] * 3, output_versions=[0])
        resp = LLMResponse(output_tokens=out, output_logprobs=[0.0] * 3, output_versions=[0] * 3)
        if mode == BAD_STOP:
            resp.stop_reason = "finished"  # type: ignore[assignment]  # past validation
        return resp

    return generate
