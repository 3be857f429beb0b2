"""The fabric on uvloop: a worker started with ``--loop uvloop`` and a client running
in a uvloop loop serve requests of every size, answers exact, in-flight bursts
included (the ``uvloop`` extra)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fastio import LLMRequest, TokenArray
from transport import ClientConfig, FabricClient

uvloop = pytest.importorskip("uvloop")


@pytest.mark.slow
def test_client_and_worker_on_uvloop(spawn: Callable[..., Any]) -> None:
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--loop", "uvloop")
    prompts = [np.arange(n, dtype=np.int32) for n in (1, 3, 2048, 300_000)]

    async def main() -> None:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        async with FabricClient([w.address], ClientConfig(stream=False)) as client:
            for ids in prompts:
                resp = await client.agenerate(LLMRequest(input_ids=TokenArray(ids)))
                assert np.array_equal(resp.output_tokens.array, ids)
                assert len(resp.itl) == max(0, len(ids) - 1) and not resp.itl.array.any()
            many = [LLMRequest(input_ids=[i, i + 1]) for i in range(3000)]
            out = await asyncio.gather(*(client.agenerate(q) for q in many))
            assert [r.output_tokens.tolist() for r in out] == [[i, i + 1] for i in range(3000)]
            assert client.stats["completed"] == len(prompts) + 3000

    uvloop.run(main())


def test_worker_cli_without_uvloop_says_how_to_get_it(monkeypatch: Any) -> None:
    import sys

    from transport.worker import cli

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails
    with pytest.raises(cli.UserError, match=r"fastio\[uvloop\]"):
        cli._use_loop("uvloop")
