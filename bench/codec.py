"""Codec suite: fastio's encode/decode against pickle, msgspec, json and msgpack.

Cases (``size`` in tokens or bytes, see ``extra["size_unit"]``):

``response_roundtrip@<n>``
    encode + decode of an ``LLMResponse`` with ``n`` output tokens (logprobs, versions,
    itl) and a 1k-token prompt. Baselines use a plain ``@dataclass`` copy of the seed's
    response with list fields (what the seed's users have today): ``pickle`` (protocol
    5), ``json``, ``msgpack`` (the ``msgpack`` package), and ``msgspec-lists`` (a
    msgspec Struct, array_like, with ``list[int]``/``list[float]`` fields).
``response_encode@<n>`` / ``response_decode@<n>``
    the two halves, fastio against pickle and msgspec-lists.
``response_decode_scaling``
    fastio decode of a 128k-token response (``fastio``) against a 1k-token one
    (impl ``fastio-1k-tokens``): the ratio is ``t(1k) / t(128k)``; >= 0.67 means the big
    one costs at most 1.5x the small one.
``request_roundtrip``
    a typical ``LLMRequest`` (1k-token prompt, metadata): per-message overhead.
``tensor_encode@<size>``
    encoding a float32 tensor above the inline threshold: fastio (zero-copy) against
    ``pickle`` of the tensor's numpy array and ``msgspec-bytes`` (``tobytes()`` into
    msgspec), both of which copy.
``tensor_encode_scaling``
    fastio encode of the largest tensor (1 GiB; 256 MiB in quick mode) against a 1 KiB
    one (impl ``fastio-1KiB``): a ratio near 1 means no copy.
``tensor_decode@<size>``
    decoding it again: fastio (a view of the frame) against pickle.

Data is seeded; every case of one run uses the same objects.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

__all__ = ["run"]

SUITE = "codec"
PROMPT = 1024


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


def _samples(fn: Any, budget_s: float, quick: bool) -> list[float]:
    """Time ``fn`` with a call count sized so one sample takes about ``budget_s``."""
    from bench.common import timeit

    one = min(timeit(fn, repeat=3, number=1, warmup=1))
    number = max(1, int(budget_s / max(one, 1e-7)))
    return timeit(fn, repeat=5 if quick else 9, number=number, warmup=1)


def run(quick: bool) -> list[Any]:
    """Measure every case; ``quick`` uses fewer sizes and repeats (well under 40 s)."""
    import fastio
    from bench.common import Measurement

    budget = 0.02 if quick else 0.1
    out: list[Measurement] = []

    def add(case: str, impl: str, size: int, fn: Any, unit: str, **extra: Any) -> Measurement:
        m = Measurement.from_samples(
            SUITE, case, impl, size, _samples(fn, budget, quick), size_unit=unit, **extra
        )
        out.append(m)
        return m

    enc, dec = fastio.Encoder(), fastio.Decoder(fastio.LLMResponse)
    list_enc = msgspec.msgpack.Encoder()
    list_dec = msgspec.msgpack.Decoder(ListResponse)

    import msgpack

    sizes = [1024, 32768] if quick else [1024, 32768, 131072]
    for n in sizes:
        fields = _arrays(n)
        ours = fastio.LLMResponse(**fields)
        seed = SeedResponse(**_as_lists(fields))
        lists = ListResponse(**_as_lists(fields))
        frames = enc.encode(ours)
        assert dec.decode(frames) == ours  # the benchmark measures a correct codec
        case = f"response_roundtrip@{n // 1024}k"
        add(case, "fastio", n, lambda o=ours: dec.decode(enc.encode(o)), "tokens")
        add(
            case,
            "pickle",
            n,
            lambda s=seed: pickle.loads(pickle.dumps(s, protocol=5)),
            "tokens",
        )
        add(case, "msgspec-lists", n, lambda s=lists: list_dec.decode(list_enc.encode(s)), "tokens")
        if n <= 32768 or not quick:
            add(
                case,
                "json",
                n,
                lambda s=seed: SeedResponse(**json.loads(json.dumps(vars(s)))),
                "tokens",
            )
            add(
                case,
                "msgpack",
                n,
                lambda s=seed: SeedResponse(**msgpack.unpackb(msgpack.packb(vars(s)))),
                "tokens",
            )
        case = f"response_encode@{n // 1024}k"
        add(case, "fastio", n, lambda o=ours: enc.encode(o), "tokens")
        add(case, "pickle", n, lambda s=seed: pickle.dumps(s, protocol=5), "tokens")
        add(case, "msgspec-lists", n, lambda s=lists: list_enc.encode(s), "tokens")
        case = f"response_decode@{n // 1024}k"
        pickled, listed = pickle.dumps(seed, protocol=5), list_enc.encode(lists)
        add(case, "fastio", n, lambda f=frames: dec.decode(f), "tokens")
        add(case, "pickle", n, lambda b=pickled: pickle.loads(b), "tokens")
        add(case, "msgspec-lists", n, lambda b=listed: list_dec.decode(b), "tokens")

    # Decode cost must not grow with the response: 128k tokens against 1k.
    small = enc.encode(fastio.LLMResponse(**_arrays(1024)))
    big = enc.encode(fastio.LLMResponse(**_arrays(131072)))
    t_big = add("response_decode_scaling", "fastio", 131072, lambda: dec.decode(big), "tokens")
    t_small = add(
        "response_decode_scaling", "fastio-1k-tokens", 1024, lambda: dec.decode(small), "tokens"
    )
    t_big.extra["big_over_small"] = t_big.median_s / t_small.median_s

    req = fastio.LLMRequest(
        rid="0f1e2d3c-request",
        input_ids=fastio.TokenArray(np.arange(PROMPT, dtype=np.int32)),
        metadata={"task": "math", "sample": 3},
    )
    seed_req = {"rid": req.rid, "input_ids": list(range(PROMPT)), "metadata": req.metadata}
    req_dec = fastio.Decoder(fastio.LLMRequest)
    add("request_roundtrip", "fastio", PROMPT, lambda: req_dec.decode(enc.encode(req)), "tokens")
    add(
        "request_roundtrip",
        "pickle",
        PROMPT,
        lambda: pickle.loads(pickle.dumps(seed_req, protocol=5)),
        "tokens",
    )

    out.extend(_tensors(quick, add))
    return out


def _tensors(quick: bool, add: Any) -> list[Any]:
    import torch

    import fastio

    enc = fastio.Encoder()
    dec = fastio.Decoder(dict[str, Any])
    raw = msgspec.msgpack.Encoder()
    top = (256 << 20) if quick else (1 << 30)
    sizes = [1 << 10, 1 << 20, top] if quick else [1 << 10, 1 << 20, 64 << 20, top]
    measured = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        label = _label(nbytes)
        msg = {"t": t}
        frames = enc.encode(msg)
        assert len(frames) == 2  # above the inline threshold: a frame
        m = add(f"tensor_encode@{label}", "fastio", nbytes, lambda m=msg: enc.encode(m), "bytes")
        measured[nbytes] = m
        arr = t.numpy()
        add(
            f"tensor_encode@{label}",
            "pickle",
            nbytes,
            lambda a=arr: pickle.dumps(a, protocol=5),
            "bytes",
        )
        add(
            f"tensor_encode@{label}",
            "msgspec-bytes",
            nbytes,
            lambda a=arr: raw.encode({"t": a.tobytes()}),
            "bytes",
        )
        received = [frames[0], bytearray(frames[1])]  # as zmq.Frame: writable memory
        pickled = pickle.dumps(arr, protocol=5)
        add(f"tensor_decode@{label}", "fastio", nbytes, lambda r=received: dec.decode(r), "bytes")
        add(f"tensor_decode@{label}", "pickle", nbytes, lambda b=pickled: pickle.loads(b), "bytes")
        del t, arr, frames, received, pickled, msg
    big, small = measured[top], measured[1 << 10]
    from bench.common import FASTIO, Measurement

    scaling = [
        Measurement(
            "codec",
            "tensor_encode_scaling",
            FASTIO,
            top,
            big.median_s,
            big.samples,
            {"size_unit": "bytes", "big_over_small": big.median_s / small.median_s},
        ),
        Measurement(
            "codec",
            "tensor_encode_scaling",
            "fastio-1KiB",
            1 << 10,
            small.median_s,
            small.samples,
            {"size_unit": "bytes"},
        ),
    ]
    return scaling


def _label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


if __name__ == "__main__":  # pragma: no cover - python -m bench.codec for a quick look
    import sys

    from bench.common import machine_info
    from bench.report import markdown

    ms = run(quick="--full" not in sys.argv)
    print(markdown(ms, machine_info()))
