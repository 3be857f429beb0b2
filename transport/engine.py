"""A reference generation engine: a tiny torch causal LM on CPU.

It is small enough for tests and benchmarks yet real: every token comes from the
model's weights (so new weights change the output), with its logprob, sampled per
:class:`~fastio.GenerationHyperparameters`, streamed one token at a time, and it stops
early on pause (``stop_reason="interrupt"``) and on cancellation.

The model is an embedding, a GRU stack and a linear head. A recurrent state keeps each
step O(1) without a KV cache; the weight-update path sees ordinary ``nn.Module``
parameters of varied shapes (:attr:`ReferenceEngine.model`).

Randomness: the weights are drawn from ``seed``. Each generation samples from its own
generator, fresh per generation, so the ``n_samples`` requests of one rid (a GRPO group)
differ. A request with an integer ``metadata["seed"]`` samples from a generator seeded by
``(seed, metadata seed, prompt length)`` instead: the same request on the same weights
then gives the same tokens, whatever else runs concurrently.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from typing import Any

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "reference", "the reference engine (transport.engine)") from exc

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
from transport.engines.api import GenerationContext

__all__ = ["GenerationContext", "ReferenceEngine", "TinyLM"]


class TinyLM(nn.Module):
    """Embedding -> GRU -> LayerNorm -> linear head over a small vocabulary.

    Parameters
    ----------
    vocab_size, hidden, layers:
        Sizes. The default (256, 64, 2) has about 67k parameters.
    seed:
        Initial weights are drawn from it.
    """

    def __init__(
        self, vocab_size: int = 256, hidden: int = 64, layers: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                # Matrices ~ N(0, 1/fan_in), vectors small: varied, weight-driven text.
                scale = 0.1 if p.dim() == 1 else 1.0 / p.shape[-1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            self.norm.weight.add_(1.0)
            self.head.weight.mul_(2.0)
        self.eval()

    def forward(
        self, ids: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` of shape (batch, time) -> logits (batch, time, vocab) and the new state."""
        x, state = self.rnn(self.embed(ids), state)
        return self.head(self.norm(x)), state


class ReferenceEngine:
    """Generates with a :class:`TinyLM`; its ``generate`` is a worker handler.

    Parameters
    ----------
    vocab_size, hidden, layers, seed:
        The model (see :class:`TinyLM`).
    token_interval:
        Extra seconds per token, to simulate a slower model in demos and tests (0: none).
    model:
        Use this module instead of building one.

    Attributes
    ----------
    model:
        The ``nn.Module``; a weight update copies into its parameters in place (while
        the worker is paused) and then sets :attr:`version`.
    version:
        Weight version stamped on every token generated (``output_versions``).

    Examples
    --------
    >>> import asyncio
    >>> from fastio import LLMRequest, GenerationHyperparameters
    >>> eng = ReferenceEngine(seed=1)
    >>> req = LLMRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4))
    >>> resp = asyncio.run(eng.generate(req))
    >>> resp.output_len, list(resp.output_versions)
    (4, [0, 0, 0, 0])
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden: int = 64,
        layers: int = 2,
        seed: int = 0,
        token_interval: float = 0.0,
        model: nn.Module | None = None,
    ) -> None:
        self.seed = seed
        self.model: nn.Module = (
            model if model is not None else TinyLM(vocab_size, hidden, layers, seed)
        )
        self.vocab_size = int(getattr(self.model, "vocab_size", vocab_size))
        self.version = 0
        self.token_interval = token_interval
        self._nonce = os.urandom(8).hex()
        self._draws = 0

    def _generator(self, req: LLMRequest) -> torch.Generator:
        # Samples of one rid (n_samples of a GRPO group share it) must differ, so each
        # generation draws fresh randomness. ``metadata["seed"]`` (an int) makes one
        # reproducible: same seed, prompt and weights -> same tokens.
        seed = req.metadata.get("seed") if isinstance(req.metadata, dict) else None
        if isinstance(seed, int) and not isinstance(seed, bool):
            key = f"{self.seed}/{seed}/{len(req.input_ids)}".encode()
        else:
            self._draws += 1
            key = f"{self.seed}/{self._nonce}/{self._draws}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))

    def _sample(
        self,
        logits: torch.Tensor,
        g: GenerationHyperparameters,
        gen: torch.Generator,
        ban: list[int],
    ) -> tuple[int, float]:
        if ban:
            logits = logits.clone()
            logits[ban] = float("-inf")
        if g.greedy:
            tok = int(torch.argmax(logits))
            return tok, float(torch.log_softmax(logits, -1)[tok])
        scaled = logits / max(g.temperature, 1e-5)
        logp = torch.log_softmax(scaled, -1)
        filt = scaled
        if g.top_k < self.vocab_size:
            kth = torch.topk(filt, max(g.top_k, 1)).values[-1]
            filt = filt.masked_fill(filt < kth, float("-inf"))
        if g.top_p < 1.0:
            sorted_logits, order = torch.sort(filt, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) >= g.top_p  # keep the first past p
            filt = filt.clone()
            filt[order[drop]] = float("-inf")
        tok = int(torch.multinomial(torch.softmax(filt, -1), 1, generator=gen))
        # The logprob is under the temperature-scaled distribution before top-k/top-p.
        return tok, float(logp[tok])

    async def generate(self, req: LLMRequest, ctx: GenerationContext | None = None) -> LLMResponse:
        """Generate up to ``req.gconfig.max_new_tokens`` tokens after ``req.input_ids``.

        Returns ``stop_reason`` ``"stop"`` (a stop token, included in the output),
        ``"length"`` or ``"interrupt"`` (the worker paused; the output so far).

        Raises
        ------
        ValueError
            For token ids outside the vocabulary.
        """
        g = req.gconfig
        ids_np = np.asarray(req.input_ids.array, dtype=np.int64)
        if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= self.vocab_size):
            raise ValueError(f"input ids must lie in [0, {self.vocab_size})")
        if ids_np.size == 0:
            ids_np = np.zeros(1, dtype=np.int64)  # an empty prompt starts from token 0
        gen = self._generator(req)
        stop_ids = set(g.stop_token_ids)
        toks: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        stop: Any = "length"
        # Grad mode is thread state, and other requests' coroutines run at every await:
        # a ``no_grad`` block must never span an await, so each step enters its own.
        with torch.inference_mode():
            logits, state = self.model(torch.from_numpy(ids_np)[None])
        last = logits[0, -1]
        for step in range(g.max_new_tokens):
            if ctx is not None and ctx.interrupted:
                stop = "interrupt"
                break
            ban = [t for t in stop_ids if t < self.vocab_size] if step < g.min_new_tokens else []
            with torch.inference_mode():
                tok, lp = self._sample(last, g, gen, ban)
            version = self.version
            toks.append(tok)
            lps.append(lp)
            vers.append(version)
            if ctx is not None:
                ctx.emit(tok, lp, version)
            if tok in stop_ids:
                stop = "stop"
                break
            if step + 1 == g.max_new_tokens:
                break
            # Yield between tokens: heartbeats, control and other requests interleave.
            await asyncio.sleep(self.token_interval)
            with torch.inference_mode():
                logits, state = self.model(torch.tensor([[tok]]), state)
            last = logits[0, -1]
        return LLMResponse(
            input_tokens=req.input_ids,
            output_tokens=TokenArray(np.array(toks, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(lps, dtype=np.float32)),
            output_versions=TokenArray(np.array(vers, dtype=np.int32)),
            stop_reason=stop,
        )
