"""A generation engine serving a Hugging Face ``transformers`` causal LM (``--engine hf``),
batched on an engine thread of its own (``docs/engines.md#the-built-in-engines``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "hf", "the hf engine (transport.hf_engine)") from exc

from fastio import LLMRequest, LLMResponse
from transport.generation import Generation, RequestSeeds, prompt_ids, sample_rows
from transport.hf_model import (
    MODEL_SIZES,
    KVBatch,
    build_model,
    load_pretrained,
    model_config,
    transformers_module,
    weight_left_linear,
)
from transport.options import NonNegativeSeconds, Positive, parse_options

if TYPE_CHECKING:
    from transport.engines.api import GenerationContext

__all__ = [
    "MODEL_SIZES", "HFEngine", "HFOptions", "build_model", "create_engine", "factory",
    "load_pretrained", "model_config",
]  # fmt: skip

log = logging.getLogger("transport.hf_engine")

#: A step's output for one sequence: (sequence, token, logprob, version).
_Emitted = list[tuple["_Seq", int, float, int]]


@dataclass(eq=False, kw_only=True)
class _Seq(Generation):
    """A request in the engine thread, which alone writes it (``cancelled`` aside)."""

    prompt: np.ndarray[Any, Any]
    ctx: GenerationContext | None
    fut: asyncio.Future[LLMResponse]
    pos: int = 0  # tokens of this sequence in the cache
    pending: int = -1  # sampled, not yet fed
    cancelled: bool = False


class HFEngine:
    """Serves a ``transformers`` causal LM (or a module with its ``forward`` signature) on
    one engine thread. ``device``: ``cuda`` when available; ``seed``: mixed into every
    request's sampling seed; ``max_batch``: sequences decoded together; ``token_interval``:
    seconds added per step; ``weight_left``: each ``nn.Linear`` on CPU as ``weight @ x.T``.

    >>> import asyncio
    >>> from fastio import GenerationHyperparameters, LLMRequest
    >>> eng = HFEngine(build_model("tiny"), device="cpu")
    >>> req = LLMRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4))
    >>> asyncio.run(eng.generate(req)).output_len
    4
    >>> eng.close()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        seed: int = 0,
        max_batch: int = 64,
        token_interval: float = 0.0,
        weight_left: bool = True,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model: nn.Module = model.to(self.device).eval()
        if weight_left and self.device.type == "cpu":
            for mod in self.model.modules():
                if type(mod) is nn.Linear:
                    # An instance attribute: state_dict and parameters stay as they are.
                    mod.forward = functools.partial(weight_left_linear, mod)  # type: ignore[method-assign]
        cfg = getattr(model, "config", None)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0)) or int(
            model.get_input_embeddings().num_embeddings  # type: ignore[operator]
        )
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        bos = getattr(cfg, "bos_token_id", None)
        self._start_token = int(bos) if isinstance(bos, int) else 0
        self.version = 0
        self.seed = seed
        self.max_batch = max(1, max_batch)
        self.token_interval = token_interval
        self.step_lock = threading.Lock()
        self.stats: dict[str, int] = dict.fromkeys(
            ("forwards", "prefills", "decodes", "tokens", "max_batch_seen"), 0
        )
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache (and the output with it).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )
        self._seeds = RequestSeeds(seed)
        self._incoming: collections.deque[_Seq] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._batch: KVBatch[_Seq] = KVBatch()
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    async def generate(self, req: LLMRequest, ctx: GenerationContext | None = None) -> LLMResponse:
        """Generate after ``req.input_ids``, streaming through ``ctx``; ``ValueError`` for
        ids outside the vocabulary or a prompt as long as the context, ``RuntimeError``
        once closed or when the forward failed."""
        if self._closing:
            raise RuntimeError("the engine is closed")
        ids = prompt_ids(req, self.vocab_size, self._start_token)
        if len(req.input_ids) >= self.max_len:
            raise ValueError(
                f"prompt of {len(req.input_ids)} tokens; the model's context is {self.max_len}"
            )
        fut = asyncio.get_running_loop().create_future()
        seq = _Seq.of(req, self._seeds, prompt=ids, ctx=ctx, fut=fut)
        if seq.g.max_new_tokens <= 0:  # set after the checks of its constructor
            seq.reason = "length"
            return seq.response()
        with self._wake:
            self._incoming.append(seq)
            self._wake.notify()
        try:
            return await asyncio.shield(seq.fut)  # the thread sets it, even if cancelled
        except asyncio.CancelledError:
            # Return only once the thread let go of the sequence (no forward in flight).
            seq.cancelled = True
            with self._wake:
                self._wake.notify()
            await asyncio.wait([seq.fut], timeout=30)
            raise

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the engine thread between two steps for the ``with`` body."""
        with self.step_lock:
            yield

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running fail with RuntimeError."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._incoming and not self._batch.seqs and not self._closing:
                    self._wake.wait()
                if self._closing:
                    break
                room = self.max_batch - len(self._batch.seqs)
                new = [self._incoming.popleft() for _ in range(min(room, len(self._incoming)))]
            emitted: _Emitted = []
            done: list[_Seq] = []
            with self.step_lock, torch.inference_mode():
                try:
                    self._retire(done)
                    admit = [s for s in new if not self._leaves(s, done)]
                    if admit:
                        self._prefill(admit, emitted, done)
                        self._retire(done)
                    if self._batch.seqs:
                        self._decode(emitted, done)
                except Exception as exc:  # out of memory, say: the batch's cache is lost
                    failed = [s for s in (*self._batch.seqs, *new) if not s.reason]
                    log.exception("engine step failed; failing %d sequences", len(failed))
                    self._post([], failed, exc)
                    self._batch = KVBatch()
                    emitted = [e for e in emitted if e[0].reason]
            self._post(emitted, done)
            if self.token_interval > 0:
                time.sleep(self.token_interval)
        with self._wake:
            left = [s for s in (*self._batch.seqs, *self._incoming) if not s.reason]
            self._incoming.clear()
        self._batch = KVBatch()
        self._post([], left, RuntimeError("the engine is closed"))

    def _post(self, emitted: _Emitted, done: list[_Seq], exc: BaseException | None = None) -> None:
        # A step's tokens and ended sequences (failed with exc) to their loops, one call each.
        for loop in {s.fut.get_loop() for s, *_ in emitted} | {s.fut.get_loop() for s in done}:
            em = [e for e in emitted if e[0].fut.get_loop() is loop]
            dn = [s for s in done if s.fut.get_loop() is loop]
            with contextlib.suppress(RuntimeError):  # a loop that closed meanwhile
                loop.call_soon_threadsafe(_deliver, em, dn, exc)

    def _leaves(self, s: _Seq, done: list[_Seq]) -> bool:
        if s.cancelled:
            s.reason = "cancelled"
        elif s.ctx is not None and s.ctx.interrupted:
            s.reason = "interrupt"
        else:
            return False
        done.append(s)
        return True

    def _retire(self, done: list[_Seq]) -> None:
        b = self._batch
        b.keep([i for i, s in enumerate(b.seqs) if not s.reason and not self._leaves(s, done)])

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": mask, "position_ids": pos,
            self._cache_kw: cache, "use_cache": True,
        }  # fmt: skip
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        out = self.model(**kwargs)  # under _run's inference_mode
        self.stats["forwards"] += 1
        cache = getattr(out, self._cache_kw, None)
        return out.logits[:, -1, :], out.past_key_values if cache is None else cache

    def _prefill(self, seqs: list[_Seq], emitted: _Emitted, done: list[_Seq]) -> None:
        width = max(len(s.prompt) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = s.prompt
            mask[i, width - len(s.prompt) :] = 1
            s.pos = len(s.prompt)
        mask_t = torch.from_numpy(mask).to(self.device)
        pos = (mask_t.cumsum(-1) - 1).clamp(min=0)
        cache = transformers_module().DynamicCache()
        logits, cache = self._forward(torch.from_numpy(ids).to(self.device), mask_t, pos, cache)
        self.stats["prefills"] += 1
        self._batch.merge(seqs, cache, mask_t)
        self._sample(seqs, logits, emitted, done)

    def _decode(self, emitted: _Emitted, done: list[_Seq]) -> None:
        b = self._batch
        assert b.mask is not None
        seqs = b.seqs
        ids = torch.tensor([[s.pending] for s in seqs], dtype=torch.int64, device=self.device)
        pos = torch.tensor([[s.pos] for s in seqs], dtype=torch.int64, device=self.device)
        b.mask = torch.cat([b.mask, b.mask.new_ones((len(seqs), 1))], 1)
        logits, b.cache = self._forward(ids, b.mask, pos, b.cache)
        self.stats["decodes"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(seqs))
        for s in seqs:
            s.pos += 1
        self._sample(seqs, logits, emitted, done)

    def _sample(
        self, seqs: list[_Seq], logits: torch.Tensor, emitted: _Emitted, done: list[_Seq]
    ) -> None:
        toks, lps = sample_rows(logits.float(), seqs)
        version = self.version
        self.stats["tokens"] += len(seqs)
        for s, tok, lp in zip(seqs, toks, lps, strict=True):
            s.pending = tok
            emitted.append((s, tok, lp, version))
            if s.add(tok, lp, version, room=s.pos + 1 < self.max_len):
                done.append(s)


def _deliver(emitted: _Emitted, done: list[_Seq], exc: BaseException | None) -> None:
    for s, tok, lp, ver in emitted:
        if s.ctx is not None and not s.cancelled:
            s.ctx.emit(tok, lp, ver)
    for s in done:
        if s.fut.done():
            continue
        if exc is not None:
            s.fut.set_exception(RuntimeError(f"{type(exc).__name__}: {exc}"))
        elif s.reason == "cancelled":
            s.fut.cancel()
        else:
            s.fut.set_result(s.response())


class HFOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """:func:`create_engine`'s options (``--engine-opt``): :class:`HFEngine`'s, the model's
    ``arch`` (``llama``/``qwen2``), ``dtype``, ``max_len`` and torch's ``threads``."""

    model_size: str = "small"
    model_path: str | None = None
    device: str | None = None
    seed: int = 0
    arch: str = "llama"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_batch: Positive = 64
    max_len: Positive = 4096
    token_interval: NonNegativeSeconds = 0.0
    threads: Positive | None = None


