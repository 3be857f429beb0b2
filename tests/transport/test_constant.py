"""Constant arrays shared by responses: the client's zero itl and the echo engines'
fillers are read-only views of one array, whatever the length (no allocation per
message); the benchmarks' echo sends its fillers as shared frames."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

from bench import echo as bench_echo
from fastio import LLMRequest, TokenArray
from transport.client.calls import _zero_itl
from transport.constant import MAX_SHARED, constant
from transport.worker.echo import echo_handler

#: The echo engine users run and the benchmarks' one: the same answers.
ECHOES = pytest.mark.parametrize(
    "echo", [echo_handler, bench_echo.echo_handler], ids=["transport", "bench"]
)


def test_constant_views_are_read_only_correct_and_shared() -> None:
    a = constant(5000, np.float64)
    b = constant(100_000, np.float64)  # grows the shared array
    c = constant(7, np.int32, 3)
    assert a.shape == (5000,) and b.shape == (100_000,) and not a.any() and not b.any()
    assert c.tolist() == [3] * 7 and c.dtype == np.int32
    assert constant(0, np.float64).shape == (0,) and constant(-1, np.float64).shape == (0,)
    for v in (a, b, c):
        assert not v.flags.writeable and v.flags.c_contiguous
    assert np.shares_memory(b, constant(60_000, np.float64))
    assert a.tolist() == [0.0] * 5000  # the old array's view is intact after the growth
    big = constant(MAX_SHARED + 1, np.uint8)
    assert not big.flags.writeable and len(big) == MAX_SHARED + 1


def test_zero_itl_of_long_responses_shares_memory_and_copies_on_write() -> None:
    x, y = _zero_itl(32_767), _zero_itl(20_000)
    assert len(x) == 32_767 and len(y) == 20_000 and not x.array.any()
    assert np.shares_memory(x.array, y.array)
    # A caller changing its response's itl gets its own copy; the shared zeros stay.
    x[0] = 1.5
    assert x[0] == 1.5 and not _zero_itl(32_767).array.any()
    x += TokenArray(np.ones(32_767))
    assert not _zero_itl(32_767).array.any()


@ECHOES
def test_echo_fillers_of_long_prompts_are_shared(echo: Any) -> None:
    ctx: Any = SimpleNamespace(version=4)
    ids = list(range(10_000))

    async def two() -> Any:
        return [await echo(LLMRequest(input_ids=ids), ctx) for _ in range(2)]

    r1, r2 = asyncio.run(two())
    assert r1.output_tokens.tolist() == ids
    assert r1.output_logprobs.tolist() == [0.0] * 10_000
    assert r1.output_versions.tolist() == [4] * 10_000
    assert np.shares_memory(r1.output_logprobs.array, r2.output_logprobs.array)
    assert np.shares_memory(r1.output_versions.array, r2.output_versions.array)


@ECHOES
def test_echo_fillers_of_short_prompts_follow_the_weight_version(echo: Any) -> None:
    # Short prompts take cached fillers: a new version must replace them at once.
    async def run(version: int, n: int) -> Any:
        return await echo(LLMRequest(input_ids=list(range(n))), SimpleNamespace(version=version))

    for version, n in ((0, 16), (7, 16), (7, 4096), (0, 3), (2, 5000), (2, 1)):
        r = asyncio.run(run(version, n))
        assert r.output_versions.tolist() == [version] * n
        assert r.output_logprobs.tolist() == [0.0] * n
        assert r.output_tokens.tolist() == list(range(n))
        assert not r.output_versions.array.flags.writeable


def test_zero_itl_of_the_usual_response_is_a_read_only_view() -> None:
    for n in (0, 1, 15, 4096, 4097, 10_000):
        itl = _zero_itl(n)
        assert len(itl) == n and not itl.array.any() and not itl.array.flags.writeable


def test_frame_constants_are_whole_frames_kept_per_length() -> None:
    frame_constant = bench_echo.frame_constant
    a = frame_constant(70_000, np.float32)
    assert type(a.base) is zmq.Frame and a.nbytes == len(a.base)  # sent as that frame
    assert not a.flags.writeable and not a.any() and len(a) == 70_000
    assert frame_constant(70_000, np.float32) is a
    v = frame_constant(5, np.int32, 3)
    assert v.tolist() == [3] * 5 and v.dtype == np.int32
    assert frame_constant(-1, np.int32).shape == (0,)
    for n in range(40):  # a bounded table: old lengths are made again
        frame_constant(n + 1, np.int8)
    assert frame_constant(70_000, np.float32) is not a
    huge = frame_constant(5 << 20, np.float32)  # over 4 MiB: not kept, a shared view
    assert type(huge.base) is not zmq.Frame and np.shares_memory(huge, constant(10, np.float32))


def test_the_bench_echo_is_an_engine_the_worker_resolves() -> None:
    from transport.engines.registry import resolve_engine

    assert resolve_engine("bench.echo:engine")({}) is bench_echo.echo_handler
    assert bench_echo.echo_handler.inline and echo_handler.inline  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no --engine-opt"):
        bench_echo.engine({"x": "1"})
