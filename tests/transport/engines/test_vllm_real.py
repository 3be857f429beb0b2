"""``--engine vllm`` against a real vLLM server (vLLM's CPU build, a tiny random Llama made
from a ``config.json``), started here with fastio's weight-transfer backend. Skipped where
vLLM is not installed; ``.ci/vllm.sh`` installs it in its own venv and runs this module.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (.ci/vllm.sh installs it)", allow_module_level=True)

import torch

from fastio import GenerationHyperparameters, LLMRequest
from tests.helpers import free_port
from tests.transport.conftest import WorkerProc, wait_for
from transport import ClientConfig, FabricClient, FabricController
from transport.weights import WeightPublisher
from transport.weights.update import update_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VOCAB = 1024
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}  # fmt: skip
CLIENT = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=50, request_timeout=120)


class Server:
    """A vLLM OpenAI-compatible server in dev mode with the fastio backend."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--port", str(self.port), "--host", "127.0.0.1",
                "--skip-tokenizer-init", "--load-format", "dummy", "--dtype", "float32",
                "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.1",
                "--enable-scale-out", "--max-num-seqs", "64",
                "--weight-transfer-config", json.dumps({"backend": "fastio"}),
            ],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)  # polling the server's start, with a deadline

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    #: vLLM's greedy 24 tokens after each of PROMPTS on its start-up weights.
    initial: dict[tuple[int, ...], list[int]]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """vLLM's own greedy answer, asked directly."""
        body = {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True},
        }
        req = urllib.request.Request(
            self.url + "/inference/v1/generate", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return list(json.loads(r.read())["choices"][0]["token_ids"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tinyllama")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(model_dir, tmp_path_factory.mktemp("vllm") / "server.log")
    # vLLM's own greedy answers on its start-up (dummy) weights, before any test loads others.
    s.initial = {tuple(p): s.generate(p, 24) for p in PROMPTS}
    yield s
    s.stop()


@pytest.fixture
def workers() -> Iterator[Callable[..., WorkerProc]]:
    started: list[WorkerProc] = []

    def start(url: str, *extra: str) -> WorkerProc:
        w = WorkerProc(
            [
                "--bind", "tcp://127.0.0.1:0", "--engine", "vllm", "--engine-opt", f"url={url}",
                "--engine-opt", "health_interval=0.5", "--engine-opt", "health_timeout=5",
                *extra,
            ]
        )  # fmt: skip
        started.append(w)
        w.wait_ready(120)
        return w

    yield start
    for w in started:
        w.kill()


INPROC_OPTS = {
    "skip_tokenizer_init": "1", "load_format": "dummy", "dtype": "float32",
    "enforce_eager": "1", "max_model_len": "1024", "gpu_memory_utilization": "0.1",
}  # fmt: skip


def inproc_args(model: Path, *extra: str) -> list[str]:
    """A worker running vLLM in its own process (the same engine settings as the server)."""
    args = ["--bind", "tcp://127.0.0.1:0", "--engine", "vllm", "--engine-opt", f"model={model}"]
    for k, v in INPROC_OPTS.items():
        args += ["--engine-opt", f"{k}={v}"]
    return [*args, *extra]


def children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out.update(kids)
            todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def greedy(n: int) -> GenerationHyperparameters:
    # The random model's end token would stop some prompts early: vLLM's ignore_eos is
    # not in the types, so the direct calls ignore it and the prompts avoid it (below).
    return GenerationHyperparameters(max_new_tokens=n, greedy=True)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def hf_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures",)})
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
            pad_token_id=0,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


PROMPTS = [[10 + i, 20 + i, 30 + i, 40] for i in range(8)]


def test_greedy_tokens_equal_vllms_own(server: Server, workers: Callable[..., WorkerProc]) -> None:
    w = workers(server.url)
    assert w.ready
    n = 24

    async def main() -> list[Any]:
        async with FabricClient([w.address], CLIENT) as c:
            return list(
                await asyncio.gather(
                    *(c.agenerate(LLMRequest(input_ids=p, gconfig=greedy(n))) for p in PROMPTS)
                )
            )

    resps = run(main())
    for p, r in zip(PROMPTS, resps, strict=True):
        want = server.initial[tuple(p)]
        got = r.output_tokens.tolist()
        assert got == want[: len(got)] and len(got) in (n, len(want)), (p, got, want)
        assert r.output_versions.tolist() == [0] * len(got)
        assert len(r.output_logprobs) == len(got) and all(
            x <= 0 for x in r.output_logprobs.tolist()
        )


def test_out_of_vocab_stop_token_fails_one_request_and_no_worker(
    server: Server, workers: Callable[..., WorkerProc]
) -> None:
    w = workers(server.url)

    async def main() -> tuple[list[Any], list[Any]]:
        async with FabricClient([w.address], CLIENT) as c:
            bad = LLMRequest(
                input_ids=[1, 2, 3],
                gconfig=GenerationHyperparameters(max_new_tokens=4, stop_token_ids=[5000]),
            )
            # Longer than the server's max_model_len: vLLM refuses it (the worker cannot know).
            long = LLMRequest(input_ids=[7] * 1100, gconfig=greedy(4))
            futs = [c.agenerate(bad), c.agenerate(long)]
            good = [c.agenerate(LLMRequest(input_ids=p, gconfig=greedy(4))) for p in PROMPTS]
            res = await asyncio.gather(*futs, return_exceptions=True)
            return res, list(await asyncio.gather(*good))

    (err, err_long), goods = run(main())
    assert isinstance(err, Exception) and "5000" in str(err), err
    assert isinstance(err_long, Exception) and "1100" in str(err_long), err_long
    assert all(len(r.output_tokens) == 4 for r in goods)
    assert w.proc.poll() is None and server.healthy()


@pytest.mark.timeout(300)
def test_a_worker_idle_past_the_servers_keepalive_is_alive(
    server: Server, workers: Callable[..., WorkerProc]
) -> None:
    w = workers(server.url)

    async def main() -> None:
        async with FabricClient([w.address], CLIENT) as c:
            for i in range(2):
                r = await c.agenerate(LLMRequest(input_ids=PROMPTS[i], gconfig=greedy(4)))
                assert len(r.output_tokens) == 4
                # Idle: vLLM (uvicorn) closes kept connections after 5 s.
                t_end = time.monotonic() + 30
                while time.monotonic() < t_end:
                    await asyncio.sleep(1.0)
                    assert w.proc.poll() is None, "the worker closed itself while idle"
            r = await c.agenerate(LLMRequest(input_ids=PROMPTS[3], gconfig=greedy(4)))
            assert len(r.output_tokens) == 4

    run(main())
    assert w.proc.poll() is None


def _publish_and_update(address: str, pub: WeightPublisher, state: Any, version: int) -> Any:
    with FabricController([address]) as ctl:
        return update_weights(ctl, pub, state, version, timeout=120)


@pytest.mark.parametrize("where", ["bridge", "in-worker"])
def test_pause_keeps_requests_in_place_and_weights_land_between(
    where: str, server: Server, model_dir: Path, workers: Callable[..., WorkerProc]
) -> None:
    """8 x 200 tokens in flight, an update_weights in between: each request completes
    once, not interrupted, its versions from 0 to 1; then greedy output equals
    transformers' with the new weights. Through the bridge, and with vLLM in the worker."""
    port = free_port()
    pub = WeightPublisher(f"tcp://127.0.0.1:{port}")
    inproc: WorkerProc | None = None
    try:
        plugin = (
            "--plugin", "transport.weights.update:subscribe",
            "--plugin-opt", f"weights_endpoint=tcp://127.0.0.1:{port}",
        )  # fmt: skip
        if where == "bridge":
            w = workers(server.url, *plugin)
        else:
            w = inproc = WorkerProc(inproc_args(model_dir, *plugin))
            w.wait_ready(300)
        model = hf_model(seed=7)
        n = 200
        seen: dict[int, int] = {}

        async def main() -> list[Any]:
            async with FabricClient([w.address], CLIENT) as c:
                futs = [
                    c.agenerate(
                        LLMRequest(input_ids=p, gconfig=greedy(n)),
                        on_chunk=lambda t, lp, v, i=i: seen.__setitem__(i, seen.get(i, 0) + len(t)),
                    )
                    for i, p in enumerate(PROMPTS)
                ]
                await asyncio.to_thread(
                    wait_for, lambda: len(seen) == len(PROMPTS), 120, "every request streaming"
                )
                res = await asyncio.to_thread(_publish_and_update, w.address, pub, model, 1)
                assert res.ok, res
                out = list(await asyncio.gather(*futs))
                counts = c.stats
                assert counts.get("resent", 0) == 0 and counts.get("interrupted", 0) == 0, counts
                return out

        resps = run(main())
        for r in resps:
            vers = r.output_versions.tolist()
            assert r.stop_reason in ("length", "stop") and len(vers) == len(r.output_tokens)
            assert vers == sorted(vers) and vers[0] == 0 and vers[-1] == 1, vers
        if where == "bridge":
            assert server.get("/weight_info")["weight_version"] == "1"

        async def after() -> list[Any]:
            async with FabricClient([w.address], CLIENT) as c:
                return list(
                    await asyncio.gather(
                        *(
                            c.agenerate(LLMRequest(input_ids=p, gconfig=greedy(16)))
                            for p in PROMPTS[:4]
                        )
                    )
                )

        for p, r in zip(PROMPTS[:4], run(after()), strict=True):
            got = r.output_tokens.tolist()
            assert got == hf_greedy(model, p, 16)[: len(got)], p
            assert set(r.output_versions.tolist()) == {1}
    finally:
        pub.close()
        if inproc is not None:
            inproc.kill()


def test_a_version_vllm_refuses_leaves_it_paused_until_a_whole_one_lands(
    server: Server, workers: Callable[..., WorkerProc]
) -> None:
    port = free_port()
    pub = WeightPublisher(f"tcp://127.0.0.1:{port}")
    try:
        w = workers(
            server.url, "--plugin", "transport.weights.update:subscribe",
            "--plugin-opt", f"weights_endpoint=tcp://127.0.0.1:{port}",
        )  # fmt: skip
        good = hf_model(seed=11)
        state = dict(good.state_dict())
        # A tensor vLLM refuses, after others loaded: the weights would be mixed.
        state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
        base = server.get("/weight_info")["weight_version"]
        with FabricController([w.address]) as ctl:
            res = update_weights(ctl, pub, state, 50, timeout=120, strict=False)
            assert not res.ok and res.failed, res
            assert server.get("/weight_info")["weight_version"] == base
            assert server.get("/is_paused")["is_paused"] is True  # never serves a mix
            status = ctl.health()
            assert all(s.version == -1 and s.paused for s in status.values()), status
            res = update_weights(ctl, pub, good, 51, timeout=120)
            assert res.ok, res
        assert server.get("/weight_info")["weight_version"] == "51"
        assert server.get("/is_paused")["is_paused"] is False

        async def after() -> Any:
            async with FabricClient([w.address], CLIENT) as c:
                return await c.agenerate(LLMRequest(input_ids=PROMPTS[0], gconfig=greedy(12)))

        r = run(after())
        got = r.output_tokens.tolist()
        assert got == hf_greedy(good, PROMPTS[0], 12)[: len(got)]
        assert set(r.output_versions.tolist()) == {51}
    finally:
        pub.close()


def test_vllm_in_the_worker_equals_vllms_server_and_dies_with_the_worker(
    server: Server, model_dir: Path
) -> None:
    """Greedy tokens equal the server's (same engine, same dummy weights); a cancelled
    request stops and the worker serves on; a bad option fails the start with vLLM's
    message; ``kill -9`` of the worker leaves no vLLM process behind."""
    bad = subprocess.run(
        [sys.executable, "-m", "transport.worker", *inproc_args(model_dir, "--engine-opt", "no_such_option=1")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown vLLM engine option 'no_such_option'" in bad.stderr
    w = WorkerProc(inproc_args(model_dir))
    try:
        w.wait_ready(300)
        kids = children(w.pid)
        assert kids, "vLLM's engine core runs in a process of its own"
        n = 24

        async def main() -> list[Any]:
            async with FabricClient([w.address], CLIENT) as c:
                slow = c.agenerate(LLMRequest(input_ids=[5, 6, 7], gconfig=greedy(900)))
                out = list(
                    await asyncio.gather(
                        *(c.agenerate(LLMRequest(input_ids=p, gconfig=greedy(n))) for p in PROMPTS)
                    )
                )
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow
                out.append(await c.agenerate(LLMRequest(input_ids=PROMPTS[0], gconfig=greedy(n))))
            # Not streamed: vLLM's final output only, the same tokens.
            async with FabricClient(
                [w.address], msgspec.structs.replace(CLIENT, stream=False)
            ) as c:
                out.append(await c.agenerate(LLMRequest(input_ids=PROMPTS[1], gconfig=greedy(n))))
            return out

        resps = run(main())
        for p, r in zip([*PROMPTS, PROMPTS[0], PROMPTS[1]], resps, strict=True):
            want = server.initial[tuple(p)]  # the same dummy weights as the worker's vLLM
            got = r.output_tokens.tolist()
            assert got == want[: len(got)] and len(got) in (n, len(want)), (p, got, want)
            assert r.output_versions.tolist() == [0] * len(got)
    finally:
        w.kill()
    wait_for(lambda: not any(alive(k) for k in kids), 60, "vLLM's processes gone")


def test_a_corrupted_bucket_never_reaches_vllm(
    server: Server, workers: Callable[..., WorkerProc]
) -> None:
    """A version one of whose buckets fails its checksum on the way is never staged for
    vLLM: its label and its weights stay, and the worker serves on (the same path as a
    trainer killed mid-version: no complete version, nothing loaded)."""
    from tests.transport.weights.helpers import corrupting_bucket_1

    with corrupting_bucket_1({60}) as pub:
        w = workers(
            server.url, "--plugin", "transport.weights.update:subscribe",
            "--plugin-opt", f"weights_endpoint={pub.endpoint}",
        )  # fmt: skip

        async def ask() -> list[int]:
            async with FabricClient([w.address], CLIENT) as c:
                r = await c.agenerate(LLMRequest(input_ids=PROMPTS[2], gconfig=greedy(12)))
                return list(r.output_tokens.tolist())

        before, label = run(ask()), server.get("/weight_info")["weight_version"]
        pub.wait_for_workers(1, 60)
        res = pub.wait(pub.publish(hf_model(seed=13), 60).version, 60)
        assert not res.applied and res.failed, res
        assert "checksum" in next(iter(res.failed.values()))
        assert server.get("/weight_info")["weight_version"] == label
        assert server.get("/is_paused")["is_paused"] is False
        assert run(ask()) == before  # the old weights, whole, still served
