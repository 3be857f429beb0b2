"""Round trips, wire layout, zero-copy and sockets of the multi-frame codec."""

from __future__ import annotations

import multiprocessing as mp
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Union

import msgpack
import numpy as np
import pytest
import torch
import zmq
from PIL import Image

import fastio
from fastio import (
    Decoder,
    Encoder,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    RolloutStat,
    TokenArray,
    VLMRequest,
    VLMResponse,
)
from fastio.protocol import DEFAULT_INLINE_THRESHOLD, PROTOCOL_VERSION, ExtCode, MsgKind
from tests.helpers import RNG_SEED, all_messages, big_response, rng

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
]


def assert_same(a: Any, b: Any) -> None:
    """Deep equality with images compared by pixels."""
    assert type(a) is type(b)
    if isinstance(a, Image.Image):
        assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    elif isinstance(a, (VLMRequest, VLMResponse)):
        for f in a.__struct_fields__:
            x, y = getattr(a, f), getattr(b, f)
            if isinstance(x, list):
                assert len(x) == len(y)
                for xi, yi in zip(x, y, strict=True):
                    assert_same(xi, yi)
            else:
                assert x == y
    else:
        assert a == b


@pytest.mark.parametrize("msg", all_messages(), ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "union"])
def test_round_trip_every_type(msg: Any, typed: bool) -> None:
    frames = fastio.encode(msg)
    assert isinstance(frames[0], bytes)
    back = fastio.decode(frames, type(msg) if typed else None)
    assert_same(msg, back)
    # Bytes (as recv(copy=True) delivers) decode the same.
    assert_same(msg, fastio.decode([bytes(f) for f in frames]))


def test_union_decode_returns_whatever_arrived() -> None:
    dec = Decoder()
    for msg in all_messages():
        assert type(dec.decode(fastio.encode(msg))) is type(msg)


def test_typed_decode_rejects_another_type() -> None:
    with pytest.raises(fastio.DecodeError, match="invalid message body"):
        fastio.decode(fastio.encode(RolloutStat()), LLMRequest)


def test_token_fields_decode_as_token_arrays_with_dtypes() -> None:
    resp = fastio.decode(fastio.encode(big_response()), LLMResponse)
    for name in ("input_tokens", "output_tokens", "output_logprobs", "output_versions", "itl"):
        assert type(getattr(resp, name)) is TokenArray
    assert resp.output_logprobs.dtype == np.float32 and resp.itl.dtype == np.float64


@pytest.mark.parametrize("n", [0, 1, 31, 32, 63, 64, 65, 255, 256, 65535, 65536])
def test_boundary_element_counts(n: int) -> None:
    ids = np.arange(n, dtype=np.int32)
    frames = fastio.encode(LLMRequest(rid="x", input_ids=ids))
    inline = ids.nbytes < DEFAULT_INLINE_THRESHOLD
    assert len(frames) == (1 if inline else 2)
    back = fastio.decode(frames, LLMRequest)
    assert back.input_ids == ids.tolist() and back.input_ids.dtype == np.int32
    # Lists of Python ints (metadata, stop ids) at the same sizes.
    g = GenerationHyperparameters(stop_token_ids=list(range(n)))
    assert fastio.decode(fastio.encode(g)).stop_token_ids == list(range(n))
    s = "x" * n
    assert fastio.decode(fastio.encode(LLMRequest(rid=s))).rid == s


@pytest.mark.parametrize("nbytes", [0, 1, 254, 255, 256, 257, 4096])
@pytest.mark.parametrize("threshold", [0, 1, 256, 300])
def test_bytes_around_the_inline_threshold(nbytes: int, threshold: int) -> None:
    arr = np.arange(nbytes, dtype=np.uint8)
    frames = Encoder(inline_threshold=threshold).encode({"a": arr})
    assert len(frames) == (1 if nbytes < threshold else 2)
    if len(frames) == 2:
        assert frames[1].nbytes == nbytes
    back = fastio.decode(frames, dict[str, Any])["a"]
    assert back.dtype == np.uint8 and np.array_equal(back, arr)


def test_bad_inline_threshold() -> None:
    with pytest.raises(ValueError, match="inline_threshold"):
        Encoder(inline_threshold=-1)


