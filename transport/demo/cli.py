"""``python -m transport.demo``: arguments, the orchestrator and the entry point."""

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
from transport.demo.display import Display
from transport.demo.reports import REPORT_DECODER, ClientReport, RunState, UpdateReport, verdict
from transport.demo.roles import client_role
from transport.demo.sizes import SIZE_DEFAULTS, SIZES
from transport.demo.supervise import WorkerPool
from transport.demo.trainer import trainer_role

__all__ = ["UserError", "main"]


class UserError(Exception):
    """A mistake of the person running the demo: reported in one line, exit status 2."""


def _check_args(a: argparse.Namespace) -> None:
    for name in ("workers", "clients", "concurrency", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if a.chaos and a.workers < 2:
        raise UserError("--chaos needs --workers 2 or more (someone must serve meanwhile)")
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
        raise UserError(f"--engine hf needs transformers: {install_hint('hf')}")


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
    display = Display(live=sys.stdout.isatty(), interval=a.progress_every)
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
    pub_addr = f"ipc://{tmp}/weights" if a.transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    common = ["--engine", a.engine, "--model-size", a.model_size, "--seed", str(a.seed)]
    if a.model_path:
        common += ["--model-path", a.model_path]

    stop = StopSignals()
    pool = WorkerPool(a, tmp, pub_addr, keys_dir, display.print)
    clients: list[subprocess.Popen[bytes]] = []
    trainer: subprocess.Popen[bytes] | None = None
    st = RunState()
    try:
        model = a.model_path or f"{a.engine} {a.model_size}"
        display.print(
            f"fastio demo: {a.workers} workers, {a.clients} clients x {a.concurrency} in flight, "
            f"model {model}, {a.transport}, auth {'on' if a.auth else 'off'}; logs in {tmp} "
        )
        pool.start()
        addrs = pool.addresses
        tcmd = ["-m", "transport.demo", "--role", "trainer", "--report", report_addr,
                "--publisher", pub_addr, "--update-every", str(a.update_every),
                "--workers-list", ",".join(addrs), *common]  # fmt: skip
        if keys_dir:
            tcmd += ["--keys", keys_dir]
        trainer = spawn(tcmd, tmp / "trainer.log")
        read_ready(trainer, "the trainer", tmp / "trainer.log", 300)
        for i in range(a.clients):
            ccmd = ["-m", "transport.demo", "--role", "client", "--index", str(i),
                    "--report", report_addr, "--workers-list", ",".join(addrs),
                    "--concurrency", str(a.concurrency), "--max-new-tokens", str(a.max_new_tokens),
                    "--prompt-len", str(a.prompt_len), *common]  # fmt: skip
            if keys_dir:
                ccmd += ["--keys", keys_dir]
            clients.append(spawn(ccmd, tmp / f"client{i}.log"))
        for i, p in enumerate(clients):
            read_ready(p, f"client{i}", tmp / f"client{i}.log", 120)
        names = {f"client{i}": p for i, p in enumerate(clients)}
        names["trainer"] = trainer
        st.started = time.perf_counter()
        end = st.started + a.duration
        # --chaos: one worker killed (and restarted) once the run is well under way.
        chaos_at = st.started + 0.4 * a.duration if a.chaos else None
        victim = random.Random(a.seed).randrange(a.workers)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)

        def drain(wait_ms: int) -> None:
            while poller.poll(wait_ms):
                wait_ms = 0
                msg = REPORT_DECODER.decode(pull.recv())
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
                now = time.perf_counter()
                if chaos_at is not None and now >= chaos_at:
                    chaos_at = None
                    pool.kill(victim, now - st.started)
                pool.check(now - st.started, time.monotonic())
                st.events, st.crashed = pool.events, pool.crashed
                dead = [n for n, p in names.items() if p.poll() is not None]
                if dead:
                    display.print(f"{dead[0]} exited early; see {tmp}/{dead[0]}.log")
                    early = True
                    break
                display.update(st)
            if not early and not stop.seen and pool.starting():
                # The final check is over every worker: one restarting now is waited
                # for, so that the summary shows it caught up.
                at = time.perf_counter() - st.started
                display.print(f"[{at:5.1f} s] waiting for {', '.join(pool.starting())} to be back")
                while not stop.seen and pool.starting():
                    drain(250)
                    pool.check(time.perf_counter() - st.started, time.monotonic())
                    display.update(st)
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
        ctx.term()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
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
        watch_parent()
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        return 0
    a = _parse(args)
    if a.role == "client":
        watch_parent()
        a.workers = a.workers_addrs
        asyncio.run(client_role(a))
        return 0
    if a.role == "trainer":
        watch_parent()
        a.workers = a.workers_addrs
        import torch

        torch.set_num_threads(1)
        trainer_role(a)
        return 0
    try:
        return _orchestrate(a)
    except UserError as exc:
        print(f"python -m transport.demo: error: {exc}", file=sys.stderr, flush=True)
        return 2
