"""The seed's types: names, fields, defaults and behaviour (parity with io_struct.py)."""

from __future__ import annotations

import getpass
import os
import uuid
from typing import Any

import msgspec
import numpy as np
import pytest

import fastio
from fastio import (
    AllocationMode,
    AllocationType,
    FinetuneSpec,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    RolloutStat,
    SaveLoadMeta,
    SaverConfig,
    TokenArray,
    VLMRequest,
    VLMResponse,
    WeightUpdateMeta,
)

INF = float("inf")


def fields(tp: type) -> list[tuple[str, object]]:
    """(name, default or REQUIRED) for every field, in wire order."""
    out = []
    for f in msgspec.structs.fields(tp):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = "REQUIRED"
        out.append((f.name, default))
    return out


def test_generation_hyperparameters_fields_and_defaults() -> None:
    assert fields(GenerationHyperparameters) == [
        ("n_samples", 1),
        ("max_new_tokens", 16384),
        ("min_new_tokens", 0),
        ("greedy", False),
        ("top_p", 1.0),
        ("top_k", 100000000),
        ("temperature", 1.0),
        ("stop_token_ids", []),
    ]


def test_generation_hyperparameters_new_copies_and_changes() -> None:
    g = GenerationHyperparameters(stop_token_ids=[7])
    h = g.new(max_new_tokens=5, temperature=0.5)
    assert (h.max_new_tokens, h.temperature, h.stop_token_ids) == (5, 0.5, [7])
    assert (g.max_new_tokens, g.temperature) == (16384, 1.0)
    h.stop_token_ids.append(8)  # a copy, not shared
    assert g.stop_token_ids == [7]
    assert g.new() == g and g.new() is not g
    with pytest.raises(TypeError, match="no_such_field"):
        g.new(no_such_field=1)


def test_default_factories_are_fresh() -> None:
    a, b = GenerationHyperparameters(), GenerationHyperparameters()
    a.stop_token_ids.append(1)
    assert b.stop_token_ids == []
    r1, r2 = LLMRequest(), LLMRequest()
    r1.metadata["x"] = 1
    assert r2.metadata == {}
    # The default gconfig is built without the construction checks: still fresh, typed
    # and equal to a checked one.
    r1.gconfig.stop_token_ids.append(7)
    assert r2.gconfig.stop_token_ids == [] and r1.gconfig is not r2.gconfig
    assert type(r2.gconfig) is GenerationHyperparameters
    assert r2.gconfig == GenerationHyperparameters()


def test_llm_request_fields_and_rid() -> None:
    names = [n for n, _ in fields(LLMRequest)]
    assert names == ["rid", "input_ids", "gconfig", "metadata", "model_id"]
    r = LLMRequest()
    assert uuid.UUID(r.rid).version == 4 and str(uuid.UUID(r.rid)) == r.rid
    assert LLMRequest().rid != r.rid
    assert r.input_ids == [] and isinstance(r.input_ids, TokenArray)
    assert r.gconfig == GenerationHyperparameters()
    assert r.metadata == {} and r.model_id is None
    # Positional construction as with the seed's dataclass.
    r = LLMRequest("abc", [1, 2], GenerationHyperparameters(n_samples=4), {"k": "v"}, "m")
    assert (r.rid, r.input_ids, r.gconfig.n_samples, r.metadata, r.model_id) == (
        "abc",
        [1, 2],
        4,
        {"k": "v"},
        "m",
    )


