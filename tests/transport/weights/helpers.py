"""Helpers of the weight-update tests (a test module imports these, never another test
module): sample state dicts, a publisher with injected faults and the worker process
that hosts subscribers for it, the worker CLI's weights plugin arguments, and a small
transformers causal LM."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from unittest import mock

import msgspec
import torch

import fastio
from fastio.weight_msgs import (
    PUBLISHER_TO_SUBSCRIBER,
    WeightBucket,
    WeightBucketInfo,
    WeightFetch,
)
from transport import FabricController
from transport.weights import WeightPublisher, WeightSubscriber, state_digest
from transport.weights.bucket import dtype_name, plan_buckets
from transport.weights.serving import Serving

# -- state dicts ---------------------------------------------------------------------


def make_state(seed: int, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small state dict mixing dtypes and shapes (0-d, empty, odd sizes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97 * scale, 33, generator=g),
        "layers.0.attn.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(65, 31, generator=g).half(),
        "layers.0.norm.weight": torch.randn(33, generator=g),
        "scalar": torch.randn((), generator=g, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "steps": torch.randint(0, 1 << 40, (3,), generator=g),
        "mask": torch.rand(17, generator=g) > 0.5,
    }


def zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def digest_of(version: int) -> int:
    return state_digest(make_state(version))


# -- faults and worker processes ---------------------------------------------------
BUCKET = 2048  # many small buckets: "mid-update" has room

Fault = Callable[[str, int, int], "str | None"]


def plan_for(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[WeightBucketInfo]:
    """:func:`~transport.weights.bucket.plan_buckets` for a mapping of tensors, in its
    iteration order."""
    specs = ((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items())
    return plan_buckets(specs, bucket_bytes)


@contextlib.contextmanager
def serving_with(cls: type[Serving]) -> Iterator[None]:
    """Publishers made inside serve with ``cls``, a :class:`Serving` subclass that
    injects faults (the publisher builds its serving loop in ``__init__``)."""
    with mock.patch("transport.weights.publisher.Serving", cls):
        yield


class FaultyServing(Serving):
    """The serving loop of :class:`FaultyPublisher`: faults injected where the bytes
    leave it (``fault`` is set by the publisher)."""

    fault: Fault

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._corrupt: set[tuple[bytes, int, int]] = set()
        self._dec = fastio.Decoder(PUBLISHER_TO_SUBSCRIBER)
        super().__init__(*args, **kwargs)

    def _serve_fetch(self, ident: bytes, wid: str, msg: WeightFetch) -> None:
        what = self.fault(wid, msg.version, msg.index)
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "hold":
            return  # not answered (a trainer that is slow there); the worker asks again
        key = (ident, msg.version, msg.index)
        if what == "corrupt":
            self._corrupt.add(key)
        else:
            self._corrupt.discard(key)
        super()._serve_fetch(ident, wid, msg)

    def _link_send(self, snd: Any, piece: WeightBucket) -> Any:
        key = (snd.ident, piece.version, piece.index)
        if key in self._corrupt and piece.offset == 0 and piece.chunks[0].size:
            chunk = piece.chunks[0].copy()
            chunk[chunk.size // 2] ^= 0xFF
            piece = msgspec.structs.replace(piece, chunks=[chunk])
        if key in self._corrupt and piece.last:
            self._corrupt.discard(key)
        return super()._link_send(snd, piece)

    def reply(self, ident: bytes, frames: list[Any], track: bool = False) -> Any:
        if self._corrupt:
            msg = self._dec.decode([bytes(memoryview(f)) for f in frames])
            key = (ident, getattr(msg, "version", -1), getattr(msg, "index", -1))
            if isinstance(msg, WeightBucket) and key in self._corrupt:
                if msg.chunks and msg.offset == 0 and msg.chunks[0].size:
                    chunk = msg.chunks[0].copy()
                    chunk[chunk.size // 2] ^= 0xFF
                    msg = msgspec.structs.replace(msg, chunks=[chunk, *msg.chunks[1:]])
                elif not msg.chunks and msg.last:
                    msg = msgspec.structs.replace(msg, checksum=msg.checksum ^ 1)
                if msg.last:
                    self._corrupt.discard(key)
                frames = self.encoder.encode(msg)
        return super().reply(ident, frames, track)


class FaultyPublisher(WeightPublisher):
    """A publisher with faults injected where the bytes leave it (tests only).

    ``fault(worker, version, bucket)`` is asked at every Fetch: ``"die"`` SIGKILLs this
    process there (a trainer dying mid-update); ``"hold"`` leaves the Fetch unanswered;
    ``"corrupt"`` changes what that answer
    carries, as bytes changed after they were hashed would: over TCP one byte of the
    first piece is flipped (in a copy: the staged snapshot is never touched; ZeroMQ
    frames and the data link alike), through
    shared memory the checksum of the last notice is off by one.
    """

    def __init__(self, fault: Fault, *args: Any, **kwargs: Any) -> None:
        class Faulty(FaultyServing):
            pass

        Faulty.fault = staticmethod(fault)  # type: ignore[assignment]
        with serving_with(Faulty):
            super().__init__(*args, **kwargs)


def corrupting_bucket_1(versions: set[int], **kw: Any) -> FaultyPublisher:
    """A TCP publisher of 4 KiB buckets whose bucket 1 is corrupted in ``versions``."""

    def fault(worker: str, version: int, index: int) -> str | None:
        return "corrupt" if version in versions and index == 1 else None

    return FaultyPublisher(
        fault, "tcp://127.0.0.1:*", shm=False, bucket_bytes=4096, heartbeat_interval=0.1, **kw
    )


def variant_target(variant: str) -> dict[str, torch.Tensor]:
    """A worker's model: ``good`` matches the updates, the others do not."""
    t = zeros_like(make_state(0))
    if variant == "name":
        t["layers.0.norm.renamed"] = t.pop("layers.0.norm.weight")
    elif variant == "shape":
        t["layers.0.mlp.weight"] = torch.zeros(65, 30, dtype=torch.float16)
    elif variant == "dtype":
        t["layers.0.attn.weight"] = torch.zeros(64, 64, dtype=torch.float32)
    return t


