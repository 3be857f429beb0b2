"""The transformers engine: real models, compared with a plain argmax loop on the same
weights; in-process for the engine's own behaviour, in real worker processes for the
fabric and the weight subscriber."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import wait_for
from transport import FabricClient, FabricController, SyncFabricClient
from transport.demo import hf_worker_args as demo_worker_args
from transport.hf_engine import (
    MODEL_SIZES,
    HFEngine,
    build_model,
    create_engine,
    factory,
)
from transport.weights import WeightPublisher, update_weights

G = GenerationHyperparameters
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [200, 3, 17, 90]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """As in a worker process: two intra-op threads per forward on a loaded 2-core
    machine spin against each other (20x slower forwards of the tiny model)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_model("tiny", seed=0)


def argmax_loop(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The reference: no cache, no batch, the whole sequence through the model per token."""
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            t = int(torch.argmax(logits))
            toks.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return toks, lps


def step_logits(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Logits (len(out), vocab) that produced each token of ``out`` (teacher forcing)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]


@pytest.fixture
def engine(tiny: torch.nn.Module) -> Iterator[HFEngine]:
    eng = HFEngine(build_model("tiny", seed=0), device="cpu")
    yield eng
    eng.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def req(prompt: list[int], **g: Any) -> LLMRequest:
    return LLMRequest(input_ids=prompt, gconfig=G(**g))


class FakeCtx:
    """What the engine reads of a worker's RequestContext."""

    def __init__(self) -> None:
        self.interrupted = False
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)


# -- in process -----------------------------------------------------------------------
def test_greedy_equals_an_argmax_loop_on_the_same_weights(
    engine: HFEngine, tiny: torch.nn.Module
) -> None:
    ctxs = [FakeCtx() for _ in PROMPTS]

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(
                engine.generate(req(p, max_new_tokens=12, greedy=True), c)
                for p, c in zip(PROMPTS, ctxs, strict=True)
            )
        )

    for p, r, c in zip(PROMPTS, run(main()), ctxs, strict=True):
        toks, lps = argmax_loop(tiny, p, 12)
        assert r.output_tokens.array.tolist() == toks
        np.testing.assert_allclose(r.output_logprobs.array, lps, atol=1e-4)
        assert r.stop_reason == "length"
        assert c.tokens == toks, "streamed tokens differ from the result"
        assert r.output_versions.array.tolist() == [0] * 12


def test_stop_tokens_end_the_output_and_min_new_tokens_bans_them(
    engine: HFEngine, tiny: torch.nn.Module
) -> None:
    toks, _ = argmax_loop(tiny, PROMPTS[0], 8)
    stop = toks[3]
    first = toks.index(stop)
    r = run(engine.generate(req(PROMPTS[0], max_new_tokens=8, greedy=True, stop_token_ids=[stop])))
    assert r.stop_reason == "stop"
    assert r.output_tokens.array.tolist() == toks[: first + 1]
    r = run(
        engine.generate(
            req(PROMPTS[0], max_new_tokens=8, greedy=True, stop_token_ids=[stop],
                min_new_tokens=first + 2)
        )
    )  # fmt: skip
    assert stop not in r.output_tokens.array.tolist()[: first + 2]
    assert r.output_len >= first + 2


@pytest.mark.parametrize("n", [1, 2, 17])
def test_max_new_tokens(engine: HFEngine, n: int) -> None:
    r = run(engine.generate(req([3, 4], max_new_tokens=n)))
    assert r.output_len == n and r.stop_reason == "length"


