"""Property tests: round trips of every type, and garbage only ever raises DecodeError.

Derandomized with bounded example counts so the file runs in seconds and the same
examples run everywhere.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastio
from fastio import (
    AllocationMode,
    AllocationType,
    DecodeError,
    FinetuneSpec,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    RolloutStat,
    SaveLoadMeta,
    SaverConfig,
    VLMRequest,
    VLMResponse,
    WeightUpdateMeta,
)

FAST = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
finite = st.floats(allow_nan=False)
text = st.text(max_size=20)
# Sizes straddling the inline threshold (256 bytes = 64 int32).
token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=200)
float_lists = st.lists(finite, max_size=100)
json_like = st.recursive(
    st.none() | st.booleans() | i64 | finite | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=10,
)

gconfigs = st.builds(
    GenerationHyperparameters,
    n_samples=st.integers(1, 64),
    max_new_tokens=st.integers(1, 2**20),
    min_new_tokens=st.integers(0, 100),
    greedy=st.booleans(),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(1, 2**63 - 1),
    temperature=st.floats(0.0, 1e300),
    stop_token_ids=st.lists(st.integers(0, 2**63 - 1), max_size=5),
)
requests = st.builds(
    LLMRequest,
    rid=text,
    input_ids=token_lists,
    gconfig=gconfigs,
    metadata=st.dictionaries(text, json_like, max_size=4),
    model_id=st.none() | text,
)
responses = st.builds(
    LLMResponse,
    input_tokens=token_lists,
    output_tokens=token_lists,
    output_logprobs=float_lists,
    output_versions=st.lists(st.integers(-1, 2**31 - 1), max_size=200),
    stop_reason=st.sampled_from(["length", "stop", "interrupt", "abort"]),
    latency=st.floats(allow_nan=False),
    ttft=st.floats(allow_nan=False),
    itl=float_lists,
)
sizes = st.integers(1, 64)
allocs = st.builds(
    lambda backend, a, b, c, d, e, f: AllocationMode.from_str(
        f"{backend}.d{a}p{b}t{c}+d{d}p{e}t{f}"
    ),
    st.sampled_from(["vllm", "sglang"]),
    sizes,
    sizes,
    sizes,
    sizes,
    sizes,
    sizes,
)
param_specs = st.builds(
    ParamSpec, name=text, shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple), dtype=text
)
messages = st.one_of(
    gconfigs,
    requests,
    responses,
    st.builds(VLMRequest, rid=text, input_ids=token_lists, image_data=st.none() | st.lists(text)),
    st.builds(VLMResponse, output_tokens=token_lists, input_images=st.lists(text, max_size=3)),
    st.builds(FinetuneSpec, i64, i64, i64),
    allocs,
    param_specs,
    st.builds(
        WeightUpdateMeta,
        type=st.sampled_from(["disk", "nccl"]),
        path=st.none() | text,
        alloc_mode=st.none() | allocs,
        nccl_master_address=text,
        nccl_master_port=st.integers(0, 65535),
        nccl_param_specs=st.lists(param_specs, max_size=3),
        nccl_group_name=text,
    ),
    st.builds(
        SaverConfig,
        text,
        text,
        text,
        st.none() | i64,
        st.none() | i64,
        st.none() | i64,
    ),
    st.builds(
        SaveLoadMeta,
        text,
        text,
        st.booleans(),
        st.none() | text,
        st.none() | text,
        st.none() | text,
        st.booleans(),
    ),
    st.builds(RolloutStat, i64, i64, i64),
)


@FAST
@given(msg=messages, threshold=st.sampled_from([0, 64, 256, 10_000]))
def test_round_trip_every_type(msg: Any, threshold: int) -> None:
    frames = fastio.Encoder(inline_threshold=threshold).encode(msg)
    assert fastio.decode(frames) == msg
    assert fastio.decode([bytes(f) for f in frames], type(msg)) == msg


@FAST
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_random_frames_only_raise_decode_error(frames: list[bytes]) -> None:
    with contextlib.suppress(DecodeError):
        fastio.decode(frames)


@FAST
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=3))
def test_random_bodies_behind_a_valid_prefix(body: bytes, buffers: list[bytes]) -> None:
    header = b"\x93\x01" + bytes([len(buffers)]) + body
    for tp in (None, LLMResponse, dict[str, Any]):
        with contextlib.suppress(DecodeError):
            fastio.decode([header, *buffers], tp)


SEEDS = [
    LLMResponse(
        input_tokens=np.arange(70, dtype=np.int32),
        output_tokens=[1, 2, 3],
        output_logprobs=np.linspace(0, 1, 80),
        output_versions=[4] * 10,
        itl=[0.1],
    ),
    LLMRequest(rid="x", input_ids=list(range(100)), metadata={"k": [1, "v", None]}),
    VLMRequest(image_data=["a"]),
    WeightUpdateMeta.from_param_specs(
        AllocationMode(AllocationType.DECOUPLED_SGLANG, {"*": {"d": 1}, "gen": {"d": 1}}),
        [ParamSpec("w", (2, 2), "float32")],
        master_address="127.0.0.1",
        master_port=1,
    ),
]
SEED_FRAMES = [[bytes(f) for f in fastio.encode(m)] for m in SEEDS]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(SEED_FRAMES))]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "drop", "dup"]))
        pos = draw(st.integers(0, max(len(f) - 1, 0)))
        if op == "flip" and f:
            f[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and f:
            f[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            f[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and f:
            del f[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del f[pos:]
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "dup":
            frames.insert(i, bytearray(f))
    return [bytes(f) for f in frames]


@settings(FAST, max_examples=300)
@given(mutated())
def test_mutated_frames_only_raise_decode_error(frames: list[bytes]) -> None:
    for tp in (None, LLMResponse, LLMRequest):
        with contextlib.suppress(DecodeError):
            fastio.decode(frames, tp)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), i32),
        st.tuples(st.just("extend"), st.lists(i32, max_size=40)),
        st.tuples(st.just("iadd"), st.lists(i32, max_size=40)),
        st.tuples(st.just("pop"), st.integers(-50, 50)),
        st.tuples(st.just("radd"), st.lists(i32, max_size=5)),
        st.tuples(st.just("slice"), st.tuples(st.integers(-60, 60), st.integers(-60, 60))),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=30,
)


@FAST
@given(st.lists(i32, max_size=50), ops)
def test_token_array_matches_a_list(start: list[int], program: list[tuple[str, Any]]) -> None:
    """A random program of list operations gives the same result on both."""
    t, ref = fastio.TokenArray(start, dtype="int32"), list(start)
    for op, arg in program:
        if op == "append":
            t.append(arg)
            ref.append(arg)
        elif op == "extend":
            t.extend(arg)
            ref.extend(arg)
        elif op == "iadd":
            t += arg
            ref += arg
        elif op == "pop":
            if -len(ref) <= arg < len(ref):
                assert t.pop(arg) == ref.pop(arg)
        elif op == "radd":
            t, ref = arg + t, arg + ref
        elif op == "slice":
            t, ref = t[arg[0] : arg[1]], ref[arg[0] : arg[1]]
        else:
            t.clear()
            ref.clear()
        assert t == ref and len(t) == len(ref) and t.dtype == np.int32
    frames = fastio.encode(LLMRequest(input_ids=t))
    assert fastio.decode(frames, LLMRequest).input_ids == ref
