"""The disk route to engines: a version written once by the trainer
(transport.weights.disk.save_weights), loaded by each worker's engine, the worker's
version following only once the engine (for the SGLang bridge: its server) confirms."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc
from tests.transport.engines_helpers import FAST, bridge_args, fake
from tests.transport.fakes.common import FakeProc, reference_output, seed_of_path
from transport import FabricClient, FabricController
from transport.engines.disk import update_weights_on_disk
from transport.weights.disk import save_weights
from transport.weights.errors import WeightUpdateError

__all__ = ["fake"]

STATE = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2)}


def test_sglang_hook_loads_a_version_written_by_the_disk_path(
    fake: Callable[..., FakeProc], tmp_path: Path
) -> None:
    from transport.engines.sglang import SGLangEngine

    server = fake("sglang")
    path = save_weights(tmp_path, STATE, 5).parent
    eng = SGLangEngine(server.url, health_interval=0)

    async def main() -> None:
        try:
            with pytest.raises(WeightUpdateError, match="did not load"):
                await eng.load_weights_from_disk(str(tmp_path / "nowhere"), 4)
            assert eng.version == 0 and server.stats().get("reloads", 0) == 0
            await eng.load_weights_from_disk(str(path), 5)
            assert eng.version == 5
        finally:
            await eng.close()

    asyncio.run(main())
    stats = server.stats()
    assert stats["reloads"] == 1 and stats["seed"] == seed_of_path(str(path))
    # Bracketed by the server's pause and continue.
    assert stats["pauses"] == stats["continues"] == 2


@pytest.mark.slow
def test_trainer_writes_once_and_every_worker_follows(
    spawn: Callable[..., WorkerProc], fake: Callable[..., FakeProc], tmp_path: Path
) -> None:
    s1, s2 = fake("sglang"), fake("sglang")
    root = tmp_path / "shared"
    follow = ("--plugin", "transport.engines.disk:follow", "--plugin-opt", f"weights_dir={root}")
    w1 = spawn(*bridge_args("sglang", s1.url), *follow, wait=False)
    w2 = spawn(*bridge_args("sglang", s2.url), *follow, wait=False)
    a1, a2 = w1.wait_ready(), w2.wait_ready()
    prompt = [4, 4, 4]
    g = GenerationHyperparameters(max_new_tokens=10)

    async def ask(addr: str) -> object:
        async with FabricClient([addr], FAST) as client:
            return await client.agenerate(LLMRequest(input_ids=prompt, gconfig=g))

    with FabricController([a1, a2]) as ctl:
        versions = update_weights_on_disk(ctl, root, STATE, version=2, timeout=30)
    assert versions == {a1: 2, a2: 2}
    assert len(list(root.glob("v*/model.safetensors"))) == 1  # written once
    seed = seed_of_path(str(root / "v00000002"))
    for server, addr in ((s1, a1), (s2, a2)):
        assert server.stats()["reloads"] == 1
        r = asyncio.run(ask(addr))
        assert r.output_tokens.tolist() == reference_output(seed, prompt, 10)  # type: ignore[attr-defined]
        assert r.output_versions.tolist() == [2] * 10  # type: ignore[attr-defined]
