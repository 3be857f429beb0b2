"""Record the wire vectors: the messages of :func:`messages` as encoded by the fastio
found on ``PYTHONPATH`` (an old release's checkout), one file per message.

Run from outside the repository, so that the checkout on ``PYTHONPATH`` is imported::

    cd /tmp && PYTHONPATH=/path/to/old/checkout python /path/to/record.py OUT_DIR

Each file ``OUT_DIR/<name>.frames`` is a msgpack array of bin: the frames of one
message, header first. Only APIs every recorded release has are used here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: Large arrays: 3000 int32 tokens are 12000 bytes, above the 8192-byte threshold at
#: which the one-step-back encoding (ext 32 + d) and the current one (ext 48 + d) part.
LARGE = 3000
SMALL = 10


def messages() -> dict[str, Any]:
    """The recorded messages, by name (deterministic)."""
    import numpy as np

    from fastio import GenerationHyperparameters, LLMRequest, LLMResponse, TokenArray
    from fastio import fabric_msgs as fm

    def request(rid: str, n: int) -> Any:
        return LLMRequest(
            rid=rid,
            input_ids=np.arange(1, n + 1, dtype=np.int32),
            gconfig=GenerationHyperparameters(max_new_tokens=16),
        )

    def outputs(n: int) -> dict[str, Any]:
        # TokenArrays, as a worker's engine hands them over (fabric messages keep
        # what they are given).
        return {
            "output_tokens": TokenArray(np.arange(100, 100 + n, dtype=np.int32)),
            "output_logprobs": TokenArray(-np.arange(n, dtype=np.float32) / 8),
            "output_versions": TokenArray(np.full(n, 3, dtype=np.int32)),
        }

    return {
        # client -> worker
        "ping": fm.Heartbeat(sent_at=1.5),
        "submit_small": fm.Submit(id=1, request=request("small", SMALL)),
        "submit_large": fm.Submit(id=1, request=request("large", LARGE)),
        "cancel": fm.Cancel(id=1),
        # worker -> client
        "pong": fm.Heartbeat(
            sent_at=1.5, worker_id="old-worker", incarnation="0123456789abcdef", version=3
        ),
        "result_small": fm.Result(id=1, stop_reason="length", **outputs(SMALL)),
        "result_large": fm.Result(id=1, stop_reason="length", **outputs(LARGE)),
        "stream_large": fm.Stream(id=1, seq=0, **outputs(LARGE)),
        "error": fm.Error(id=-1, code=1, message="x"),
        # a seed type, as a trainer might store or send it
        "llm_response_large": LLMResponse(
            input_tokens=np.arange(1, SMALL + 1, dtype=np.int32),
            stop_reason="length",
            latency=1.5,
            ttft=0.25,
            **outputs(LARGE),
        ),
    }


def frame_bytes(frame: Any) -> bytes:
    """The bytes of one encoded frame (bytes, memoryview or numpy array)."""
    return bytes(memoryview(frame).cast("B"))


def main(out: str) -> None:
    import msgspec

    import fastio

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for name, msg in messages().items():
        frames = [frame_bytes(f) for f in fastio.encode(msg)]
        (path / f"{name}.frames").write_bytes(msgspec.msgpack.encode(frames))
    print(f"recorded {len(messages())} messages with {fastio.__file__} into {path}")


if __name__ == "__main__":
    main(sys.argv[1])
