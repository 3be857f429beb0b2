"""AReaL's rollout side over the fabric: the real ``areal`` package (1.0.x) driving
``transport.areal.FabricInferenceEngine`` against worker processes that serve the
``hf`` engine (a tiny random-weight model), with a tokenizer built here.

Installed by ``.ci/areal.sh`` (areal without its dependency tree); skipped where
``areal`` is absent.
"""

from __future__ import annotations

import asyncio
import itertools
import string
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("areal")
pytest.importorskip("transformers")

import torch
from areal.api.cli_args import GenerationHyperparameters as AGen
from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from areal.workflow.rlvr import RLVRWorkflow

from fastio import LLMRequest
from tests.transport.conftest import WorkerProc, await_for, wait_for
from transport import ClientClosed, ClientConfig, FabricController
from transport.areal import FabricInferenceEngine, disk_root, save_for_rollout, to_llm_request
from transport.areal.loops import LoopClients
from transport.demo import hf_worker_args
from transport.hf_engine import build_model
from transport.weights import WeightPublisher, WeightUpdateError

PAD, EOS = 0, 1
DATA = [
    {"messages": [{"role": "user", "content": "what is 1+1?"}], "answer": "2"},
    {"messages": [{"role": "user", "content": "say hi"}], "answer": "hi"},
    {"messages": [{"role": "user", "content": "count: 1 2 3"}], "answer": "4"},
]


def make_tokenizer() -> Any:
    """A character-level tokenizer over the tiny model's 256 ids, built locally."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + " .,:;?!'+-=*<>|/\n"
    toks = ["<pad>", "<eos>", "<unk>", *chars]
    toks += [f"[{i}]" for i in range(256 - len(toks))]
    tk = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=[], unk_token="<unk>")
    )
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def reward(
    prompt: str, completion: str, prompt_ids: Any, completion_ids: Any, **data: Any
) -> float:
    """Our own reward: the share of letters in the completion, plus 1 for the answer."""
    letters = sum(c.isalpha() for c in completion) / max(1, len(completion))
    return letters + (1.0 if data["answer"] in completion else 0.0)


def greedy(
    model: torch.nn.Module, prompt: list[int], n: int, stops: tuple[int, ...] = (PAD, EOS)
) -> list[int]:
    """The reference: argmax over the whole sequence per token, stop token included."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(torch.argmax(model(torch.tensor([ids])).logits[0, -1]))
            out.append(t)
            ids.append(t)
            if t in stops:
                break
    return out


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def model0() -> torch.nn.Module:
    return build_model("tiny", seed=0)


@pytest.fixture
def workers() -> Iterator[Callable[..., WorkerProc]]:
    """``start(*extra_args, **engine_opts)``: a worker serving the tiny model on CPU."""
    procs: list[WorkerProc] = []

    def start(*extra: str, **opts: Any) -> WorkerProc:
        w = WorkerProc(
            [
                "--bind",
                "tcp://127.0.0.1:0",
                *hf_worker_args("tiny", device="cpu", threads=1, **opts),
                *extra,
            ]
        )
        procs.append(w)
        w.wait_ready(120)
        return w

    yield start
    for w in procs:
        w.kill()


def make_engine(addresses: list[str], **kw: Any) -> FabricInferenceEngine:
    config = InferenceEngineConfig(
        backend="fastio:d1", max_concurrent_rollouts=8, consumer_batch_size=4,
        max_head_offpolicyness=100, setup_timeout=60, request_timeout=120,
    )  # fmt: skip
    engine = FabricInferenceEngine(config, weights_timeout=kw.pop("weights_timeout", 60.0), **kw)
    engine.initialize(addr=addresses, train_data_parallel_size=1)
    return engine


def workflow(tok: Any, n: int = 8) -> RLVRWorkflow:
    return RLVRWorkflow(
        reward_fn=reward, gconfig=AGen(max_new_tokens=n, greedy=True), tokenizer=tok
    )