def test_sampling_parameters_are_honoured(engine: HFEngine, tiny: torch.nn.Module) -> None:
    p = PROMPTS[1]
    greedy, _ = argmax_loop(tiny, p, 10)
    # top_k=1 and a tiny top_p leave only the argmax.
    for g in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-6), dict(temperature=0.0)):
        r = run(engine.generate(req(p, max_new_tokens=10, **g)))
        assert r.output_tokens.array.tolist() == greedy, g
    # So do the degenerate 0s that construction refuses, set afterwards (the engine
    # must not rely on validation).
    for name in ("top_p", "top_k"):
        odd = req(p, max_new_tokens=10)
        setattr(odd.gconfig, name, 0)
        assert run(engine.generate(odd)).output_tokens.array.tolist() == greedy, name
    # top_k=3 at temperature 2: every token among the 3 most likely of its step, and
    # its logprob is under the temperature-scaled distribution.
    for _ in range(3):
        r = run(engine.generate(req(p, max_new_tokens=20, top_k=3, temperature=2.0)))
        out = r.output_tokens.array.tolist()
        logits = step_logits(tiny, p, out)
        top3 = torch.topk(logits, 3, -1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(out)), out
        want = torch.log_softmax(logits / 2.0, -1)[torch.arange(len(out)), torch.tensor(out)]
        np.testing.assert_allclose(r.output_logprobs.array, want.numpy(), atol=1e-4)
    # top_p=0.5: every token inside the nucleus of its step.
    r = run(engine.generate(req(p, max_new_tokens=20, top_p=0.5)))
    out = r.output_tokens.array.tolist()
    probs = torch.softmax(step_logits(tiny, p, out), -1)
    for i, t in enumerate(out):
        above = probs[i][probs[i] > probs[i][t]].sum()
        assert above < 0.5, (i, t, float(above))
    # Sampling differs between generations, and metadata["seed"] makes it repeatable.
    outs = {
        tuple(run(engine.generate(req(p, max_new_tokens=16))).output_tokens.array.tolist())
        for _ in range(4)
    }
    assert len(outs) > 1
    seeded = [
        LLMRequest(input_ids=p, gconfig=G(max_new_tokens=16), metadata={"seed": 7})
        for _ in range(2)
    ]
    a, b = (run(engine.generate(s)).output_tokens.array.tolist() for s in seeded)
    assert a == b


def test_concurrent_requests_share_forwards(tiny: torch.nn.Module) -> None:
    eng = HFEngine(build_model("tiny", seed=0), device="cpu")
    try:
        n, new = 8, 24

        async def main() -> list[Any]:
            # Held between steps while the n requests are queued: the engine thread wakes
            # on the first, so it may take that one alone, but the other n - 1 wait for
            # the next step together (without the hold, a loaded machine can spread them
            # over several steps, each with a prefill of its own).
            with eng.hold():
                tasks = [
                    asyncio.ensure_future(engine_req(eng, [i + 1, i + 2, i + 3], new))
                    for i in range(n)
                ]
                await asyncio.sleep(0)  # one turn of the loop: each task queues its request
            return await asyncio.gather(*tasks)

        rs = run(main())
        assert all(r.output_len == new for r in rs)
        # One request after the other would take n * new forwards; batched, at most two
        # prefills (the first request alone, then the others) beside new - 1 decodes.
        assert eng.stats["max_batch_seen"] == n, eng.stats
        assert eng.stats["forwards"] <= new + 2, eng.stats
        for i, r in enumerate(rs):
            toks, _ = argmax_loop(tiny, [i + 1, i + 2, i + 3], new)
            assert r.output_tokens.array.tolist() == toks
    finally:
        eng.close()


async def engine_req(eng: HFEngine, p: list[int], n: int) -> Any:
    return await eng.generate(req(p, max_new_tokens=n, greedy=True))


def test_max_batch_bounds_the_batch_and_late_requests_join(tiny: torch.nn.Module) -> None:
    eng = HFEngine(build_model("tiny", seed=0), device="cpu", max_batch=3)
    try:

        async def main() -> list[Any]:
            first = [asyncio.ensure_future(engine_req(eng, [7, 8], 30)) for _ in range(2)]
            # Join while the first two decode (continuous batching).
            while eng.stats["decodes"] < 3:
                await asyncio.sleep(0.001)
            late = [asyncio.ensure_future(engine_req(eng, [9, i], 10)) for i in range(4)]
            return await asyncio.gather(*first, *late)

        rs = run(main())
        assert [r.output_len for r in rs] == [30, 30, 10, 10, 10, 10]
        assert eng.stats["max_batch_seen"] == 3, eng.stats
        toks, _ = argmax_loop(tiny, [9, 2], 10)
        assert rs[4].output_tokens.array.tolist() == toks
    finally:
        eng.close()


def test_interrupt_ends_between_steps_with_the_tokens_so_far(engine: HFEngine) -> None:
    ctx = FakeCtx()

    async def main() -> Any:
        task = asyncio.ensure_future(engine.generate(req([1, 2, 3], max_new_tokens=4000), ctx))
        while len(ctx.tokens) < 5:
            await asyncio.sleep(0.001)
        ctx.interrupted = True
        return await task

    r = run(main())
    assert r.stop_reason == "interrupt"
    assert 5 <= r.output_len < 4000
    assert r.output_tokens.array.tolist() == ctx.tokens
    # An interrupted worker starts nothing: a new request ends at once, empty.
    r = run(engine.generate(req([1, 2, 3], max_new_tokens=10), ctx))
    assert r.stop_reason == "interrupt" and r.output_len == 0