def _array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    r = rng()
    if dtype == "bool":
        return np.asarray(r.integers(0, 2, shape), bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return np.asarray(r.integers(info.min, info.max, shape, dtype=dtype, endpoint=True))
    return np.asarray(r.standard_normal(shape) * 100, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (7,), (300,), (5, 7, 3)])
def test_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    arr = _array(dtype, shape)
    back = fastio.decode(fastio.encode({"a": arr}), dict[str, Any])["a"]
    assert back.dtype == np.dtype(dtype) and back.shape == arr.shape
    assert np.array_equal(back, arr, equal_nan=dtype.startswith("float"))


def test_non_contiguous_fortran_and_big_endian_arrays() -> None:
    base = np.arange(2000, dtype=np.float32).reshape(40, 50)
    cases = {
        "strided": base[::2, ::3],
        "transposed": base.T,
        "fortran": np.asfortranarray(base),
        "reversed": base[::-1],
        "big_endian": base.astype(">f4"),
        "big_endian_small": np.arange(3, dtype=">i8"),
        "column": base[:, 1],
    }
    back = fastio.decode(fastio.encode(cases), dict[str, Any])
    for key, arr in cases.items():
        assert back[key].flags.c_contiguous
        assert back[key].dtype == arr.dtype.newbyteorder("=")
        assert np.array_equal(back[key], arr), key


def test_numpy_scalars_and_subclasses() -> None:
    msg = {"f": np.float32(0.5), "i": np.int64(3), "m": np.ma.masked_array([1, 2])}
    back = fastio.decode(fastio.encode(msg), dict[str, Any])
    assert back["f"] == 0.5 and back["i"] == 3 and type(back["i"]) is int
    assert np.array_equal(back["m"], [1, 2])


@pytest.mark.parametrize("bad", [np.array(["a"]), np.zeros(2, np.complex64), np.array([object()])])
def test_unsupported_dtypes_raise_encode_error(bad: np.ndarray) -> None:
    with pytest.raises(fastio.EncodeError, match="unsupported array dtype"):
        fastio.encode({"a": bad})


TORCH_DTYPES = [
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (300,), (4, 0, 2), (16, 33)])
def test_torch_cpu_tensors(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(RNG_SEED)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    back = fastio.decode(fastio.encode({"t": t}), dict[str, Any])["t"]
    assert isinstance(back, torch.Tensor)
    assert back.dtype == dtype and back.shape == t.shape and back.device.type == "cpu"
    assert torch.equal(back, t)


def test_torch_tensor_zero_copy_both_ways() -> None:
    t = torch.arange(4096, dtype=torch.bfloat16)
    frames = fastio.encode({"t": t})
    assert len(frames) == 2
    assert frames[1].nbytes == t.numel() * 2
    src = t.view(torch.uint8).numpy()
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), src)
    received = [bytearray(f) for f in frames]
    back = fastio.decode(received, dict[str, Any])["t"]
    assert np.shares_memory(back.view(torch.uint8).numpy(), np.frombuffer(received[1], np.uint8))
    # From read-only bytes torch gets a private copy (no read-only tensors in torch),
    # without torch's non-writable-buffer warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ro = fastio.decode([bytes(f) for f in frames], dict[str, Any])["t"]
    assert torch.equal(ro, t)
    ro.add_(1)  # must not corrupt the immutable frame


def test_torch_requires_grad_non_contiguous_and_params() -> None:
    w = torch.nn.Linear(8, 4).weight  # a Parameter with requires_grad
    msg = {"w": w, "wt": w.t(), "slice": torch.arange(100.0)[::3]}
    back = fastio.decode(fastio.encode(msg), dict[str, Any])
    assert torch.equal(back["w"], w.detach()) and not back["w"].requires_grad
    assert torch.equal(back["wt"], w.detach().t()) and back["wt"].is_contiguous()
    assert torch.equal(back["slice"], torch.arange(100.0)[::3])


def test_torch_unsupported_dtype() -> None:
    with pytest.raises(fastio.EncodeError, match="unsupported tensor dtype"):
        fastio.encode({"t": torch.zeros(2, dtype=torch.complex64)})


def test_token_fields_accept_tensors() -> None:
    resp = LLMResponse(output_tokens=torch.arange(10, dtype=torch.int32))
    back = fastio.decode(fastio.encode(resp), LLMResponse)
    assert back.output_tokens == list(range(10))


