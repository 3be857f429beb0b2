"""The sampling and bookkeeping shared by the built-in engines
(:mod:`transport.generation`), and the reference engine built on it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from fastio import GenerationHyperparameters, LLMRequest
from transport.engine import ReferenceEngine
from transport.generation import Generation, RequestSeeds, prompt_ids, sample_rows

G = GenerationHyperparameters


def gen(req: LLMRequest, seed: int = 0) -> Generation:
    return Generation.of(req, RequestSeeds(seed))


def req(prompt: list[int], **g: Any) -> LLMRequest:
    return LLMRequest(input_ids=prompt, gconfig=G(**g))


def test_rows_sample_under_their_own_parameters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = torch.argmax(logits, -1).tolist()
    rows = [
        gen(req([1], greedy=True)),
        gen(req([1], top_k=1)),
        gen(req([1], top_p=1e-6)),
        gen(req([1], temperature=2.0)),
    ]
    toks, lps = sample_rows(logits.clone(), rows)
    assert toks[:3] == best[:3]
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[best[0]]), abs=1e-5)
    want = torch.log_softmax(logits[3] / 2.0, -1)[toks[3]]
    assert lps[3] == pytest.approx(float(want), abs=1e-5)


def test_stop_tokens_are_banned_before_min_new_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 10.0
    row = gen(req([1], greedy=True, stop_token_ids=[7], min_new_tokens=1))
    assert sample_rows(logits.clone(), [row])[0] != [7]
    assert row.add(3, -1.0, 0) is False
    assert sample_rows(logits.clone(), [row])[0] == [7]
    assert row.add(7, -0.1, 1) is True and row.reason == "stop"
    r = row.response()
    assert r.output_tokens.array.tolist() == [3, 7] and r.output_versions.array.tolist() == [0, 1]


def test_length_ends_at_max_new_tokens_or_without_room() -> None:
    row = gen(req([1], max_new_tokens=2))
    assert row.add(1, 0.0, 0) is False and row.add(1, 0.0, 0) is True
    assert row.reason == "length"
    full = gen(req([1], max_new_tokens=9))
    assert full.add(1, 0.0, 0, room=False) and full.reason == "length"


def test_seeds_differ_per_generation_and_repeat_with_a_metadata_seed() -> None:
    seeds = RequestSeeds(3)
    plain = req([1, 2])
    a, b = (torch.rand(4, generator=seeds.generator(plain)) for _ in range(2))
    assert not torch.equal(a, b)
    seeded = LLMRequest(input_ids=[1, 2], gconfig=G(), metadata={"seed": 5})
    c = torch.rand(4, generator=seeds.generator(seeded))
    d = torch.rand(4, generator=RequestSeeds(3).generator(seeded))
    assert torch.equal(c, d)


def test_prompt_ids_checks_the_vocabulary_and_starts_an_empty_prompt() -> None:
    assert prompt_ids(req([]), 10, 4).tolist() == [4]
    assert prompt_ids(req([0, 9]), 10, 4).tolist() == [0, 9]
    with pytest.raises(ValueError, match="input ids"):
        prompt_ids(req([10]), 10, 4)


def test_reference_engine_keeps_the_argmax_for_a_degenerate_top_p() -> None:
    """top_p <= 0 (refused at construction, set afterwards): the argmax, as greedy
    gives, rather than a failed draw from an empty nucleus."""
    eng = ReferenceEngine(seed=1)
    greedy = asyncio.run(eng.generate(req([1, 2, 3], max_new_tokens=8, greedy=True)))
    odd = req([1, 2, 3], max_new_tokens=8)
    odd.gconfig.top_p = 0
    got = asyncio.run(eng.generate(odd))
    assert got.output_tokens.array.tolist() == greedy.output_tokens.array.tolist()
