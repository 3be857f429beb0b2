"""Binding a version to a worker: aliases, renaming and dtypes, checked before a byte
moves, and the cast copy bit-identical to ``tensor.to(dtype)`` (no sockets here)."""

from __future__ import annotations

import pytest
import torch

from tests.transport.weights.helpers import plan_for
from transport.weights import BucketApplier, WeightMismatchError
from transport.weights.binding import Binding, advertised_dtype, parse_dtype
from transport.weights.bucket import pack_bucket, split_aliases, wire_tensor


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(7, 5, generator=g)
    return {
        "emb": emb,
        "w": torch.randn(5, 5, generator=g) * 1e4,
        "steps": torch.arange(3),
        "head": emb,  # tied
    }


def packed(src: dict[str, torch.Tensor]) -> tuple[list, list[torch.Tensor], dict[str, str]]:
    unique, aliases = split_aliases(src)
    plan = plan_for(unique, 1 << 20)
    out = torch.empty(plan[0].nbytes, dtype=torch.uint8)
    pack_bucket(plan[0], unique, out)
    return plan, [out], aliases


def test_tied_tensors_are_found_and_overlaps_are_not() -> None:
    base = torch.zeros(4, 4)
    unique, aliases = split_aliases({"a": base, "b": base, "row": base[0], "t": base.t()})
    assert aliases == {"b": "a"} and list(unique) == ["a", "row", "t"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_cast_copy_is_bit_identical_to_to(dtype: torch.dtype) -> None:
    src = state()
    src["w"][0, 0] = float("nan")
    src["w"][0, 1] = -0.0
    src["w"][0, 2] = 3.0e38  # overflows fp16 and bf16 alike: inf either way
    plan, chunks, aliases = packed(src)
    dst = {k: torch.zeros_like(v, dtype=dtype if v.is_floating_point() else v.dtype)
           for k, v in src.items()}  # fmt: skip
    b = Binding(plan, dst, aliases=aliases, dtype="auto")
    BucketApplier(dst).apply(plan[0], chunks, b.dests)
    for k, v in src.items():
        want = v.to(dst[k].dtype)
        assert torch.equal(dst[k].view(torch.uint8), want.contiguous().view(torch.uint8)), k
    # pieces split at odd places give the same (the cast assembles them)
    flat = chunks[0]
    pieces = [flat[:13], flat[13:200], flat[200:]]
    again = {k: torch.zeros_like(v) for k, v in dst.items()}
    BucketApplier(again).apply(plan[0], pieces, b.dests)
    assert all(torch.equal(again[k].view(torch.uint8), dst[k].view(torch.uint8)) for k in dst)


def test_renaming_skipping_and_their_errors() -> None:
    src = state()
    plan, chunks, aliases = packed(src)
    dst = {"E": torch.zeros(7, 5), "H": torch.zeros(7, 5), "W": torch.zeros(5, 5)}
    table = {"emb": "E", "head": "H", "w": "W", "steps": None}
    b = Binding(plan, dst, aliases=aliases, rename=lambda n: table[n])
    assert b.dests == {"emb": ["E", "H"], "w": ["W"], "steps": []}
    BucketApplier(dst).apply(plan[0], chunks, b.dests)
    assert torch.equal(dst["H"], src["emb"]) and torch.equal(dst["W"], src["w"])
    with pytest.raises(WeightMismatchError, match="would receive both"):
        Binding(plan, dst, aliases=aliases, rename=lambda n: "E")
    with pytest.raises(WeightMismatchError, match="'steps' is not a parameter"):
        Binding(plan, dst, aliases=aliases, rename={"emb": "E", "head": "H", "w": "W"})
    with pytest.raises(WeightMismatchError, match="bad alias"):
        Binding(plan, dst, aliases={"x": "nowhere"}, strict=False)


def test_dtype_requests_that_cannot_be_met_are_refused_up_front() -> None:
    src = state()
    plan, _, aliases = packed(src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst["steps"] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(WeightMismatchError, match="dtype mismatch for 'steps'"):
        Binding(plan, dst, aliases=aliases, dtype="auto")  # ints are never converted
    with pytest.raises(WeightMismatchError, match="cannot convert 'steps'"):
        Binding(plan, {}, aliases=aliases, dtype={"steps": "float32"}, loader=True)


def test_a_loader_sees_every_name_in_the_wanted_dtype() -> None:
    src = state()
    plan, chunks, aliases = packed(src)
    b = Binding(plan, {}, aliases=aliases, dtype=torch.bfloat16, loader=True)
    got = dict(b.named_tensors([(plan[0], chunks)]))
    assert set(got) == set(src)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], src["w"].bfloat16())
    assert got["steps"].dtype == torch.int64 and torch.equal(got["head"], got["emb"])
    e = plan[0].tensors[0]
    assert wire_tensor(e, chunks).data_ptr() == chunks[0].data_ptr() + e.offset  # a view


def test_dtype_names_and_the_hello_advertisement() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    with pytest.raises(WeightMismatchError):
        parse_dtype("float7")
    mixed = {"a": torch.zeros(1, dtype=torch.bfloat16), "n": torch.zeros(1, dtype=torch.int64)}
    assert advertised_dtype("auto", mixed) == "bfloat16"
    assert advertised_dtype("auto", {**mixed, "f": torch.zeros(1)}) == ""
    assert advertised_dtype({"a": "float16"}, mixed) == "" and advertised_dtype(None, mixed) == ""
    assert advertised_dtype("fp16", {}) == "float16"
