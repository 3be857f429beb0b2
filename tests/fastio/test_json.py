"""``fastio.to_builtins`` / ``fastio.to_json``: named fields at every depth, token
arrays as lists, read back by the standard library's ``json``."""

from __future__ import annotations

import json
import math

import msgspec
import numpy as np
import pytest

import fastio


def test_response_has_named_fields_and_lists() -> None:
    resp = fastio.LLMResponse(
        input_tokens=[1, 2, 3],
        output_tokens=[7, 8],
        output_logprobs=[-0.5, -0.25],
        output_versions=[4, 5],
        stop_reason="length",
        latency=0.5,
        ttft=0.125,
        itl=[0.25],
    )
    got = json.loads(fastio.to_json(resp))
    assert got == {
        "input_tokens": [1, 2, 3],
        "output_tokens": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "output_versions": [4, 5],
        "stop_reason": "length",
        "latency": 0.5,
        "ttft": 0.125,
        "itl": [0.25],
    }
    # The positional wire form is what msgspec gives by itself: that is not this.
    assert isinstance(json.loads(msgspec.json.encode(resp, enc_hook=fastio.enc_hook)), list)


def test_nested_structs_are_named_too() -> None:
    req = fastio.LLMRequest(
        rid="r1",
        input_ids=np.array([5, 6], dtype=np.int32),
        gconfig=fastio.GenerationHyperparameters(max_new_tokens=4, stop_token_ids=[2]),
        metadata={"step": 3, "inner": [fastio.ParamSpec(name="w", shape=(2, 3), dtype="float32")]},
    )
    got = json.loads(fastio.to_json(req))
    assert got["rid"] == "r1" and got["input_ids"] == [5, 6]
    assert got["gconfig"]["max_new_tokens"] == 4 and got["gconfig"]["stop_token_ids"] == [2]
    assert got["metadata"] == {
        "step": 3,
        "inner": [{"name": "w", "shape": [2, 3], "dtype": "float32"}],
    }
    assert fastio.to_builtins(req) == got


def test_weight_update_meta_with_specs_and_allocation() -> None:
    meta = fastio.WeightUpdateMeta(
        type="nccl",
        alloc_mode=fastio.AllocationMode.from_str("sglang.d4p1t1+d2p2t1"),
        nccl_param_specs=[fastio.ParamSpec(name="w", shape=(4,), dtype="bfloat16")],
    )
    got = json.loads(fastio.to_json(meta))
    assert got["type"] == "nccl"
    assert got["nccl_param_specs"] == [{"name": "w", "shape": [4], "dtype": "bfloat16"}]
    assert got["alloc_mode"] == {
        "type_": fastio.AllocationType.DECOUPLED_SGLANG.value,
        "parallel_strat": {"*": {"d": 2, "p": 2, "t": 1}, "gen": {"d": 4, "p": 1, "t": 1}},
    }


def test_infinities_and_a_list_of_messages() -> None:
    out = fastio.to_builtins([fastio.LLMResponse(output_tokens=[1]), {"k": (1, 2)}])
    assert out[0]["output_tokens"] == [1] and math.isinf(out[0]["latency"])
    assert out[1] == {"k": [1, 2]}
    # JSON has no infinity: msgspec writes null, which json reads back as None.
    assert json.loads(fastio.to_json(fastio.LLMResponse()))["latency"] is None


def test_unknown_values_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="cannot convert object"):
        fastio.to_json(fastio.LLMRequest(input_ids=[1], metadata={"x": object()}))


def test_tensors_become_nested_lists() -> None:
    torch = pytest.importorskip("torch")
    got = json.loads(fastio.to_json({"t": torch.arange(4).reshape(2, 2)}))
    assert got == {"t": [[0, 1], [2, 3]]}