def test_token_fields_accept_lists_and_arrays() -> None:
    ids = np.arange(10, dtype=np.int64)
    r = LLMRequest(input_ids=ids)
    assert r.input_ids.array is ids  # wrapped, no copy
    r = LLMRequest(input_ids=[1, 2, 3])
    assert r.input_ids.dtype == np.int32
    resp = LLMResponse(output_logprobs=[0.1, -0.25], itl=[0.01])
    # Lists of floats keep the exact Python values (float64), as the seed's lists.
    assert resp.output_logprobs == [0.1, -0.25] and resp.output_logprobs.dtype == np.float64
    assert resp.itl.dtype == np.float64
    assert LLMResponse(output_versions=[-1, 3]).output_versions.dtype == np.int32
    with pytest.raises((TypeError, ValueError)):
        LLMRequest(input_ids=["a", "b"])
    # Ids beyond int32 are kept, as the seed kept any int: int64 (uint64 from 2**63).
    big = LLMRequest(input_ids=[1, 2**40])
    assert big.input_ids == [1, 2**40] and big.input_ids.dtype == np.int64
    assert fastio.decode(fastio.encode(big)).input_ids == [1, 2**40]
    assert LLMRequest(input_ids=[2**63]).input_ids.dtype == np.uint64
    with pytest.raises(OverflowError, match="64 bits"):
        LLMRequest(input_ids=[2**64])


def test_llm_response_fields_and_lengths() -> None:
    assert fields(LLMResponse) == [
        ("input_tokens", []),
        ("output_tokens", []),
        ("output_logprobs", []),
        ("output_versions", []),
        ("stop_reason", "stop"),
        ("latency", INF),
        ("ttft", INF),
        ("itl", []),
    ]
    r = LLMResponse(input_tokens=[1, 2, 3], output_tokens=[4, 5])
    assert (r.input_len, r.output_len) == (3, 2)
    assert LLMResponse().input_len == 0 == LLMResponse().output_len


def test_seed_versions_idiom() -> None:
    r = LLMResponse(input_tokens=[1, 2, 3], output_tokens=[4, 5], output_versions=[7, 8])
    versions = [-1] * r.input_len + r.output_versions
    assert versions == [-1, -1, -1, 7, 8]
    seq = r.input_tokens + r.output_tokens
    assert seq == [1, 2, 3, 4, 5] and len(seq) == 5


def test_vlm_types_extend_llm_types() -> None:
    assert issubclass(VLMRequest, LLMRequest) and issubclass(VLMResponse, LLMResponse)
    assert [n for n, _ in fields(VLMRequest)][-1] == "image_data"
    assert VLMRequest().image_data == []
    assert VLMRequest(image_data=None).image_data is None
    assert [n for n, _ in fields(VLMResponse)][-1] == "input_images"
    assert VLMResponse().input_images == []
    assert VLMResponse(output_tokens=[1]).output_len == 1


def test_finetune_spec() -> None:
    assert [n for n, _ in fields(FinetuneSpec)] == [
        "total_train_epochs",
        "dataset_size",
        "train_batch_size",
    ]
    f = FinetuneSpec(total_train_epochs=3, dataset_size=100, train_batch_size=8)
    assert f.steps_per_epoch == 12  # drop_last
    assert f.total_train_steps == 36
    assert FinetuneSpec(1, 7, 8).total_train_steps == 0
    with pytest.raises(TypeError):
        FinetuneSpec(1, 2)  # type: ignore[call-arg]


def test_allocation_type() -> None:
    assert AllocationType.DECOUPLED_vLLM.value == 1
    assert AllocationType.DECOUPLED_SGLANG.value == 2
    assert [m.name for m in AllocationType] == ["DECOUPLED_vLLM", "DECOUPLED_SGLANG"]


def test_allocation_mode_reference_table() -> None:
    m = AllocationMode.from_str("sglang.d4p1t1+d2p2t1")
    assert m.type_ is AllocationType.DECOUPLED_SGLANG
    assert (m.gen_dp_size, m.gen_pp_size, m.gen_tp_size, m.gen_world_size) == (4, 1, 1, 4)
    assert (m.train_dp_size, m.train_pp_size, m.train_tp_size, m.train_world_size) == (2, 2, 1, 4)
    assert m.parallel_strat == {"*": {"d": 2, "p": 2, "t": 1}, "gen": {"d": 4, "p": 1, "t": 1}}

    m = AllocationMode.from_str("d2p2t1+vllm.d4t1p1")
    assert m.type_ is AllocationType.DECOUPLED_vLLM
    assert (m.gen_dp_size, m.gen_tp_size, m.gen_pp_size) == (4, 1, 1)
    assert (m.train_dp_size, m.train_pp_size, m.train_tp_size) == (2, 2, 1)

    m = AllocationMode.from_str("vllm.t2d3p1+p2t4d1")
    assert (m.gen_tp_size, m.gen_dp_size, m.gen_world_size) == (2, 3, 6)
    assert (m.train_pp_size, m.train_tp_size, m.train_world_size) == (2, 4, 8)

    for bad in ("sglang.d4p1t1+eval", "d4p1t1"):
        with pytest.raises(ValueError, match="allocation mode"):
            AllocationMode.from_str(bad)