def check_trajectory(
    traj: dict[str, torch.Tensor], tok: Any, model: torch.nn.Module, version: int, n: int = 8
) -> None:
    """One RLVR trajectory: the prompt, the model's greedy output, its version, and
    our reward of the decoded completion."""
    ids = traj["input_ids"][0].tolist()
    mask = traj["loss_mask"][0].tolist()
    plen = mask.index(1)
    prompt, out = ids[:plen], ids[plen:]
    assert out == greedy(model, prompt, n), "not the served model's greedy output"
    assert traj["versions"][0].tolist() == [-1] * plen + [version] * len(out)
    assert traj["logprobs"][0, :plen].eq(0).all() and traj["logprobs"][0, plen:].lt(0).all()
    assert traj["attention_mask"].all()
    data = next(
        d for d in DATA if tok.decode(prompt).startswith(f"<|user|>{d['messages'][0]['content']}")
    )
    expect = reward(tok.decode(prompt), tok.decode(out), prompt, out, **data)
    assert traj["rewards"].item() == pytest.approx(expect)


# -- without workers ----------------------------------------------------------------------
def test_model_request_becomes_an_llm_request_and_refuses_what_it_cannot_carry() -> None:
    g = AGen(max_new_tokens=50, max_tokens=20, greedy=True, top_k=-1, stop_token_ids=[1])
    g.stop_token_ids.append(None)  # what new_with_stop_and_pad_token_ids adds without a pad
    req = ModelRequest(rid="r1", input_ids=[5, 6, 7], gconfig=g, metadata={"seed": 3})
    out = to_llm_request(req)
    assert out.rid == "r1" and out.input_ids.tolist() == [5, 6, 7]
    assert out.gconfig.max_new_tokens == 17  # capped by max_tokens - prompt, as AReaL does
    assert out.gconfig.greedy and out.gconfig.stop_token_ids == [1]
    assert out.gconfig.top_k == type(out.gconfig)().top_k and out.metadata == {"seed": 3}
    for bad, match in (
        (dict(gconfig=AGen(n_samples=2)), "n_samples"),
        (dict(gconfig=AGen(stop=["\n"])), "stop strings"),
        (dict(image_data=["aGk="]), "image"),
        (dict(gconfig=AGen(temperature=-1.0)), "cannot be sent"),
    ):
        with pytest.raises(ValueError, match=match):
            to_llm_request(ModelRequest(input_ids=[1, 2], **bad))
    with pytest.raises(RuntimeError, match="non-positive"):
        to_llm_request(ModelRequest(input_ids=[1] * 5, gconfig=AGen(max_tokens=5)))


def test_disk_root_undoes_arealss_per_version_path(tmp_path: Path) -> None:
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "weight_update"))
    assert disk_root(meta) == disk_root(meta.with_version(7)) == tmp_path / "weight_update"
    with pytest.raises(ValueError, match="disk"):
        disk_root(WeightUpdateMeta(type="xccl"))


def test_initialize_names_a_worker_that_does_not_answer() -> None:
    import socket

    from transport import ControlError

    with socket.socket() as s:  # a free port, no worker behind it
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    config = InferenceEngineConfig(backend="fastio:d1", setup_timeout=0.5)
    engine = FabricInferenceEngine(config)
    with pytest.raises(ControlError, match=f"tcp://{addr}"):
        engine.initialize(addr=[addr])
    assert not engine.initialized and engine.controller is None
    with pytest.raises(RuntimeError, match="not initialized"):
        asyncio.run(engine.agenerate(ModelRequest(input_ids=[1])))


