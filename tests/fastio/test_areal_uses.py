"""AReaL's own uses of the types, as its rollout code writes them (drop-in parity).

Each test is a pattern taken from AReaL's ``RemoteSGLangEngine.agenerate`` and its RLVR
workflow, run on fastio's types: they must behave as the seed's dataclasses of lists.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing as mp
import os
import uuid
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import fastio
from fastio import (
    AllocationMode,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    SaverConfig,
    TokenArray,
    WeightUpdateMeta,
)
from fastio import fabric_msgs as fm
from tests.helpers import all_messages


def sglang_payload(req: LLMRequest) -> dict[str, Any]:
    """What AReaL's agenerate posts to SGLang's /generate (aiohttp ``json=``)."""
    g = req.gconfig
    return {
        "input_ids": req.input_ids.copy(),
        "sampling_params": {
            "top_p": g.top_p,
            "top_k": g.top_k,
            "max_new_tokens": g.max_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature,
            "stop_token_ids": g.stop_token_ids,
        },
        "return_logprob": True,
        "stream": False,
    }


def fake_sglang(payload_text: str, produced: int, abort_after: int | None) -> dict[str, Any]:
    """A stand-in for the server: reads the JSON payload, answers as SGLang does
    (``finish_reason`` ``"abort"`` when a pause interrupts the generation)."""
    payload = json.loads(payload_text)
    ids, params = payload["input_ids"], payload["sampling_params"]
    n = params["max_new_tokens"]
    if abort_after is not None:
        n = min(n, abort_after)
    out = [(ids[-1] + 1 + i) % 50_000 for i in range(n)]
    finish = "abort" if abort_after is not None and n == abort_after else "length"
    return {
        "output_ids": out,
        "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "finish_reason": {"type": finish},
        },
    }


def test_payload_goes_through_stdlib_json() -> None:
    req = LLMRequest(
        rid=uuid.uuid4().hex,
        input_ids=[1, 2, 3],
        gconfig=GenerationHyperparameters(max_new_tokens=8, stop_token_ids=[2]),
    )
    payload = sglang_payload(req)
    assert type(payload["input_ids"]) is list
    text = json.dumps(payload)
    assert json.loads(text)["input_ids"] == [1, 2, 3]
    # Decoded requests (views of received frames) serialise the same way.
    got = fastio.decode(fastio.encode(req))
    assert json.dumps(sglang_payload(got)) == text


def test_accumulate_and_resubmit_loop() -> None:
    """agenerate's loop: resubmit after each abort with the output appended."""
    g = GenerationHyperparameters(max_new_tokens=10)
    req = LLMRequest(rid="r", input_ids=[7, 8, 9], gconfig=g)
    payload = sglang_payload(req)
    acc_tokens: list[int] = []
    acc_logprobs: list[float] = []
    acc_versions: list[int] = []
    stop_reason = "length"
    reasons: list[str] = []
    version = 0
    rounds = 0
    while stop_reason != "stop" and len(acc_tokens) < g.max_new_tokens:
        rounds += 1
        result = fake_sglang(json.dumps(payload), len(acc_tokens), abort_after=4)
        finish = result["meta_info"]["finish_reason"]["type"]
        out = result["output_ids"]
        acc_tokens.extend(out)
        acc_logprobs.extend(x[0] for x in result["meta_info"]["output_token_logprobs"])
        acc_versions.extend([version] * len(out))
        payload["input_ids"] += out
        payload["sampling_params"]["max_new_tokens"] -= len(out)
        stop_reason = "stop" if finish == "stop" else "abort" if finish == "abort" else "length"
        reasons.append(stop_reason)
        version += 1
        if len(acc_tokens) >= g.max_new_tokens:
            break
    assert rounds == 3 and len(acc_tokens) == 10 and reasons == ["abort", "abort", "length"]
    for reason in reasons:
        resp = LLMResponse(
            input_tokens=req.input_ids,
            output_tokens=acc_tokens,
            output_logprobs=acc_logprobs,
            output_versions=acc_versions,
            stop_reason=reason,  # type: ignore[arg-type]
        )
        assert resp.output_tokens == acc_tokens and resp.output_versions == acc_versions
        assert fastio.decode(fastio.encode(resp)).stop_reason == reason
    assert payload["input_ids"] == [7, 8, 9, *acc_tokens]


def test_token_fields_accumulate_like_lists() -> None:
    """``req.input_ids += resp.output_tokens``, ``.extend`` and ``.copy()`` on the fields
    themselves, including decoded ones (views of received, read-only frames)."""
    req = LLMRequest(input_ids=[1, 2, 3])
    frames = [bytes(f) for f in fastio.encode(LLMResponse(output_tokens=np.arange(5000)))]
    resp = fastio.decode(frames, LLMResponse)
    prompt = req.input_ids.copy()
    req.input_ids += resp.output_tokens
    assert len(req.input_ids) == 5003 and req.input_ids[:4] == [1, 2, 3, 0]
    req.input_ids.extend(resp.output_tokens[:2])
    req.input_ids.extend([11, 12])
    assert req.input_ids[-4:] == [0, 1, 11, 12]
    assert prompt == [1, 2, 3] and type(prompt) is list  # the copy is independent
    snapshot = req.input_ids.copy()
    req.input_ids[0] = 99  # item assignment, as on a list
    assert snapshot[0] == 1 and req.input_ids[0] == 99
    assert resp.output_tokens[:3] == [0, 1, 2]  # the received frame is untouched
    back = fastio.decode(fastio.encode(req))
    assert back.input_ids == req.input_ids.copy()