@pytest.mark.parametrize(
    ("mode", "expect"),
    [
        ("L", "L"),
        ("LA", "LA"),
        ("RGB", "RGB"),
        ("RGBA", "RGBA"),
        ("CMYK", "CMYK"),
        ("YCbCr", "YCbCr"),
        ("I", "I"),
        ("F", "F"),
        ("I;16", "I;16"),
        ("1", "L"),
        ("P", "RGB"),
    ],
)
def test_pil_images(mode: str, expect: str) -> None:
    base = Image.fromarray(rng().integers(0, 255, (13, 17, 3), dtype=np.uint8), "RGB")
    img = base.convert(mode)
    back = fastio.decode(fastio.encode({"i": img}), dict[str, Any])["i"]
    assert isinstance(back, Image.Image)
    assert back.mode == expect and back.size == img.size
    assert back.tobytes() == img.convert(expect).tobytes()


def test_pil_image_palette_with_transparency_and_empty() -> None:
    p = Image.new("P", (4, 4))
    p.info["transparency"] = 0
    back = fastio.decode(fastio.encode([p]), list[Any])[0]
    assert back.mode == "RGBA" and back.size == (4, 4)
    empty = Image.new("RGB", (0, 3))
    back = fastio.decode(fastio.encode([empty]), list[Any])[0]
    assert back.size == (0, 3) and back.mode == "RGB"


def test_large_image_is_a_frame() -> None:
    img = Image.new("RGB", (64, 64), (1, 2, 3))
    frames = fastio.encode(VLMRequest(image_data=[img]))
    assert len(frames) == 2 and frames[1].nbytes == 64 * 64 * 3
    assert fastio.decode(frames).image_data[0].getpixel((5, 5)) == (1, 2, 3)


def test_header_is_plain_msgpack() -> None:
    resp = big_response(2048)
    resp.input_tokens = TokenArray(np.arange(300, dtype=np.int32))  # 1200 bytes: inline
    frames = fastio.encode(resp)
    header = msgpack.unpackb(frames[0], strict_map_key=False)
    version, n_buffers, body = header
    assert version == PROTOCOL_VERSION == 2 and n_buffers == len(frames) - 1 == 4
    assert body[0] == MsgKind.LLM_RESPONSE == 3
    # Token arrays in a frame: ext 48 + dtype index (int32 is 5), the frame index as
    # one byte; the frame is the array (2048 int32).
    ext = body[2]
    assert isinstance(ext, msgpack.ExtType) and ext.code == ExtCode.TOKENS_REF + 5 == 53
    assert ext.data == b"\x01" and memoryview(frames[1]).nbytes == 2048 * 4
    assert body[3].code == ExtCode.TOKENS_REF + 11 and body[3].data == b"\x02"  # float32
    assert body[5:8] == ["length", 1.5, 0.25]
    inline = body[1]  # 300 int32 = 1200 bytes: ext 16 + 5, the raw elements
    assert inline.code == ExtCode.TOKENS_INLINE + 5 == 21
    assert np.frombuffer(inline.data, "<i4").tolist() == list(range(300))


def test_header_of_inline_arrays_and_defaults_is_plain_msgpack() -> None:
    frames = fastio.encode(LLMRequest(rid="abc", input_ids=[1, 2, 3]))
    assert len(frames) == 1
    version, n_buffers, body = msgpack.unpackb(frames[0])
    assert (version, n_buffers) == (2, 0)
    assert body[0] == MsgKind.LLM_REQUEST and body[1] == "abc"
    assert body[2].code == 21 and np.frombuffer(body[2].data, "<i4").tolist() == [1, 2, 3]
    # Every field is written, defaults included (msgspec ignores omit_defaults for
    # array_like Structs): gconfig, metadata, model_id.
    assert body[3][0] == MsgKind.GENERATION_HYPERPARAMETERS and body[4:] == [{}, None]


