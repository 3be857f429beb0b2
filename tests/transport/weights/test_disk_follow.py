"""The disk route (:mod:`transport.weights.disk_follow`): a worker follows a directory
of versions written by :func:`transport.weights.disk.save_weights` and has its engine
load each newer one while paused (through the engine's ``load_weights_from_disk`` hook,
for the SGLang bridge its server, else by an in-place copy that refuses a version that
does not fit the model); the trainer writes a version once and waits until every worker
reports it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse
from tests.transport.conftest import WorkerProc, await_for
from tests.transport.engines_helpers import FAST, bridge_args, fake
from tests.transport.fakes.common import FakeProc, reference_output, seed_of_path
from transport import FabricClient, FabricController, WorkerConfig, WorkerServer
from transport.weights.disk import latest_version, load_weights, save_weights
from transport.weights.disk_follow import DiskFollower, follow, update_weights_on_disk
from transport.weights.errors import WeightUpdateError

__all__ = ["fake"]

STATE = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2)}


class Engine:
    """An engine with a model and a version (what the in-place copy needs)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.version = 0

    async def generate(self, req: LLMRequest, ctx: Any) -> LLMResponse:
        return LLMResponse(input_tokens=req.input_ids, output_tokens=req.input_ids)


class HookEngine(Engine):
    """An engine that loads versions itself (as the SGLang bridge hands them to its
    server); it has a model too, which the follower must then leave alone."""

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.refuse = refuse
        self.calls: list[tuple[str, int, bool]] = []  # path, version, paused during it
        self.server: WorkerServer | None = None

    async def load_weights_from_disk(self, path: str, version: int) -> None:
        assert self.server is not None
        self.calls.append((path, version, self.server.paused))
        if version in self.refuse:
            raise WeightUpdateError(f"the server did not load {path}")


def other_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


async def serve(
    root: Path, engine: Engine | None = None, **kw: Any
) -> tuple[WorkerServer, Engine, DiskFollower, Any]:
    engine = engine or Engine()
    server = WorkerServer(engine, WorkerConfig(bind="tcp://127.0.0.1:0"))
    if isinstance(engine, HookEngine):
        engine.server = server
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


@pytest.mark.parametrize("kind", ["copy", "hook"])
def test_under_a_controllers_pause_it_loads_and_leaves_the_resume_to_it(
    tmp_path: Path, kind: str
) -> None:
    async def main() -> None:
        server, engine, _, task = await serve(tmp_path, HookEngine() if kind == "hook" else None)
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


def test_the_engines_hook_loads_first_and_a_version_it_refuses_is_not_retried(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        hook = HookEngine(refuse=frozenset({1}))
        server, engine, follower, task = await serve(tmp_path, hook)
        try:
            before = {k: v.clone() for k, v in engine.model.state_dict().items()}
            save_weights(tmp_path, other_weights(1), 1)
            await await_for(lambda: follower.refused == 1, 10, "the refusal")
            assert engine.version == 0 and not server.paused
            save_weights(tmp_path, other_weights(2), 2)
            await await_for(lambda: engine.version == 2, 10, "version 2")
            assert server.status().version == 2
            # Each version handed over once, as a directory, while paused; version 1
            # was not tried again in the many looks before version 2 was written.
            assert hook.calls == [
                (str(tmp_path / "v00000001"), 1, True),
                (str(tmp_path / "v00000002"), 2, True),
            ]
            assert same(engine.model, before), "the in-place copy ran besides the hook"
            await await_for(lambda: not server.paused, 5, "the resume")
        finally:
            await stop(server, task)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "disk_root"),
        ({"disk_root": "/x", "disk_poll": "soon"}, "disk_poll"),
        ({"disk_root": "/x", "disk_poll": "0"}, "disk_poll=.0.: expected a number > 0"),
        ({"disk_root": "/x", "disk_strict": "maybe"}, "disk_strict"),
        ({"disk_root": "/x", "disk_dir": "/y"}, "unknown disk plugin option.*disk_dir"),
    ],
)
def test_bad_plugin_options_are_named(opts: dict[str, str], match: str) -> None:
    async def main() -> None:
        server = WorkerServer(Engine(), WorkerConfig(bind="tcp://127.0.0.1:0"))
        with pytest.raises(ValueError, match=match):
            await follow(server, opts)

    asyncio.run(main())


def test_an_engine_that_cannot_load_weights_is_refused_at_start(tmp_path: Path) -> None:
    class Bare:
        version = 0

        async def generate(self, req: LLMRequest, ctx: Any) -> LLMResponse:
            raise NotImplementedError

    async def main() -> None:
        server = WorkerServer(Bare(), WorkerConfig(bind="tcp://127.0.0.1:0"))
        with pytest.raises(TypeError, match=r"no load_weights_from_disk and no \.model"):
            await follow(server, {"disk_root": str(tmp_path)})

    asyncio.run(main())


@pytest.mark.parametrize("marker", ['{"version": 3}', '{"version": 3, "dir": 3}', "[3]"])
def test_a_malformed_marker_is_named_by_every_reader(tmp_path: Path, marker: str) -> None:
    (tmp_path / "LATEST").write_text(marker)
    for read in (latest_version, lambda root: load_weights(root, dict(STATE))):
        with pytest.raises(WeightUpdateError, match="malformed weight marker"):
            read(tmp_path)


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
    plugin = ("--plugin", "transport.weights.disk_follow:follow", "--plugin-opt")
    follow_root = (*plugin, f"disk_root={root}")
    w1 = spawn(*bridge_args("sglang", s1.url), *follow_root, wait=False)
    w2 = spawn(*bridge_args("sglang", s2.url), *follow_root, wait=False)
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