def create_engine(
    model_size: str = "small",
    model_path: str | None = None,
    device: str | None = None,
    seed: int | str = 0,
    **opts: Any,
) -> HFEngine:
    """The ``hf`` engine of the worker CLI: a model of :data:`MODEL_SIZES` with random
    weights from ``seed`` (also the sampling seed), or the local directory ``model_path``;
    ``opts``: the other fields of :class:`HFOptions`, as values or strings."""
    given = dict(model_size=model_size, model_path=model_path, device=device, seed=seed)
    o = parse_options({**given, **opts}, HFOptions, "hf engine option")
    dtype = getattr(torch, o.dtype)
    if o.threads is not None:
        torch.set_num_threads(o.threads)
    if o.model_path:
        model = load_pretrained(o.model_path, dtype)
    else:
        model = build_model(o.model_size, o.seed, o.arch, dtype, o.max_len)
    return HFEngine(
        model,
        device=o.device or None,
        seed=o.seed,
        max_batch=o.max_batch,
        token_interval=o.token_interval,
    )


def factory(opts: dict[str, str]) -> HFEngine:
    """``--engine transport.hf_engine:factory``: :func:`create_engine` from the options it
    knows (others, such as the weight plugin's ``weights_*``, are left to their plugins)."""
    return create_engine(**{k: v for k, v in opts.items() if k in HFOptions.__struct_fields__})