def test_inline_threshold_keeps_small_requests_in_one_frame() -> None:
    assert DEFAULT_INLINE_THRESHOLD > 256
    frames = fastio.encode(LLMRequest(input_ids=np.arange(64, dtype=np.int32)))
    assert len(frames) == 1
    batch = [LLMRequest(input_ids=np.arange(64, dtype=np.int32)) for _ in range(256)]
    assert len(fastio.encode(batch)) == 1
    below = DEFAULT_INLINE_THRESHOLD // 4 - 1
    assert len(fastio.encode(LLMRequest(input_ids=np.arange(below, dtype=np.int32)))) == 1
    at = DEFAULT_INLINE_THRESHOLD // 4
    assert len(fastio.encode(LLMRequest(input_ids=np.arange(at, dtype=np.int32)))) == 2


def test_legacy_tokens_ext_4_still_decodes() -> None:
    ext = msgpack.ExtType(4, msgpack.packb(["int32", [3], np.arange(3, dtype="<i4").tobytes()]))
    got = fastio.decode([msgpack.packb([1, 0, [3, [], ext]])])
    assert got.output_tokens == [0, 1, 2] and got.output_tokens.dtype == np.int32


def test_independent_encoder_output_decodes() -> None:
    """A message built by the `msgpack` package alone, as another language would."""
    ids = np.arange(100, dtype="<i8")
    ext = msgpack.ExtType(1, msgpack.packb(["int64", [100], 1]))
    # Non-minimal ints in the header (uint8 version) are legal msgpack too.
    header = b"\x93\xcc\x01\x01" + msgpack.packb([2, "rid-7", ext, [1, 3, 64]])
    req = fastio.decode([header, ids.tobytes()])
    assert isinstance(req, LLMRequest)
    assert req.rid == "rid-7" and req.input_ids == list(range(100))
    assert req.gconfig.n_samples == 3 and req.gconfig.max_new_tokens == 64
    # Token arrays as plain msgpack lists of numbers are accepted.
    plain = msgpack.packb([1, 0, [3, [], [4, 5]]])
    assert fastio.decode([plain]).output_tokens == [4, 5]


def test_encoded_frames_share_memory_with_source() -> None:
    resp = big_response(8192)
    frames = fastio.encode(resp)
    for frame, field in zip(
        frames[1:],
        ["input_tokens", "output_tokens", "output_logprobs", "output_versions", "itl"],
        strict=True,
    ):
        src = getattr(resp, field).array
        # A token array's frame is its numpy array itself (no memoryview is made).
        view = memoryview(frame)
        assert view.c_contiguous and view.ndim == 1
        assert np.shares_memory(np.frombuffer(frame, np.uint8), src)
        addr = np.frombuffer(frame, np.uint8).ctypes.data
        assert addr == src.ctypes.data and view.nbytes == src.nbytes


def _address_range(buf: Any) -> tuple[int, int]:
    a = np.frombuffer(buf, np.uint8)
    return a.ctypes.data, a.ctypes.data + a.nbytes


def test_decoded_arrays_lie_inside_received_frames() -> None:
    frames = [bytearray(f) for f in fastio.encode(big_response(8192))]
    resp = fastio.decode(frames, LLMResponse)
    fields = ["input_tokens", "output_tokens", "output_logprobs", "output_versions", "itl"]
    for i, name in enumerate(fields, start=1):
        arr = getattr(resp, name).array
        lo, hi = _address_range(frames[i])
        assert lo <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= hi
        assert np.shares_memory(arr, np.frombuffer(frames[i], np.uint8))
        assert arr.flags.writeable  # bytearray frames are writable


def test_decoded_from_bytes_is_read_only() -> None:
    frames = [bytes(f) for f in fastio.encode(big_response(1000))]
    resp = fastio.decode(frames, LLMResponse)
    assert not resp.output_tokens.array.flags.writeable
    small = fastio.decode(fastio.encode(LLMRequest(input_ids=[1, 2])), LLMRequest)
    assert not small.input_ids.array.flags.writeable  # inline: a view of the header
    small.input_ids[0] = 7  # copy-on-write: assignment works, the frame stays as it was
    small.input_ids += [3]
    assert small.input_ids == [7, 2, 3]


def test_decoded_frames_outlive_the_frame_list() -> None:
    frames = [bytes(f) for f in fastio.encode(big_response(2048))]
    resp = fastio.decode(frames, LLMResponse)
    expected = big_response(2048).output_tokens.tolist()
    del frames
    assert resp.output_tokens == expected


