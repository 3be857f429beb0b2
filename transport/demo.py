"""The whole system on one machine, in one command: ``python -m transport.demo``.

Processes (all real, all talking over real ZeroMQ sockets):

* ``--workers`` generation workers (``python -m transport.worker``) serving a
  transformers causal LM (:mod:`transport.hf_engine`, random weights of
  ``--model-size``, or ``--model-path``; ``--engine reference`` serves the tiny GRU of
  :mod:`transport.engine` instead), each with a weight subscriber in its process;
* one trainer: it takes real optimizer steps on its copy of the model and every
  ``--update-every`` seconds pauses generation, publishes the new weights, waits for
  every worker to apply them and resumes (:func:`transport.weights.update_weights`);
* ``--clients`` rollout client processes, each keeping ``--concurrency`` requests in
  flight through a :class:`~transport.FabricClient`.

Children report to this process over a PUSH/PULL socket (msgspec-encoded reports, no
pickle). A live display (on a terminal; otherwise a progress line every few seconds)
shows progress; at the end a summary table gives requests/s, tokens/s, latency
percentiles, ttft and itl, weight-update latency per version, interrupted-and-resumed
counts, re-sends and workers declared dead, and whether every worker's weights equal
the trainer's. The exit status is 0 only if some request completed, every update
succeeded and the weights ended equal.

Ctrl-C (or the end of ``--duration``) shuts everything down in order. Children die with
this process even if it is killed: each holds the read end of a pipe (its stdin) whose
only writer is this process, and a watchdog thread in the child ends it when that pipe
reports end-of-file. (No ``preexec_fn``: it is unsafe in a parent that already runs
threads, as this one does with ZeroMQ's.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

__all__ = ["REFERENCE_SIZES", "SIZES", "hf_worker_args", "main"]

#: The sizes ``--model-size`` takes (those of :data:`transport.hf_engine.MODEL_SIZES`).
SIZES = ("tiny", "small", "medium", "large")

#: name -> (vocab_size, hidden, layers) of the reference engine's TinyLM.
REFERENCE_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 64, 2),
    "small": (4096, 256, 2),
    "medium": (32000, 512, 2),
    "large": (32000, 1024, 4),
}

#: Defaults that depend on the model size: (requests in flight per client, seconds
#: between weight updates). After each update every interrupted request is prefilled
#: again under the new weights, so a larger model gets fewer requests in flight and
#: rarer updates to keep serving on two cores.
SIZE_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (32, 5.0),
    "small": (16, 5.0),
    "medium": (8, 10.0),
    "large": (4, 15.0),
}


class UserError(Exception):
    """A mistake of the person running the demo: reported in one line, exit status 2."""


# -- reports from the children (msgpack, not pickle) -----------------------------------
class ClientReport(msgspec.Struct, tag="client"):
    """Figures of one rollout client process: counters are cumulative, the sample lists
    hold only what is new since the previous report (so reports stay small)."""

    client: int
    done: int = 0
    failed: int = 0
    tokens: int = 0
    latencies: list[float] = msgspec.field(default_factory=list)
    ttfts: list[float] = msgspec.field(default_factory=list)
    itls: list[float] = msgspec.field(default_factory=list)
    interrupted: int = 0
    multi_version: int = 0
    resent: int = 0
    died: int = 0
    final: bool = False


class UpdateReport(msgspec.Struct, tag="update"):
    """One weight update done by the trainer."""

    version: int
    seconds: float
    ok: bool = True
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    loss: float = 0.0
    nbytes: int = 0


class FinalCheck(msgspec.Struct, tag="final"):
    """The trainer's end-of-run check of every worker's weights."""

    version: int
    trainer_digest: str
    workers: dict[str, str]
    equal: bool


Report = ClientReport | UpdateReport | FinalCheck
_report_enc = msgspec.msgpack.Encoder()
_report_dec = msgspec.msgpack.Decoder(Report)


# -- process helpers --------------------------------------------------------------------
def _watch_parent(grace: float = 10.0) -> None:
    """In a child: end this process when the demo process is gone.

    Its stdin is a pipe whose only writer is the demo process (which never writes), so
    a read returns end-of-file exactly when that process exits, however it exits. The
    watchdog then sends this process SIGTERM (an orderly stop) and, if it is still
    alive ``grace`` seconds later, SIGKILL.
    """

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)  # the orderly stop's allowance, then no more waiting
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    # The run's directory marks every child's environment, so a test (or a person) can
    # find them all: grep FASTIO_DEMO_RUN /proc/*/environ.
    env = {**os.environ, "FASTIO_DEMO_RUN": str(log_path.parent)}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        # The parent-death pipe (see _watch_parent): we hold the only write end.
        stdin=subprocess.PIPE,
        # Own session: a terminal Ctrl-C reaches only this process, which then stops
        # the children in order (clients, trainer, workers).
        start_new_session=True,
    )
    log.close()  # the child has its own copy
    return proc


def _log_tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()
    return "(no output)"


def _read_ready(proc: subprocess.Popen[bytes], name: str, log: Path, timeout: float) -> Any:
    """Wait for the child's one-line JSON ``{"ready": ...}`` on stdout."""
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"{name} was not ready after {timeout:.0f} s")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                code = proc.wait()
                raise RuntimeError(f"{name} exited ({code}) before it was ready: {_log_tail(log)}")
            buf += chunk
    finally:
        sel.close()
    return json.loads(buf.split(b"\n", 1)[0])


