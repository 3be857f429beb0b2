"""Codec suite: fastio's encode/decode next to a vLLM-style codec, pickle 5, msgspec.

Every case measures its implementations *interleaved* (round after round, each
implementation once per round, after a warm-up), so a noisy neighbour slows all of
them alike; medians over the rounds are reported.

Implementations
---------------
``fastio``
    :class:`fastio.Encoder` / :class:`fastio.Decoder` (untrusted: the default, what a
    socket reader uses).
``vllm-style``
    :class:`VllmStyleEncoder` / :class:`VllmStyleDecoder` below: a codec written here in
    the technique of vLLM V1's ``serial_utils`` (array_like, ``omit_defaults``,
    ``gc=False`` Structs with ``np.ndarray`` fields; an array travels as ``(dtype,
    shape, data)`` where ``data`` is the bytes inline under 256 B, else the index of an
    extra zero-copy frame; decode is ``np.frombuffer`` in ``dec_hook``). It keeps its
    buffer list on the instance, as vLLM does, so it is not thread-safe.
``pickle``
    protocol 5 with ``buffer_callback``: arrays and tensors go out of band (no copy);
    the seed's dataclass of lists, what its users pickle today, has none.
``msgspec-lists``
    a msgspec Struct (array_like) with ``list[int]`` / ``list[float]`` token fields.

Cases (``size`` in tokens or bytes, ``extra["size_unit"]``)
-----------------------------------------------------------
``request_roundtrip@<n>`` / ``response_roundtrip@<n>``
    encode + decode of an ``LLMRequest`` (``n`` prompt tokens, metadata) or an
    ``LLMResponse`` (1k-token prompt, ``n`` output tokens with logprobs, versions, itl).
``batch256_roundtrip``
    one message holding 256 requests of 64 tokens each.
``response_encode@32k`` / ``response_decode@32k``
    the two halves.
``response_decode_scaling``
    fastio decode of a 128k-token response (``fastio``) against a 1k-token one
    (``fastio-1k-tokens``): the ratio is ``t(1k) / t(128k)``; >= 0.67 means the big one
    costs at most 1.5x the small one.
``inline_threshold@<bytes>``
    a request whose ids have that many bytes, encoded, sent through a ZeroMQ PAIR over
    ``ipc://`` and decoded, with the ids inline in the header (``fastio``) against in a
    frame of their own (``frame``). Where the ratio crosses 1 is where the inline
    threshold belongs (``fastio.protocol.DEFAULT_INLINE_THRESHOLD``).
``tensor_encode@<size>`` / ``tensor_decode@<size>``, ``tensor_encode_scaling``
    a float32 tensor above the inline threshold against pickle (out of band) and
    ``msgspec-bytes`` (``tobytes()`` into msgspec); encode of the largest against 16 KiB
    (both frames: a ratio near 1 means no copy).

Data is seeded; every case of one run uses the same objects.
"""

from __future__ import annotations

import gc
import json
import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

__all__ = ["ListResponse", "SeedResponse", "VllmStyleDecoder", "VllmStyleEncoder", "run"]

SUITE = "codec"
PROMPT = 1024


# -- the seed's types and list-based baselines ------------------------------------------
@dataclass
class SeedResponse:
    """The seed's ``LLMResponse`` as users have it today: a dataclass of lists."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: Literal["length", "stop", "interrupt"] = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    itl: list[float] = field(default_factory=list)


@dataclass
class SeedRequest:
    """The seed's ``LLMRequest`` (gconfig as a dict of the defaults)."""

    rid: str
    input_ids: list[int]
    gconfig: dict[str, Any]
    metadata: dict[str, Any]
    model_id: str | None = None


class ListResponse(msgspec.Struct, array_like=True, gc=False):
    """msgspec with plain list fields: the strongest list-based baseline."""

    input_tokens: list[int] = msgspec.field(default_factory=list)
    output_tokens: list[int] = msgspec.field(default_factory=list)
    output_logprobs: list[float] = msgspec.field(default_factory=list)
    output_versions: list[int] = msgspec.field(default_factory=list)
    stop_reason: str = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    itl: list[float] = msgspec.field(default_factory=list)