def test_memoryview_frames_of_other_formats() -> None:
    frames = fastio.encode({"a": np.arange(2000, dtype=np.float64)})
    typed = [frames[0], memoryview(np.frombuffer(frames[1], np.float64))]
    assert np.array_equal(fastio.decode(typed, dict[str, Any])["a"], np.arange(2000.0))
    tokens = fastio.encode(LLMResponse(output_tokens=np.arange(4000, dtype=np.int64)))
    typed = [tokens[0], memoryview(np.frombuffer(tokens[1], np.int64))]
    assert fastio.decode(typed, LLMResponse).output_tokens == list(range(4000))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _pair(ctx: zmq.Context[Any], a_type: int, b_type: int) -> tuple[zmq.Socket[Any], ...]:
    a, b = ctx.socket(a_type), ctx.socket(b_type)
    for s in (a, b):
        s.linger = 0
        s.rcvtimeo = s.sndtimeo = 5000
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    return a, b


def test_pair_socket_copy_false_zero_copy(ctx: zmq.Context[Any]) -> None:
    a, b = _pair(ctx, zmq.PAIR, zmq.PAIR)
    resp = big_response(65536)
    tracker = a.send_multipart(fastio.encode(resp), copy=False, track=True)
    got = b.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in got)
    back = fastio.decode(got, LLMResponse)
    tracker.wait(5)
    assert back == resp
    arr = back.output_tokens.array
    assert arr.flags.writeable  # zmq.Frame memory is writable
    assert np.shares_memory(arr, np.frombuffer(got[2].buffer, np.uint8))


def test_dealer_router_round_trip(ctx: zmq.Context[Any]) -> None:
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    for msg in all_messages():
        dealer.send_multipart(fastio.encode(msg), copy=False)
        ident, *frames = router.recv_multipart(copy=False)
        req = fastio.decode(frames)
        router.send_multipart([ident, *fastio.encode(req)], copy=False)
        assert_same(msg, fastio.decode(dealer.recv_multipart(copy=False)))


def _echo_server(endpoint: str) -> None:
    """Child process: decode whatever arrives and send it back re-encoded."""
    import zmq as z

    import fastio as f

    c = z.Context()
    s = c.socket(z.ROUTER)
    s.linger = 0
    s.connect(endpoint)
    try:
        while True:
            ident, *frames = s.recv_multipart(copy=False)
            try:
                obj = f.decode(frames)
                s.send_multipart([ident, *f.encode(obj)], copy=False)
            except f.DecodeError as exc:
                s.send_multipart([ident, b"error", str(exc).encode()])
    finally:
        c.destroy(linger=0)


def test_cross_process_echo(ctx: zmq.Context[Any]) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    port = dealer.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(
        target=_echo_server, args=(f"tcp://127.0.0.1:{port}",), daemon=True
    )
    proc.start()
    try:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        for msg in [big_response(32768), LLMRequest(input_ids=[1, 2]), RolloutStat(1, 2, 3)]:
            dealer.send_multipart(fastio.encode(msg), copy=False)
            assert poller.poll(30_000), "echo server did not answer"
            assert fastio.decode(dealer.recv_multipart(copy=False)) == msg
        # Garbage: the server answers with an error and keeps serving.
        dealer.send_multipart([b"\xc1garbage"])
        assert poller.poll(30_000)
        kind, text = dealer.recv_multipart()
        assert kind == b"error" and b"malformed header" in text
        dealer.send_multipart(fastio.encode(RolloutStat(4)), copy=False)
        assert poller.poll(30_000)
        assert fastio.decode(dealer.recv_multipart()) == RolloutStat(4)
    finally:
        proc.kill()
        proc.join(10)


