"""Engines of tests/transport/client/test_poison.py (``--engine module:function``): one that a
given prompt token kills, and one with a vocabulary it must never be handed ids outside."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastio import LLMRequest, LLMResponse

#: A prompt holding this token kills the worker process (an engine crash, as a token id
#: past the vocabulary does to vLLM).
POISON = 13
#: A prompt holding this token is refused by the engine (``ValueError``).
REJECT = 14
#: Exit status of a worker that :data:`POISON` killed.
POISON_EXIT = 41
#: Exit status of a :class:`VocabEngine` handed an id outside its vocabulary.
VOCAB_EXIT = 42


def _echo(req: LLMRequest) -> LLMResponse:
    out = req.input_ids.tolist()
    return LLMResponse(
        output_tokens=out, output_logprobs=[0.0] * len(out), output_versions=[0] * len(out)
    )


def poison_engine(opts: dict[str, str]) -> Any:
    """Echoes the prompt after ``opts["seconds"]`` (default 0.02); a prompt holding
    :data:`POISON` ends the process ``opts["crash_after"]`` s (default 0.1) after it
    arrives, mid-"generation"; one holding :data:`REJECT` raises ``ValueError``."""
    seconds = float(opts.get("seconds", "0.02"))
    crash_after = float(opts.get("crash_after", "0.1"))

    async def generate(req: LLMRequest, ctx: Any) -> LLMResponse:
        ids = req.input_ids.array
        if (ids == POISON).any():
            await asyncio.sleep(crash_after)
            os._exit(POISON_EXIT)
        if (ids == REJECT).any():
            raise ValueError(f"token {REJECT} is not allowed in a prompt")
        await asyncio.sleep(seconds)
        return _echo(req)

    return generate


class VocabEngine:
    """An engine with a ``vocab_size`` that does not check its input: an id outside
    ``[0, vocab_size)`` in a prompt or stop token ends the process (as it may kill a
    real engine), so a worker that serves on never handed it one. A prompt holding
    :data:`REJECT` it refuses (``ValueError``)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    async def generate(self, req: LLMRequest, ctx: Any) -> LLMResponse:
        """Echo the prompt (or die, see the class)."""
        prompt = req.input_ids.tolist()
        if any(not 0 <= t < self.vocab_size for t in [*prompt, *req.gconfig.stop_token_ids]):
            os._exit(VOCAB_EXIT)
        if REJECT in prompt:
            raise ValueError(f"token {REJECT} is not allowed in a prompt")
        return _echo(req)


def vocab_engine(opts: dict[str, str]) -> Any:
    """A :class:`VocabEngine` of ``opts["vocab_size"]`` (default 16) tokens."""
    return VocabEngine(int(opts.get("vocab_size", "16")))


_ENGINES = {"poison": poison_engine, "vocab": vocab_engine}


def serve(address: str, engine: str, opts: dict[str, str]) -> None:
    """A worker process's body: a :class:`~transport.WorkerServer` bound at
    ``address`` serving ``engine`` (``"poison"`` or ``"vocab"``, made with ``opts``)
    until the process ends."""
    from transport import WorkerConfig, WorkerServer

    server = WorkerServer(_ENGINES[engine](opts), WorkerConfig(bind=address))
    asyncio.run(server.serve_forever())