def test_a_cancelled_request_returns_once_the_engine_let_go(engine: HFEngine) -> None:
    ctx = FakeCtx()

    async def main() -> None:
        task = asyncio.ensure_future(engine.generate(req([1, 2], max_new_tokens=4000), ctx))
        while len(ctx.tokens) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # By the time the handler ended, the engine thread has dropped the sequence.
        assert engine._batch.seqs == []
        with engine.hold():
            assert engine._batch.seqs == []

    run(main())
    assert run(engine.generate(req([1, 2], max_new_tokens=3))).output_len == 3


def test_weights_copied_in_place_change_the_output(engine: HFEngine) -> None:
    new = build_model("tiny", seed=1)
    before = run(engine.generate(req(PROMPTS[1], max_new_tokens=10, greedy=True)))
    with engine.hold(), torch.no_grad():
        target = engine.model.state_dict()
        for name, t in new.state_dict().items():
            target[name].copy_(t)
        engine.version = 1
    after = run(engine.generate(req(PROMPTS[1], max_new_tokens=10, greedy=True)))
    assert after.output_tokens.array.tolist() == argmax_loop(new, PROMPTS[1], 10)[0]
    assert after.output_tokens.array.tolist() != before.output_tokens.array.tolist()
    assert after.output_versions.array.tolist() == [1] * 10


def test_weight_left_linears_change_no_result_and_no_parameter(tiny: torch.nn.Module) -> None:
    plain = HFEngine(build_model("tiny", seed=0), device="cpu", weight_left=False)
    left = HFEngine(build_model("tiny", seed=0), device="cpu", weight_left=True)
    try:
        a, b = (
            run(e.generate(req(PROMPTS[1], max_new_tokens=12, greedy=True))) for e in (plain, left)
        )
        assert a.output_tokens.array.tolist() == b.output_tokens.array.tolist()
        np.testing.assert_allclose(a.output_logprobs.array, b.output_logprobs.array, atol=1e-4)
        assert list(left.model.state_dict()) == list(tiny.state_dict())
    finally:
        plain.close()
        left.close()


def test_bad_input_is_refused_and_the_engine_keeps_serving(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="input ids"):
        run(engine.generate(req([1, 999999], max_new_tokens=3)))
    r = run(engine.generate(req([], max_new_tokens=3)))  # an empty prompt starts from BOS
    assert r.output_len == 3
    none = req([1], max_new_tokens=1)
    none.gconfig.max_new_tokens = 0  # refused at construction; set afterwards
    assert run(engine.generate(none)).output_len == 0


def test_create_engine_takes_strings_and_refuses_unknowns() -> None:
    eng = create_engine("tiny", seed="3", device="cpu", max_batch="4", arch="qwen2",
                        token_interval="0")  # fmt: skip
    try:
        assert eng.max_batch == 4 and type(eng.model).__name__ == "Qwen2ForCausalLM"
        assert run(eng.generate(req([1, 2], max_new_tokens=2))).output_len == 2
    finally:
        eng.close()
    with pytest.raises(ValueError, match="model size"):
        create_engine("huge")
    with pytest.raises(ValueError, match="option"):
        create_engine("tiny", batch="3")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        create_engine(model_path="/nonexistent/model")
    # The worker's --plugin-opt dict also holds other plugins' options.
    eng = factory({"model_size": "tiny", "device": "cpu", "weights_endpoint": "tcp://x:1"})
    eng.close()
    assert set(MODEL_SIZES) == {"tiny", "small", "medium", "large"}


def test_from_pretrained_on_a_local_directory(tmp_path: Any, tiny: torch.nn.Module) -> None:
    tiny.save_pretrained(tmp_path)  # type: ignore[operator]
    eng = create_engine(model_path=str(tmp_path), device="cpu")
    try:
        r = run(eng.generate(req(PROMPTS[0], max_new_tokens=6, greedy=True)))
        assert r.output_tokens.array.tolist() == argmax_loop(tiny, PROMPTS[0], 6)[0]
    finally:
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_equals_an_argmax_loop_on_the_device() -> None:
    model = build_model("tiny", seed=0).to("cuda")
    eng = HFEngine(build_model("tiny", seed=0), device="cuda")
    try:
        rs = run(asyncio.gather(*(engine_req(eng, p, 8) for p in PROMPTS)))
        for p, r in zip(PROMPTS, rs, strict=True):
            ids = list(p)
            with torch.no_grad():
                for t in r.output_tokens.array.tolist():
                    logits = model(torch.tensor([ids], device="cuda")).logits[0, -1]
                    assert int(torch.argmax(logits)) == t
                    ids.append(t)
        assert eng.stats["max_batch_seen"] >= 2
    finally:
        eng.close()


