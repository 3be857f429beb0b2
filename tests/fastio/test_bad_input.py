"""Bad input raises fastio.DecodeError saying what is wrong: never another exception,
a hang or a large allocation."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch  # noqa: F401 - imported up front: the allocation checks must not see it

import fastio
from fastio import DecodeError, Decoder, LLMRequest, LLMResponse, MessageTooLarge, TokenArray
from fastio.protocol import TokenEncoding

MiB = 1 << 20


def ext(code: int, payload: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload))


def header(body: Any, n_buffers: int = 0, version: int = 1) -> bytes:
    return msgpack.packb([version, n_buffers, body])


def resp_body(tokens: Any) -> list[Any]:
    """An LLMResponse body (tag 3) whose output_tokens field is ``tokens``."""
    return [3, [], tokens]


@pytest.fixture
def small_peak() -> Iterator[Callable[[], int]]:
    """Peak bytes allocated (numpy included) while the test body runs."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    yield lambda: tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()


def expect(frames: Any, match: str, type: Any = None, **kw: Any) -> DecodeError:
    dec = Decoder(type, **kw)
    with pytest.raises(DecodeError, match=match) as info:
        dec.decode(frames)
    assert isinstance(info.value, ValueError)
    return info.value


GOOD = fastio.encode(
    LLMResponse(output_tokens=np.arange(4000, dtype=np.int32), output_logprobs=[0.5] * 1200)
)
assert len(GOOD) == 3  # both arrays above the inline threshold


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "non-empty list of frames"),
        (b"\x93\x01\x00\x90", "non-empty list of frames"),
        ("frames", "non-empty list of frames"),
        ([42], "not bytes-like"),
        (["text"], "not bytes-like"),
        ([None], "not bytes-like"),
        ([b""], "malformed header"),
        ([b"\xc1"], "malformed header"),
        ([b"\x00"], "malformed header"),
        ([b"garbage bytes that are not msgpack"], "malformed header"),
        ([msgpack.packb([1, 0])], "expected \\[version, n_buffers, body\\]"),
        ([msgpack.packb({"a": 1})], "malformed header"),
        ([msgpack.packb(["1", 0, []])], "must be ints"),
        (
            [header([12], version=3)],
            "unsupported protocol version 3; this decoder reads versions 1-2",
        ),
        ([header([12], version=0)], "unsupported protocol version 0"),
        ([header([12], version=-1)], "unsupported protocol version -1"),
        ([header([12], n_buffers=1)], "wrong frame count: header announces 1 buffers, got 0"),
        ([header([12]), b"x"], "wrong frame count: header announces 0 buffers, got 1"),
        ([header([99])], "invalid message body.*99"),
        ([header(["LLMRequest"])], "invalid message body"),
        ([header([12, "many", 0, 0])], "invalid message body: Expected `int`, got `str`"),
        ([header([3, [], [], [], [], "bogus"])], "invalid message body.*bogus"),
        ([header([2, 42])], "invalid message body: Expected `str`, got `int`"),
        ([header([2, "rid", "not tokens"])], "invalid message body.*array"),
        ([header([2, "rid", [1, "x"]])], "invalid message body.*numbers"),
        ([header([6, 1])], "invalid message body.*length"),
        ([header([12, 1, 2, 3]) + b"\x00"], "invalid message body.*trailing"),
    ],
)
def test_malformed_frames(frames: Any, match: str) -> None:
    expect(frames, match)


def test_every_truncation_of_a_header() -> None:
    h = GOOD[0]
    for cut in range(len(h)):
        with pytest.raises(DecodeError):
            fastio.decode([h[:cut], *GOOD[1:]])


def test_truncated_and_padded_buffer_frames() -> None:
    # The compact reference (ext 48 + d): the frame is the array, whole items only.
    short = [GOOD[0], bytes(GOOD[1])[:-1], GOOD[2]]
    expect(short, "token array of int32 in frame 1 needs a multiple of 4 bytes of data, got 15999")
    long = [GOOD[0], bytes(GOOD[1]) + b"\x00", GOOD[2]]
    expect(long, "needs a multiple of 4 bytes of data, got 16001")
    expect(GOOD[:2], "wrong frame count: header announces 2 buffers, got 1")
    expect([*GOOD, b"extra"], "wrong frame count: header announces 2 buffers, got 3")


