"""Sampling parameters are validated once, where data enters: on construction (naming
the field and the rule) and on decode (fastio.DecodeError naming the field path and the
rule, which a worker turns into BAD_REQUEST)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

import fastio
from fastio import (
    MAX_NEW_TOKENS,
    DecodeError,
    Decoder,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    TokenArray,
)
from fastio import fabric_msgs as fm

DEFAULTS = GenerationHyperparameters()


def test_areal_defaults_hold() -> None:
    g = GenerationHyperparameters()
    assert (g.n_samples, g.max_new_tokens, g.min_new_tokens, g.greedy) == (1, 16384, 0, False)
    assert (g.top_p, g.top_k, g.temperature, g.stop_token_ids) == (1.0, 100000000, 1.0, [])
    # Edges of each rule are accepted.
    GenerationHyperparameters(
        max_new_tokens=MAX_NEW_TOKENS, top_p=1e-9, top_k=1, temperature=0.0, stop_token_ids=[0]
    )
    GenerationHyperparameters(greedy=True, temperature=0, top_p=1)  # ints where floats go


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("max_new_tokens", 0, ValueError, "max_new_tokens must be >= 1, got 0"),
        ("max_new_tokens", -5, ValueError, "max_new_tokens must be >= 1"),
        ("max_new_tokens", 10**12, ValueError, "max_new_tokens must be <= 16777216"),
        ("max_new_tokens", "10", TypeError, "max_new_tokens must be an int, got str '10'"),
        ("max_new_tokens", 10.0, TypeError, "max_new_tokens must be an int"),
        ("max_new_tokens", True, TypeError, "max_new_tokens must be an int"),
        ("temperature", -1.0, ValueError, "temperature must be >= 0.0, got -1.0"),
        ("temperature", "hot", TypeError, "temperature must be a float"),
        ("top_p", 2.0, ValueError, "top_p must be <= 1.0, got 2.0"),
        ("top_p", 0.0, ValueError, "top_p must be > 0.0, got 0.0"),
        ("top_p", float("nan"), ValueError, "top_p must be > 0.0"),
        ("top_k", 0, ValueError, "top_k must be >= 1, got 0"),
        ("top_k", -1, ValueError, "top_k must be >= 1"),
        ("n_samples", 0, ValueError, "n_samples must be >= 1, got 0"),
        ("min_new_tokens", -1, ValueError, "min_new_tokens must be >= 0"),
        ("stop_token_ids", [-3], ValueError, r"stop_token_ids\[0\] must be >= 0, got -3"),
        ("stop_token_ids", [1, "2"], TypeError, r"stop_token_ids\[1\] must be an int"),
        ("stop_token_ids", 5, TypeError, "stop_token_ids must be a list of ints"),
        ("greedy", "yes", TypeError, "greedy must be a bool"),
    ],
)
def test_construction_names_field_and_rule(
    field: str, value: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        GenerationHyperparameters(**{field: value})
    with pytest.raises(error, match=match):
        DEFAULTS.new(**{field: value})  # the resubmission path builds one like this


def test_numpy_numbers_are_accepted_as_python_numbers() -> None:
    g = GenerationHyperparameters(max_new_tokens=np.int64(8), top_p=np.float32(0.5))
    assert type(g.max_new_tokens) is int and type(g.top_p) is float
    assert fastio.decode(fastio.encode(g)) == g


def _wire_request(**gconfig: Any) -> bytes:
    """An LLMRequest header built with the msgpack package, as a peer might send it."""
    fields = dict(zip(
        ["n_samples", "max_new_tokens", "min_new_tokens", "greedy", "top_p", "top_k",
         "temperature", "stop_token_ids"],
        [1, 16, 0, False, 1.0, 100000000, 1.0, []],
        strict=True,
    ))  # fmt: skip
    fields.update(gconfig)
    body = [2, "rid", [1, 2], [1, *fields.values()], {}, None]
    return bytes(msgpack.packb([1, 0, body]))


@pytest.mark.parametrize(
    ("gconfig", "rule", "field"),
    [
        ({"max_new_tokens": 0}, "Expected `int` >= 1", "max_new_tokens"),
        ({"max_new_tokens": 10**12}, "Expected `int` <= 16777216", "max_new_tokens"),
        ({"max_new_tokens": "10"}, "Expected `int`, got `str`", "max_new_tokens"),
        ({"temperature": -1.0}, "Expected `float` >= 0.0", "temperature"),
        ({"top_p": 2.0}, "Expected `float` <= 1.0", "top_p"),
        ({"top_k": 0}, "Expected `int` >= 1", "top_k"),
        ({"n_samples": 0}, "Expected `int` >= 1", "n_samples"),
        ({"stop_token_ids": [-3]}, "Expected `int` >= 0", r"stop_token_ids\[0\]"),
    ],
)
def test_wire_violation_is_a_decode_error_naming_path_and_rule(
    gconfig: dict[str, Any], rule: str, field: str
) -> None:
    frames = [_wire_request(**gconfig)]
    with pytest.raises(DecodeError, match=rf"{rule}.*LLMRequest\.gconfig\.{field}"):
        fastio.decode(frames)
    # Nested in a fabric Submit, as a worker receives it: the path starts at Submit.
    body = msgpack.unpackb(frames[0])[2]
    submit = bytes(msgpack.packb([1, 0, [20, 7, body, 0.0, True]]))
    with pytest.raises(DecodeError, match=rf"{rule}.*Submit\.request\.gconfig\.{field}"):
        Decoder(fm.CLIENT_TO_WORKER).decode([submit])


def test_valid_wire_request_decodes_in_both_trust_modes() -> None:
    frames = [_wire_request(max_new_tokens=7, top_p=0.5)]
    for trusted in (False, True):
        req = Decoder(LLMRequest, trusted=trusted).decode(frames)
        assert req.gconfig.max_new_tokens == 7 and req.input_ids == [1, 2]


def test_token_fields_are_checked_in_both_trust_modes() -> None:
    # A float array where token ids go: msgspec sees Any, __post_init__ catches it.
    ext = msgpack.ExtType(16 + 12, np.array([1.5], "<f8").tobytes())  # float64 inline
    frames = [bytes(msgpack.packb([1, 0, [2, "rid", ext]]))]
    for trusted in (False, True):
        with pytest.raises(DecodeError, match="input_ids holds integers"):
            Decoder(LLMRequest, trusted=trusted).decode(frames)
    # msgspec's checks hold in both modes.
    with pytest.raises(DecodeError, match="Expected `int` >= 1"):
        Decoder(LLMRequest, trusted=True).decode([_wire_request(max_new_tokens=0)])


def test_trusted_skips_the_size_limit_only() -> None:
    frames = fastio.encode(LLMRequest(input_ids=np.arange(5000, dtype=np.int32)))
    with pytest.raises(fastio.MessageTooLarge):
        Decoder(LLMRequest, max_message_size=1000).decode(frames)
    got = Decoder(LLMRequest, max_message_size=1000, trusted=True).decode(frames)
    assert len(got.input_ids) == 5000
    with pytest.raises(DecodeError, match="wrong frame count"):
        Decoder(LLMRequest, trusted=True).decode(frames[:1])


def test_construction_checks_are_not_repeated_on_decode() -> None:
    """A decode leaves no decode state behind: construction checks work afterwards,
    in this thread (the decode state is per thread)."""
    fastio.decode(fastio.encode(LLMRequest(input_ids=[1])))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        GenerationHyperparameters(max_new_tokens=0)
    with pytest.raises(DecodeError):
        fastio.decode([_wire_request(max_new_tokens=0)])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        GenerationHyperparameters(max_new_tokens=0)


def test_request_fields_are_typed_on_construction() -> None:
    with pytest.raises(TypeError, match="rid must be a str"):
        LLMRequest(rid=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metadata must be a dict"):
        LLMRequest(metadata=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_id must be a str or None"):
        LLMRequest(model_id=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [">i4", ">u2", np.dtype("int32").newbyteorder(">")])
def test_token_fields_accept_integer_arrays_of_any_byte_order(dtype: Any) -> None:
    """The fast path of the token-field check is a lookup among the native dtypes;
    integers in other byte orders take the full check and are accepted."""
    ids = TokenArray(np.arange(5).astype(dtype))
    req = LLMRequest(input_ids=ids)
    assert req.input_ids == [0, 1, 2, 3, 4]
    resp = LLMResponse(output_tokens=ids, output_logprobs=TokenArray(np.zeros(5, ">f8")))
    assert resp.output_tokens == [0, 1, 2, 3, 4] and resp.output_logprobs == [0.0] * 5
    back = fastio.decode(fastio.encode(req))
    assert back.input_ids == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dtype", ["bool", "float32", "complex64"])
def test_token_ids_refuse_non_integer_token_arrays(dtype: str) -> None:
    ids = TokenArray.wrap(np.zeros(3, dtype))  # wrap checks nothing
    with pytest.raises(TypeError, match="input_ids holds integers"):
        LLMRequest(input_ids=ids)
    with pytest.raises(TypeError, match="output_versions holds integers"):
        LLMResponse(output_versions=ids)
