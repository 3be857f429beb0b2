"""A generation engine serving a Hugging Face ``transformers`` causal LM.

The model comes from a config with random weights (:data:`MODEL_SIZES`, Llama or Qwen2
layout, tied embeddings: for tests, benchmarks and the demo, nothing is downloaded) or
from ``from_pretrained`` on a local directory. Serve it from a worker::

    python -m transport.worker --bind tcp://127.0.0.1:5555 --engine hf --model-size small

(:func:`create_engine` builds it; :func:`factory` is the same for a worker CLI's
``--engine module:factory``, taking the options as ``key=value`` strings.)
``python -m bench.hf_engine`` measures its tokens/s at each size.

Threads. All compute runs on one engine thread that owns the model; the worker's event
loop never runs a forward, so it keeps answering heartbeats and moving bytes while the
model computes. :meth:`HFEngine.generate` (a worker handler) hands the request to that
thread and awaits a future; tokens come back once per step through
``loop.call_soon_threadsafe`` and are streamed with ``ctx.emit``.

Batching. The thread runs a step loop over every active sequence: one decode forward
for the whole batch per step, with a batched KV cache (left-padded, explicit position
ids). New requests join between steps (continuous batching): they are prefilled
together, then their cache rows are merged into the running batch. Finished, cancelled
and interrupted sequences leave between steps.

Interruption. Between two steps the thread looks at each sequence's context: a paused
worker (``ctx.interrupted``) ends it with ``stop_reason="interrupt"`` and the tokens so
far; a cancelled or aborted request is dropped. A handler returns only once the thread
has let go of its sequence, so when a paused worker reports no running handler, no
forward is running or will start until a request is admitted again.

Weight updates. A weight subscriber copies into :attr:`HFEngine.model` in place and then
sets :attr:`HFEngine.version`; every token carries the version it was sampled under
(``output_versions``). Two safe points:

* the worker's pause (what :func:`transport.weights.attach_subscriber` uses): by the
  paragraph above, the copy cannot overlap a forward;
* :attr:`HFEngine.step_lock` (a ``threading.Lock``, also :meth:`HFEngine.hold`): the
  thread holds it for each whole step, so a copy made under it (``WeightSubscriber(...,
  lock=engine.step_lock)``) lands between two steps without pausing anyone. Such a
  subscriber verifies the whole version before its first write (its default
  ``atomic=True``): a plain lock is left when a version fails, so the one-pass mode,
  which can leave the weights mixed, is the default only under the worker's pause.

Sampling follows :class:`~fastio.GenerationHyperparameters`: ``greedy``, ``temperature``,
``top_k``, ``top_p``, ``stop_token_ids`` (the stop token is included in the output),
``min_new_tokens`` (stop tokens banned before it) and ``max_new_tokens``. Logprobs are
under the temperature-scaled distribution before top-k/top-p (greedy: the model's own
distribution). ``n_samples`` is the caller's business: each request is one sample.
Randomness is per request as in :mod:`transport.engine`: fresh per generation, or
reproducible with an integer ``metadata["seed"]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "hf", "the hf engine (transport.hf_engine)") from exc

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
from transport.hf_model import (
    MODEL_SIZES,
    build_model,
    cache_set,
    cache_tensors,
    left_pad,
    load_pretrained,
    model_config,
    sample_rows,
    transformers_module,
    weight_left_linear,
)
from transport.options import parse_options

if TYPE_CHECKING:
    from transport.engines.api import GenerationContext

__all__ = [
    "MODEL_SIZES",
    "HFEngine",
    "HFOptions",
    "build_model",
    "create_engine",
    "factory",
    "load_pretrained",
    "model_config",
]

log = logging.getLogger("transport.hf_engine")


# -- one generation --------------------------------------------------------------------
@dataclass(eq=False)
class _Seq:
    """A request as the engine thread sees it (fields written by that thread only, but
    ``cancelled``, set by the loop)."""

    prompt: np.ndarray[Any, Any]
    g: GenerationHyperparameters
    ctx: Any
    gen: torch.Generator
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[LLMResponse]
    input_ids: TokenArray
    stop_ids: frozenset[int]
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    vers: list[int] = field(default_factory=list)
    pos: int = 0  # tokens of this sequence in the cache
    pending: int = -1  # sampled, not yet fed
    reason: str = ""  # set once finished
    cancelled: bool = False

    def response(self) -> LLMResponse:
        return LLMResponse(
            input_tokens=self.input_ids,
            output_tokens=TokenArray(np.array(self.toks, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(self.lps, dtype=np.float32)),
            output_versions=TokenArray(np.array(self.vers, dtype=np.int32)),
            stop_reason=self.reason,  # type: ignore[arg-type]
        )


class _Batch:
    """The running batch: its sequences (row order), the KV cache and attention mask."""

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # (rows, columns) int64, 0 on left padding

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows``; drop the columns that became all padding."""
        if len(rows) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).nonzero()[0])  # the first column any row still uses
        self.mask = mask[:, first:]
        cache_set(
            self.cache,
            [
                (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
                for k, v in cache_tensors(self.cache)
            ],
        )

    def merge(self, seqs: list[_Seq], cache: Any, mask: torch.Tensor) -> None:
        """Append rows prefilled on their own, left-padding the shorter side."""
        if not self.seqs:
            self.seqs, self.cache, self.mask = list(seqs), cache, mask
            return
        assert self.mask is not None
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([left_pad(self.mask, width, 1), left_pad(mask, width, 1)], 0)
        cache_set(
            self.cache,
            [
                (
                    torch.cat([left_pad(k, width, 2), left_pad(k2, width, 2)], 0),
                    torch.cat([left_pad(v, width, 2), left_pad(v2, width, 2)], 0),
                )
                for (k, v), (k2, v2) in zip(
                    cache_tensors(self.cache), cache_tensors(cache), strict=True
                )
            ],
        )
        self.seqs += seqs


class HFEngine:
    """Serves a ``transformers`` causal LM; its ``generate`` is a worker handler.

    Parameters
    ----------
    model:
        A causal LM (``PreTrainedModel``) or any module with its ``forward`` signature
        (``input_ids``, ``attention_mask``, ``position_ids``, a ``DynamicCache``).
    device:
        Where it runs (default: ``cuda`` when available, else ``cpu``); the model is
        moved there.
    seed:
        Mixed into every request's sampling seed.
    max_batch:
        Sequences decoded together at most; more requests wait for a row.
    token_interval:
        Extra seconds per step (0: none), to simulate a slower model in tests.
    weight_left:
        On CPU, compute each ``nn.Linear`` as ``weight @ x.T`` instead of ``x @
        weight.T`` (default on). Same result up to rounding; BLAS builds such as MKL's
        are much faster this way for the few rows of a decode step (see
        :func:`weight_left_linear`). The parameters are untouched.

    Attributes
    ----------
    model:
        The ``nn.Module``; a weight update copies into its parameters in place while no
        step runs (the worker paused, or under :attr:`step_lock`) and then sets
        :attr:`version`.
    version:
        Weight version stamped on every token generated (``output_versions``).
    step_lock:
        Held by the engine thread for each step (prefill, decode, sampling).
    stats:
        ``forwards``, ``prefills``, ``decodes``, ``tokens``, ``max_batch_seen`` (counts).

    Examples
    --------
    >>> import asyncio
    >>> eng = HFEngine(build_model("tiny"), device="cpu")
    >>> req = LLMRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4))
    >>> resp = asyncio.run(eng.generate(req))
    >>> resp.output_len, list(resp.output_versions)
    (4, [0, 0, 0, 0])
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
        # transformers 5.x renamed past_key_values to cache (and the output with it).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )
        self._nonce = os.urandom(8).hex()
        self._draws = 0
        self._incoming: collections.deque[_Seq] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._batch = _Batch()
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # -- the loop's side ----------------------------------------------------------------
    def _generator(self, req: LLMRequest) -> torch.Generator:
        seed = req.metadata.get("seed") if isinstance(req.metadata, dict) else None
        if isinstance(seed, int) and not isinstance(seed, bool):
            key = f"{self.seed}/{seed}/{len(req.input_ids)}".encode()
        else:
            self._draws += 1
            key = f"{self.seed}/{self._nonce}/{self._draws}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))

    async def generate(self, req: LLMRequest, ctx: GenerationContext | None = None) -> LLMResponse:
        """Generate up to ``req.gconfig.max_new_tokens`` tokens after ``req.input_ids``.

        Returns ``stop_reason`` ``"stop"`` (a stop token, included in the output),
        ``"length"`` (``max_new_tokens``, or the model's ``max_position_embeddings``)
        or ``"interrupt"`` (the worker paused; the output so far).

        Raises
        ------
        ValueError
            For token ids outside the vocabulary, or a prompt as long as the model's
            context.
        RuntimeError
            When the engine is closed, or the forward failed (out of memory, say).
        """
        if self._closing:
            raise RuntimeError("the engine is closed")
        g = req.gconfig
        ids = np.asarray(req.input_ids.array, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"input ids must lie in [0, {self.vocab_size})")
        if ids.size >= self.max_len:
            raise ValueError(f"prompt of {ids.size} tokens; the model's context is {self.max_len}")
        if ids.size == 0:
            ids = np.array([self._start_token], dtype=np.int64)
        loop = asyncio.get_running_loop()
        seq = _Seq(
            prompt=ids, g=g, ctx=ctx, gen=self._generator(req), loop=loop,
            fut=loop.create_future(), input_ids=req.input_ids,
            stop_ids=frozenset(int(t) for t in g.stop_token_ids),
        )  # fmt: skip
        if g.max_new_tokens <= 0:
            seq.reason = "length"
            return seq.response()
        with self._wake:
            self._incoming.append(seq)
            self._wake.notify()
        try:
            # Shielded: a cancellation must not cancel the future the thread will set.
            return await asyncio.shield(seq.fut)
        except asyncio.CancelledError:
            # Return only once the thread has let go of the sequence: a paused worker
            # with no running handler then has no forward in flight either.
            seq.cancelled = True
            with self._wake:
                self._wake.notify()
            await asyncio.wait([seq.fut], timeout=30)
            raise

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the engine thread between two steps for the ``with`` body (a weight copy
        outside a worker pause, say)."""
        with self.step_lock:
            yield

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running fail with RuntimeError."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not self._incoming and not self._batch.seqs and not self._closing:
                    self._wake.wait()
                if self._closing:
                    break
                room = self.max_batch - len(self._batch.seqs)
                new = [self._incoming.popleft() for _ in range(min(room, len(self._incoming)))]
            emitted: list[tuple[_Seq, int, float, int]] = []
            done: list[_Seq] = []
            with self.step_lock, torch.inference_mode():
                try:
                    self._step(new, emitted, done)
                except Exception as exc:
                    # (Out of memory, say.) The batch's cache is lost: fail its sequences,
                    # keep those that ended before, serve the next requests afresh.
                    failed = [s for s in (*self._batch.seqs, *new) if not s.reason]
                    log.exception("engine step failed; failing %d sequences", len(failed))
                    self._fail(failed, exc)
                    self._batch = _Batch()
                    emitted = [e for e in emitted if e[0].reason]
            self._post(emitted, done)
            if self.token_interval > 0:
                time.sleep(self.token_interval)
        with self._wake:
            left = [s for s in (*self._batch.seqs, *self._incoming) if not s.reason]
            self._incoming.clear()
        self._batch = _Batch()
        self._fail(left, RuntimeError("the engine is closed"))

    def _fail(self, seqs: list[_Seq], exc: BaseException) -> None:
        for s in seqs:
            with contextlib.suppress(RuntimeError):  # a loop that closed meanwhile
                s.loop.call_soon_threadsafe(_set_exception, s.fut, exc)

    def _post(self, emitted: list[tuple[_Seq, int, float, int]], done: list[_Seq]) -> None:
        """Hand a step's tokens and finished sequences to their loops, one callback each."""
        if not emitted and not done:
            return
        loops = {s.loop for s, *_ in emitted} | {s.loop for s in done}
        for loop in loops:
            em = [e for e in emitted if e[0].loop is loop] if len(loops) > 1 else emitted
            dn = [s for s in done if s.loop is loop] if len(loops) > 1 else done
            with contextlib.suppress(RuntimeError):  # a loop that closed meanwhile
                loop.call_soon_threadsafe(_deliver, em, dn)

    def _ended(self, s: _Seq, reason: str, done: list[_Seq]) -> None:
        s.reason = reason
        done.append(s)

    def _retire(self, done: list[_Seq]) -> None:
        """Drop every sequence that is finished, cancelled or interrupted."""
        rows = []
        for i, s in enumerate(self._batch.seqs):
            if s.reason:
                continue
            if s.cancelled:
                self._ended(s, "cancelled", done)
            elif s.ctx is not None and s.ctx.interrupted:
                self._ended(s, "interrupt", done)
            else:
                rows.append(i)
        self._batch.keep(rows)

    def _step(
        self, new: list[_Seq], emitted: list[tuple[_Seq, int, float, int]], done: list[_Seq]
    ) -> None:
        self._retire(done)
        admit = []
        for s in new:
            if s.cancelled:
                self._ended(s, "cancelled", done)
            elif s.ctx is not None and s.ctx.interrupted:
                self._ended(s, "interrupt", done)
            else:
                admit.append(s)
        if admit:
            self._prefill(admit, emitted, done)
            self._retire(done)
        if self._batch.seqs:
            self._decode(emitted, done)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": mask, "position_ids": pos,
            self._cache_kw: cache, "use_cache": True,
        }  # fmt: skip
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        self.stats["forwards"] += 1
        new_cache = getattr(out, self._cache_kw, None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[:, -1, :], new_cache

    def _new_cache(self) -> Any:
        return transformers_module().DynamicCache()

    def _prefill(
        self, seqs: list[_Seq], emitted: list[tuple[_Seq, int, float, int]], done: list[_Seq]
    ) -> None:
        width = max(len(s.prompt) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = s.prompt
            mask[i, width - len(s.prompt) :] = 1
        dev = self.device
        mask_t = torch.from_numpy(mask).to(dev)
        pos = (mask_t.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(torch.from_numpy(ids).to(dev), mask_t, pos, self._new_cache())
        self.stats["prefills"] += 1
        for s in seqs:
            s.pos = len(s.prompt)
        self._batch.merge(seqs, cache, mask_t)
        self._sample(seqs, logits, emitted, done)

    def _decode(self, emitted: list[tuple[_Seq, int, float, int]], done: list[_Seq]) -> None:
        b = self._batch
        assert b.mask is not None
        seqs = b.seqs
        dev = self.device
        ids = torch.tensor([[s.pending] for s in seqs], dtype=torch.int64, device=dev)
        pos = torch.tensor([[s.pos] for s in seqs], dtype=torch.int64, device=dev)
        b.mask = torch.cat([b.mask, b.mask.new_ones((len(seqs), 1))], 1)
        logits, b.cache = self._forward(ids, b.mask, pos, b.cache)
        self.stats["decodes"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(seqs))
        for s in seqs:
            s.pos += 1
        self._sample(seqs, logits, emitted, done)

    def _sample(
        self,
        seqs: list[_Seq],
        logits: torch.Tensor,
        emitted: list[tuple[_Seq, int, float, int]],
        done: list[_Seq],
    ) -> None:
        """One token for each row of ``logits`` (rows in ``seqs`` order)."""
        toks, lps = sample_rows(logits.float(), [s.g for s in seqs], seqs)
        version = self.version
        self.stats["tokens"] += len(seqs)
        for s, tok, lp in zip(seqs, toks, lps, strict=True):
            s.toks.append(tok)
            s.lps.append(lp)
            s.vers.append(version)
            s.pending = tok
            emitted.append((s, tok, lp, version))
            if tok in s.stop_ids:
                self._ended(s, "stop", done)
            elif len(s.toks) >= s.g.max_new_tokens or s.pos + 1 >= self.max_len:
                self._ended(s, "length", done)


def _deliver(emitted: list[tuple[_Seq, int, float, int]], done: list[_Seq]) -> None:
    """In the loop: stream a step's tokens, then finish the sequences that ended."""
    for s, tok, lp, ver in emitted:
        if s.ctx is not None and not s.cancelled:
            s.ctx.emit(tok, lp, ver)
    for s in done:
        if not s.fut.done():
            if s.reason == "cancelled":
                s.fut.cancel()
            else:
                s.fut.set_result(s.response())


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(RuntimeError(f"{type(exc).__name__}: {exc}"))


# -- construction from the command line --------------------------------------------------
class HFOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of :func:`create_engine` (``--engine-opt key=value``)."""

    model_size: str = "small"
    model_path: str | None = None
    device: str | None = None
    seed: int = 0
    arch: str = "llama"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_batch: Annotated[int, Meta(ge=1)] = 64
    max_len: Annotated[int, Meta(ge=1)] = 4096
    token_interval: Annotated[float, Meta(ge=0)] = 0.0
    threads: Annotated[int, Meta(ge=1)] | None = None


def create_engine(
    model_size: str = "small",
    model_path: str | None = None,
    device: str | None = None,
    seed: int | str = 0,
    **opts: Any,
) -> HFEngine:
    """The ``hf`` engine of the worker CLI (``--engine hf``).

    Parameters
    ----------
    model_size:
        A key of :data:`MODEL_SIZES` (random weights from ``seed``); ignored when
        ``model_path`` is given.
    model_path:
        A local directory for ``AutoModelForCausalLM.from_pretrained`` (never
        downloads).
    device:
        ``cpu``, ``cuda``, ``cuda:1``... (default: cuda when available).
    seed:
        Weights of the random model, and the sampling seed.
    **opts:
        ``arch`` (``llama``/``qwen2``), ``dtype`` (``float32``/``bfloat16``/``float16``),
        ``max_batch``, ``max_len``, ``token_interval``, ``threads`` (torch threads of
        the process): the other fields of :class:`HFOptions`. Values may be strings
        (``--engine-opt k=v``); they are converted.

    Raises
    ------
    ValueError
        Unknown size, architecture, dtype or option, or a malformed value.
    """
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
    """``--engine transport.hf_engine:factory``: :func:`create_engine` from the worker's
    ``--plugin-opt key=value`` options (keys it does not know, such as the weight
    plugin's ``weights_*``, are left to their plugins)."""
    return create_engine(**{k: v for k, v in opts.items() if k in HFOptions.__struct_fields__})
