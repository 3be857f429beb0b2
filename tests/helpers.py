"""Helpers shared by several test modules (a test module imports these, never another
test module): worker processes and polling, ZeroMQ peers of a worker, the codec's
sample messages, the recorded wire vectors, and Prometheus expositions."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import zmq
from PIL import Image

import fastio
from fastio import (
    AllocationMode,
    FinetuneSpec,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    RolloutStat,
    SaveLoadMeta,
    SaverConfig,
    VLMRequest,
    VLMResponse,
    WeightUpdateMeta,
)
from fastio import fabric_msgs as fm

ROOT = Path(__file__).resolve().parents[1]

# --- processes and polling -----------------------------------------------------------


class WorkerProc:
    """A ``python -m transport.worker`` subprocess."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        pp = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transport.worker", *args],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        self.address = ""
        #: The ready line, parsed.
        self.ready: dict[str, Any] = {}
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Block until the worker prints its ready line (poll with a deadline: generous,
        as tests share a loaded machine with other tests' processes)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                self.ready = json.loads(line)
                self.address = self.ready["ready"][0]
                return self.address
        raise TimeoutError("worker did not become ready")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until truthy (bounded; no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        select.select([], [], [], 0.01)  # a 10 ms poll tick between checks
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    """A loopback TCP port free now (nothing listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def await_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Async :func:`wait_for`: yields to the loop between checks."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        await asyncio.sleep(0.005)  # poll tick; the loop keeps serving meanwhile
    raise AssertionError(f"timed out waiting for {what}")


#: Imported once by the forkserver of :func:`mp_context`, not by every child.
CHILD_PRELOAD = ["torch", "transport.weights.publisher", "transport.weights.subscriber"]


def mp_context() -> Any:
    """The multiprocessing context of the tests' child processes (trainers, workers):
    ``forkserver``, whose server has torch and the weights package imported, so a child
    is a fresh process forked from that idle server (no threads started, no sockets)
    instead of a spawn that imports torch again (seconds of CPU per child on 2 cores)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(CHILD_PRELOAD)
    return ctx


# --- a raw ZeroMQ peer of a worker -------------------------------------------------------

#: A pong slower than this means the worker did not answer: generous for a loaded
#: machine (this is a liveness test, not a speed test; bench measures the p99).
PONG_BOUND_S = 2.0


def dealer(ctx: zmq.Context[Any], address: str, rcvhwm: int = 1000) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.connect(address)
    return s


def ping(sock: zmq.Socket[Any]) -> fm.Heartbeat:
    """One ping; the pong (Results/Errors met on the way are skipped)."""
    sent = time.time()
    sock.send_multipart(fastio.encode(fm.Heartbeat(sent_at=sent)))
    deadline = time.monotonic() + PONG_BOUND_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(left * 1000), f"no pong within {PONG_BOUND_S} s"
        for part in fm.split(sock.recv_multipart()):
            msg = fastio.decode(part, type=fm.WORKER_TO_CLIENT)
            if isinstance(msg, fm.Heartbeat) and msg.sent_at == sent:
                return msg


# --- the codec's sample messages ------------------------------------------------------

RNG_SEED = 1234


def rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def big_response(n: int = 4096) -> LLMResponse:
    r = rng()
    return LLMResponse(
        input_tokens=r.integers(0, 150_000, 3000, dtype=np.int32),
        output_tokens=r.integers(0, 150_000, n, dtype=np.int32),
        output_logprobs=-r.random(n, dtype=np.float32),
        output_versions=np.full(n, 3, np.int32),
        stop_reason="length",
        latency=1.5,
        ttft=0.25,
        itl=r.random(n),
    )


def all_messages() -> list[Any]:
    alloc = AllocationMode.from_str("sglang.d4p1t1+d2p2t1")
    img = Image.fromarray(rng().integers(0, 255, (8, 6, 3), dtype=np.uint8), "RGB")
    return [
        GenerationHyperparameters(n_samples=4, greedy=True, stop_token_ids=[1, 2]),
        LLMRequest(
            rid="r1",
            input_ids=list(range(1000)),
            gconfig=GenerationHyperparameters(temperature=0.7),
            metadata={"task": "math", "n": 3, "nested": {"x": [1.5, None]}},
            model_id="policy",
        ),
        LLMRequest(),
        big_response(),
        LLMResponse(),
        VLMRequest(input_ids=[1, 2, 3], image_data=[img, "https://example.org/a.png"]),
        VLMRequest(image_data=None),
        VLMResponse(output_tokens=[5, 6], input_images=[img, "path/to/b.jpg"]),
        FinetuneSpec(3, 1000, 32),
        alloc,
        ParamSpec("model.layers.0.weight", (4096, 4096), "bfloat16"),
        WeightUpdateMeta.from_disk(SaverConfig("e", "t", "/root")),
        WeightUpdateMeta(
            type="nccl",
            alloc_mode=alloc,
            nccl_master_port=1234,
            nccl_param_specs=[ParamSpec("a", (2,), "float32")],
        ),
        SaverConfig("e", "t", "/root", freq_steps=10),
        SaveLoadMeta("/ckpt", "hf", True, None, None, None, naive_distributed=True),
        RolloutStat(5, 3, 2),
    ]


# --- recorded bytes of earlier releases (tests/fastio/wire_vectors) --------------------

VECTORS = ROOT / "tests" / "fastio" / "wire_vectors"


def _load_recorder() -> Any:
    """``wire_vectors/record.py``, which defines the recorded messages."""
    spec = importlib.util.spec_from_file_location(
        "fastio_wire_vectors_record", VECTORS / "record.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record = _load_recorder()

ERAS = ["ext4", "compact", "ref"]
#: Ext codes each release's decoder reads (16 + d etc. for every token dtype).
_T = set(range(16, 29)) - {26}
ERA_READS = {
    "ext4": {1, 2, 3, 4},
    "compact": {1, 2, 3, 4} | _T | {c + 16 for c in _T},
    "ref": {1, 2, 3, 4} | _T | {c + 16 for c in _T} | {c + 32 for c in _T},
}


def load(era: str, name: str) -> list[bytes]:
    """The recorded frames of one message."""
    frames: list[bytes] = msgspec.msgpack.decode((VECTORS / era / f"{name}.frames").read_bytes())
    return frames


def ext_codes(frames: list[Any]) -> tuple[int, set[int]]:
    """The header's version and every ext code in the message, read by the ``msgpack``
    package (independent of fastio)."""
    codes: set[int] = set()

    def hook(code: int, data: bytes) -> Any:
        codes.add(code)
        if code in (1, 2, 4):  # [dtype, shape, data]: nested values to look into
            msgpack.unpackb(data, ext_hook=hook)
        return None

    version, n, _ = msgpack.unpackb(
        record.frame_bytes(frames[0]), ext_hook=hook, strict_map_key=False
    )
    assert n == len(frames) - 1
    return version, codes


# --- Prometheus text expositions ---------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of a text exposition: ``{(name, labels): value}``."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not an exposition line: {line!r}"
        name, labels, value = m.groups()
        out[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return out


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)