MALFORMED = [
    ("", "'+'"),
    ("+", "generation backend"),
    ("sglang.d4p1t1", "'+'"),
    ("sglang.d4p1t1+d2p2t1+d1p1t1", "'+'"),
    ("d2p2t1+d4p1t1", "generation backend"),
    ("tensorrt.d4p1t1+d2p2t1", "generation backend"),
    ("sglang.d4p1t1+vllm.d2p2t1", "generation backend"),
    ("SGLANG.d4p1t1+d2p2t1", "generation backend"),
    ("sglang.+d2p2t1", "generation part ''"),
    ("sglang.d4p1+d2p2t1", "generation part 'd4p1'"),
    ("sglang.d4p1t1p1+d2p2t1", "generation part"),
    ("sglang.d4d1t1+d2p2t1", "exactly once"),
    ("sglang.dxp1t1+d2p2t1", "generation part"),
    ("sglang.d-1p1t1+d2p2t1", "generation part"),
    ("sglang.d0p1t1+d2p2t1", "must be >= 1"),
    ("sglang.d4p1t1+d2p0t1", "training size p0"),
    ("sglang.d4p1t1+d2p2t1 ", "training part"),
    (" sglang.d4p1t1+d2p2t1", "generation backend"),
    ("sglang.d4p1t1+eval", "training part 'eval'"),
    ("sglang.d4 p1t1+d2p2t1", "generation part"),
    ("sglang:d4p1t1+d2p2t1", "generation backend"),
]


@pytest.mark.parametrize(("text", "what"), MALFORMED)
def test_allocation_mode_malformed_says_what_and_how(text: str, what: str) -> None:
    with pytest.raises(ValueError) as info:
        AllocationMode.from_str(text)
    msg = str(info.value)
    assert what in msg
    assert repr(text) in msg  # names the input
    assert "sglang.d4p1t1+d2p2t1" in msg or "d4p1t1" in msg  # shows a valid form


def test_allocation_mode_seed_helpers() -> None:
    assert AllocationMode.extract_parallelism_strategy("t2d4p1") == {"*": {"t": 2, "d": 4, "p": 1}}
    assert AllocationMode.extract_decoupled_alloc("d2p2t1+vllm.d4t1p1") == {
        "*": {"d": 2, "p": 2, "t": 1},
        "gen": {"d": 4, "t": 1, "p": 1},
    }
    for bad in ("d2p2", "x", "d2p2t1+"):
        with pytest.raises(ValueError, match="d4p1t1"):
            AllocationMode.extract_parallelism_strategy(bad)
    with pytest.raises(ValueError):
        AllocationMode.extract_decoupled_alloc("d4p1t1")


@pytest.mark.parametrize("bad", [None, 42, b"sglang.d4p1t1+d2p2t1"])
def test_allocation_mode_not_a_string(bad: object) -> None:
    with pytest.raises(ValueError, match="string"):
        AllocationMode.from_str(bad)  # type: ignore[arg-type]


def test_allocation_mode_round_trips() -> None:
    m = AllocationMode.from_str("sglang.d4p1t1+d2p2t1")
    back = fastio.decode(fastio.encode(m))
    assert back == m and back.type_ is AllocationType.DECOUPLED_SGLANG


