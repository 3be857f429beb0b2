"""Decode tokens/s of :class:`transport.hf_engine.HFEngine` on this machine.

``python -m bench.hf_engine [--sizes tiny,small] [--batches 1,16]`` prints one JSON row
per size, batch and ``weight_left`` setting (off, then on: the engine's CPU default), so
the two ways of computing a linear layer (:func:`transport.hf_model.weight_left_linear`)
can be compared on the BLAS at hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import torch

from fastio import GenerationHyperparameters, LLMRequest, TokenArray
from transport.hf_engine import HFEngine
from transport.hf_model import build_model


async def _rate(eng: HFEngine, batch: int, new_tokens: int) -> float:
    g = GenerationHyperparameters(max_new_tokens=new_tokens)
    prompt = TokenArray(np.arange(1, 17, dtype=np.int32))
    reqs = [LLMRequest(input_ids=prompt, gconfig=g) for _ in range(batch)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(eng.generate(r) for r in reqs))
    return sum(o.output_len for o in outs) / (time.perf_counter() - t0)


def run(
    sizes: list[str], batches: list[int], new_tokens: int, device: str | None
) -> list[dict[str, object]]:
    """Decode tokens/s of each size and batch, with ``weight_left`` off and on; each row
    is printed as it is measured and returned."""
    rows: list[dict[str, object]] = []
    for size in sizes:
        for left in (False, True):
            # A fresh model each: the engine changes how its Linear layers compute.
            eng = HFEngine(build_model(size), device=device, weight_left=left)
            asyncio.run(_rate(eng, 2, new_tokens))  # warm-up
            for batch in batches:
                rate = asyncio.run(_rate(eng, batch, new_tokens))
                row: dict[str, object] = {
                    "size": size,
                    "weight_left": left,
                    "batch": batch,
                    "tokens_per_s": rate,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
            eng.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.hf_engine``: the hf engine's decode tokens/s on this machine."""
    p = argparse.ArgumentParser(prog="python -m bench.hf_engine", description=main.__doc__)
    p.add_argument("--bench", action="store_true", help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--sizes", default="tiny,small,medium,large")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    run(a.sizes.split(","), [int(b) for b in a.batches.split(",")], a.new_tokens, a.device)


if __name__ == "__main__":
    main()