def test_abort_stop_reason_is_stored_and_travels() -> None:
    resp = LLMResponse(output_tokens=[1, 2], stop_reason="abort")
    assert fastio.decode(fastio.encode(resp)).stop_reason == "abort"
    result = fm.Result(id=3, output_tokens=TokenArray([1]), stop_reason="abort")
    assert fastio.decode(fastio.encode(result), fm.Result).stop_reason == "abort"


def test_version_lists() -> None:
    resp = fastio.decode(
        fastio.encode(
            LLMResponse(input_tokens=[5, 6, 7], output_tokens=[8, 9], output_versions=[3, 4])
        )
    )
    versions = [-1] * resp.input_len + resp.output_versions
    assert versions == [-1, -1, -1, 3, 4]
    seq = resp.input_tokens + resp.output_tokens
    logprobs = [0.0] * resp.input_len + resp.output_logprobs
    assert len(seq) == len(versions) == 5 and len(logprobs) == 3
    assert torch.tensor(versions.copy()).tolist() == [-1, -1, -1, 3, 4]
    assert torch.as_tensor(versions).tolist() == [-1, -1, -1, 3, 4]
    assert max(resp.output_versions) == 4 and min(versions) == -1
    assert json.dumps({"versions": versions.copy()}) == '{"versions": [-1, -1, -1, 3, 4]}'


def test_json_dumps_of_every_type_through_msgspec() -> None:
    """Trajectories dumped as JSON lines: msgspec.json.encode / to_builtins with
    fastio.enc_hook, and back."""
    for msg in all_messages():
        text = msgspec.json.encode(msg, enc_hook=fastio.enc_hook)
        built = msgspec.to_builtins(msg, enc_hook=fastio.enc_hook)
        assert isinstance(json.loads(text), list)  # array_like Structs: JSON arrays
        json.dumps(built)  # plain builtins
        if not isinstance(msg, (fastio.VLMRequest, fastio.VLMResponse, fastio.SaveLoadMeta)):
            assert msgspec.convert(built, type(msg)) == msg
    resp = LLMResponse(output_tokens=[1, 2], output_logprobs=[-0.5, -0.25], latency=1.0, ttft=0.5)
    named = msgspec.to_builtins(msgspec.structs.asdict(resp), enc_hook=fastio.enc_hook)
    assert named["output_tokens"] == [1, 2] and named["output_logprobs"] == [-0.5, -0.25]
    assert json.loads(json.dumps(named))["stop_reason"] == "stop"


def test_dataclass_helpers_have_msgspec_twins() -> None:
    g = GenerationHyperparameters(max_new_tokens=5)
    h = msgspec.structs.replace(g, max_new_tokens=6)
    assert h.max_new_tokens == 6 and g.max_new_tokens == 5
    assert [f.name for f in msgspec.structs.fields(LLMRequest)] == [
        "rid",
        "input_ids",
        "gconfig",
        "metadata",
        "model_id",
    ]
    d = msgspec.structs.asdict(LLMRequest(rid="x", input_ids=[1]))
    assert d["rid"] == "x" and d["input_ids"] == [1]


def _use_meta(meta: WeightUpdateMeta) -> tuple[str, str | None, int, int, str]:
    """Runs in a worker process: the meta arrives by pickle, as AReaL's launcher sends it."""
    assert type(meta) is WeightUpdateMeta
    world = meta.alloc_mode.gen_world_size if meta.alloc_mode else 0
    shapes = sum(len(p.shape) for p in meta.nccl_param_specs)
    return meta.type, meta.path, world, shapes, f"{os.getpid()}"


@pytest.mark.slow
def test_weight_update_meta_pickles_into_a_process_pool(tmp_path: Any) -> None:
    disk = WeightUpdateMeta.from_disk(
        SaverConfig(experiment_name="e", trial_name="t", fileroot=str(tmp_path))
    )
    nccl = WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d2p1t1+d2p1t1"),
        [ParamSpec("w", (4, 4), "bfloat16"), ParamSpec("b", (4,), "float32")],
        master_address="127.0.0.1",
        master_port=29511,
    )
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        got = list(pool.map(_use_meta, [disk, nccl]))
    assert got[0][:4] == ("disk", disk.path, 0, 0)
    assert got[1][:4] == ("nccl", None, 2, 3)
    assert all(pid != str(os.getpid()) for *_, pid in got)
