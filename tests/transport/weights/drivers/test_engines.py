"""What a real engine needs from a weight update, with a transformers causal LM (random
weights from a small config, tied embeddings; nothing is downloaded) as the trainer's
and the workers' model: dtype conversion bit-identical to ``tensor.to(dtype)`` over
shared memory, TCP and disk; tied weights sent once; renaming; a loader hook that fuses
q/k/v as ``model.load_weights`` does; and the worker plugin's options from the CLI.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import bits, make_lm, zeroed
from transport.weights import WeightPublisher, WeightSubscriber
from transport.weights.disk import load_weights, save_weights

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TIED = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def assert_cast_of(worker: Any, trainer: Any, dtype: torch.dtype) -> None:
    got, want = worker.state_dict(), trainer.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == dtype, k
        assert torch.equal(bits(got[k]), bits(want[k].to(dtype))), k


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    things: list[Any] = []

    def add(x: Any) -> Any:
        things.append(x)
        return x

    yield add
    for x in reversed(things):
        x.close()


# -- fp32 trainer -> bf16 workers -------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_fp32_trainer_to_bf16_workers(
    ctx: Any, closing: Callable[[Any], Any], kind: str, shm: bool
) -> None:
    trainer = make_lm(kind, seed=1)
    workers = [zeroed(make_lm(kind, dtype=torch.bfloat16)) for _ in range(2)]
    pub = closing(WeightPublisher(context=ctx, shm=shm, heartbeat_interval=0.1))
    for i, w in enumerate(workers):
        closing(
            WeightSubscriber(
                pub.endpoint, w, context=ctx, shm=shm, dtype="auto", worker_id=f"w{i}"
            ).start()
        )
    pub.wait_for_workers(2, 30)
    wait_for(lambda: {i.dtype for i in pub.workers().values()} == {"bfloat16"}, 10, "Hellos")
    ann = pub.publish(trainer, 1)
    res = pub.wait(1, 60)
    assert res.ok, res
    assert {a.via for a in res.applied.values()} == {"shm" if shm else "tcp"}
    for w in workers:
        assert_cast_of(w, trainer, torch.bfloat16)
    # Every worker wants bf16: the trainer cast while packing (half the bytes), and the
    # tied lm_head travelled once, as an alias of the embedding.
    entries = {e.name: e for b in ann.buckets for e in b.tensors}
    assert ann.aliases == {TIED: EMBED} and TIED not in entries
    assert {e.dtype for e in entries.values()} == {"bfloat16"}
    assert {e.src_dtype for e in entries.values()} == {"float32"}
    params = sum(t.numel() for n, t in trainer.state_dict().items() if n != TIED)
    assert sum(e.nbytes for e in entries.values()) == 2 * params
    # The workers generate what the cast trainer generates.
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = trainer.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(workers[0](ids).logits, ref(ids).logits)


def test_workers_that_want_different_dtypes_cast_on_their_side(
    ctx: Any, closing: Callable[[Any], Any]
) -> None:
    trainer = make_lm(seed=2)
    bf16 = zeroed(make_lm(dtype=torch.bfloat16))
    fp16 = zeroed(make_lm(dtype=torch.float16))
    fp32 = zeroed(make_lm())
    pub = closing(WeightPublisher(context=ctx, shm=False, heartbeat_interval=0.1))
    for i, (m, d) in enumerate(((bf16, "auto"), (fp16, torch.float16), (fp32, None))):
        closing(WeightSubscriber(pub.endpoint, m, context=ctx, dtype=d, worker_id=f"w{i}").start())
    pub.wait_for_workers(3, 30)
    ann = pub.publish(trainer, 1)
    assert pub.wait(1, 60).ok
    assert {e.dtype for b in ann.buckets for e in b.tensors} == {"float32"}  # as held
    assert_cast_of(bf16, trainer, torch.bfloat16)
    assert_cast_of(fp16, trainer, torch.float16)
    assert_cast_of(fp32, trainer, torch.float32)


def test_fp32_trainer_to_bf16_worker_through_disk(tmp_path: Path) -> None:
    trainer = make_lm("qwen2", seed=3)
    path = save_weights(tmp_path, trainer, 7)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert TIED not in set(f.keys())  # stored once
    worker = zeroed(make_lm("qwen2", dtype=torch.bfloat16))
    assert load_weights(tmp_path, worker, dtype="auto") == 7
    assert_cast_of(worker, trainer, torch.bfloat16)
    with pytest.raises(Exception, match="dtype mismatch"):
        load_weights(tmp_path, zeroed(make_lm("qwen2", dtype=torch.bfloat16)))  # no dtype


def test_a_worker_that_wants_wider_than_the_trainer_cast_fails_clearly(
    ctx: Any, closing: Callable[[Any], Any]
) -> None:
    trainer = make_lm(seed=4)
    bf16 = zeroed(make_lm(dtype=torch.bfloat16))
    pub = closing(WeightPublisher(context=ctx, shm=False, heartbeat_interval=0.1))
    closing(WeightSubscriber(pub.endpoint, bf16, context=ctx, dtype="auto", worker_id="a").start())
    pub.wait_for_workers(1, 30)
    wait_for(lambda: pub.workers()["a"].dtype == "bfloat16", 10, "the Hello")
    pub.publish(trainer, 1)  # cast to bf16 by the trainer: the only worker wants it
    late = zeroed(make_lm())  # joins later and wants fp32
    closing(
        WeightSubscriber(pub.endpoint, late, context=ctx, dtype="auto", worker_id="late").start()
    )
    res = pub.wait(1, 30, workers=["a", "late"])
    assert "a" in res.applied
    assert "cast by the trainer from float32" in res.failed["late"]
    assert all(not p.any() for p in late.parameters())  # untouched


# -- renaming and the loader hook ------------------------------------------------------
STACKED = [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)]


class FusedEngine:
    """An engine that keeps q/k/v as one fused parameter per layer, as vLLM does, and
    takes weights through ``load_weights(iterable of (name, tensor))``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.model = zeroed(make_lm(dtype=dtype))
        self.params: dict[str, torch.Tensor] = {}
        for name, p in self.model.state_dict().items():
            if any(f".{s}." in name for s, _ in STACKED):
                continue
            self.params[name] = p
        attn = self.model.model.layers[0].self_attn
        self.q, self.kv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        hidden = attn.q_proj.weight.shape[1]
        for i, _ in enumerate(self.model.model.layers):
            self.params[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.zeros(
                self.q + 2 * self.kv, hidden, dtype=dtype
            )
        self.seen: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        bounds = {0: (0, self.q), 1: (self.q, self.q + self.kv), 2: (self.q + self.kv, None)}
        for name, t in weights:
            self.seen.append(name)
            for shard, idx in STACKED:
                if f".{shard}." in name:
                    dst = self.params[name.replace(shard, "qkv_proj")]
                    lo, hi = bounds[idx]
                    dst[lo:hi].copy_(t)
                    break
            else:
                self.params[name].copy_(t)


def fsdp_to_engine(name: str) -> str | None:
    """Trainer names carry FSDP's prefix; its flat-param bookkeeping is not a weight."""
    if name.endswith("._flat_param_meta"):
        return None
    return name.removeprefix("_fsdp_wrapped_module.")


def test_a_loader_fuses_qkv_from_renamed_bf16_weights(
    ctx: Any, closing: Callable[[Any], Any]
) -> None:
    trainer = make_lm(seed=5)
    state = {f"_fsdp_wrapped_module.{k}": v for k, v in trainer.state_dict().items()}
    state["_fsdp_wrapped_module._flat_param_meta"] = torch.zeros(3)
    engine = FusedEngine(torch.bfloat16)
    pub = closing(WeightPublisher(context=ctx, heartbeat_interval=0.1))
    sub = closing(
        WeightSubscriber(
            pub.endpoint,
            None,
            context=ctx,
            dtype=torch.bfloat16,
            rename=fsdp_to_engine,
            loader=engine.load_weights,
        ).start()
    )
    pub.wait_for_workers(1, 30)
    assert pub.publish_and_wait(state, 1, timeout=60).ok
    assert sub.version == 1 and sub.consistent
    want = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    for i in range(2):
        pre = f"model.layers.{i}.self_attn."
        fused = torch.cat([want[pre + f"{s}.weight"] for s, _ in STACKED])
        assert torch.equal(bits(engine.params[pre + "qkv_proj.weight"]), bits(fused))
    for name, p in engine.params.items():
        if "qkv_proj" not in name:
            assert torch.equal(bits(p), bits(want[name])), name
    assert TIED in engine.seen and EMBED in engine.seen  # the alias is handed over too
    assert not any("_flat_param_meta" in n for n in engine.seen)


def test_a_loader_that_raises_fails_the_version(ctx: Any, closing: Callable[[Any], Any]) -> None:
    trainer = make_lm(seed=6)
    target = zeroed(make_lm())
    calls: list[int] = []

    def loader(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        calls.append(len(list(weights)))
        if len(calls) == 1:
            raise RuntimeError("engine refused (test)")

    pub = closing(WeightPublisher(context=ctx, heartbeat_interval=0.1))
    sub = closing(
        WeightSubscriber(pub.endpoint, target, context=ctx, loader=loader, retries=1).start()
    )
    pub.wait_for_workers(1, 30)
    res = pub.wait(pub.publish(trainer, 1).version, 30)
    assert (
        "the loader raised" in res.failed[sub.worker_id]
        and "engine refused" in res.failed[sub.worker_id]
    )
    assert sub.version == -1 and not sub.consistent
    assert pub.publish_and_wait(make_lm(seed=7), 2, timeout=30).ok
    n = len(trainer.state_dict())  # the tied lm_head included
    assert sub.version == 2 and sub.consistent and calls == [n, n]


# -- the worker plugin from the command line -------------------------------------------
def loader_for_tinylm(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """A CLI loader: ``function(model, weights)``; it copies by name (after the in-place
    copy did the same: it checks that it is handed every tensor)."""
    sd = model.state_dict()
    names = set()
    for name, t in weights:
        sd[name].copy_(t)
        names.add(name)
    assert names == set(sd), names ^ set(sd)


@pytest.mark.parametrize("how", ["json", "callable"])
def test_the_plugin_takes_dtype_rename_loader_and_strict(
    spawn: Callable[..., Any], how: str
) -> None:
    import json

    from fastio import GenerationHyperparameters, LLMRequest
    from transport import FabricController, SyncFabricClient
    from transport.engine import ReferenceEngine, TinyLM

    pub = WeightPublisher(shm=False, heartbeat_interval=0.1)
    try:
        new = TinyLM(seed=3)
        state = {f"trainer.{k}": v.double() for k, v in new.state_dict().items()}
        rename = (
            json.dumps({k: k.removeprefix("trainer.") for k in state})
            if how == "json"
            else "tests.transport.weights.drivers.test_engines:strip_trainer"
        )
        w = spawn(
            "--bind", "tcp://127.0.0.1:0", "--worker-id", "gen",
            "--plugin", "transport.weights.update:subscribe",
            "--plugin-opt", f"weights_endpoint={pub.endpoint}",
            "--plugin-opt", "weights_shm=0",
            "--plugin-opt", "weights_dtype=auto",
            "--plugin-opt", f"weights_rename={rename}",
            "--plugin-opt", "weights_strict=1",
            "--plugin-opt", "weights_loader=tests.transport.weights.drivers.test_engines:loader_for_tinylm",
        )  # fmt: skip
        pub.wait_for_workers(1, 30)
        res = pub.publish_and_wait(state, 1, timeout=30)
        assert list(res.applied) == ["gen"]
        req = LLMRequest(
            rid="r",
            input_ids=[1, 2, 3],
            gconfig=GenerationHyperparameters(max_new_tokens=6, greedy=True),
        )
        with FabricController([w.address]) as ctl:
            wait_for(lambda: {s.version for s in ctl.health().values()} == {1}, 10, "v1")
        with SyncFabricClient([w.address]) as client:
            got = client.generate(req)
        import asyncio

        import numpy as np

        local = asyncio.run(ReferenceEngine(model=new).generate(req))
        assert np.array_equal(got.output_tokens.array, local.output_tokens.array)
    finally:
        pub.close()


def strip_trainer(name: str) -> str:
    return name.removeprefix("trainer.")


def _versioned(seen: list[Any]) -> dict[str, Any]:
    """Loaders of each shape a user writes: ``version`` positional, keyword-only, none,
    and a partial; each records what it was given."""

    def positional(weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        seen.append((len(list(weights)), version))

    def keyword(weights: Iterable[tuple[str, torch.Tensor]], *, version: int = -1) -> None:
        seen.append((len(list(weights)), version))

    def plain(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen.append((len(list(weights)), None))

    def bound(tag: str, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        seen.append((len(list(weights)), (tag, version)))

    return {
        "positional": (positional, 5),
        "keyword": (keyword, 5),
        "plain": (plain, None),
        "partial": (functools.partial(bound, "p"), ("p", 5)),
    }


@pytest.mark.parametrize("kind", ["positional", "keyword", "plain", "partial"])
def test_a_loader_that_takes_version_gets_it_once(
    kind: str, ctx: Any, closing: Callable[[Any], Any]
) -> None:
    seen: list[Any] = []
    loader, expected = _versioned(seen)[kind]
    pub = closing(WeightPublisher(context=ctx, heartbeat_interval=0.1))
    sub = closing(WeightSubscriber(pub.endpoint, zeroed(make_lm()), context=ctx, loader=loader))
    sub.start()
    pub.wait_for_workers(1, 30)
    assert pub.publish_and_wait(make_lm(seed=6), 5, timeout=30).ok
    assert sub.version == 5
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] == expected, seen
