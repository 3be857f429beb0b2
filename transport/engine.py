"""A reference generation engine: a tiny torch causal LM on CPU, in the worker's loop
(``docs/engines.md#the-built-in-engines``)."""

from __future__ import annotations

import asyncio

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "reference", "the reference engine (transport.engine)") from exc

from fastio import LLMRequest, LLMResponse
from transport.engines.api import GenerationContext
from transport.generation import Generation, RequestSeeds, prompt_ids, sample_rows

__all__ = ["GenerationContext", "ReferenceEngine", "TinyLM"]


class TinyLM(nn.Module):
    """Embedding -> GRU -> LayerNorm -> linear head of sizes ``vocab_size``, ``hidden``,
    ``layers``; initial weights drawn from ``seed``."""

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
    """Generates with a :class:`TinyLM` (``vocab_size``, ``hidden``, ``layers``, ``seed``;
    or ``model``); ``seed`` also seeds the sampling, ``token_interval`` adds seconds per
    token.

    >>> import asyncio
    >>> from fastio import LLMRequest, GenerationHyperparameters
    >>> req = LLMRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4))
    >>> list(asyncio.run(ReferenceEngine(seed=1).generate(req)).output_versions)
    [0, 0, 0, 0]
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
        self.model = model if model is not None else TinyLM(vocab_size, hidden, layers, seed)
        self.vocab_size = int(getattr(self.model, "vocab_size", vocab_size))
        self.version = 0
        self.token_interval = token_interval
        self._seeds = RequestSeeds(seed)

    async def generate(self, req: LLMRequest, ctx: GenerationContext | None = None) -> LLMResponse:
        """Generate after ``req.input_ids``, streaming through ``ctx``; ``ValueError`` for ids
        outside the vocabulary."""
        ids = prompt_ids(req, self.vocab_size, 0)
        seq = Generation.of(req, self._seeds)
        # Grad mode is thread state and other coroutines run at each await: no
        # inference_mode block spans an await.
        with torch.inference_mode():
            logits, state = self.model(torch.from_numpy(ids)[None])
        while len(seq.toks) < seq.g.max_new_tokens:
            if ctx is not None and ctx.interrupted:
                seq.reason = "interrupt"
                break
            with torch.inference_mode():
                (tok,), (lp,) = sample_rows(logits[:, -1], [seq])
            version = self.version
            ended = seq.add(tok, lp, version)
            if ctx is not None:
                ctx.emit(tok, lp, version)
            if ended:
                break
            # Yield between tokens: heartbeats, control and other requests interleave.
            await asyncio.sleep(self.token_interval)
            with torch.inference_mode():
                logits, state = self.model(torch.tensor([[tok]]), state)
        seq.reason = seq.reason or "length"
        return seq.response()