def _stop(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in procs:
        for f in (p.stdin, p.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _StopSignals:
    """Notes SIGINT and SIGTERM (a blocking role polls ``seen`` between steps)."""

    def __init__(self) -> None:
        self.seen = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, *_: Any) -> None:
        self.seen = True


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


@functools.lru_cache(maxsize=1)
def _worker_help() -> str:
    """``python -m transport.worker --help``: which flags this worker CLI has."""
    out = subprocess.run(
        [sys.executable, "-m", "transport.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    return out.stdout


def hf_worker_args(
    model_size: str = "small",
    model_path: str | None = None,
    device: str | None = None,
    seed: int = 0,
    **opts: Any,
) -> list[str]:
    """Worker command-line arguments that serve :mod:`transport.hf_engine`.

    With a worker CLI that has ``--engine hf`` that is used; otherwise the same engine
    through ``--engine transport.hf_engine:factory``, whose options then travel as
    ``--plugin-opt``. ``opts`` are further :func:`transport.hf_engine.create_engine`
    options.
    """
    if "--engine-opt" in _worker_help():
        args = ["--engine", "hf", "--model-size", model_size, "--seed", str(seed)]
        if model_path:
            args += ["--model-path", model_path]
        if device:
            args += ["--device", device]
        for k, v in opts.items():
            args += ["--engine-opt", f"{k}={v}"]
        return args
    every = {"model_size": model_size, "seed": seed, **opts}
    if model_path:
        every["model_path"] = model_path
    if device:
        every["device"] = device
    args = ["--engine", "transport.hf_engine:factory"]
    for k, v in every.items():
        args += ["--plugin-opt", f"{k}={v}"]
    return args


# -- roles -------------------------------------------------------------------------------
def _curve_for_client(keys: str | None) -> Any:
    if not keys:
        return None
    from transport import CurveConfig

    return CurveConfig(
        secret_key_file=os.path.join(keys, "client.key_secret"),
        server_public_key_file=os.path.join(keys, "worker.key"),
    )


def _vocab(a: argparse.Namespace) -> int:
    if a.engine == "reference":
        return REFERENCE_SIZES[a.model_size][0]
    if a.model_path:
        with open(os.path.join(a.model_path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    from transport.hf_engine import MODEL_SIZES

    return MODEL_SIZES[a.model_size]["vocab_size"]


async def _client_role(a: argparse.Namespace) -> None:
    from fastio import GenerationHyperparameters, LLMRequest, TokenArray
    from transport import ClientConfig, FabricClient

    stop = _stop_event()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(a.report)
    rep = ClientReport(client=a.index)
    rng = random.Random(a.index)
    vocab = _vocab(a)
    config = ClientConfig(curve=_curve_for_client(a.keys))
    print(json.dumps({"ready": True}), flush=True)

    async with FabricClient(a.workers, config) as client:

        async def one_loop() -> None:
            while not stop.is_set():
                n = rng.randint(8, a.prompt_len)
                req = LLMRequest(
                    input_ids=TokenArray(
                        np.asarray([rng.randrange(vocab) for _ in range(n)], np.int32)
                    ),
                    gconfig=GenerationHyperparameters(
                        max_new_tokens=rng.randint(min(8, a.max_new_tokens), a.max_new_tokens),
                        temperature=1.0,
                    ),
                )
                t0 = time.perf_counter()
                try:
                    resp = await client.agenerate(req, timeout=300)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rep.failed += 1
                    # No worker alive (NoWorkerAvailable) fails at once: wait before the
                    # next try instead of spinning.
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                    continue
                rep.done += 1
                rep.tokens += resp.output_len
                rep.latencies.append(time.perf_counter() - t0)
                rep.ttfts.append(resp.ttft)
                if len(resp.itl):
                    rep.itls.append(float(resp.itl.array.mean()))
                if len(set(resp.output_versions.array.tolist())) > 1:
                    rep.multi_version += 1

        def counters() -> None:
            rep.interrupted = client.stats.get("interrupted", 0)
            rep.resent = client.stats.get("resent", 0)
            rep.died = client.stats.get("workers_died", 0)

        tasks = [asyncio.ensure_future(one_loop()) for _ in range(a.concurrency)]
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            counters()
            _send_report(push, rep)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        counters()
    rep.final = True
    _send_report(push, rep)
    push.close()
    ctx.term()


def _send_report(push: zmq.Socket[Any], rep: ClientReport) -> None:
    push.send(_report_enc.encode(rep))
    rep.latencies.clear()
    rep.ttfts.clear()
    rep.itls.clear()


def _trainer_model(a: argparse.Namespace) -> tuple[Any, int, Any]:
    """The trainer's copy of the workers' model, its vocabulary and a loss function."""
    import torch

    if a.engine == "reference":
        from transport.engine import TinyLM

        vocab, hidden, layers = REFERENCE_SIZES[a.model_size]
        tiny = TinyLM(vocab, hidden, layers, seed=a.seed)

        def tiny_logits(x: torch.Tensor) -> torch.Tensor:
            return tiny(x)[0]  # type: ignore[no-any-return]

        return tiny, vocab, tiny_logits
    from transport import hf_engine

    if a.model_path:
        model: Any = hf_engine.load_pretrained(a.model_path)
    else:
        model = hf_engine.build_model(a.model_size, seed=a.seed)

    def hf_logits(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x).logits  # type: ignore[no-any-return]

    return model, int(model.config.vocab_size), hf_logits


def _trainer_role(a: argparse.Namespace) -> None:
    import torch

    from transport import FabricController
    from transport.weights import WeightPublisher, state_digest, update_weights

    stop = _StopSignals()
    torch.manual_seed(1234)
    model, vocab, logits_of = _trainer_model(a)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(a.report)
    ctl = FabricController(a.workers, curve=_curve_for_client(a.keys), timeout=60)
    pub_curve = None
    if a.keys:
        from transport import CurveConfig

        pub_curve = CurveConfig(
            secret_key_file=os.path.join(a.keys, "trainer.key_secret"),
            authorized_clients_dir=os.path.join(a.keys, "workers"),
        )
    pub = WeightPublisher(a.publisher, curve=pub_curve)
    print(json.dumps({"ready": pub.endpoint}), flush=True)
    # Wait for every worker's subscriber, but stay responsive to a stop meanwhile.
    joined_by = time.monotonic() + 120
    while not stop.seen:
        try:
            pub.wait_for_workers(len(a.workers), timeout=0.25)
            break
        except TimeoutError:
            if time.monotonic() > joined_by:
                raise
    version = 0
    next_update = time.monotonic() + a.update_every
    while not stop.seen:
        while not stop.seen and time.monotonic() < next_update:
            time.sleep(min(0.05, max(0.0, next_update - time.monotonic())))
        if stop.seen:
            break
        # A real optimizer step on a small synthetic next-token batch: the weights
        # really change, and the step stays cheap next to the workers' generation.
        x = torch.randint(0, vocab, (2, 17))
        logits = logits_of(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        version += 1
        t0 = time.perf_counter()
        res = update_weights(ctl, pub, model, version, timeout=60, strict=False)
        rep = UpdateReport(
            version=version,
            seconds=time.perf_counter() - t0,
            ok=res.ok,
            failed={**res.failed, **dict.fromkeys(res.missing, "no answer")},
            loss=float(loss),
            nbytes=nbytes,
        )
        push.send(_report_enc.encode(rep))
        next_update = time.monotonic() + a.update_every
    # Final check: every worker's reported digest equals the trainer's weights.
    want = state_digest(model.state_dict())
    seen = {w: info.digest for w, info in pub.workers().items() if info.alive}
    final = FinalCheck(
        version=version,
        trainer_digest=f"{want:016x}",
        workers={w: f"{d:016x}" if d is not None else "unknown" for w, d in seen.items()},
        equal=len(seen) == len(a.workers) and all(d == want for d in seen.values()),
    )
    push.send(_report_enc.encode(final))
    ctl.close()
    pub.close()
    push.close()
    ctx.term()


# -- the orchestrator ----------------------------------------------------------------------
@dataclass
class _State:
    clients: dict[int, ClientReport] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    updates: list[UpdateReport] = field(default_factory=list)
    final: FinalCheck | None = None
    started: float = field(default_factory=time.perf_counter)

    def total(self, name: str) -> int:
        return sum(int(getattr(r, name)) for r in self.clients.values())


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _summary_rows(st: _State, elapsed: float) -> list[tuple[str, str]]:
    done, toks = st.total("done"), st.total("tokens")
    lat, ttft, itl = st.latencies, st.ttfts, st.itls
    rows = [
        ("elapsed", f"{elapsed:.1f} s"),
        ("requests done / failed", f"{done} / {st.total('failed')}"),
        ("requests/s", f"{done / max(elapsed, 1e-9):.1f}"),
        ("tokens/s", f"{toks / max(elapsed, 1e-9):.0f}"),
        (
            "latency p50 / p90 / p99",
            f"{_pct(lat, 50) * 1e3:.0f} / {_pct(lat, 90) * 1e3:.0f} / {_pct(lat, 99) * 1e3:.0f} ms",
        ),
        ("ttft p50 / p99", f"{_pct(ttft, 50) * 1e3:.1f} / {_pct(ttft, 99) * 1e3:.1f} ms"),
        ("itl mean p50", f"{_pct(itl, 50) * 1e3:.2f} ms"),
        ("interrupted (resumed) chunks", str(st.total("interrupted"))),
        ("responses spanning >1 weight version", str(st.total("multi_version"))),
        ("re-sent after worker loss", str(st.total("resent"))),
        ("workers declared dead", str(st.total("died"))),
        ("weight version", str(st.updates[-1].version if st.updates else 0)),
    ]
    if st.updates:
        mib = st.updates[-1].nbytes / 2**20
        rows.append(("weight update (pause+publish+apply+resume)", f"{mib:.1f} MiB per version"))
    for u in st.updates[-8:]:
        rows.append(
            (
                f"  v{u.version}",
                f"{u.seconds * 1e3:.0f} ms" + ("" if u.ok else f" FAILED {u.failed}"),
            )
        )
    if st.final is not None:
        rows.append(
            (
                "workers' weights == trainer's",
                ("yes" if st.final.equal else "NO")
                + f" (v{st.final.version}, {len(st.final.workers)} workers)",
            )
        )
    return rows


class _Display:
    """rich when it is installed, plain lines otherwise; a live table on a terminal, a
    progress line every few seconds elsewhere (a log, CI)."""

    def __init__(self, live: bool, interval: float = 5.0) -> None:
        try:
            from fastio._optional import require

            self.rich: Any = require("rich.console", "demo", "the demo's tables")
            require("rich.table", "demo")
            require("rich.live", "demo")
        except ImportError:
            self.rich = None
        self.console = self.rich.Console() if self.rich is not None else None
        self.live = live and self.console is not None
        self.interval = interval
        self._next = time.monotonic() + interval
        self._live: Any = None

    def print(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def table(self, rows: list[tuple[str, str]], title: str) -> Any:
        if self.rich is None:
            width = max(len(k) for k, _ in rows)
            return "\n".join([title, *(f"{k:<{width}} │ {v}" for k, v in rows)])
        from rich.table import Table

        t = Table(title=title, show_header=True)
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(k, v)
        return t

    def __enter__(self) -> _Display:
        self._next = time.monotonic() + self.interval
        if self.live:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, st: _State) -> None:
        elapsed = time.perf_counter() - st.started
        if self._live is not None:
            self._live.update(self.table(_summary_rows(st, elapsed), "running (Ctrl-C stops)"))
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        done = st.total("done")
        self.print(
            f"[{elapsed:5.0f} s] done {done} ({done / max(elapsed, 1e-9):.1f}/s), "
            f"failed {st.total('failed')}, {st.total('tokens') / max(elapsed, 1e-9):.0f} tok/s, "
            f"version {st.updates[-1].version if st.updates else 0}, "
            f"re-sent {st.total('resent')}, workers dead {st.total('died')}"
        )

    def summary(self, st: _State, elapsed: float) -> None:
        t = self.table(_summary_rows(st, elapsed), "fastio demo summary")
        if self.console is not None:
            self.console.print(t)
        else:
            print(t, flush=True)


def _verdict(st: _State, early: bool) -> str:
    """Why the run failed ("" when it did not)."""
    if early:
        return "a process exited early"
    if st.total("done") == 0:
        return "no request completed"
    failed = [u.version for u in st.updates if not u.ok]
    if failed:
        return f"weight update(s) failed: versions {failed}"
    if st.final is None:
        return "the trainer did not report its final weight check"
    if not st.final.equal:
        return "the workers' weights differ from the trainer's"
    return ""


def _check_args(a: argparse.Namespace) -> None:
    for name in ("workers", "clients", "concurrency", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if a.prompt_len < 8:
        raise UserError("--prompt-len must be at least 8")
    for name in ("duration", "update_every"):
        if not getattr(a, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if a.model_path:
        if a.engine != "hf":
            raise UserError("--model-path needs --engine hf")
        if not os.path.isfile(os.path.join(a.model_path, "config.json")):
            raise UserError(f"--model-path {a.model_path}: no config.json there")
    if a.engine == "hf" and importlib.util.find_spec("transformers") is None:
        raise UserError("--engine hf needs transformers: pip install 'fastio[hf]'")


def _worker_cmd(
    a: argparse.Namespace, i: int, bind: str, pub_addr: str, keys: str | None
) -> list[str]:
    cmd = ["-m", "transport.demo", "--role", "run", "transport.worker", "--bind", bind,
           "--worker-id", f"worker{i}",
           "--plugin", "transport.weights.update:subscribe",
           "--plugin-opt", f"weights_endpoint={pub_addr}", "--plugin-opt", "weights_digest=1"]  # fmt: skip
    if a.engine == "reference":
        vocab, hidden, layers = REFERENCE_SIZES[a.model_size]
        cmd += ["--engine", "reference", "--seed", str(a.seed), "--vocab-size", str(vocab),
                "--hidden", str(hidden), "--layers", str(layers),
                "--token-interval", str(a.token_interval)]  # fmt: skip
    else:
        opts = {"token_interval": a.token_interval} if a.token_interval else {}
        cmd += hf_worker_args(a.model_size, a.model_path, a.device, a.seed, **opts)
    if "--metrics-port" in _worker_help() and importlib.util.find_spec("prometheus_client"):
        cmd += ["--metrics-port", "0"]
    if keys:
        cmd += [
            "--plugin-opt", f"weights_curve_secret={keys}/worker.key_secret",
            "--plugin-opt", f"weights_curve_server={keys}/trainer.key",
            "--curve-secret", f"{keys}/worker.key_secret", "--curve-clients", f"{keys}/clients",
        ]  # fmt: skip
    return cmd


def _orchestrate(a: argparse.Namespace) -> int:
    _check_args(a)
    tmp = Path(tempfile.mkdtemp(prefix="fastio-demo-"))
    ok = False
    try:
        ok = _run(a, tmp)
    finally:
        if ok and not a.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def _run(a: argparse.Namespace, tmp: Path) -> bool:
    display = _Display(live=sys.stdout.isatty(), interval=a.progress_every)
    report_addr = f"ipc://{tmp}/report"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(report_addr)
    keys_dir: str | None = None
    if a.auth:
        from zmq.auth import create_certificates

        keys_dir = str(tmp / "keys")
        os.makedirs(keys_dir)
        for name in ("worker", "client", "trainer"):
            create_certificates(keys_dir, name)
        # Workers admit the client public keys in clients/; the trainer's weight
        # publisher admits the worker public keys in workers/.
        for who, sub in (("client", "clients"), ("worker", "workers")):
            os.makedirs(os.path.join(keys_dir, sub))
            shutil.copy(os.path.join(keys_dir, f"{who}.key"), os.path.join(keys_dir, sub))
    # Chosen before anything starts: workers connect to it (ZeroMQ retries until the
    # trainer binds), and the trainer is started once the workers' addresses are known.
    pub_addr = f"ipc://{tmp}/weights" if a.transport == "ipc" else f"tcp://127.0.0.1:{_free_port()}"
    common = ["--engine", a.engine, "--model-size", a.model_size, "--seed", str(a.seed)]
    if a.model_path:
        common += ["--model-path", a.model_path]

    stop = _StopSignals()
    workers: list[subprocess.Popen[bytes]] = []
    clients: list[subprocess.Popen[bytes]] = []
    trainer: subprocess.Popen[bytes] | None = None
    st = _State()
    try:
        model = a.model_path or f"{a.engine} {a.model_size}"
        display.print(
            f"fastio demo: {a.workers} workers, {a.clients} clients x {a.concurrency} in flight, "
            f"model {model}, {a.transport}, auth {'on' if a.auth else 'off'}; logs in {tmp} "
        )
        addrs: list[str] = []
        for i in range(a.workers):
            bind = f"ipc://{tmp}/worker{i}" if a.transport == "ipc" else "tcp://127.0.0.1:0"
            workers.append(
                _spawn(_worker_cmd(a, i, bind, pub_addr, keys_dir), tmp / f"worker{i}.log")
            )
        for i, p in enumerate(workers):
            ready = _read_ready(p, f"worker{i}", tmp / f"worker{i}.log", 300)
            addrs.append(ready["ready"][0])
            metrics = (
                f", metrics http://127.0.0.1:{ready['metrics']}/metrics"
                if "metrics" in ready
                else ""
            )
            display.print(f"worker{i}: {addrs[-1]}{metrics}")
        tcmd = ["-m", "transport.demo", "--role", "trainer", "--report", report_addr,
                "--publisher", pub_addr, "--update-every", str(a.update_every),
                "--workers-list", ",".join(addrs), *common]  # fmt: skip
        if keys_dir:
            tcmd += ["--keys", keys_dir]
        trainer = _spawn(tcmd, tmp / "trainer.log")
        _read_ready(trainer, "the trainer", tmp / "trainer.log", 300)
        for i in range(a.clients):
            ccmd = ["-m", "transport.demo", "--role", "client", "--index", str(i),
                    "--report", report_addr, "--workers-list", ",".join(addrs),
                    "--concurrency", str(a.concurrency), "--max-new-tokens", str(a.max_new_tokens),
                    "--prompt-len", str(a.prompt_len), *common]  # fmt: skip
            if keys_dir:
                ccmd += ["--keys", keys_dir]
            clients.append(_spawn(ccmd, tmp / f"client{i}.log"))
        for i, p in enumerate(clients):
            _read_ready(p, f"client{i}", tmp / f"client{i}.log", 120)
        names = {f"worker{i}": p for i, p in enumerate(workers)}
        names.update({f"client{i}": p for i, p in enumerate(clients)}, trainer=trainer)
        st.started = time.perf_counter()
        end = st.started + a.duration
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)

        def drain(wait_ms: int) -> None:
            while poller.poll(wait_ms):
                wait_ms = 0
                msg = _report_dec.decode(pull.recv())
                if isinstance(msg, ClientReport):
                    st.clients[msg.client] = msg
                    st.latencies += msg.latencies
                    st.ttfts += msg.ttfts
                    st.itls += msg.itls
                elif isinstance(msg, UpdateReport):
                    st.updates.append(msg)
                else:
                    st.final = msg

        early = False
        with display:
            while not stop.seen and time.perf_counter() < end:
                drain(250)
                dead = [n for n, p in names.items() if p.poll() is not None]
                if dead:
                    display.print(f"{dead[0]} exited early; see {tmp}/{dead[0]}.log")
                    early = True
                    break
                display.update(st)
        elapsed = time.perf_counter() - st.started
        # Orderly stop: clients (final reports), then the trainer (final weight check).
        _stop(clients, 30)
        drain(100)
        _stop([trainer], 60)
        drain(500)
        display.summary(st, elapsed)
        problem = _verdict(st, early)
        if problem:
            print(f"FAILED: {problem}", file=sys.stderr, flush=True)
        return not problem
    except RuntimeError as exc:  # a child that could not start
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        _stop([*clients, *([trainer] if trainer else []), *workers], 15)
        pull.close()
        ctx.term()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m transport.demo",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="generation worker processes")
    p.add_argument("--clients", type=int, default=2, help="rollout client processes")
    p.add_argument("--engine", choices=("hf", "reference"), default="hf",
                   help="hf: a transformers causal LM; reference: a tiny GRU")  # fmt: skip
    p.add_argument("--model-size", choices=SIZES, default="small",
                   help="size of the randomly initialised model")  # fmt: skip
    p.add_argument("--model-path", help="--engine hf: a local from_pretrained directory")
    p.add_argument("--device", help="the workers' torch device (default: cuda when present)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight per client (default: 32, 16, 8, 4 for tiny..large)")  # fmt: skip
    p.add_argument("--duration", type=float, default=30.0, help="seconds to run")
    p.add_argument("--update-every", type=float, default=None,
                   help="seconds between weight updates (default: 5, 5, 10, 15 for tiny..large)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="each request asks for 8 to this many tokens")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=32,
                   help="each prompt has 8 to this many tokens")  # fmt: skip
    p.add_argument("--token-interval", type=float, default=0.0,
                   help="simulated extra seconds per token (or step)")  # fmt: skip
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    p.add_argument(
        "--auth", action="store_true", help="CurveZMQ encryption + client authentication"
    )
    p.add_argument("--seed", type=int, default=0, help="the models' weights")
    p.add_argument("--progress-every", type=float, default=5.0,
                   help="seconds between progress lines when the output is not a terminal")  # fmt: skip
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the run's directory (kept anyway when the run fails)")  # fmt: skip
    # internal: the child roles
    p.add_argument(
        "--role",
        choices=("orchestrator", "client", "trainer", "run"),
        default="orchestrator",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--publisher", help=argparse.SUPPRESS)
    p.add_argument("--workers-list", default="", help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    concurrency, update_every = SIZE_DEFAULTS[a.model_size]
    if a.concurrency is None:
        a.concurrency = concurrency
    if a.update_every is None:
        a.update_every = update_every
    a.workers_addrs = [w for w in a.workers_list.split(",") if w]
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transport.demo``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["--role", "run"]:
        # A child that runs a module (the worker) under the parent-death watchdog.
        _watch_parent()
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        return 0
    a = _parse(args)
    if a.role == "client":
        _watch_parent()
        a.workers = a.workers_addrs
        asyncio.run(_client_role(a))
        return 0
    if a.role == "trainer":
        _watch_parent()
        a.workers = a.workers_addrs
        import torch

        torch.set_num_threads(1)
        _trainer_role(a)
        return 0
    try:
        return _orchestrate(a)
    except UserError as exc:
        print(f"python -m transport.demo: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
