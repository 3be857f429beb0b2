"""The whole system on one machine, in one command: ``python -m transport.demo``.

Processes (all real, all talking over real ZeroMQ sockets):

* ``--workers`` generation workers (``python -m transport.worker``) serving the reference
  engine, each with a weight subscriber living in its event loop;
* one trainer: it takes real optimizer steps on its copy of the model and every
  ``--update-every`` seconds pauses generation, publishes the new weights, waits for
  every worker to apply them and resumes (:func:`transport.weights.update_weights`);
* ``--clients`` rollout client processes, each keeping ``--concurrency`` requests in
  flight through a :class:`~transport.FabricClient`.

Children report to this process over a PUSH/PULL socket (msgspec-encoded reports, no
pickle). A live display shows progress; at the end a summary table gives requests/s,
tokens/s, latency percentiles, ttft and itl, weight-update latency per version,
interrupted-and-resumed counts, and whether every worker's weights equal the trainer's.
Ctrl-C (or the end of ``--duration``) shuts everything down in order; children die with
this process even if it is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

__all__ = ["MODEL_SIZES", "main"]

#: name -> (vocab_size, hidden, layers) of the reference engine's TinyLM.
MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 64, 2),
    "small": (4096, 256, 2),
    "medium": (32000, 512, 2),
    "large": (32000, 1024, 4),
}


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
def _die_with_parent() -> None:
    # Linux: the child gets SIGKILL when the demo process dies, however it dies.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    # The run's directory marks every child's environment, so a test (or a person) can
    # find them all: grep FASTIO_DEMO_RUN /proc/*/environ.
    env = {**os.environ, "FASTIO_DEMO_RUN": str(log_path.parent)}
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
        # Own process group: a terminal Ctrl-C reaches only this process, which then
        # stops the children in order (clients, trainer, workers).
        start_new_session=True,
    )


def _read_ready(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """Wait for the child's one-line JSON ``{"ready": ...}`` on stdout."""
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            raise TimeoutError(f"process {proc.args!r} did not become ready in {timeout} s")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.wait()} before ready")
        buf += chunk
    sel.close()
    doc: dict[str, Any] = json.loads(buf.split(b"\n", 1)[0])
    return doc


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


# -- roles -------------------------------------------------------------------------------
def _curve_for_client(keys: str | None) -> Any:
    if not keys:
        return None
    from transport import CurveConfig

    return CurveConfig(
        secret_key_file=os.path.join(keys, "client.key_secret"),
        server_public_key_file=os.path.join(keys, "worker.key"),
    )


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
    vocab = MODEL_SIZES[a.model_size][0]
    config = ClientConfig(curve=_curve_for_client(a.keys))
    print(json.dumps({"ready": True}), flush=True)

    async with FabricClient(a.workers, config) as client:

        async def one_loop() -> None:
            while not stop.is_set():
                n = rng.randint(8, 64)
                req = LLMRequest(
                    input_ids=TokenArray(
                        np.asarray([rng.randrange(vocab) for _ in range(n)], np.int32)
                    ),
                    gconfig=GenerationHyperparameters(
                        max_new_tokens=rng.randint(16, a.max_new_tokens), temperature=1.0
                    ),
                )
                t0 = time.perf_counter()
                try:
                    resp = await client.agenerate(req, timeout=120)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rep.failed += 1
                    continue
                rep.done += 1
                rep.tokens += resp.output_len
                rep.latencies.append(time.perf_counter() - t0)
                rep.ttfts.append(resp.ttft)
                if len(resp.itl):
                    rep.itls.append(float(resp.itl.array.mean()))
                if len(set(resp.output_versions.array.tolist())) > 1:
                    rep.multi_version += 1

        tasks = [asyncio.ensure_future(one_loop()) for _ in range(a.concurrency)]
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            rep.interrupted = client.stats["interrupted"]
            rep.resent = client.stats["resent"]
            _send_report(push, rep)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        rep.interrupted = client.stats["interrupted"]
        rep.resent = client.stats["resent"]
    rep.final = True
    _send_report(push, rep)
    push.close()
    ctx.term()


