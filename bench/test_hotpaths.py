"""pytest-benchmark suites for the hot paths, run by CI (``.ci/run``).

Each benchmark belongs to a group (one case) and names its implementation in
``extra_info["impl"]``; ``python -m bench --pytest-json`` turns the saved JSON into
ratios (baseline / fastio) checked against ``bench/reference.json``. These are not
tests of behaviour: they assert nothing about speed.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

import fastio
from bench.codec import ListResponse, SeedResponse, _arrays, _as_lists

N_TOKENS = 32768


def _lists(n: int) -> dict[str, Any]:
    return _as_lists(_arrays(n))


@pytest.mark.benchmark(group="response_32k_roundtrip")
def test_response_fastio(benchmark: Any) -> None:
    benchmark.extra_info["impl"] = "fastio"
    resp = fastio.LLMResponse(**_arrays(N_TOKENS))
    out = benchmark(lambda: fastio.decode(fastio.encode(resp)))
    assert out.output_tokens == resp.output_tokens


@pytest.mark.benchmark(group="response_32k_roundtrip")
def test_response_pickle(benchmark: Any) -> None:
    benchmark.extra_info["impl"] = "pickle"
    resp = SeedResponse(**_lists(N_TOKENS))
    out = benchmark(lambda: pickle.loads(pickle.dumps(resp, protocol=5)))
    assert out == resp


@pytest.mark.benchmark(group="response_32k_roundtrip")
def test_response_msgspec_lists(benchmark: Any) -> None:
    benchmark.extra_info["impl"] = "msgspec-lists"
    resp = ListResponse(**_lists(N_TOKENS))
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ListResponse)
    out = benchmark(lambda: dec.decode(enc.encode(resp)))
    assert out == resp


@pytest.fixture
def pair() -> Any:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://hotpath")
    b.connect("inproc://hotpath")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


@pytest.mark.benchmark(group="request_inproc_send_recv")
def test_request_socket_fastio(benchmark: Any, pair: Any) -> None:
    benchmark.extra_info["impl"] = "fastio"
    a, b = pair
    req = fastio.LLMRequest(rid="r", input_ids=np.arange(4096, dtype=np.int32))

    def once() -> Any:
        a.send_multipart(fastio.encode(req), copy=False)
        return fastio.decode(b.recv_multipart(copy=False))

    assert benchmark(once).input_ids == req.input_ids


@pytest.mark.benchmark(group="request_inproc_send_recv")
def test_request_socket_raw_bytes(benchmark: Any, pair: Any) -> None:
    benchmark.extra_info["impl"] = "raw-pyzmq"
    a, b = pair
    payload = np.arange(4096, dtype=np.int32).tobytes()

    def once() -> Any:
        a.send(payload, copy=False)
        return b.recv(copy=False)

    assert len(benchmark(once)) == len(payload)
