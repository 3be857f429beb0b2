"""The disk route's worker side: a worker follows a directory of versions written by
:func:`transport.weights.disk.save_weights`, loads each newer one while paused, and
refuses one that does not fit its model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")

from fastio import LLMRequest, LLMResponse
from tests.transport.conftest import await_for
from transport import WorkerConfig, WorkerServer
from transport.weights.disk import save_weights
from transport.weights.disk_follow import DiskFollower, follow


class Engine:
    """An engine with a model and a version (what the follower needs)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.version = 0

    async def generate(self, req: LLMRequest, ctx: Any) -> LLMResponse:
        return LLMResponse(input_tokens=req.input_ids, output_tokens=req.input_ids)


def other_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


async def serve(root: Path, **kw: Any) -> tuple[WorkerServer, Engine, DiskFollower, Any]:
    engine = Engine()
    server = WorkerServer(engine, WorkerConfig(bind="tcp://127.0.0.1:0"))
    await server.start()
    follower = DiskFollower(server, root, poll=0.01, **kw)
    return server, engine, follower, asyncio.create_task(follower.run())


async def stop(server: WorkerServer, task: Any) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await server.close()


def test_a_worker_loads_each_new_version_and_resumes_itself(tmp_path: Path) -> None:
    async def main() -> None:
        server, engine, _, task = await serve(tmp_path)
        try:
            w1 = other_weights(1)
            save_weights(tmp_path, w1, 1)
            await await_for(lambda: engine.version == 1, 10, "version 1")
            assert same(engine.model, w1)
            # It paused itself for the copy and resumed after: generation goes on.
            await await_for(lambda: not server.paused, 5, "the resume")
            w3 = other_weights(3)
            save_weights(tmp_path, w3, 3)
            await await_for(lambda: engine.version == 3, 10, "version 3")
            assert same(engine.model, w3) and server.status().version == 3
        finally:
            await stop(server, task)

    asyncio.run(main())


def test_under_a_controllers_pause_it_loads_and_leaves_the_resume_to_it(tmp_path: Path) -> None:
    async def main() -> None:
        server, engine, _, task = await serve(tmp_path)
        try:
            assert await server.pause(5)  # a controller's pause (the weight update's)
            save_weights(tmp_path, other_weights(2), 2)
            await await_for(lambda: engine.version == 2, 10, "version 2")
            assert server.paused, "the follower resumed a pause that was not its own"
            await server.resume()
            assert not server.paused
        finally:
            await stop(server, task)

    asyncio.run(main())


def test_a_version_that_does_not_fit_is_refused_and_a_later_one_loads(tmp_path: Path) -> None:
    async def main() -> None:
        server, engine, follower, task = await serve(tmp_path)
        try:
            before = {k: v.clone() for k, v in engine.model.state_dict().items()}
            bad = other_weights(4)
            bad["1.weight"] = torch.zeros(5, 3)  # wrong shape
            save_weights(tmp_path, bad, 1)
            await await_for(lambda: follower.refused == 1, 10, "the refusal")
            assert engine.version == 0 and same(engine.model, before)
            assert not server.paused, "a refused version must not leave the worker paused"
            good = other_weights(5)
            save_weights(tmp_path, good, 2)
            await await_for(lambda: engine.version == 2, 10, "version 2")
            assert same(engine.model, good)
        finally:
            await stop(server, task)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "disk_root"),
        ({"disk_root": "/x", "disk_poll": "soon"}, "disk_poll"),
        ({"disk_root": "/x", "disk_poll": "0"}, "positive"),
        ({"disk_root": "/x", "disk_strict": "maybe"}, "disk_strict"),
    ],
)
def test_bad_plugin_options_are_named(opts: dict[str, str], match: str) -> None:
    async def main() -> None:
        server = WorkerServer(Engine(), WorkerConfig(bind="tcp://127.0.0.1:0"))
        with pytest.raises(ValueError, match=match):
            await follow(server, opts)

    asyncio.run(main())
