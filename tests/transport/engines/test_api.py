"""The public engine interface: the protocol, the registry, the optional hooks wired
into a worker, and the example engine of docs/engines.md run in a worker process."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
from tests.transport.conftest import ROOT, WorkerProc, await_for
from tests.transport.engines_helpers import FAST, Streams
from transport import Engine, FabricClient, FabricController, GenerationContext, WorkerServer
from transport.engines import ENGINES, register_engine, resolve_engine
from transport.worker import WorkerConfig


def test_builtin_engines_satisfy_the_protocol() -> None:
    from transport.engine import ReferenceEngine

    assert isinstance(ReferenceEngine(), Engine)

    class NoVersion:
        async def generate(self, req: Any, ctx: Any) -> Any: ...

    assert not isinstance(NoVersion(), Engine)


def test_registry_names_resolve_lazily_and_unknown_names_say_what_exists() -> None:
    assert list(ENGINES)[:5] == ["reference", "echo", "hf", "sglang", "vllm"]
    assert resolve_engine("echo")({}).__name__ == "echo_handler"
    with pytest.raises(ValueError, match="choose from reference, echo, hf, sglang, vllm"):
        resolve_engine("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_engine("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no"):
        resolve_engine("transport.engines.builtin:nothing_here")
    register_engine("counting-test", "transport.engines.builtin:reference")
    try:
        assert resolve_engine("counting-test") is resolve_engine("reference")
    finally:
        del ENGINES["counting-test"]
    with pytest.raises(ValueError):
        register_engine("a:b", "x:y")


def test_import_transport_loads_no_bridge() -> None:
    import subprocess

    code = (
        "import sys, transport, transport.engines, transport.worker;"
        "print(sorted(m for m in sys.modules if m in "
        "('aiohttp', 'transport.engines.sglang', 'transport.engines.vllm')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.strip() == "[]", r.stderr


class Hooked:
    """An engine with every optional hook, recording the calls."""

    def __init__(self) -> None:
        self.version = 7
        self.calls: list[str] = []
        self.gate = asyncio.Event()

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        assert ctx.version == 7
        await self.gate.wait()  # set by pause_generation: no polling needed
        n = 1 if ctx.interrupted else 0
        ctx.emit(5, -0.5, self.version) if n else None
        return LLMResponse(
            input_tokens=req.input_ids,
            output_tokens=TokenArray(np.full(n, 5, np.int32)),
            output_logprobs=TokenArray(np.full(n, -0.5, np.float32)),
            output_versions=TokenArray(np.full(n, 7, np.int32)),
            stop_reason="interrupt" if n else "length",
        )

    async def start(self, worker: Any) -> None:
        self.calls.append("start")

    async def close(self) -> None:
        self.calls.append("close")

    def pause_generation(self) -> None:
        self.calls.append("pause")
        self.gate.set()

    async def continue_generation(self) -> None:
        self.calls.append("continue")

    def queue_depth(self) -> int:
        return 3


def test_hooks_are_called_by_the_worker() -> None:
    eng = Hooked()

    async def main() -> None:
        server = WorkerServer(eng, WorkerConfig(bind="tcp://127.0.0.1:0"))
        [addr] = await server.start()
        assert eng.calls == ["start"]
        async with FabricClient([addr], FAST) as client:
            fut = client.agenerate(LLMRequest(input_ids=[1, 2]))
            await await_for(lambda: server.status().running == 1, what="running")
            # The engine's own queue shows in the pongs' load.
            await await_for(lambda: client.workers[0].waiting >= 3, what="engine load")
            assert await server.pause(5)
            assert eng.calls[-1] == "pause"
            await server.resume()
            assert eng.calls[-1] == "continue"
            r = await fut  # the interrupted token, then the re-submission's end
            assert r.output_tokens.tolist() == [5] and r.output_versions.tolist() == [7]
            assert r.stop_reason == "length"
        await server.close()
        assert eng.calls[-1] == "close"

    asyncio.run(main())


def test_engine_hooks_are_found_by_name_and_wired_by_the_worker_itself() -> None:
    from transport.engines import BoundHooks, attach_engine, engine_hooks

    class Frozen(Hooked):
        pauses_in_place = True

    assert engine_hooks(None) == BoundHooks() == engine_hooks(object())
    eng = Frozen()
    hooks = engine_hooks(eng)
    assert hooks.on_pause == (eng.pause_generation,)
    assert hooks.on_resume == (eng.continue_generation,)
    assert hooks.queue_depth is not None and hooks.queue_depth() == 3
    assert hooks.keeps_in_place is not None and hooks.keeps_in_place() is True
    assert hooks.lifetime is not None and hooks.lifetime.__qualname__ == "Frozen.start"
    # The worker takes them into its own state (no socket until start()).
    server = WorkerServer(eng, WorkerConfig(bind="tcp://127.0.0.1:0"))
    assert server.on_pause == [eng.pause_generation] and server.engine_load is not None
    assert server.gate.keeps_in_place() and server.background[0].__qualname__ == "Frozen.start"
    # The old entry point still works, with a warning.
    bare = WorkerServer(lambda req, ctx: None, WorkerConfig(bind="tcp://127.0.0.1:0"))
    with pytest.warns(DeprecationWarning, match="attach_engine"):
        attach_engine(bare, eng)
    assert bare.on_resume == [eng.continue_generation] and bare.engine_load is not None


def test_a_failing_start_fails_the_worker() -> None:
    class Broken(Hooked):
        async def start(self, worker: Any) -> None:
            raise ConnectionError("backend down")

    async def main() -> None:
        server = WorkerServer(Broken(), WorkerConfig(bind="tcp://127.0.0.1:0"))
        with pytest.raises(RuntimeError, match="backend down"):
            await server.start()

    asyncio.run(main())


def docs_example() -> str:
    """The first python block after '## A complete example' in docs/engines.md."""
    text = (ROOT / "docs" / "engines.md").read_text()
    section = text.split("## A complete example", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None
    return m.group(1)


@pytest.mark.slow
def test_docs_example_engine_serves_pause_and_weights(
    spawn: Callable[..., WorkerProc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from transport.weights import WeightPublisher, update_weights

    (tmp_path / "counting_engine.py").write_text(docs_example())
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    pub = WeightPublisher(
        "tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1, worker_timeout=5.0
    )
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--worker-id", "ce",
        "--engine", "counting_engine:factory", "--engine-opt", "interval=0.02",
        "--plugin", "transport.weights.update:subscribe",
        "--plugin-opt", f"weights_endpoint={pub.endpoint}", "--plugin-opt", "weights_shm=0",
    )  # fmt: skip
    streams = Streams(2)
    n = 30

    async def main() -> list[Any]:
        async with FabricClient([w.address], FAST) as client:
            g = GenerationHyperparameters(max_new_tokens=n)
            futs = [
                client.agenerate(
                    LLMRequest(input_ids=[100 * (i + 1)], gconfig=g), on_chunk=streams.on_chunk(i)
                )
                for i in range(2)
            ]
            await await_for(lambda: all(streams.got(i) >= 5 for i in range(2)), what="tokens")
            await asyncio.to_thread(pub.wait_for_workers, 1, 20)
            with FabricController([w.address]) as ctl:
                # Pause mid-generation, publish step=3 as version 1, resume.
                res = await asyncio.to_thread(
                    update_weights, ctl, pub, {"step": torch.tensor(3)}, 1, 30
                )
                assert res.ok
            return list(await asyncio.gather(*futs))

    try:
        resps = asyncio.run(main())
    finally:
        pub.close()
    for i, r in enumerate(resps):
        toks, vers = r.output_tokens.tolist(), r.output_versions.tolist()
        assert toks == streams.tokens(i) and vers == streams.versions(i) and len(toks) == n
        k = vers.index(1)  # first token after the update
        assert 5 <= k < n and set(vers[:k]) == {0} and set(vers[k:]) == {1}
        start = 100 * (i + 1)
        assert toks[:k] == list(range(start + 1, start + k + 1))  # step 1 before
        assert toks[k:] == [toks[k - 1] + 3 * j for j in range(1, n - k + 1)]  # step 3 after