# -- in real worker processes -------------------------------------------------------------
def hf_worker_args(*extra: str, **opts: Any) -> list[str]:
    """A worker serving the tiny model on CPU, whichever way this worker CLI takes it."""
    return ["--bind", "tcp://127.0.0.1:0", *demo_worker_args("tiny", device="cpu", **opts), *extra]


@pytest.mark.slow
def test_a_worker_serves_the_model_and_streams(
    spawn: Callable[..., Any], tiny: torch.nn.Module
) -> None:
    w = spawn(*hf_worker_args(), wait=False)
    w.wait_ready(90)
    chunks: list[int] = []
    lock = threading.Lock()

    def on_chunk(tokens: Any, *_: Any) -> None:
        with lock:
            chunks.extend(tokens.array.tolist())

    with SyncFabricClient([w.address]) as client:
        futs = [client.submit(req(p, max_new_tokens=10, greedy=True)) for p in PROMPTS]
        rs = [f.result(60) for f in futs]
        for p, r in zip(PROMPTS, rs, strict=True):
            assert r.output_tokens.array.tolist() == argmax_loop(tiny, p, 10)[0]

    async def streamed() -> Any:
        async with FabricClient([w.address]) as c:
            return await c.agenerate(
                req(PROMPTS[1], max_new_tokens=10, greedy=True), on_chunk=on_chunk
            )

    r = asyncio.run(streamed())
    assert chunks == r.output_tokens.array.tolist()
    # Bad input: an error reply, and the worker keeps serving.
    with SyncFabricClient([w.address]) as client:
        with pytest.raises(Exception, match="input ids"):
            client.generate(req([1, 10**6], max_new_tokens=2), timeout=30)
        assert client.generate(req([1], max_new_tokens=2), timeout=30).output_len == 2


@pytest.mark.slow
def test_a_worker_pause_interrupts_and_the_client_completes_the_rest(
    spawn: Callable[..., Any], tiny: torch.nn.Module
) -> None:
    w = spawn(*hf_worker_args(token_interval=0.01), wait=False)
    w.wait_ready(90)
    with FabricController([w.address]) as ctl, SyncFabricClient([w.address]) as client:
        fut = client.submit(req(PROMPTS[0], max_new_tokens=200, greedy=True))
        wait_for(lambda: any(s.running for s in ctl.health(5).values()), 30, "a generation")
        ctl.pause(30)  # returns once no handler runs: the engine was interrupted
        assert all(s.running == 0 for s in ctl.health(5).values())
        ctl.resume(30)
        r = fut.result(120)
        assert client.client.stats["interrupted"] >= 1, "the pause did not interrupt it"
    assert r.output_len == 200
    assert r.output_tokens.array.tolist() == argmax_loop(tiny, PROMPTS[0], 200)[0]


@pytest.mark.slow
def test_the_weight_subscriber_updates_the_engine_in_place(spawn: Callable[..., Any]) -> None:
    pub = WeightPublisher("tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1)
    try:
        w = spawn(
            *hf_worker_args(
                "--worker-id", "w", "--plugin", "transport.weights.update:subscribe",
                "--plugin-opt", f"weights_endpoint={pub.endpoint}",
                "--plugin-opt", "weights_shm=0",
            ),
            wait=False,
        )  # fmt: skip
        w.wait_ready(90)
        pub.wait_for_workers(1, 60)
        new = build_model("tiny", seed=5)
        with FabricController([w.address]) as ctl, SyncFabricClient([w.address]) as client:
            before = client.generate(req(PROMPTS[2], max_new_tokens=8, greedy=True), timeout=60)
            assert before.output_versions.array.tolist() == [0] * 8
            res = update_weights(ctl, pub, new, 1, timeout=60)
            assert res.ok, res
            after = client.generate(req(PROMPTS[2], max_new_tokens=8, greedy=True), timeout=60)
        assert after.output_tokens.array.tolist() == argmax_loop(new, PROMPTS[2], 8)[0]
        assert after.output_tokens.array.tolist() != before.output_tokens.array.tolist()
        assert after.output_versions.array.tolist() == [1] * 8
    finally:
        pub.close()
