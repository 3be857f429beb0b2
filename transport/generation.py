"""One request as the built-in engines generate it: prompt, randomness, sampled tokens,
response (the sampling rules: ``docs/engines.md#the-built-in-engines``)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

try:
    import torch
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "reference", "the built-in engines (transport.generation)") from exc

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray

__all__ = ["Generation", "RequestSeeds", "prompt_ids", "sample_rows"]


class RequestSeeds:
    """Each generation's random generator from the engine's ``seed`` (and a request's
    integer ``metadata["seed"]``)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._nonce = os.urandom(8).hex()
        self._draws = 0

    def generator(self, req: LLMRequest) -> torch.Generator:
        """A new generator for ``req``."""
        seed = req.metadata.get("seed") if isinstance(req.metadata, dict) else None
        if isinstance(seed, int) and not isinstance(seed, bool):
            key = f"{self.seed}/{seed}/{len(req.input_ids)}".encode()
        else:
            self._draws += 1
            key = f"{self.seed}/{self._nonce}/{self._draws}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))


def prompt_ids(req: LLMRequest, vocab_size: int, start_token: int) -> np.ndarray[Any, Any]:
    """``req.input_ids`` as int64, ``[start_token]`` for an empty prompt;
    :class:`ValueError` for a token id outside ``[0, vocab_size)``."""
    ids = np.asarray(req.input_ids.array, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"input ids must lie in [0, {vocab_size})")
    return ids if ids.size else np.array([start_token], dtype=np.int64)


@dataclass(eq=False, kw_only=True)
class Generation:
    """A request's output so far: tokens, logprobs and the weight version of each."""

    input_ids: TokenArray
    g: GenerationHyperparameters
    gen: torch.Generator
    stop_ids: frozenset[int]
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    vers: list[int] = field(default_factory=list)
    reason: str = ""  # the stop reason, set once finished

    @classmethod
    def of(cls, req: LLMRequest, seeds: RequestSeeds, **fields: Any) -> Self:
        """A new generation of ``req``, with the subclass's further ``fields``."""
        g = req.gconfig
        stop_ids = frozenset(int(t) for t in g.stop_token_ids)
        return cls(
            input_ids=req.input_ids, g=g, gen=seeds.generator(req), stop_ids=stop_ids, **fields
        )

    def add(self, tok: int, lp: float, version: int, room: bool = True) -> bool:
        """Record a sampled token; True when it ends the generation (a stop token, or
        ``max_new_tokens`` reached, or no ``room`` left in the model's context)."""
        self.toks.append(tok)
        self.lps.append(lp)
        self.vers.append(version)
        if tok in self.stop_ids:
            self.reason = "stop"
        elif len(self.toks) >= self.g.max_new_tokens or not room:
            self.reason = "length"
        return bool(self.reason)

    def response(self) -> LLMResponse:
        """The :class:`~fastio.LLMResponse` of the tokens so far."""
        return LLMResponse(
            input_tokens=self.input_ids,
            output_tokens=TokenArray(np.array(self.toks, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(self.lps, dtype=np.float32)),
            output_versions=TokenArray(np.array(self.vers, dtype=np.int32)),
            stop_reason=self.reason,  # type: ignore[arg-type]
        )


def sample_rows(logits: torch.Tensor, rows: Sequence[Generation]) -> tuple[list[int], list[float]]:
    """A token and its logprob for each row of ``logits`` (rows, vocab), each under its
    row's sampling parameters; banned stop tokens are written into ``logits``."""
    n, vocab = logits.shape
    dev = logits.device
    gs = [s.g for s in rows]
    for i, s in enumerate(rows):
        if len(s.toks) < s.g.min_new_tokens and s.stop_ids:
            ban = [t for t in s.stop_ids if 0 <= t < vocab]
            if ban:
                logits[i, ban] = float("-inf")
    temps = torch.tensor(
        [1.0 if g.greedy else max(g.temperature, 1e-5) for g in gs], device=dev
    ).unsqueeze(1)
    scaled = logits / temps
    logp = torch.log_softmax(scaled, -1)
    toks = torch.argmax(logits, -1)
    sampled = [i for i in range(n) if not gs[i].greedy]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        filt = scaled.index_select(0, idx)
        ks = [min(max(gs[i].top_k, 1), vocab) for i in sampled]
        if min(ks) < vocab:
            kth = torch.topk(filt, max(k for k in ks if k < vocab), -1).values
            pick = torch.tensor([k - 1 if k < vocab else 0 for k in ks], device=dev)
            thresh = kth.gather(1, pick.unsqueeze(1))
            thresh[torch.tensor([k >= vocab for k in ks], device=dev)] = float("-inf")
            filt = filt.masked_fill(filt < thresh, float("-inf"))
        ps = [max(gs[i].top_p, 1e-9) for i in sampled]  # top_p <= 0 keeps the argmax
        if min(ps) < 1.0:
            top_p = torch.tensor([p if p < 1.0 else 2.0 for p in ps], device=dev).unsqueeze(1)
            sorted_l, order = torch.sort(filt, descending=True)
            probs = torch.softmax(sorted_l, -1)
            drop = (probs.cumsum(-1) - probs) >= top_p  # keeps the first token past p
            filt = filt.scatter(1, order, sorted_l.masked_fill(drop, float("-inf")))
        cdf = torch.softmax(filt, -1).cumsum(-1)
        u = torch.cat([torch.rand(1, generator=rows[i].gen) for i in sampled]).to(dev)
        u = u.unsqueeze(1) * cdf[:, -1:]
        # right=True never lands on a token of probability 0 (its cdf equals the previous).
        picked = torch.searchsorted(cdf, u, right=True).clamp(max=vocab - 1).squeeze(1)
        toks = toks.index_copy(0, idx, picked)
    chosen = logp.gather(1, toks.unsqueeze(1)).squeeze(1)
    return toks.tolist(), chosen.tolist()