class ListGconfig(msgspec.Struct, array_like=True, gc=False):
    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 100000000
    temperature: float = 1.0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)


class ListRequest(msgspec.Struct, array_like=True, gc=False):
    rid: str
    input_ids: list[int]
    gconfig: ListGconfig = msgspec.field(default_factory=ListGconfig)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    model_id: str | None = None


# -- the vLLM-style codec -----------------------------------------------------------------
class VGconfig(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 100000000
    temperature: float = 1.0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)


class VRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    rid: str
    input_ids: np.ndarray  # type: ignore[type-arg]
    gconfig: VGconfig = msgspec.field(default_factory=VGconfig)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    model_id: str | None = None


class VResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    input_tokens: np.ndarray  # type: ignore[type-arg]
    output_tokens: np.ndarray  # type: ignore[type-arg]
    output_logprobs: np.ndarray  # type: ignore[type-arg]
    output_versions: np.ndarray  # type: ignore[type-arg]
    stop_reason: str = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    itl: np.ndarray = msgspec.field(default_factory=lambda: np.empty(0))  # type: ignore[type-arg]


VLLM_INLINE_THRESHOLD = 256


class VllmStyleEncoder:
    """Arrays as ``(dtype.str, shape, data)``: bytes inline below 256 B, else the index
    of an extra frame holding the array's own memory. The frame list lives on the
    instance for the duration of one call (not thread-safe, as in vLLM)."""

    def __init__(self) -> None:
        self._aux: list[Any] | None = None
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)

    def encode(self, obj: Any) -> list[Any]:
        bufs: list[Any] = [b""]
        self._aux = bufs
        try:
            bufs[0] = self._enc.encode(obj)
        finally:
            self._aux = None
        return bufs

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if not obj.flags.c_contiguous:
                obj = np.ascontiguousarray(obj)
            if obj.nbytes < VLLM_INLINE_THRESHOLD:
                data: Any = obj.data  # msgspec writes a memoryview as bin
            else:
                assert self._aux is not None
                self._aux.append(obj.data)
                data = len(self._aux) - 1
            return obj.dtype.str, obj.shape, data
        raise NotImplementedError(type(obj))


class VllmStyleDecoder:
    """The other half: ``np.frombuffer`` on the inline bytes or the named frame."""

    def __init__(self, tp: Any) -> None:
        self._aux: Any = None
        self._dec = msgspec.msgpack.Decoder(tp, dec_hook=self._hook)

    def decode(self, bufs: list[Any]) -> Any:
        self._aux = bufs
        try:
            return self._dec.decode(bufs[0])
        finally:
            self._aux = None

    def _hook(self, tp: Any, obj: Any) -> Any:
        if tp is np.ndarray:
            dtype, shape, data = obj
            buf = self._aux[data] if isinstance(data, int) else data
            return np.frombuffer(buf, dtype=dtype).reshape(shape)
        raise NotImplementedError(tp)


