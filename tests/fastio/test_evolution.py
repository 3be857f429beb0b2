"""Schema evolution: appending fields with defaults keeps old and new peers talking.

"Older" and "newer" peers are simulated with separately defined Struct classes that
share a wire tag, as two versions of fastio in two processes would.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest

import fastio
from fastio import Decoder, Encoder, GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
from fastio.protocol import MsgKind
from fastio.weight_msgs import WeightHello

RESP_TAG = int(MsgKind.LLM_RESPONSE)
REQ_TAG = int(MsgKind.LLM_REQUEST)
GEN_TAG = int(MsgKind.GENERATION_HYPERPARAMETERS)


class NewerResponse(LLMResponse, tag=RESP_TAG):
    """LLMResponse of a newer release: two appended fields with defaults."""

    cached_tokens: int = 0
    routed_experts: TokenArray = msgspec.field(default_factory=TokenArray)


class OlderRequest(msgspec.Struct, array_like=True, gc=False, tag=REQ_TAG):
    """LLMRequest of an older release, before ``metadata`` and ``model_id`` existed."""

    rid: str
    input_ids: TokenArray = msgspec.field(default_factory=TokenArray)
    gconfig: GenerationHyperparameters = msgspec.field(default_factory=GenerationHyperparameters)


class NewerGeneration(msgspec.Struct, array_like=True, gc=False, tag=GEN_TAG):
    """GenerationHyperparameters with an appended field, nested inside a request."""

    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 100000000
    temperature: float = 1.0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    repetition_penalty: float = 1.0


class NewerRequest(msgspec.Struct, array_like=True, gc=False, tag=REQ_TAG):
    rid: str = ""
    input_ids: TokenArray = msgspec.field(default_factory=TokenArray)
    gconfig: NewerGeneration = msgspec.field(default_factory=NewerGeneration)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    model_id: str | None = None
    priority: int = 0


class BrokenNewer(msgspec.Struct, array_like=True, tag=REQ_TAG):
    """A *required* appended field: not a compatible change."""

    rid: str
    input_ids: TokenArray
    gconfig: GenerationHyperparameters
    metadata: dict[str, Any]
    model_id: str | None
    priority: int


def test_newer_response_decodes_in_older_reader() -> None:
    n = 2048
    new = NewerResponse(
        output_tokens=np.arange(n, dtype=np.int32),
        output_logprobs=np.zeros(n, np.float32),
        stop_reason="length",
        cached_tokens=17,
        routed_experts=np.arange(3000, dtype=np.int32),
    )
    frames = Encoder().encode(new)
    # The appended token array is a buffer frame the old reader never looks at.
    assert len(frames) == 4
    for old in (fastio.decode(frames, LLMResponse), fastio.decode(frames)):
        assert type(old) is LLMResponse
        assert old.output_tokens == list(range(n)) and old.stop_reason == "length"
        assert not hasattr(old, "cached_tokens")


def test_older_response_decodes_in_newer_reader() -> None:
    old = LLMResponse(output_tokens=[1, 2, 3], latency=2.0)
    new = Decoder(NewerResponse).decode(fastio.encode(old))
    assert isinstance(new, NewerResponse)
    assert new.output_tokens == [1, 2, 3] and new.latency == 2.0
    assert new.cached_tokens == 0 and new.routed_experts == []


def test_older_request_decodes_in_newer_reader_and_back() -> None:
    old = OlderRequest(rid="a", input_ids=TokenArray([1, 2], dtype="int32"))
    new = fastio.decode(Encoder().encode(old), LLMRequest)
    assert new.rid == "a" and new.input_ids == [1, 2]
    assert new.metadata == {} and new.model_id is None
    back = Decoder(OlderRequest).decode(fastio.encode(LLMRequest(rid="b", model_id="m")))
    assert back.rid == "b" and back.input_ids == []


def test_nested_struct_with_appended_field() -> None:
    new = NewerRequest(rid="x", gconfig=NewerGeneration(n_samples=4, repetition_penalty=1.3))
    old = fastio.decode(Encoder().encode(new), LLMRequest)
    assert old.gconfig == GenerationHyperparameters(n_samples=4)
    newer = Decoder(NewerRequest).decode(fastio.encode(LLMRequest(rid="y")))
    assert newer.gconfig.repetition_penalty == 1.0 and newer.priority == 0


def test_required_appended_field_is_rejected_clearly() -> None:
    with pytest.raises(fastio.DecodeError, match="length"):
        Decoder(BrokenNewer).decode(fastio.encode(OlderRequest(rid="a")))


def test_tag_mismatch_is_rejected() -> None:
    with pytest.raises(fastio.DecodeError, match="invalid message body"):
        Decoder(OlderRequest).decode(fastio.encode(LLMResponse()))


def test_test_types_stay_out_of_the_union() -> None:
    # Classes defined outside fastio never join decode(type=None), so they cannot
    # collide with a real wire tag.
    assert NewerResponse not in fastio.codec.message_types()
    assert type(fastio.decode(fastio.encode(LLMResponse()))) is LLMResponse


class OldHello(msgspec.Struct, array_like=True, tag_field="__kind__", tag=40):
    """WeightHello of the releases before its ``source`` field."""

    worker_id: str
    host_id: str
    pid: int
    version: int = -1
    digest: int | None = None
    dtype: str = ""
    start_time: int = 0


def test_weight_hello_bytes_before_and_after_its_source_field() -> None:
    assert int(MsgKind.WEIGHT_HELLO) == 40
    # The body an older subscriber sends, literally: read today as a Hello without a source.
    old = msgpack.packb([40, "w0", "host", 12, 5, None, "", 99])
    assert msgspec.msgpack.decode(old, type=WeightHello) == WeightHello(
        "w0", "host", 12, 5, None, "", 99, source=""
    )
    # Today's Hello in an older publisher: the trailing field is ignored.
    new = msgspec.msgpack.encode(WeightHello("w0", "host", 12, 5, None, "", 99, source="p1"))
    assert new == b"\x99" + old[1:] + msgpack.packb("p1")  # an array of 9, not 8: appended
    assert msgspec.msgpack.decode(new, type=OldHello) == OldHello("w0", "host", 12, 5, None, "", 99)