def _legacy(frames: list[Any]) -> list[Any]:
    """``frames`` with every compact token-array reference (ext 48 + d, one byte)
    rewritten as the 8-byte form (ext 32 + d: frame index, element count)."""
    version, n, body = msgpack.unpackb(frames[0])

    def fix(v: Any) -> Any:
        if isinstance(v, msgpack.ExtType) and 48 <= v.code < 64:
            (k,) = v.data
            itemsize = np.dtype(fastio.protocol.DTYPE_NAMES[v.code - 48]).itemsize
            count = memoryview(frames[k]).nbytes // itemsize
            return msgpack.ExtType(
                v.code - 16, k.to_bytes(4, "little") + count.to_bytes(4, "little")
            )
        return [fix(x) for x in v] if isinstance(v, list) else v

    return [msgpack.packb([version, n, fix(body)]), *frames[1:]]


def test_legacy_frame_references_decode_and_check_the_count() -> None:
    """The 8-byte reference (what encoders write from frame 256 on) carries the element
    count: a frame of another length is refused even when it holds whole items."""
    legacy = _legacy(GOOD)
    assert fastio.decode(legacy) == fastio.decode(GOOD)
    short = [legacy[0], bytes(GOOD[1])[:-4], GOOD[2]]
    expect(short, "array int32\\[4000\\] needs 16000 bytes of data, got 15996")
    expect([legacy[0], bytes(GOOD[1]) + b"\x00", GOOD[2]], "needs 16000 bytes of data, got 16001")
    swapped = [legacy[0], GOOD[2], GOOD[1]]
    expect(swapped, "needs 16000 bytes of data, got 9600")


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "compact token array frame reference must be 1 byte, got 0"),
        (b"\x01\x00", "compact token array frame reference must be 1 byte, got 2"),
        (b"\x00", "token array refers to frame 0, but the message has frames 1..1"),
        (b"\x02", "token array refers to frame 2, but the message has frames 1..1"),
    ],
)
def test_malformed_compact_frame_references(payload: bytes, match: str) -> None:
    frames = [header(resp_body(msgpack.ExtType(53, payload)), 1), bytes(16)]
    expect(frames, match)
    expect(frames, match, LLMResponse)
    # Without buffer frames every frame reference is an error.
    expect([header(resp_body(msgpack.ExtType(53, b"\x01")))], "no buffer frames")


@pytest.mark.parametrize(
    ("tokens", "frames", "match"),
    [
        (
            ext(1, ["int32", [10**12], 1]),
            [b"\x00" * 64],
            "needs 4000000000000 bytes of data, got 64",
        ),
        (ext(1, ["int32", [10**12], b"\x00" * 8]), [], "needs 4000000000000 bytes"),
        (ext(1, ["float64", [10**6, 10**6, 10**6], 1]), [b""], "bytes of data, got 0"),
        (ext(2, ["bfloat16", [10**12], 1]), [b""], "tensor bfloat16.*needs 2000000000000"),
        (ext(3, ["RGB", 10**6, 10**6, 1]), [b""], "image RGB 1000000x1000000 needs"),
    ],
)
def test_absurd_lengths_fail_fast_without_allocating(
    tokens: Any, frames: list[bytes], match: str, small_peak: Callable[[], int]
) -> None:
    h = header([3, [], [], [], [], "stop", 0.0, 0.0, tokens], n_buffers=len(frames))
    with pytest.raises(DecodeError, match=match):
        fastio.decode([h, *frames])
    assert small_peak() < 1 * MiB


@pytest.mark.parametrize(
    "raw",
    [
        b"\x93\x01\x00\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
        b"\x93\x01\x00\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
        b"\x93\x01\x00\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\x93\x01\x00\xdf\xff\xff\xff\xff",  # map32 of 4 billion pairs
        b"\x93\x01\x00\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GiB
        b"\xdd\xff\xff\xff\xff",  # header itself claims 4 billion items
    ],
)
def test_msgpack_length_prefixes_fail_fast(raw: bytes, small_peak: Callable[[], int]) -> None:
    with pytest.raises(DecodeError):
        fastio.decode([raw])
    assert small_peak() < 1 * MiB


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    deep = b"\x93\x01\x00" + b"\x92\x02" * 100_000 + b"\xc0"
    with pytest.raises(DecodeError):
        fastio.decode([deep])
    deep_any = b"\x93\x01\x00\x94\x02\xa1r\x90" + b"\x81\xa1k" * 100_000 + b"\xc0"
    with pytest.raises(DecodeError):
        fastio.decode([deep_any])


