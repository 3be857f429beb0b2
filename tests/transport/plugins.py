"""Worker plugins used by the fabric tests (loaded with ``--plugin module:function``)."""

from __future__ import annotations

from typing import Any


async def bump_version_on_resume(server: Any, opts: dict[str, str]) -> None:
    """Stands in for a weight subscriber: each resume follows a new weight version."""

    def bump() -> None:
        server.engine.version += 1

    server.on_resume.append(bump)


def reversing_engine(opts: dict[str, str]) -> Any:
    """An engine factory for ``--engine tests.transport.plugins:reversing_engine``."""
    from fastio import LLMResponse

    async def generate(req: Any, ctx: Any) -> Any:
        out = list(reversed(req.input_ids.tolist()))
        return LLMResponse(
            output_tokens=out,
            output_logprobs=[0.0] * len(out),
            output_versions=[int(opts.get("version", "0"))] * len(out),
        )

    return generate
