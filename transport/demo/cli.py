"""``python -m transport.demo``: the run's configuration, the orchestrator, the entry point."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from fastio._optional import install_hint
from transport.demo.children import (
    StopSignals,
    free_port,
    read_ready,
    spawn,
    stop_all,
    watch_parent,
)
from transport.demo.config import SIZE_DEFAULTS, SIZES, DemoConfig
from transport.demo.display import Display
from transport.demo.reports import REPORT_DECODER, RunState, verdict
from transport.demo.supervise import WorkerPool
from transport.sockets import bind_all, make_socket

__all__ = ["DemoConfig", "UserError", "main"]


class UserError(Exception):
    """A mistake of the person running the demo: reported in one line, exit status 2."""


def _check(c: DemoConfig) -> None:
    for name in ("workers", "clients", "concurrency", "max_new_tokens"):
        if getattr(c, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if c.chaos and c.workers < 2:
        raise UserError("--chaos needs --workers 2 or more (someone must serve meanwhile)")
    if c.prompt_len < 8:
        raise UserError("--prompt-len must be at least 8")
    for name in ("duration", "update_every"):
        if not getattr(c, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if c.model_path:
        if c.engine != "hf":
            raise UserError("--model-path needs --engine hf")
        if not os.path.isfile(os.path.join(c.model_path, "config.json")):
            raise UserError(f"--model-path {c.model_path}: no config.json there")
    if c.engine == "hf" and importlib.util.find_spec("transformers") is None:
        raise UserError(f"--engine hf needs transformers: {install_hint('hf')}")


def _orchestrate(c: DemoConfig) -> int:
    _check(c)
    tmp = Path(tempfile.mkdtemp(prefix="fastio-demo-"))
    ok = False
    try:
        ok = _run(c, tmp)
    finally:
        if ok and not c.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def _make_keys(tmp: Path) -> str:
    from zmq.auth import create_certificates

    keys = tmp / "keys"
    keys.mkdir()
    for name in ("worker", "client", "trainer"):
        create_certificates(keys, name)
    # Workers admit the client public keys in clients/; the trainer's weight publisher
    # admits the worker public keys in workers/.
    for who, sub in (("client", "clients"), ("worker", "workers")):
        (keys / sub).mkdir()
        shutil.copy(keys / f"{who}.key", keys / sub)
    return str(keys)


def _child(role: str, c: DemoConfig, log: Path) -> subprocess.Popen[bytes]:
    config = msgspec.json.encode(c).decode()
    return spawn(["-m", "transport.demo", "--role", role, "--config", config], log)


def _run(c: DemoConfig, tmp: Path) -> bool:
    display = Display(live=sys.stdout.isatty(), interval=c.progress_every)
    zctx = zmq.Context()
    pull = make_socket(zctx, zmq.PULL, hwm=None, max_message_size=None)
    bind_all(pull, f"ipc://{tmp}/report")
    # Chosen before anything starts: workers connect to it (ZeroMQ retries until the
    # trainer binds), and the trainer is started once the workers' addresses are known.
    publisher = f"ipc://{tmp}/weights" if c.transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    c = msgspec.structs.replace(
        c,
        report=f"ipc://{tmp}/report",
        publisher=publisher,
        keys=_make_keys(tmp) if c.auth else None,
    )
    stop = StopSignals()
    pool = WorkerPool(c, tmp, display.print)
    clients: list[subprocess.Popen[bytes]] = []
    trainer: subprocess.Popen[bytes] | None = None
    st = RunState()
    try:
        model = c.model_path or f"{c.engine} {c.model_size}"
        display.print(
            f"fastio demo: {c.workers} workers, {c.clients} clients x {c.concurrency} in flight, "
            f"model {model}, {c.transport}, auth {'on' if c.auth else 'off'}; logs in {tmp} "
        )
        pool.start()
        c = msgspec.structs.replace(c, addresses=pool.addresses)
        trainer = _child("trainer", c, tmp / "trainer.log")
        read_ready(trainer, "the trainer", tmp / "trainer.log", 300)
        for i in range(c.clients):
            clients.append(
                _child("client", msgspec.structs.replace(c, index=i), tmp / f"client{i}.log")
            )
        for i, p in enumerate(clients):
            read_ready(p, f"client{i}", tmp / f"client{i}.log", 120)
        names = {f"client{i}": p for i, p in enumerate(clients)}
        names["trainer"] = trainer
        st.started = time.perf_counter()
        end = st.started + c.duration
        # --chaos: one worker killed (and restarted) once the run is well under way.
        chaos_at = st.started + 0.4 * c.duration if c.chaos else None
        victim = random.Random(c.seed).randrange(c.workers)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)

        def drain(wait_ms: int) -> None:
            while poller.poll(wait_ms):
                wait_ms = 0
                st.take(REPORT_DECODER.decode(pull.recv()))

        def step() -> None:
            drain(250)
            pool.check(time.perf_counter() - st.started, time.monotonic())
            st.events, st.crashed = pool.events, pool.crashed
            display.update(st)

        early = False
        with display:
            while not stop.seen and time.perf_counter() < end:
                if chaos_at is not None and time.perf_counter() >= chaos_at:
                    chaos_at = None
                    pool.kill(victim, time.perf_counter() - st.started)
                step()
                dead = [n for n, p in names.items() if p.poll() is not None]
                if dead:
                    display.print(f"{dead[0]} exited early; see {tmp}/{dead[0]}.log")
                    early = True
                    break
            if not early and not stop.seen and pool.starting():
                # The final check is over every worker: one restarting now is waited
                # for, so that the summary shows it caught up.
                at = time.perf_counter() - st.started
                display.print(f"[{at:5.1f} s] waiting for {', '.join(pool.starting())} to be back")
                while not stop.seen and pool.starting():
                    step()
        elapsed = time.perf_counter() - st.started
        # Orderly stop: clients (final reports), then the trainer (final weight check).
        stop_all(clients, 30)
        drain(100)
        stop_all([trainer], 60)
        drain(500)
        display.summary(st, elapsed)
        problem = verdict(st, early)
        if problem:
            print(f"FAILED: {problem}", file=sys.stderr, flush=True)
        return not problem
    except RuntimeError as exc:  # a child that could not start
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        stop_all([*clients, *([trainer] if trainer else []), *pool.procs()], 15)
        pull.close()
        zctx.term()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m transport.demo",
        description="The whole system on one machine, in one command.",
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
    p.add_argument("--chaos", action="store_true",
                   help="kill one worker with SIGKILL at 40%% of --duration; it is restarted "
                        "and the run must still answer every request once")  # fmt: skip
    p.add_argument("--progress-every", type=float, default=5.0,
                   help="seconds between progress lines when the output is not a terminal")  # fmt: skip
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the run's directory (kept anyway when the run fails)")  # fmt: skip
    # internal: a child role and its DemoConfig as JSON
    p.add_argument("--role", choices=("orchestrator", "client", "trainer"),
                   default="orchestrator", help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transport.demo``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["--role", "run"]:
        # A child that runs a module (the worker) under the parent-death watchdog.
        watch_parent()
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        return 0
    a = _parse(args)
    if a.role != "orchestrator":
        watch_parent()
        c = msgspec.json.decode(a.config, type=DemoConfig)
        if a.role == "client":
            from transport.demo.roles import client_role

            asyncio.run(client_role(c))
        else:
            import torch

            from transport.demo.trainer import trainer_role

            torch.set_num_threads(1)
            trainer_role(c)
        return 0
    flags = {k: v for k, v in vars(a).items() if k not in ("role", "config")}
    concurrency, update_every = SIZE_DEFAULTS[a.model_size]
    flags["concurrency"] = concurrency if a.concurrency is None else a.concurrency
    flags["update_every"] = update_every if a.update_every is None else a.update_every
    try:
        return _orchestrate(DemoConfig(**flags))
    except UserError as exc:
        print(f"python -m transport.demo: error: {exc}", file=sys.stderr, flush=True)
        return 2