@pytest.mark.parametrize(
    ("descriptor", "frames", "match"),
    [
        (["int32", [4], 2], [b"\x00" * 16], "refers to frame 2, but the message has frames 1..1"),
        (["int32", [4], 0], [b"\x00" * 16], "refers to frame 0"),
        (["int32", [4], -1], [b"\x00" * 16], "refers to frame -1"),
        (["int32", [4], 1], [], "refers to frame 1, but the message has no buffer frames"),
        (["int32", [4], 2**64 - 1], [b"\x00" * 16], "refers to frame"),
        (["int32", [-4], 1], [b"\x00" * 16], "negative dimension"),
        (["int32", [2, -2], 1], [b"\x00" * 16], "negative dimension"),
        (["int32", [1] * 65, 1], [b"\x00" * 4], "65 dimensions"),
        (["int32", [5], 1], [b"\x00" * 16], "array int32\\[5\\] needs 20 bytes of data, got 16"),
        (["int32", [5], b"\x00" * 16], [], "needs 20 bytes of data, got 16"),
        (["complex128", [1], 1], [b"\x00" * 16], "unknown array dtype 'complex128'"),
        (["bfloat16", [8], 1], [b"\x00" * 16], "bfloat16 only as a tensor"),
        (["int32", [4]], [b"\x00" * 16], "malformed array descriptor"),
        (["int32", 4, 1], [b"\x00" * 16], "malformed array descriptor"),
        ([4, [4], 1], [b"\x00" * 16], "malformed array descriptor"),
        (["int32", [4], "1"], [b"\x00" * 16], "malformed array descriptor"),
        (["int32", [4], 1.0], [b"\x00" * 16], "malformed array descriptor"),
    ],
)
def test_bad_array_descriptors(descriptor: Any, frames: list[bytes], match: str) -> None:
    h = header(resp_body(ext(1, descriptor)), n_buffers=len(frames))
    expect([h, *frames], match)
    h = header({"a": ext(1, descriptor)}, n_buffers=len(frames))
    expect([h, *frames], match, type=dict[str, Any])


def test_non_1d_array_in_token_field() -> None:
    h = header(resp_body(ext(1, ["int32", [2, 2], b"\x00" * 16])))
    expect([h], "1-D")


def test_bad_ext_payloads_and_codes() -> None:
    expect([header(resp_body(msgpack.ExtType(9, b"")))], "unknown extension type code 9")
    negative_code = header(resp_body(msgpack.ExtType(5, b"\x00"))).replace(b"\xd4\x05", b"\xd4\xff")
    expect([negative_code], "invalid message body")
    expect([header(resp_body(msgpack.ExtType(1, b"\xc1")))], "malformed array descriptor")
    expect([header(resp_body(msgpack.ExtType(1, b"")))], "malformed array descriptor")


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (["float8", [2], b"\x00\x00"], "unknown tensor dtype 'float8'"),
        (["float32", [2], b"\x00" * 7], "tensor float32\\[2\\] needs 8 bytes of data, got 7"),
        (["float32", [-2], b""], "negative dimension"),
    ],
)
def test_bad_tensor_descriptors(descriptor: Any, match: str) -> None:
    expect([header({"t": ext(2, descriptor)})], match, type=dict[str, Any])


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (["P", 2, 2, b"\x00" * 4], "unsupported image mode 'P'"),
        (["RGB", -2, 2, b""], "invalid image size -2x2"),
        (["RGB", 2, 2, b"\x00" * 11], "image RGB 2x2 needs 12 bytes of data, got 11"),
        (["RGB", 2, 2], "malformed image descriptor"),
        (["RGB", 2, 2, 3], "refers to frame 3"),
    ],
)
def test_bad_image_descriptors(descriptor: Any, match: str) -> None:
    expect([header({"i": ext(3, descriptor)})], match, type=dict[str, Any])


def test_message_size_limit() -> None:
    big = fastio.encode(LLMResponse(output_tokens=np.zeros(10_000, np.int32)))
    total = sum(memoryview(f).nbytes for f in big)
    err = expect(
        big, f"message of {total} bytes exceeds the limit of 1000 bytes", max_message_size=1000
    )
    assert isinstance(err, MessageTooLarge)
    # The limit is checked before anything is parsed: garbage + size -> too large.
    with pytest.raises(MessageTooLarge):
        Decoder(max_message_size=10).decode([b"\xc1" * 11])
    # At the limit it decodes.
    assert Decoder(LLMResponse, max_message_size=total).decode(big).output_len == 10_000