# -- data -----------------------------------------------------------------------------------
def _arrays(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    return {
        "input_tokens": rng.integers(0, 150_000, PROMPT, dtype=np.int32),
        "output_tokens": rng.integers(0, 150_000, n, dtype=np.int32),
        "output_logprobs": -rng.random(n, dtype=np.float32),
        "output_versions": np.full(n, 7, np.int32),
        "stop_reason": "length",
        "latency": 12.5,
        "ttft": 0.2,
        "itl": rng.random(n) * 0.05,
    }


def _as_lists(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}


def _ids(n: int) -> np.ndarray:  # type: ignore[type-arg]
    return np.random.default_rng(n + 1).integers(0, 150_000, n, dtype=np.int32)


METADATA = {"task": "math", "sample": 3}


def _pickle_rt(obj: Any) -> Any:
    """pickle protocol 5 with out-of-band buffers (no copy of arrays or tensors)."""
    bufs: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    return pickle.loads(data, buffers=bufs)


# -- measurement ------------------------------------------------------------------------------
def interleaved(
    fns: dict[str, Callable[[], Any]], *, budget_s: float, rounds: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Seconds per call of each function: ``rounds`` samples each, taken in turn (one
    sample of every function per round), each sample sized to about ``budget_s``.

    The garbage collector is paused inside each sample, as ``timeit`` does.
    """
    numbers: dict[str, int] = {}
    for impl, fn in fns.items():
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        numbers[impl] = max(1, int(budget_s / max(one, 1e-7)))
    samples: dict[str, list[float]] = {impl: [] for impl in fns}
    enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            for impl, fn in fns.items():
                n = numbers[impl]
                gc.disable()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[impl].append((time.perf_counter() - t0) / n)
                if enabled:
                    gc.enable()
    finally:
        if enabled:
            gc.enable()
    return samples


def run(quick: bool) -> list[Any]:
    """Measure every case; ``quick`` uses fewer sizes and rounds (well under a minute)."""
    import fastio
    from bench.common import Measurement

    budget = 0.01 if quick else 0.05
    rounds = 7 if quick else 15
    out: list[Measurement] = []

    def case(
        name: str,
        size: int,
        unit: str,
        fns: dict[str, Callable[[], Any]],
        n_rounds: int = rounds,
        warmup: int = 3,
    ) -> dict[str, list[float]]:
        got = interleaved(fns, budget_s=budget, rounds=n_rounds, warmup=warmup)
        for impl, s in got.items():
            out.append(Measurement.from_samples(SUITE, name, impl, size, s, size_unit=unit))
        return got

    enc = fastio.Encoder()
    dec_resp, dec_req = fastio.Decoder(fastio.LLMResponse), fastio.Decoder(fastio.LLMRequest)
    venc = VllmStyleEncoder()
    vdec_resp, vdec_req = VllmStyleDecoder(VResponse), VllmStyleDecoder(VRequest)
    list_enc = msgspec.msgpack.Encoder()
    list_dec_resp = msgspec.msgpack.Decoder(ListResponse)
    list_dec_req = msgspec.msgpack.Decoder(ListRequest)

    sizes = [1024, 32768, 131072]
    for n in sizes:
        label = f"{n // 1024}k"
        # Requests.
        ids = _ids(n)
        ours_q = fastio.LLMRequest(
            rid="0f1e2d3c-request", input_ids=fastio.TokenArray(ids), metadata=METADATA
        )
        v_q = VRequest(rid=ours_q.rid, input_ids=ids, metadata=METADATA)
        seed_q = SeedRequest(ours_q.rid, ids.tolist(), msgspec.to_builtins(ListGconfig()), METADATA)
        list_q = ListRequest(rid=ours_q.rid, input_ids=ids.tolist(), metadata=METADATA)
        assert dec_req.decode(enc.encode(ours_q)) == ours_q
        assert np.array_equal(vdec_req.decode(venc.encode(v_q)).input_ids, ids)
        fns: dict[str, Callable[[], Any]] = {
            "fastio": lambda o=ours_q: dec_req.decode(enc.encode(o)),
            "vllm-style": lambda o=v_q: vdec_req.decode(venc.encode(o)),
        }
        if n <= 32768 or not quick:
            fns["pickle"] = lambda o=seed_q: _pickle_rt(o)
            fns["msgspec-lists"] = lambda o=list_q: list_dec_req.decode(list_enc.encode(o))
        case(f"request_roundtrip@{label}", n, "tokens", fns)

        # Responses.
        fields = _arrays(n)
        ours = fastio.LLMResponse(**fields)
        v_r = VResponse(**fields)
        seed = SeedResponse(**_as_lists(fields))
        lists = ListResponse(**_as_lists(fields))
        assert dec_resp.decode(enc.encode(ours)) == ours  # a correct codec is measured
        fns = {
            "fastio": lambda o=ours: dec_resp.decode(enc.encode(o)),
            "vllm-style": lambda o=v_r: vdec_resp.decode(venc.encode(o)),
        }
        if n <= 32768 or not quick:
            fns["pickle"] = lambda o=seed: _pickle_rt(o)
            fns["msgspec-lists"] = lambda o=lists: list_dec_resp.decode(list_enc.encode(o))
        if n == 32768 and not quick:
            fns["json"] = lambda s=seed: SeedResponse(**json.loads(json.dumps(vars(s))))
        case(f"response_roundtrip@{label}", n, "tokens", fns)

        if n == 32768:
            bufs: list[Any] = []
            pickled = pickle.dumps(seed, protocol=5, buffer_callback=bufs.append)
            case(
                "response_encode@32k",
                n,
                "tokens",
                {
                    "fastio": lambda o=ours: enc.encode(o),
                    "vllm-style": lambda o=v_r: venc.encode(o),
                    "pickle": lambda o=seed: pickle.dumps(o, protocol=5, buffer_callback=_oob),
                    "msgspec-lists": lambda o=lists: list_enc.encode(o),
                },
            )
            frames, vframes, listed = enc.encode(ours), venc.encode(v_r), list_enc.encode(lists)
            case(
                "response_decode@32k",
                n,
                "tokens",
                {
                    "fastio": lambda f=frames: dec_resp.decode(f),
                    "vllm-style": lambda f=vframes: vdec_resp.decode(f),
                    "pickle": lambda b=pickled, pb=bufs: pickle.loads(b, buffers=pb),
                    "msgspec-lists": lambda b=listed: list_dec_resp.decode(b),
                },
            )

    # 256 requests of 64 tokens in one message.
    batch = [
        fastio.LLMRequest(rid=f"r{i}", input_ids=fastio.TokenArray(_ids(64)), metadata=METADATA)
        for i in range(256)
    ]
    v_batch = [VRequest(rid=q.rid, input_ids=q.input_ids.array, metadata=METADATA) for q in batch]
    list_batch = [ListRequest(rid=q.rid, input_ids=q.input_ids.tolist()) for q in batch]
    seed_batch = [
        SeedRequest(q.rid, q.input_ids.tolist(), msgspec.to_builtins(ListGconfig()), METADATA)
        for q in batch
    ]
    dec_batch = fastio.Decoder(list[fastio.LLMRequest])
    vdec_batch = VllmStyleDecoder(list[VRequest])
    list_dec_batch = msgspec.msgpack.Decoder(list[ListRequest])
    assert len(enc.encode(batch)) == 1 and len(venc.encode(v_batch)) == 257
    case(
        "batch256_roundtrip",
        256 * 64,
        "tokens",
        {
            "fastio": lambda: dec_batch.decode(enc.encode(batch)),
            "vllm-style": lambda: vdec_batch.decode(venc.encode(v_batch)),
            "pickle": lambda: _pickle_rt(seed_batch),
            "msgspec-lists": lambda: list_dec_batch.decode(list_enc.encode(list_batch)),
        },
    )

    # Decode cost must not grow with the response: 128k tokens against 1k.
    small = enc.encode(fastio.LLMResponse(**_arrays(1024)))
    big = enc.encode(fastio.LLMResponse(**_arrays(131072)))
    got = interleaved(
        {
            "fastio": lambda: dec_resp.decode(big),
            "fastio-1k-tokens": lambda: dec_resp.decode(small),
        },
        budget_s=budget,
        rounds=rounds,
    )
    m_big = Measurement.from_samples(
        SUITE, "response_decode_scaling", "fastio", 131072, got["fastio"], size_unit="tokens"
    )
    m_small = Measurement.from_samples(
        SUITE,
        "response_decode_scaling",
        "fastio-1k-tokens",
        1024,
        got["fastio-1k-tokens"],
        size_unit="tokens",
    )
    m_big.extra["big_over_small"] = m_big.median_s / m_small.median_s
    out += [m_big, m_small]

    _inline_threshold(quick, case)
    out.extend(_tensors(quick, case, rounds))
    return out


def _oob(buf: pickle.PickleBuffer) -> None:
    """A ``buffer_callback`` that sends every buffer out of band (returns false)."""


def _inline_threshold(quick: bool, case: Any) -> None:
    """Ids inline in the header against in a frame of their own, through a socket."""
    import tempfile

    import zmq

    import fastio

    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="fastio-bench-")
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind(f"ipc://{tmp}/t")
        b.connect(f"ipc://{tmp}/t")
        inline, framed = (
            fastio.Encoder(inline_threshold=1 << 30),
            fastio.Encoder(inline_threshold=0),
        )
        dec = fastio.Decoder(fastio.LLMRequest)

        def trip(enc: fastio.Encoder, req: fastio.LLMRequest) -> None:
            a.send_multipart(enc.encode(req), copy=False)
            dec.decode(b.recv_multipart(copy=False))

        sizes = [1024, 4096, 16384] if quick else [256, 1024, 2048, 4096, 8192, 16384, 65536]
        for nbytes in sizes:
            req = fastio.LLMRequest(input_ids=fastio.TokenArray(_ids(nbytes // 4)))
            case(
                f"inline_threshold@{_label(nbytes)}",
                nbytes,
                "bytes",
                {
                    "fastio": lambda r=req: trip(inline, r),
                    "frame": lambda r=req: trip(framed, r),
                },
            )
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _tensors(quick: bool, case: Any, rounds: int) -> list[Any]:
    import torch

    import fastio
    from bench.common import FASTIO, Measurement

    enc = fastio.Encoder()
    dec = fastio.Decoder(dict[str, Any])
    raw = msgspec.msgpack.Encoder()
    top = (256 << 20) if quick else (1 << 30)
    # The smallest is above the inline threshold too: the scaling case compares frames.
    sizes = [16 << 10, 1 << 20, top] if quick else [16 << 10, 1 << 20, 64 << 20, top]
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        label = _label(nbytes)
        msg = {"t": t}
        frames = enc.encode(msg)
        assert len(frames) == 2  # above the inline threshold: a frame
        arr = t.numpy()
        big = nbytes >= 64 << 20
        case(
            f"tensor_encode@{label}",
            nbytes,
            "bytes",
            {
                "fastio": lambda m=msg: enc.encode(m),
                # The tensor's numpy view: numpy arrays support out-of-band buffers.
                "pickle": lambda a=arr: pickle.dumps({"t": a}, protocol=5, buffer_callback=_oob),
                "msgspec-bytes": lambda a=arr: raw.encode({"t": a.tobytes()}),
            },
            3 if big else rounds,
            1,
        )
        received = [frames[0], *(bytearray(f) for f in frames[1:])]  # writable, as zmq.Frame
        pbufs: list[pickle.PickleBuffer] = []
        pickled = pickle.dumps({"t": arr}, protocol=5, buffer_callback=pbufs.append)
        case(
            f"tensor_decode@{label}",
            nbytes,
            "bytes",
            {
                "fastio": lambda r=received: dec.decode(r),
                "pickle": lambda b=pickled, pb=pbufs: pickle.loads(b, buffers=pb),
            },
            3 if big else rounds,
            1,
        )
        del t, arr, frames, received, pickled, msg, pbufs
    # Scaling: the largest against the smallest, interleaved with each other only (next
    # to the 1 GiB copies of msgspec-bytes, page reclaim would time the neighbour).
    small = 16 << 10
    big_msg = {"t": torch.ones(top // 4, dtype=torch.float32)}
    small_msg = {"t": torch.ones(small // 4, dtype=torch.float32)}
    got = interleaved(
        {
            "fastio": lambda: enc.encode(big_msg),
            "fastio-16KiB": lambda: enc.encode(small_msg),
        },
        budget_s=0.02,
        rounds=rounds,
    )
    big_s, small_s = statistics.median(got["fastio"]), statistics.median(got["fastio-16KiB"])
    return [
        Measurement(
            SUITE,
            "tensor_encode_scaling",
            FASTIO,
            top,
            big_s,
            got["fastio"],
            {"size_unit": "bytes", "big_over_small": big_s / small_s},
        ),
        Measurement(
            SUITE,
            "tensor_encode_scaling",
            "fastio-16KiB",
            small,
            small_s,
            got["fastio-16KiB"],
            {"size_unit": "bytes"},
        ),
    ]


def _label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


if __name__ == "__main__":  # pragma: no cover - python -m bench.codec for a quick look
    import sys

    from bench.common import machine_info
    from bench.report import markdown

    ms = run(quick="--full" not in sys.argv)
    print(markdown(ms, machine_info()))
