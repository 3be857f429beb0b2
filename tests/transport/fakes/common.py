"""What the fake servers share: a deterministic model, fault options, the process helper.

The "model": each token is a function of the weights seed and the whole context so far
(prompt plus the tokens generated before it), so a generation interrupted and resumed
with its partial output appended continues exactly as the uninterrupted one, and a
weight reload (a new seed) changes the output. Logprobs are a function of the same.

Faults (command-line options): ``--hang-after N`` stops answering anything (streams,
``/health``) once N tokens were generated in all; ``--die-after N`` exits the process
at that point; ``--token-interval S`` paces generation (a model's step time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

VOCAB = 256
ROOT = Path(__file__).resolve().parents[3]


def context_hash(ids: list[int], h: int = 0) -> int:
    """Hash of a token sequence, extendable one token at a time."""
    for t in ids:
        h = zlib.crc32(struct.pack("<i", t), h)
    return h


def next_token(seed: int, h: int) -> tuple[int, float]:
    """The token after a context of hash ``h`` under weights ``seed``, with its logprob."""
    x = zlib.crc32(struct.pack("<qI", seed, h))
    return x % VOCAB, -round(((x >> 8) % 1000) / 1000 + 0.001, 6)


def reference_output(seed: int, prompt: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    """What the fake generates for ``prompt`` (``n`` tokens at most) under ``seed``."""
    h = context_hash(prompt)
    out: list[int] = []
    for _ in range(n):
        tok, _lp = next_token(seed, h)
        out.append(tok)
        h = context_hash([tok], h)
        if tok in stop:
            break
    return out


def seed_of_path(path: str) -> int:
    """The weights seed of a model directory: a hash of its safetensors files' bytes."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    h = 0
    for f in files:
        h = zlib.crc32(f.read_bytes(), h)
    return h


class FakeState:
    """Weights, faults and counters of one fake server (asyncio, one loop)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.seed: int = args.seed
        self.weight_version = "default"
        self.token_interval: float = args.token_interval
        self.hang_after: int = args.hang_after
        self.die_after: int = args.die_after
        self.tokens = 0
        self.hung = asyncio.Event()
        self.stats: dict[str, int] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    # -- what both servers serve alike ------------------------------------------------------
    def app(self) -> Any:
        """The aiohttp application: the server's own routes (:meth:`routes`), ``GET
        /health`` and ``GET /fake/stats``."""
        from aiohttp import web

        app = web.Application()
        self.routes(app)
        app.router.add_get("/health", self.health)
        app.router.add_get("/fake/stats", self.get_stats)
        return app

    def routes(self, app: Any) -> None:
        """Add the server's own endpoints to ``app``."""
        raise NotImplementedError

    def n_running(self) -> int:
        """Requests generating now (``running`` in the stats)."""
        raise NotImplementedError

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        await self.fault_point()
        return web.Response(text="")

    async def get_stats(self, request: Any) -> Any:
        from aiohttp import web

        body = dict(self.stats, seed=self.seed, running=self.n_running(), tokens=self.tokens)
        return web.json_response(body)

    def sample(self, h: int, stop: set[int], n_out: int, min_new: int) -> tuple[int, float, int]:
        """The next token after a context of hash ``h`` (a stop token before ``min_new``
        tokens becomes another), its logprob and the context's new hash; counted."""
        tok, lp = next_token(self.seed, h)
        if tok in stop and n_out < min_new:
            tok = (tok + 1) % VOCAB
        self.tokens += 1
        return tok, lp, context_hash([tok], h)

    async def fault_point(self) -> None:
        """Called before each token and each request: hang or die when due."""
        if self.die_after >= 0 and self.tokens >= self.die_after:
            os._exit(3)
        if self.hang_after >= 0 and self.tokens >= self.hang_after:
            self.hung.set()
        if self.hung.is_set():
            await asyncio.Event().wait()  # hung for good


async def open_stream(request: Any) -> Any:
    """A prepared server-sent event response to ``request``."""
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def sse(body: Any) -> bytes:
    """One ``data:`` event of ``body`` as JSON."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def end_stream(resp: Any) -> Any:
    """``data: [DONE]`` and the end of the body; returns ``resp``."""
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--token-interval", type=float, default=0.0)
    p.add_argument("--hang-after", type=int, default=-1)
    p.add_argument("--die-after", type=int, default=-1)
    p.add_argument("--incremental", action="store_true", help="sglang: incremental chunks")
    p.add_argument(
        "--register-delay", type=float, default=0.0,
        help="sglang: seconds a request waits (a queue) before its rid can be aborted",
    )  # fmt: skip
    p.add_argument("--model", default="fake-model", help="vllm: the served model name")
    return p.parse_args(argv)


def serve(make_app: Any, port: int, keepalive: float = 75.0) -> None:
    """Run the app ``make_app()`` builds (in the loop) on 127.0.0.1:port (0: any) and
    print ``{"port": P}`` once listening; idle kept connections close after
    ``keepalive`` s (aiohttp's default 75)."""
    from aiohttp import web

    async def main() -> None:
        app = make_app()
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, keepalive_timeout=keepalive
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        real = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        print(json.dumps({"port": real, "pid": os.getpid()}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


class FakeProc:
    """A fake server process (``python -m tests.transport.fakes.<kind>_server``)."""

    def __init__(self, kind: str, *args: str) -> None:
        pp = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"tests.transport.fakes.{kind}_server", *args],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake {kind} server exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                self.port = json.loads(self.proc.stdout.readline())["port"]
                break
        else:
            self.kill()
            raise TimeoutError(f"fake {kind} server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        """The server's counters and state (``GET /fake/stats``)."""
        with urllib.request.urlopen(self.url + "/fake/stats", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