def test_param_spec() -> None:
    p = ParamSpec(name="w", shape=(2, 3), dtype="bfloat16")
    assert (p.name, p.shape, p.dtype) == ("w", (2, 3), "bfloat16")
    back = fastio.decode(fastio.encode(p), ParamSpec)
    assert back == p and back.shape == (2, 3)


def test_saver_config_fields() -> None:
    assert fields(SaverConfig) == [
        ("experiment_name", "REQUIRED"),
        ("trial_name", "REQUIRED"),
        ("fileroot", "REQUIRED"),
        ("freq_epochs", None),
        ("freq_steps", None),
        ("freq_secs", None),
    ]


def test_weight_update_meta_fields() -> None:
    assert fields(WeightUpdateMeta) == [
        ("type", "REQUIRED"),
        ("path", None),
        ("alloc_mode", None),
        ("nccl_master_address", "127.0.0.1"),
        ("nccl_master_port", 29500),
        ("nccl_param_specs", []),
        ("nccl_group_name", "update_weight_group"),
    ]


def test_weight_update_meta_from_disk_exact_path(tmp_path: Any) -> None:
    root = str(tmp_path / "data" / "root")
    cfg = SaverConfig(experiment_name="exp", trial_name="t1", fileroot=root)
    meta = WeightUpdateMeta.from_disk(cfg)
    assert meta.type == "disk"
    user = getpass.getuser()
    assert meta.path == f"{root}/checkpoints/{user}/exp/t1/default/weight_update"
    assert meta.path == os.path.join(
        root, "checkpoints", user, "exp", "t1", "default", "weight_update"
    )
    # As the seed's Saver.get_save_checkpoint_root: the checkpoint root exists, the
    # weight_update directory is the trainer's to write.
    assert os.path.isdir(os.path.dirname(meta.path)) and not os.path.exists(meta.path)
    assert WeightUpdateMeta.from_disk(cfg) == meta  # exist_ok
    assert fastio.decode(fastio.encode(meta)) == meta


class FakeEngine:
    def __init__(self, specs: list[ParamSpec]) -> None:
        self.specs = specs

    def get_param_specs(self) -> list[ParamSpec]:
        return self.specs


def test_weight_update_meta_process_group_factories() -> None:
    alloc = AllocationMode.from_str("sglang.d2p1t2+d2p1t1")
    specs = [ParamSpec("a", (4, 4), "float32"), ParamSpec("b", (8,), "bfloat16")]
    m = WeightUpdateMeta.from_param_specs(
        alloc, specs, nccl_group_name="g", master_address="127.0.0.1", master_port=1234
    )
    assert (m.type, m.alloc_mode, m.nccl_param_specs, m.nccl_group_name) == (
        "nccl",
        alloc,
        specs,
        "g",
    )
    assert (m.nccl_master_address, m.nccl_master_port) == ("127.0.0.1", 1234)
    assert m.nccl_param_specs is not specs  # a copy of the caller's list

    f = WeightUpdateMeta.from_fsdp_nccl(alloc, FakeEngine(specs))
    assert f.type == "nccl" and f.nccl_param_specs == specs
    assert f.nccl_group_name == "update_weight_group"
    assert isinstance(f.nccl_master_address, str) and f.nccl_master_address
    assert 0 < f.nccl_master_port < 65536
    back = fastio.decode(fastio.encode(f))
    assert back == f and back.alloc_mode.gen_world_size == 4


class FakeTokenizer:
    name_or_path = "Qwen/Qwen2-0.5B"

    def encode(self, text: str) -> list[int]:
        return [1, 2]


def test_save_load_meta_tokenizer_travels_as_name() -> None:
    assert [n for n, _ in fields(SaveLoadMeta)] == [
        "path",
        "weight_format",
        "with_optim",
        "tokenizer",
        "processor",
        "base_model_path",
        "naive_distributed",
    ]
    tok = FakeTokenizer()
    m = SaveLoadMeta("/ckpt", "hf", False, tok, None, "/base")
    assert m.tokenizer is tok and m.naive_distributed is False  # live in process
    back = fastio.decode(fastio.encode(m))
    assert isinstance(back, SaveLoadMeta)
    assert back.tokenizer == "Qwen/Qwen2-0.5B" and back.processor is None
    assert (back.path, back.weight_format, back.with_optim, back.base_model_path) == (
        "/ckpt",
        "hf",
        False,
        "/base",
    )
    with pytest.raises(TypeError):
        SaveLoadMeta("/ckpt", "hf", False)  # type: ignore[call-arg]  # required, as in the seed