def _in_threads(body: Callable[[int], None], n: int = 4) -> None:
    """Run ``body(k)`` for k in range(n) on n threads started together; re-raise what
    any of them raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(k: int) -> None:
        try:
            barrier.wait(5)
            body(k)
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors


def test_shared_encoder_decoder_across_threads() -> None:
    enc, dec = Encoder(), Decoder(LLMResponse)

    def work(k: int) -> None:
        for i in range(200):
            n = 2100 + 37 * k + i  # above the inline threshold: frames
            resp = LLMResponse(output_tokens=np.full(n, k, np.int32), output_logprobs=np.zeros(n))
            frames = enc.encode(resp)
            back = dec.decode(frames)
            assert len(frames) == 3
            assert back.output_len == n and back.output_tokens.count(k) == n

    _in_threads(work)


def test_decoder_device_cpu_is_a_view() -> None:
    t = torch.arange(4000, dtype=torch.float32)
    frames = [bytearray(f) for f in fastio.encode({"t": t})]
    back = Decoder(dict[str, Any], device="cpu").decode(frames)["t"]
    assert np.shares_memory(back.numpy(), np.frombuffer(frames[1], np.uint8))


def test_message_types_registry_includes_extensions() -> None:
    types = fastio.codec.message_types()
    for tp in fastio.MESSAGE_TYPES:
        assert tp in types
    tags = [tp.__struct_config__.tag for tp in types]
    assert tags == sorted(set(tags))


def test_encode_unsupported_object() -> None:
    with pytest.raises(fastio.EncodeError, match="cannot encode"):
        fastio.encode({"x": object()})
    with pytest.raises(fastio.EncodeError):
        fastio.encode({1j: 2})


def test_header_with_wider_msgpack_encodings() -> None:
    """Any valid msgpack encoding of the header's array and ints is accepted."""
    body = msgpack.packb([12, 1, 2, 3])
    for prefix in (
        b"\x93\x01\x00",
        b"\xdc\x00\x03\x01\x00",
        b"\xdd\x00\x00\x00\x03\xcd\x00\x01\xd0\x00",
    ):
        assert fastio.decode([prefix + body]) == RolloutStat(1, 2, 3)
    # Ints where floats are expected, and float32, are accepted.
    resp = fastio.decode(
        [
            b"\x93\x01\x00"
            + msgpack.packb([3, [], [], [], [], "stop", 2, 0.5], use_single_float=True)
        ]
    )
    assert resp.latency == 2.0 and resp.ttft == 0.5


def test_token_arrays_and_ndarrays_keep_their_types_anywhere() -> None:
    msg = {"tokens": TokenArray([1, 2, 3] * 100, dtype="int32"), "array": np.arange(300)}
    back = fastio.decode(fastio.encode(msg), dict[str, Any])
    assert type(back["tokens"]) is TokenArray and back["tokens"] == [1, 2, 3] * 100
    assert type(back["array"]) is np.ndarray and np.array_equal(back["array"], np.arange(300))
    # A numpy array sent by a peer into a token field becomes a TokenArray.
    frames = fastio.encode([3, [], np.arange(500, dtype=np.int32)])
    resp = fastio.decode(frames, LLMResponse)
    assert type(resp.output_tokens) is TokenArray and resp.output_tokens == list(range(500))


def test_decoder_device_moves_tensors() -> None:
    """The device branch, exercised without a GPU through torch's "meta" device."""
    t = torch.arange(1000, dtype=torch.bfloat16).reshape(10, 100)
    back = Decoder(dict[str, Any], device="meta").decode(fastio.encode({"t": t}))["t"]
    assert back.device.type == "meta" and back.shape == (10, 100) and back.dtype == torch.bfloat16


def test_protocol_doc_examples_are_exact() -> None:
    """The byte examples of docs/PROTOCOL.md ("Header"), byte for byte."""
    frames = fastio.encode(
        LLMResponse(
            output_tokens=np.arange(3000, dtype=np.int32),
            stop_reason="length",
            latency=1.5,
            ttft=0.25,
        )
    )
    assert len(frames) == 2 and frames[1].nbytes == 12000
    assert frames[0] == bytes.fromhex(
        "930201 9903 c70015 d43501 c7001c c70015 a66c656e677468"
        " cb3ff8000000000000 cb3fd0000000000000 c7001c"
    )
    (req,) = fastio.encode(LLMRequest(rid="r", input_ids=[5, 6]))
    assert req == bytes.fromhex(
        "930200 9602a172 d7150500000006000000"
        " 990101cd400000c2cb3ff0000000000000ce05f5e100cb3ff000000000000090 80c0"
    )


_NESTED: list[Any] = []  # [decoder, frames] while the test below runs; what it decoded