def subscriber_proc(endpoint: str, workers: list[tuple[str, str]], opts: dict[str, Any]) -> None:
    """A worker process hosting one subscriber per (worker id, variant)."""
    torch.set_num_threads(1)
    die = opts.get("die_at")  # (worker id, version, bucket): SIGKILL ourselves there
    subs = []
    for wid, variant in workers:

        def progress(version: int, bucket: int, wid: str = wid) -> None:
            if die is not None and (wid, version, bucket) == tuple(die):
                os.kill(os.getpid(), signal.SIGKILL)

        subs.append(
            WeightSubscriber(
                endpoint,
                variant_target(variant),
                worker_id=wid,
                shm=opts.get("shm", False),
                report_digest=True,
                heartbeat_interval=0.1,
                fetch_timeout=opts.get("fetch_timeout", 2.0),
                publisher_timeout=opts.get("publisher_timeout", 10.0),
                retries=2,
                on_progress=progress,
                atomic=opts.get("atomic"),
                data_link=opts.get("data_link", True),
            ).start()
        )
    threading.Event().wait()  # until the test kills us


# -- the worker CLI with the weights plugin ----------------------------------------
def worker_args(wid: str, endpoint: str, *extra: str) -> list[str]:
    return [
        "--bind",
        "tcp://127.0.0.1:0",
        "--worker-id",
        wid,
        "--plugin-opt",
        f"weights_endpoint={endpoint}",
        "--plugin-opt",
        "weights_shm=0",
        *extra,
    ]


def status(ctl: FabricController) -> dict[str, Any]:
    """Worker id -> status, of every worker that answers."""
    return {s.worker_id: s for s in ctl.health(timeout=5).values()}


# -- a transformers model ------------------------------------------------------------
def make_lm(kind: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A small causal LM with random weights and tied embeddings (needs transformers)."""
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def zeroed(model: Any) -> Any:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (so NaN payloads and -0.0 compare exactly too)."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