def _send_report(push: zmq.Socket[Any], rep: ClientReport) -> None:
    push.send(_report_enc.encode(rep))
    rep.latencies.clear()
    rep.ttfts.clear()
    rep.itls.clear()


def _trainer_role(a: argparse.Namespace) -> None:
    import torch

    from transport import FabricController
    from transport.engine import TinyLM
    from transport.weights import WeightPublisher, state_digest, update_weights

    stop = _StopSignals()
    torch.manual_seed(1234)
    vocab, hidden, layers = MODEL_SIZES[a.model_size]
    model = TinyLM(vocab, hidden, layers, seed=a.seed)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
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
        # A real optimizer step on synthetic next-token data: the weights really change.
        x = torch.randint(0, vocab, (8, 32))
        logits, _ = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        version += 1
        t0 = time.perf_counter()
        res = update_weights(ctl, pub, model, version, timeout=20, strict=False)
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


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _summary_table(st: _State, elapsed: float, title: str) -> Any:
    from rich.table import Table

    reps = list(st.clients.values())
    done = sum(r.done for r in reps)
    toks = sum(r.tokens for r in reps)
    lat, ttft, itl = st.latencies, st.ttfts, st.itls
    t = Table(title=title, show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("elapsed", f"{elapsed:.1f} s")
    t.add_row("requests done / failed", f"{done} / {sum(r.failed for r in reps)}")
    t.add_row("requests/s", f"{done / max(elapsed, 1e-9):.1f}")
    t.add_row("tokens/s", f"{toks / max(elapsed, 1e-9):.0f}")
    t.add_row(
        "latency p50 / p90 / p99",
        f"{_pct(lat, 50) * 1e3:.0f} / {_pct(lat, 90) * 1e3:.0f} / {_pct(lat, 99) * 1e3:.0f} ms",
    )
    t.add_row("ttft p50 / p99", f"{_pct(ttft, 50) * 1e3:.1f} / {_pct(ttft, 99) * 1e3:.1f} ms")
    t.add_row("itl mean p50", f"{_pct(itl, 50) * 1e3:.2f} ms")
    t.add_row("interrupted (resumed) chunks", str(sum(r.interrupted for r in reps)))
    t.add_row("responses spanning >1 weight version", str(sum(r.multi_version for r in reps)))
    t.add_row("re-sent after worker loss", str(sum(r.resent for r in reps)))
    t.add_row("weight version", str(st.updates[-1].version if st.updates else 0))
    if st.updates:
        mib = st.updates[-1].nbytes / 2**20
        t.add_row("weight update (pause+publish+apply+resume)", f"{mib:.1f} MiB per version")
    for u in st.updates[-8:]:
        t.add_row(
            f"  v{u.version}",
            f"{u.seconds * 1e3:.0f} ms" + ("" if u.ok else f" FAILED {u.failed}"),
        )
    if st.final is not None:
        t.add_row(
            "workers' weights == trainer's",
            ("yes" if st.final.equal else "NO")
            + f" (v{st.final.version}, {len(st.final.workers)} workers)",
        )
    return t


def _orchestrate(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="fastio-demo-"))
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
    vocab, hidden, layers = MODEL_SIZES[a.model_size]
    # Chosen before anything starts: workers connect to it (ZeroMQ retries until the
    # trainer binds), and the trainer is started once the workers' addresses are known.
    pub_addr = f"ipc://{tmp}/weights" if a.transport == "ipc" else f"tcp://127.0.0.1:{_free_port()}"

    stop = _StopSignals()
    workers: list[subprocess.Popen[bytes]] = []
    clients: list[subprocess.Popen[bytes]] = []
    trainer: subprocess.Popen[bytes] | None = None
    st = _State()
    try:
        console.print(
            f"[bold]fastio demo[/]: {a.workers} workers, {a.clients} clients, model {a.model_size}, {a.transport}, auth {'on' if a.auth else 'off'}; logs in {tmp}"
        )
        addrs: list[str] = []
        for i in range(a.workers):
            bind = f"ipc://{tmp}/worker{i}" if a.transport == "ipc" else "tcp://127.0.0.1:0"
            cmd = [
                "-m", "transport.worker", "--bind", bind, "--engine", "reference",
                "--worker-id", f"worker{i}", "--seed", str(a.seed), "--vocab-size", str(vocab),
                "--hidden", str(hidden), "--layers", str(layers),
                "--token-interval", str(a.token_interval),
                "--plugin", "transport.weights.update:subscribe",
                "--plugin-opt", f"weights_endpoint={pub_addr}", "--plugin-opt", "weights_digest=1",
            ]  # fmt: skip
            if keys_dir:
                cmd += [
                    "--plugin-opt",
                    f"weights_curve_secret={keys_dir}/worker.key_secret",
                    "--plugin-opt",
                    f"weights_curve_server={keys_dir}/trainer.key",
                    "--curve-secret",
                    f"{keys_dir}/worker.key_secret",
                    "--curve-clients",
                    f"{keys_dir}/clients",
                ]
            workers.append(_spawn(cmd, tmp / f"worker{i}.log"))
        for p in workers:
            addrs.append(_read_ready(p, 120)["ready"][0])
        tcmd = [
            "-m", "transport.demo", "--role", "trainer", "--report", report_addr,
            "--publisher", pub_addr, "--model-size", a.model_size, "--seed", str(a.seed),
            "--update-every", str(a.update_every), "--workers-list", ",".join(addrs),
        ]  # fmt: skip
        if keys_dir:
            tcmd += ["--keys", keys_dir]
        trainer = _spawn(tcmd, tmp / "trainer.log")
        _read_ready(trainer, 120)
        for i in range(a.clients):
            ccmd = [
                "-m", "transport.demo", "--role", "client", "--index", str(i),
                "--report", report_addr, "--workers-list", ",".join(addrs),
                "--model-size", a.model_size, "--concurrency", str(a.concurrency),
                "--max-new-tokens", str(a.max_new_tokens),
            ]  # fmt: skip
            if keys_dir:
                ccmd += ["--keys", keys_dir]
            clients.append(_spawn(ccmd, tmp / f"client{i}.log"))
        for p in clients:
            _read_ready(p, 60)
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

        with Live(console=console, refresh_per_second=4, transient=True) as live:
            while not stop.seen and time.perf_counter() < end:
                drain(250)
                dead = [p for p in (*workers, trainer, *clients) if p.poll() is not None]
                if dead:
                    console.print(
                        f"[red]a process exited early: {dead[0].args!r}; see logs in {tmp}"
                    )
                    break
                live.update(
                    _summary_table(st, time.perf_counter() - st.started, "running (Ctrl-C stops)")
                )
        elapsed = time.perf_counter() - st.started
        # Orderly stop: clients (final reports), then the trainer (final weight check).
        _stop(clients, 30)
        drain(100)
        _stop([trainer], 60)
        drain(500)
        console.print(_summary_table(st, elapsed, "fastio demo summary"))
        ok = st.final is not None and st.final.equal and all(u.ok for u in st.updates)
        return 0 if ok else 1
    finally:
        _stop([*clients, *([trainer] if trainer else []), *workers], 15)
        pull.close()
        ctx.term()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m transport.demo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--workers", type=int, default=2, help="generation worker processes")
    p.add_argument("--clients", type=int, default=2, help="rollout client processes")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight per client")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to run")
    p.add_argument("--update-every", type=float, default=5.0, help="seconds between weight updates")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--token-interval", type=float, default=0.0, help="simulated extra seconds per token"
    )
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    p.add_argument(
        "--auth", action="store_true", help="CurveZMQ encryption + client authentication"
    )
    p.add_argument("--seed", type=int, default=0)
    # internal: the child roles
    p.add_argument(
        "--role",
        choices=("orchestrator", "client", "trainer"),
        default="orchestrator",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--publisher", help=argparse.SUPPRESS)
    p.add_argument("--workers-list", default="", help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.workers_addrs = [w for w in a.workers_list.split(",") if w]
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transport.demo``."""
    a = _parse(argv)
    if a.role == "client":
        a.workers = a.workers_addrs
        asyncio.run(_client_role(a))
        return 0
    if a.role == "trainer":
        a.workers = a.workers_addrs
        import torch

        torch.set_num_threads(1)
        _trainer_role(a)
        return 0
    return _orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