class _Inner(fastio.WireStruct, tag=1998):
    a: TokenArray

    def __post_init__(self) -> None:
        if len(_NESTED) == 2:
            dec, frames = _NESTED
            _NESTED.append(dec.decode(frames)["x"])


class _Outer(fastio.WireStruct, tag=1999):
    inner: _Inner
    b: TokenArray


def test_decode_inside_a_decode_on_one_thread() -> None:
    """A user type whose __post_init__ decodes with the same Decoder (same thread), while
    the outer message still has a frame-backed array to read: both read their own."""
    inner_frames = fastio.encode({"x": TokenArray(np.arange(3000, dtype=np.int32))})
    outer = _Outer(_Inner(TokenArray(np.arange(4000, dtype=np.int32))), TokenArray(np.zeros(5000)))
    dec = Decoder(Union[_Outer, dict[str, Any]])  # noqa: UP007
    _NESTED[:] = [dec, inner_frames]
    try:
        got = dec.decode(fastio.encode(outer))
    finally:
        seen = _NESTED[2:]
        _NESTED.clear()
    assert got.inner.a == list(range(4000)) and got.b == [0.0] * 5000
    assert seen[0] == list(range(3000))


def test_protocol_doc_fabric_examples_are_exact() -> None:
    """The token arrays of the fabric examples in docs/PROTOCOL.md, byte for byte."""
    from fastio import fabric_msgs as fm

    submit = fm.Submit(
        id=7,
        request=LLMRequest(
            rid="r1",
            input_ids=np.array([1, 2, 3], np.int32),
            gconfig=GenerationHyperparameters(max_new_tokens=4),
        ),
    )
    assert fastio.encode(submit)[0].startswith(
        bytes.fromhex("930200951407 9602a27231 c70c15010000000200000003000000 9901010400c2")
    )
    result = fm.Result(
        id=7,
        output_tokens=TokenArray(np.array([5, 6], np.int32)),
        output_logprobs=TokenArray(np.array([-0.5, -1.0], np.float32)),
        output_versions=TokenArray(np.array([0, 0], np.int32)),
        stop_reason="length",
    )
    assert fastio.encode(result) == [
        bytes.fromhex("930200961507 d7150500000006000000 d71b000000bf000080bf d7150000000000000000")
        + b"\xa6length"
    ]


def _expect_header(frames: list[Any]) -> None:
    """The header announces exactly the buffers that follow, and decodes."""
    version, n_buffers, _ = msgpack.unpackb(frames[0], strict_map_key=False, raw=True)
    assert (version, n_buffers) == (PROTOCOL_VERSION, len(frames) - 1)


def test_one_encoder_alternating_message_shapes() -> None:
    """The encoder writes the header in one call with the buffer count guessed from
    the last message, and tries a stateless encode while messages stay inline: every
    change of shape (inline, one frame, many frames, 200 frames, inline objects that
    stop the stateless encoder) still gives the right header."""
    enc, dec = Encoder(), Decoder(dict[str, Any])
    big = np.arange(5000, dtype=np.int32)
    shapes: list[dict[str, Any]] = [
        {"a": TokenArray([1, 2, 3])},
        {"a": TokenArray(big)},
        {"a": TokenArray([4])},
        {"a": TokenArray(big), "b": TokenArray(big + 1), "c": np.zeros(3000)},
        {"a": TokenArray(big)},
        {f"k{i}": TokenArray(big + i) for i in range(200)},
        {"a": TokenArray([5, 6])},
        {"t": torch.arange(4), "a": TokenArray([7])},  # inline tensor: stateful path
        {"a": TokenArray([8])},
        {"t": torch.arange(4000)},
        {"s": np.float32(0.5), "a": TokenArray([9])},
        {"i": Image.new("RGB", (2, 2))},
        {"a": TokenArray([10])},
    ]
    for _ in range(2):
        for msg in shapes:
            frames = enc.encode(msg)
            _expect_header(frames)
            back = dec.decode(frames)
            assert back.keys() == msg.keys()
            for k, v in msg.items():
                if isinstance(v, TokenArray):
                    assert back[k] == v
                elif isinstance(v, torch.Tensor):
                    assert torch.equal(back[k], v)
                elif isinstance(v, np.ndarray):
                    assert np.array_equal(back[k], v)


