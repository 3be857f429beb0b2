"""CUDA tensors: encoded through host memory, decoded onto a requested device.

Skipped without a GPU; runs wherever torch sees one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fastio
from fastio import Decoder, LLMResponse

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (1024, 33)])
def test_cuda_tensor_to_cpu_and_back(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = (torch.randn(shape, device="cuda", generator=g) * 10).to(dtype)
    frames = fastio.encode({"t": t})
    on_cpu = fastio.decode(frames, dict[str, Any])["t"]
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == dtype
    assert torch.equal(on_cpu, t.cpu())
    on_gpu = Decoder(dict[str, Any], device="cuda:0").decode(frames)["t"]
    assert on_gpu.device == torch.device("cuda:0") and torch.equal(on_gpu, t)


def test_cuda_non_contiguous_and_requires_grad() -> None:
    w = torch.randn(64, 32, device="cuda", requires_grad=True)
    back = Decoder(dict[str, Any], device="cuda").decode(fastio.encode({"w": w.t()}))["w"]
    assert back.is_cuda and not back.requires_grad and torch.equal(back, w.detach().t())


def test_device_decoder_leaves_numpy_token_arrays_on_host() -> None:
    resp = LLMResponse(output_tokens=np.arange(4096, dtype=np.int32))
    back = Decoder(LLMResponse, device=torch.device("cuda")).decode(fastio.encode(resp))
    assert back.output_tokens == list(range(4096))
    assert back.output_tokens.tensor().cuda().sum().item() == sum(range(4096))


def test_cuda_token_field_input() -> None:
    resp = LLMResponse(output_tokens=torch.arange(10, device="cuda", dtype=torch.int32))
    assert fastio.decode(fastio.encode(resp), LLMResponse).output_tokens == list(range(10))