def _nobody() -> str:
    """A loopback address with no worker behind it (a client to it waits)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_each_event_loop_gets_its_own_client_closed_with_that_loop() -> None:
    clients = LoopClients([_nobody()], ClientConfig())
    try:

        async def use() -> tuple[Any, Any, dict[Any, Any]]:
            first, again = await clients.get(), await clients.get()
            return first, again, clients.snapshot()

        c1, again, seen = asyncio.run(use())
        assert again is c1 and list(seen.values()) == [c1]
        # asyncio.run's shutdown of async generators closed it with its loop.
        assert clients.snapshot() == {} and c1.workers == []

        # A loop closed without that shutdown (as AReaL's executor closes its own): its
        # client goes when the next loop's first request finds it closed.
        loop = asyncio.new_event_loop()
        c2 = loop.run_until_complete(clients.get())
        loop.close()
        assert clients.snapshot() == {loop: c2} and len(c2.workers) == 1

        async def other() -> Any:
            return await clients.get()

        c3 = asyncio.run(other())
        assert c3 is not c2 and c2.workers == [] and clients.snapshot() == {}
    finally:
        clients.close()
    with pytest.raises(RuntimeError, match="not initialized"):
        asyncio.run(other())


def test_clients_of_two_threads_and_close_from_a_third() -> None:
    """Two threads await on loops of their own, each with its client; close() from
    the main thread closes each on its loop: their waiting requests fail with
    ClientClosed there."""
    clients = LoopClients([_nobody()], ClientConfig(connect_timeout=120))
    got: dict[str, Any] = {}
    lock = threading.Lock()

    async def wait_forever(name: str) -> None:
        client = await clients.get()
        fut = client.agenerate(LLMRequest(input_ids=[1, 2]))  # no worker: it waits
        with lock:
            got[name] = (client, threading.get_ident())
        try:
            await fut
        except ClientClosed as exc:
            with lock:
                got[name + ".error"] = (exc, threading.get_ident())

    threads = [threading.Thread(target=asyncio.run, args=(wait_forever(n),)) for n in ("a", "b")]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(clients.snapshot()) == 2 and len(got) == 2, 30, "two clients")
        (ca, ta), (cb, tb) = got["a"], got["b"]
        assert ca is not cb and ta != tb and set(clients.snapshot().values()) == {ca, cb}
        assert ca.pending == cb.pending == 1
        clients.close()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        # Each request failed on its own loop's thread, its client closed.
        assert got["a.error"][1] == ta and got["b.error"][1] == tb
        assert ca.workers == cb.workers == [] and clients.snapshot() == {}
    finally:
        clients.close()
        for t in threads:
            t.join(30)


def test_close_from_inside_a_clients_own_loop() -> None:
    clients = LoopClients([_nobody()], ClientConfig())

    async def use_then_close() -> Any:
        client = await clients.get()
        clients.close()  # e.g. engine.destroy() awaited in a coroutine
        return client

    client = asyncio.run(use_then_close())
    assert client.workers == [] and clients.snapshot() == {}


# -- with worker processes ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(400)  # two process starts of torch + transformers on a loaded machine
def test_an_rlvr_episode_and_pause_over_the_fabric(
    workers: Callable[..., WorkerProc], tok: Any, model0: torch.nn.Module
) -> None:
    w = workers(token_interval=0.02)
    engine = make_engine([w.address])
    try:
        # AReaL's own episode, awaited directly, then through AReaL's executor.
        traj = asyncio.run(workflow(tok).arun_episode(engine, DATA[0]))
        check_trajectory(traj, tok, model0, version=0)
        batch = engine.rollout_batch(DATA, workflow=workflow(tok))
        assert len(batch) == len(DATA)
        for t in batch:
            check_trajectory(t, tok, model0, version=0)
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=[5, 6], tokenizer=tok,
                                                         gconfig=AGen(max_new_tokens=4, greedy=True))))  # fmt: skip
        assert isinstance(resp, ModelResponse) and resp.tokenizer is tok
        assert resp.output_tokens == greedy(model0, [5, 6], 4, stops=())
        assert resp.ttft <= resp.latency < float("inf")

        # pause_generation: every worker paused, a request waits there until
        # continue_generation, then completes.
        with FabricController([w.address]) as ctl:
            engine.pause_generation()
            assert all(s.paused for s in ctl.health(5).values())
            task = engine.submit(DATA[1], workflow=workflow(tok))
            wait_for(
                lambda: sum(s.waiting for s in ctl.health(5).values()) == 1, 30, "a waiting request"
            )
            assert engine.wait(1, timeout=0.2, raise_timeout=False) == []
            engine.continue_generation()
            assert not any(s.paused for s in ctl.health(5).values())
            (t,) = engine.wait(1, timeout=60)
            assert isinstance(task, int)
            check_trajectory(t, tok, model0, version=0)
    finally:
        engine.destroy()


@pytest.mark.slow
@pytest.mark.timeout(400)  # two process starts of torch + transformers on a loaded machine
def test_rollout_batches_around_weight_updates_from_the_publisher(
    workers: Callable[..., WorkerProc], tok: Any, model0: torch.nn.Module
) -> None:
    pub = WeightPublisher("tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1)
    chunks: list[tuple[str, list[int], list[int]]] = []
    lock = threading.Lock()

    def on_chunk(rid: str, tokens: Any, logprobs: Any, versions: Any) -> None:
        with lock:
            chunks.append((rid, tokens.tolist(), versions.tolist()))

    try:
        w = workers(
            "--worker-id", "w", "--plugin", "transport.weights.update:subscribe",
            "--plugin-opt", f"weights_endpoint={pub.endpoint}", "--plugin-opt", "weights_shm=0",
            token_interval=0.05,  # the mid-episode update lands while it generates (3 s)
        )  # fmt: skip
        pub.wait_for_workers(1, 60)
        engine = make_engine([w.address], on_chunk=on_chunk)
        try:
            first = engine.rollout_batch(DATA, workflow=workflow(tok))
            for t in first:
                check_trajectory(t, tok, model0, version=0)

            # AReaL's trainer order: pause, pause_generation, the update's future,
            # the trainer's broadcast (here: fastio's publisher), wait, continue.
            model1 = build_model("tiny", seed=5)
            engine.pause()
            engine.pause_generation()
            fut = engine.update_weights_from_distributed(
                WeightUpdateMeta(type="xccl", version=1), []
            )
            pub.publish(model1, 1)
            fut.result(60)
            engine.set_version(1)
            engine.continue_generation()
            engine.resume()
            second = engine.rollout_batch(DATA, workflow=workflow(tok))
            for t in second:
                check_trajectory(t, tok, model1, version=1)

            # An update in the middle of an episode: the tokens before it carry
            # version 1, those after it version 2, in one trajectory.
            model2 = build_model("tiny", seed=11)
            prompt = next(p for p in ([3 + i, 40, 50] for i in range(60))
                          if PAD not in (g := greedy(model1, p, 60)) and EOS not in g)  # fmt: skip
            long = RLVRWorkflow(
                reward_fn=reward, gconfig=AGen(max_new_tokens=60, greedy=True), tokenizer=tok,
                get_input_ids_fn=lambda *_: list(prompt),
            )  # fmt: skip
            with lock:
                chunks.clear()
            engine.submit(DATA[0], workflow=long)
            wait_for(lambda: sum(len(c[1]) for c in chunks) >= 5, 60, "five streamed tokens")
            engine.pause_generation()
            fut = engine.update_weights_from_distributed(
                WeightUpdateMeta(type="xccl", version=2), []
            )
            pub.publish(model2, 2)
            fut.result(60)
            engine.set_version(2)
            engine.continue_generation()
            (t,) = engine.wait(1, timeout=60)
            out = t["input_ids"][0, len(prompt) :].tolist()
            vers = t["versions"][0, len(prompt) :].tolist()
            k = vers.count(1)
            assert 5 <= k < len(out) and vers == [1] * k + [2] * (len(out) - k), vers
            assert out[:k] == greedy(model1, prompt, k)
            assert out[k:] == greedy(model2, prompt + out[:k], 60 - k)
            # The stream saw every token once, with the same versions.
            assert list(itertools.chain.from_iterable(c[1] for c in chunks)) == out
            assert list(itertools.chain.from_iterable(c[2] for c in chunks)) == vers
        finally:
            engine.destroy()
    finally:
        pub.close()


@pytest.mark.slow
@pytest.mark.timeout(400)  # two process starts of torch + transformers on a loaded machine
def test_rollout_batches_around_a_weight_update_from_disk(
    workers: Callable[..., WorkerProc], tok: Any, model0: torch.nn.Module, tmp_path: Path
) -> None:
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "weight_update"))
    root = disk_root(meta)
    w = workers(
        "--plugin", "transport.weights.disk_follow:follow", "--plugin-opt", f"disk_root={root}"
    )
    engine = make_engine([w.address], weights_timeout=30.0)
    try:
        for t in engine.rollout_batch(DATA, workflow=workflow(tok)):
            check_trajectory(t, tok, model0, version=0)
        # AReaL's FSDPEngine order for disk: pause_generation, the future, the save.
        model1 = build_model("tiny", seed=7)
        v1 = meta.with_version(1)
        engine.pause_generation()
        fut = engine.update_weights_from_disk(v1)
        save_for_rollout(v1, model1)
        fut.result(60)
        engine.set_version(1)
        engine.continue_generation()
        for t in engine.rollout_batch(DATA, workflow=workflow(tok)):
            check_trajectory(t, tok, model1, version=1)

        # A version that does not fit the model is refused by the worker (nothing
        # written), the future says which version each worker holds, and the
        # worker keeps serving version 1.
        bad = {k: v for k, v in model1.state_dict().items() if "layers.1." not in k}
        v2 = meta.with_version(2)
        engine.weights_timeout = 3.0
        fut = engine.update_weights_from_disk(v2)
        save_for_rollout(v2, bad)
        with pytest.raises(WeightUpdateError, match="version 2 not reported"):
            fut.result(60)
        for t in engine.rollout_batch(DATA[:1], workflow=workflow(tok)):
            check_trajectory(t, tok, model1, version=1)
    finally:
        engine.destroy()


@pytest.mark.slow
@pytest.mark.timeout(400)  # a process start of torch + transformers on a loaded machine
def test_agenerate_on_the_callers_loops_from_threads_and_the_executor(
    workers: Callable[..., WorkerProc], tok: Any, model0: torch.nn.Module
) -> None:
    """No thread of the engine's own: each loop that awaits (two threads' asyncio.run,
    AReaL's executor) sends and receives on its own client, at the same time; a
    cancelled task cancels its request on the worker; destroy closes every client."""
    w = workers(token_interval=0.01)
    engine = make_engine([w.address])
    prompts = [[5 + i, 6, 7] for i in range(4)]
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        async def run() -> None:
            reqs = [ModelRequest(input_ids=p, tokenizer=tok, gconfig=AGen(max_new_tokens=6,
                                                                        greedy=True))
                    for p in prompts]  # fmt: skip
            resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
            loop = asyncio.get_running_loop()
            out[k] = ([r.output_tokens for r in resps], engine.fabric_clients.get(loop))

        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)

    try:
        assert engine.fabric_clients == {}  # made by each loop's first request
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        batch = engine.rollout_batch(DATA, workflow=workflow(tok))
        for t in threads:
            t.join(120)
        assert not errors, errors
        expect = [greedy(model0, p, 6, stops=()) for p in prompts]
        assert out[0][0] == out[1][0] == expect
        assert out[0][1] is not None and out[1][1] is not None and out[0][1] is not out[1][1]
        for t in batch:
            check_trajectory(t, tok, model0, version=0)
        # The threads' clients closed with their loops; the executor's stays open.
        (left,) = engine.fabric_clients.values()
        assert left not in (out[0][1], out[1][1]) and len(left.workers) == 1
        assert out[0][1].workers == out[1][1].workers == []

        # Cancelling the awaiting task cancels the request on its worker.
        with FabricController([w.address]) as ctl:

            async def cancel_one() -> None:
                long = ModelRequest(input_ids=[9, 9], gconfig=AGen(max_new_tokens=100000,
                                                                   max_tokens=100002))  # fmt: skip
                task = asyncio.create_task(engine.agenerate(long))
                await await_for(lambda: sum(s.running for s in ctl.health(5).values()) == 1,
                                60, "the request running")  # fmt: skip
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            asyncio.run(cancel_one())
            wait_for(lambda: sum(s.running for s in ctl.health(5).values()) == 0, 60, "cancelled")
    finally:
        engine.destroy()
    assert engine.fabric_clients == {} and left.workers == []
