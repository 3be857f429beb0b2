"""``python -m transport.demo``: the orchestrator and the entry point."""

from __future__ import annotations

import asyncio
import random
import runpy
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from transport.demo.children import (
    Child,
    WorkerPool,
    free_port,
    stop_all,
    stop_signals,
    watch_parent,
)
from transport.demo.config import DemoConfig, UserError, parse_config
from transport.demo.reports import REPORT_DECODER, Display, RunState, verdict
from transport.sockets import bind_all, make_socket

__all__ = ["DemoConfig", "UserError", "main"]


def _make_keys(tmp: Path) -> str:
    from zmq.auth import create_certificates

    keys = tmp / "keys"
    keys.mkdir()
    for name in ("worker", "client", "trainer"):
        create_certificates(keys, name)
    # Workers admit the client keys in clients/, the trainer's publisher the worker keys.
    for who, sub in (("client", "clients"), ("worker", "workers")):
        (keys / sub).mkdir()
        shutil.copy(keys / f"{who}.key", keys / sub)
    return str(keys)


def _child(role: str, c: DemoConfig, tmp: Path, name: str, index: int = 0) -> Child:
    config = msgspec.json.encode(msgspec.structs.replace(c, index=index)).decode()
    args = ["-m", "transport.demo", "--role", role, "--config", config]
    return Child(name, tmp / f"{name}.log", args)


def _run(c: DemoConfig, tmp: Path) -> bool:
    display, st = Display(live=sys.stdout.isatty(), interval=c.progress_every), RunState()
    zctx = zmq.Context()
    pull = make_socket(zctx, zmq.PULL, hwm=None, max_message_size=None)
    bind_all(pull, f"ipc://{tmp}/report")
    # Known before anything starts: the workers connect to it before the trainer binds.
    publisher = f"ipc://{tmp}/weights" if c.transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    keys = _make_keys(tmp) if c.auth else None
    c = msgspec.structs.replace(c, report=f"ipc://{tmp}/report", publisher=publisher, keys=keys)
    stop, pool = stop_signals(), WorkerPool(c, tmp, display.print)
    children: list[Child] = []
    try:
        display.print(
            f"fastio demo: {c.workers} workers, {c.clients} clients x {c.concurrency} in flight, "
            f"model {c.model_path or f'{c.engine} {c.model_size}'}, {c.transport}, "
            f"auth {'on' if c.auth else 'off'}; logs in {tmp} "
        )
        c = msgspec.structs.replace(c, addresses=pool.start())
        children.append(_child("trainer", c, tmp, "trainer"))
        c = msgspec.structs.replace(c, vocab=children[0].ready(300)["vocab"])
        children += [_child("client", c, tmp, f"client{i}", index=i) for i in range(c.clients)]
        for ch in children[1:]:
            ch.ready(120)
        st.started = time.perf_counter()
        # --chaos: one worker killed (and restarted) once the run is well under way.
        chaos_at = 0.4 * c.duration if c.chaos else None
        victim = random.Random(c.seed).randrange(c.workers)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)

        def drain(wait_ms: int) -> None:
            while poller.poll(wait_ms):
                wait_ms = 0
                st.take(REPORT_DECODER.decode(pull.recv()))

        def step() -> float:
            drain(250)
            pool.check(at := time.perf_counter() - st.started)
            st.events, st.crashed = pool.events, pool.crashed
            display.update(st)
            return at

        dead: list[str] = []
        with display:
            while not stop.is_set() and not dead and (at := step()) < c.duration:
                if chaos_at is not None and at >= chaos_at:
                    chaos_at = None
                    pool.kill(victim, at)
                dead = [ch.name for ch in children if ch.proc.poll() is not None]
            if dead:
                display.print(f"{dead[0]} exited early; see {tmp}/{dead[0]}.log")
            elif not stop.is_set() and pool.starting():
                # The final check is over every worker: wait for one restarting now.
                display.print(f"[{at:5.1f} s] waiting for {', '.join(pool.starting())} to be back")
                while not stop.is_set() and pool.starting():
                    step()
        elapsed = time.perf_counter() - st.started
        # Orderly stop: clients (final reports), then the trainer (final weight check).
        stop_all([ch.proc for ch in children[1:]], 30)
        drain(100)
        stop_all([children[0].proc], 60)
        drain(500)
        display.summary(st, elapsed)
        problem = verdict(st, early=bool(dead))
        if problem:
            print(f"FAILED: {problem}", file=sys.stderr, flush=True)
        return not problem
    except RuntimeError as exc:  # a child that could not start
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        stop_all([*(ch.proc for ch in children), *pool.procs()], 15)
        pull.close()
        zctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transport.demo``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["--role", "run"]:
        # A child that runs a module (the worker) under the parent-death watchdog.
        watch_parent()
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        return 0
    try:
        role, c = parse_config(args)
    except UserError as exc:
        print(f"python -m transport.demo: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if role != "orchestrator":
        from transport.demo.roles import client_role, trainer_role

        watch_parent()
        if role == "client":
            asyncio.run(client_role(c))
        else:
            import torch

            torch.set_num_threads(1)
            trainer_role(c)
        return 0
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