def test_shared_encoder_across_threads_with_mixed_shapes() -> None:
    """Threads sharing one Encoder and Decoder, each sending inline and frame-backed
    messages in its own rhythm: the shared guesses never corrupt a header."""
    enc, dec = Encoder(), Decoder(LLMRequest)

    def work(k: int) -> None:
        for i in range(300):
            n = 3000 if (i + k) % (k + 2) == 0 else 10 + k  # frame or inline
            req = LLMRequest(rid=f"{k}-{i}", input_ids=np.full(n, k, np.int32))
            frames = enc.encode(req)
            _expect_header(frames)
            assert len(frames) == (2 if n == 3000 else 1)
            back = dec.decode(frames)
            assert back.rid == req.rid and len(back.input_ids) == n
            assert back.input_ids.count(k) == n

    _in_threads(work)


def test_encode_inside_an_encode() -> None:
    """An encode started while another is in progress on the same thread (here from a
    tokenizer-like object's name_or_path property) uses its own per-call state."""
    enc = Encoder()
    inner: list[list[Any]] = []

    class Tok:
        @property
        def name_or_path(self) -> str:
            inner.append(enc.encode({"x": TokenArray(np.arange(3000, dtype=np.int32))}))
            return "tok"

    for big in (False, True):
        ids = np.arange(4000 if big else 4, dtype=np.int32)
        frames = enc.encode({"tok": Tok(), "ids": TokenArray(ids)})
        _expect_header(frames)
        assert fastio.decode(frames, dict[str, Any])["ids"] == ids
        _expect_header(inner[-1])
        assert fastio.decode(inner[-1], dict[str, Any])["x"] == list(range(3000))


def test_frames_past_255_use_the_8_byte_reference() -> None:
    """A compact reference holds the frame index in one byte: from frame 256 on the
    encoder writes the 8-byte form (index, element count), and both decode."""
    arrays = [TokenArray(np.full(2500 + i, i, np.int32)) for i in range(300)]
    frames = fastio.encode(arrays)
    assert len(frames) == 301
    _, _, body = msgpack.unpackb(frames[0])
    assert {e.code for e in body[:255]} == {ExtCode.TOKENS_REF + 5}
    assert {e.code for e in body[255:]} == {ExtCode.TOKENS_FRAME + 5}
    assert body[299].data == (300).to_bytes(4, "little") + (2799).to_bytes(4, "little")
    back = fastio.decode(frames, list[TokenArray])
    assert [len(t) for t in back] == [2500 + i for i in range(300)]
    assert all(t[0] == i and t[-1] == i for i, t in enumerate(back))
    # Received frames are bytes-like: the same header decodes them.
    received = [frames[0], *(bytes(f) for f in frames[1:])]
    assert fastio.decode(received, list[TokenArray])[299] == back[299]


@pytest.mark.parametrize("n", [100, 5000])  # inline in the header, a frame of its own
def test_token_arrays_strided_offset_and_big_endian(n: int) -> None:
    """The encoder hands a token array's numpy array itself to msgspec (inline) or as the
    frame: views at an offset send only their own elements; strided and big-endian
    arrays take the slow path (one packed little-endian copy)."""
    base = np.arange(4 * n, dtype=np.int32)
    cases = {
        "strided": TokenArray(base[::2][:n]),
        "offset view": TokenArray(base)[n : 2 * n],
        "big-endian": TokenArray(base[:n].astype(">i4")),
        "int64 offset view": TokenArray(base.astype(np.int64))[1 : n + 1],
    }
    for name, ids in cases.items():
        frames = fastio.encode(LLMRequest(input_ids=ids))
        assert len(frames) == (1 if n == 100 else 2), name
        if n != 100:
            assert memoryview(frames[1]).nbytes == n * ids.array.dtype.itemsize, name
            # The slow path (a packed copy) writes the compact reference too.
            ref = msgpack.unpackb(frames[0])[2][2]
            assert ref.code >= ExtCode.TOKENS_REF and ref.data == b"\x01", name
        received = [frames[0], *(bytes(f) for f in frames[1:])]
        back = fastio.decode(received, LLMRequest)
        assert back.input_ids == ids.tolist(), name
        assert back.input_ids.array.dtype == ids.array.dtype.newbyteorder("="), name
