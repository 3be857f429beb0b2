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


def _answer(req: Any) -> Any:
    from fastio import LLMResponse

    out = req.input_ids.tolist()
    return LLMResponse(
        output_tokens=out, output_logprobs=[0.0] * len(out), output_versions=[0] * len(out)
    )


def blocking_engine(opts: dict[str, str]) -> Any:
    """A sync handler that blocks its thread for ``opts["seconds"]`` (``time.sleep``),
    then echoes the prompt: a stand-in for an engine that never yields."""
    import time

    seconds = float(opts.get("seconds", "4"))

    def generate(req: Any, ctx: Any) -> Any:
        time.sleep(seconds)
        return _answer(req)

    return generate


def torch_loop_engine(opts: dict[str, str]) -> Any:
    """An async handler that runs torch matrix products for ``opts["seconds"]`` without
    ever awaiting (a forward pass run inline), then echoes the prompt."""
    import time

    import torch

    seconds = float(opts.get("seconds", "4"))

    async def generate(req: Any, ctx: Any) -> Any:
        a = torch.randn(256, 256)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
        return _answer(req)

    return generate


def slow_engine(opts: dict[str, str]) -> Any:
    """An async handler that waits ``opts["seconds"]`` (yielding), then echoes."""
    import asyncio

    seconds = float(opts.get("seconds", "1"))

    async def generate(req: Any, ctx: Any) -> Any:
        await asyncio.sleep(seconds)
        return _answer(req)

    return generate


async def failing_plugin(server: Any, opts: dict[str, str]) -> None:
    """A background job that fails as it starts (a plugin given bad options)."""
    raise ValueError(f"bad plugin options {sorted(opts)}")