def test_live_objects_without_a_name_are_refused() -> None:
    m = SaveLoadMeta("/ckpt", "hf", False, object(), None, None)
    with pytest.raises(fastio.EncodeError, match="object"):
        fastio.encode(m)


def test_rollout_stat() -> None:
    assert fields(RolloutStat) == [("submitted", 0), ("accepted", 0), ("running", 0)]
    s = RolloutStat(submitted=5, accepted=3, running=2)
    s.running -= 1  # mutable, as the seed's dataclass
    assert fastio.decode(fastio.encode(s)) == RolloutStat(5, 3, 1)


def test_wire_structs_are_mutable_and_untracked() -> None:
    r = LLMRequest(input_ids=[1])
    r.input_ids += [2, 3]
    assert r.input_ids == [1, 2, 3]
    for tp in fastio.MESSAGE_TYPES:
        cfg = tp.__struct_config__
        assert cfg.array_like and not cfg.gc and not cfg.frozen and not cfg.forbid_unknown_fields
        assert isinstance(cfg.tag, int)
    tags = [tp.__struct_config__.tag for tp in fastio.MESSAGE_TYPES]
    assert tags == [int(k) for k in fastio.MsgKind if k < 20]


def test_token_fields_reject_arrays_of_the_wrong_kind() -> None:
    import numpy as np

    with pytest.raises(TypeError, match="input_ids holds integers"):
        fastio.LLMRequest(input_ids=np.zeros(3))
    with pytest.raises(TypeError, match="output_versions holds integers"):
        fastio.LLMResponse(output_versions=np.ones(2, dtype=bool))
    with pytest.raises(TypeError, match="itl holds numbers"):
        fastio.LLMResponse(itl=np.ones(2, dtype=bool))
    # A float array arriving in a token-id field is a DecodeError, not a silent pass.
    bad = fastio.LLMResponse()
    bad.output_tokens = fastio.TokenArray(np.zeros(4))  # attribute writes are unchecked
    with pytest.raises(fastio.DecodeError, match="output_tokens holds integers"):
        fastio.decode(fastio.encode(bad))
    good = fastio.decode(fastio.encode(fastio.LLMResponse(output_logprobs=np.zeros(4, np.float32))))
    assert good.output_logprobs == [0.0] * 4


def test_seed_dataclass_gconfig_is_converted_and_garbage_rejected() -> None:
    from dataclasses import dataclass, field

    @dataclass
    class SeedGconfig:  # the seed's own dataclass, as users construct it today
        n_samples: int = 2
        max_new_tokens: int = 7
        min_new_tokens: int = 0
        greedy: bool = True
        top_p: float = 1.0
        top_k: int = 100000000
        temperature: float = 1.0
        stop_token_ids: list[int] = field(default_factory=lambda: [3])

    req = fastio.LLMRequest(gconfig=SeedGconfig())  # type: ignore[arg-type]
    assert type(req.gconfig) is fastio.GenerationHyperparameters
    assert (req.gconfig.max_new_tokens, req.gconfig.greedy, req.gconfig.stop_token_ids) == (
        7,
        True,
        [3],
    )
    with pytest.raises(TypeError, match="gconfig must be a GenerationHyperparameters"):
        fastio.LLMRequest(gconfig=3)  # type: ignore[arg-type]


def test_stop_reason_is_validated_on_construction() -> None:
    with pytest.raises(ValueError, match="stop_reason must be one of"):
        fastio.LLMResponse(stop_reason="paused")  # type: ignore[arg-type]
    assert fastio.LLMResponse(stop_reason="abort").stop_reason == "abort"