@pytest.mark.parametrize("tokens", [None, TokenEncoding.COMPACT], ids=["default", "compact"])
def test_the_size_limit_counts_bytes_of_an_encoders_own_frames(tokens: Any) -> None:
    # In-process, frames are the arrays themselves: their len() counts items, not bytes.
    enc = fastio.Encoder(tokens=tokens)
    for msg in (
        LLMResponse(output_tokens=np.zeros(10_000, np.int32)),  # two frames
        LLMResponse(output_tokens=np.zeros(10_000, np.int32), output_logprobs=np.zeros(10_000)),
    ):
        frames = enc.encode(msg)
        total = sum(memoryview(f).nbytes for f in frames)
        with pytest.raises(MessageTooLarge):
            Decoder(LLMResponse, max_message_size=total - 1).decode(frames)
        assert Decoder(LLMResponse, max_message_size=total).decode(frames).output_len == 10_000


def test_frame_objects_that_are_not_contiguous() -> None:
    strided = memoryview(np.arange(16, dtype=np.uint8)[::2])
    expect([GOOD[0], strided, GOOD[2]], "not a contiguous buffer")


def test_decoder_keeps_working_after_errors() -> None:
    dec = Decoder(LLMResponse)
    for bad in ([b"\xc1"], [header([99])], GOOD[:2]):
        with pytest.raises(DecodeError):
            dec.decode(bad)
    assert dec.decode(GOOD).output_len == 4000


def test_typed_decoder_wrong_type_message() -> None:
    expect(fastio.encode(LLMRequest()), "invalid message body", type=LLMResponse)


def test_tokens_ext_must_be_1d() -> None:
    expect([header(resp_body(ext(4, ["int32", [2, 2], b"\x00" * 16])))], "token array must be 1-D")
    h = header(resp_body(ext(4, ["int32", [2, 2], 1])), n_buffers=1)
    expect([h, b"\x00" * 16], "token array must be 1-D")
    h = header(resp_body(ext(1, ["int32", [2, 2], 1])), n_buffers=1)
    expect([h, b"\x00" * 16], "1-D")


def test_token_fields_with_wrong_contents() -> None:
    expect([header(resp_body(["a", "b"]))], "output_tokens holds numbers")
    expect([header(resp_body([1.5]))], "output_tokens holds integers, got floats")
    expect([header(resp_body([[1], [2]]))], "output_tokens must be a flat sequence")
    # An int beside a non-number is no overflow; text beside bytes no unicode error.
    expect([header(resp_body([1, None]))], "output_tokens holds numbers, got object values")
    expect([header(resp_body([b"\xff", "a"]))], "output_tokens must be a flat sequence")
    with pytest.raises(OverflowError, match="at most 64 bits"):
        TokenArray([2**70, 1])
    assert Decoder(LLMResponse).decode([header(resp_body([2**40]))]).output_tokens == [2**40]
    expect([header(resp_body({"a": 1}))], "output_tokens takes a list")
    expect([header(resp_body(ext(3, ["L", 1, 1, b"\x00"])))], "output_tokens takes a list")


@pytest.mark.parametrize("code", [-128, -100, -2, 5, 15, 26, 29, 31, 42, 45, 47, 58, 61, 64, 127])
def test_ext_codes_outside_the_tables(code: int) -> None:
    """The decoder's hooks look dtypes up by ext code in 256-entry lists: negative codes
    (the upper half), the bfloat16 codes and the gaps between the token ranges are
    refused, with and without buffer frames."""

    def frames_with(n: int) -> list[bytes]:
        # fixext 1 with the code's byte (msgpack-python refuses to pack negative codes).
        h = header(resp_body(msgpack.ExtType(7, b"\x01")), n)
        h = h.replace(b"\xd4\x07\x01", b"\xd4" + bytes([code & 0xFF]) + b"\x01")
        return [h, bytes(16)][: n + 1]

    for frames in (frames_with(0), frames_with(1)):
        for tp in (None, LLMResponse):
            err = expect(frames, "unknown extension type code|invalid message body", tp)
            assert str(code) in str(err) or code < 0
