"""``python -m transport.worker``: a generation worker process.

It prints one JSON line ``{"ready": [endpoints], "pid": ..., "worker_id": ...}`` (plus
``"metrics": port`` with ``--metrics-port``) once it serves. A user error prints one
line on stderr and exits 2 (1: a plugin failed as it started).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import zmq

from transport.engines.registry import ENGINES, resolve_engine
from transport.errors import BadAddress
from transport.metrics import start_http_server
from transport.options import resolve_entry
from transport.sockets import CurveConfig
from transport.worker.config import WorkerConfig, checked_config
from transport.worker.server import Background, WorkerServer
from transport.zmqio import tune_malloc

__all__ = ["main"]

PROG = "python -m transport.worker"
#: Engines that compute nothing in the worker: torch is not imported for them.
_NO_TORCH = frozenset(("echo", "sglang", "vllm"))
#: Flags that set the WorkerConfig field of the same name (checked by WorkerConfig).
_CONFIG_FLAGS = {
    "worker_id": "name in heartbeats (default host:pid)",
    "max_concurrency": "handlers running at once",
    "max_pending": "running plus waiting",
    "client_timeout": "s of silence before a client is dead",
    "max_message_size": "bytes",
    "hwm": "socket high-water mark",
    "peer_queue_limit": "bytes queued for a client that does not read before it is dropped",
}
#: Flags of the reference engine (also --seed, shared with hf), as its engine options.
_REFERENCE_FLAGS = {
    "vocab_size": ("256", "reference: vocabulary"),
    "hidden": ("64", "reference: hidden size"),
    "layers": ("2", "reference: GRU layers"),
    "token_interval": ("0.0", "reference: simulated s per token"),
}

#: The help of the flags whose text is longer than their line.
_HELP = {
    "engine": "the engine: the reference TinyLM, an echo, a transformers causal LM, a bridge to "
    "a running SGLang or vLLM server (--engine-opt url=http://...), or module:factory "
    "(factory(engine_opts) returns a handler or an engine)",
    "model_size": "--engine hf: the size of the randomly initialised model",
    "inline": "serve the socket on the engine's loop (on: only for engines that never block; "
    "auto: as the engine says, the echo does) instead of a thread of its own",
    "loop": "event loop of the engine's loop and the socket thread (uvloop: pip install "
    "'fastio[uvloop]')",
    "plugin": "module:function(server, plugin_opts), a background job in the worker's loop",
    "metrics_port": "serve Prometheus /metrics on 127.0.0.1 at this port (0 picks one) and "
    "record the latency histograms; off if unset",
}


class UserError(Exception):
    """An error the user can fix: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _engine_spec(value: str) -> str:
    if value in ENGINES or (":" in value and all(value.partition(":")[::2])):
        return value
    choices = ", ".join(ENGINES)
    raise argparse.ArgumentTypeError(
        f"invalid choice {value!r} (choose from {choices}, or module:factory)"
    )


def _key_value(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {value!r}")
    return key, val


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    # A default only where the help does not say it, and there is one.
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, "", []):
            return action.help
        return super()._get_help_string(action)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(
        prog=PROG,
        description="A generation worker: a ZeroMQ ROUTER serving a generate engine.",
        formatter_class=_Help,
    )
    add = p.add_argument
    add("--bind", action="append", required=True, help="address to bind (repeatable)")
    engines = "{" + ",".join(ENGINES) + ",module:factory}"
    add("--engine", default="reference", type=_engine_spec, metavar=engines, help=_HELP["engine"])
    sizes = ("tiny", "small", "medium", "large")
    add("--model-size", default="small", choices=sizes, help=_HELP["model_size"])
    add("--model-path", help="--engine hf: a local from_pretrained directory")
    add("--device", help="--engine hf: torch device (default: cuda when present)")
    add("--seed", default="0", help="weights seed of reference / hf")
    for name, (default, help) in _REFERENCE_FLAGS.items():
        add(_flag(name), default=default, help=help)
    defaults = WorkerConfig()
    for name, help in _CONFIG_FLAGS.items():
        add(_flag(name), default=getattr(defaults, name), help=help)
    add("--inline", default="auto", choices=("auto", "on", "off"), help=_HELP["inline"])
    add("--loop", default="asyncio", choices=("asyncio", "uvloop"), help=_HELP["loop"])
    add("--curve-secret", help="this worker's .key_secret certificate (enables CURVE)")
    add("--curve-clients", help="directory of authorized client .key certificates")
    add("--plugin", action="append", default=[], help=_HELP["plugin"])
    kv: dict[str, Any] = dict(action="append", default=[], type=_key_value, metavar="KEY=VALUE")
    add("--engine-opt", help="option for the engine factory (repeatable)", **kv)
    add("--plugin-opt", help="option passed to plugins (repeatable)", **kv)
    add("--metrics-port", type=int, default=None, help=_HELP["metrics_port"])
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    add("--log-level", default="WARNING", type=str.upper, choices=levels, help="any case")
    args = p.parse_args(argv)
    if args.plugin_opt and not args.plugin:
        keys = ", ".join(sorted({k for k, _ in args.plugin_opt}))
        p.error(f"--plugin-opt {keys} given without --plugin: no plugin would read it")
    return args


def _config(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig the flags describe; a bad value is named by its flag."""
    given: dict[str, Any] = {name: getattr(args, name) for name in _CONFIG_FLAGS}
    given.update(bind=args.bind, extra=dict(args.plugin_opt))
    given["inline"] = {"auto": None, "on": True, "off": False}[args.inline]
    given["latency_metrics"] = args.metrics_port is not None
    if args.curve_secret:
        given["curve"] = CurveConfig(
            secret_key_file=args.curve_secret, authorized_clients_dir=args.curve_clients
        )
    try:
        return checked_config(given)
    except ValueError as exc:  # "worker option NAME=VALUE: expected ...": named by its flag
        m = re.fullmatch(r"worker option (\w+)=.*?: (expected .*)", str(exc))
        if m is None:
            raise UserError(str(exc)) from None
        raise UserError(f"{_flag(m[1])} {given[m[1]]}: {m[2]}") from None


def build_engine(args: argparse.Namespace) -> Any:
    """The handler or engine ``--engine`` names, built with its options: ``--engine-opt``
    over the legacy flags of the reference and hf engines."""
    opts: dict[str, str] = {}
    if args.engine == "reference":
        opts = {name: getattr(args, name) for name in (*_REFERENCE_FLAGS, "seed")}
    elif args.engine == "hf":
        opts = {"model_size": args.model_size, "seed": args.seed}
        opts.update((k, v) for k in ("model_path", "device") if (v := getattr(args, k)))
    opts.update(args.engine_opt)
    try:
        return resolve_engine(args.engine)(opts)
    except ValueError as exc:
        raise UserError(f"--engine {args.engine}: {exc}") from exc
    except Exception as exc:
        raise UserError(f"--engine {args.engine}: {type(exc).__name__}: {exc}") from exc


def _plugins(args: argparse.Namespace) -> list[Background]:
    opts = dict(args.plugin_opt)
    jobs: list[Background] = []
    for spec in args.plugin:
        try:
            fn = resolve_entry(spec, "--plugin")
        except ValueError as exc:
            raise UserError(str(exc)) from exc

        async def job(server: WorkerServer, fn: Callable[..., Any] = fn) -> None:
            await fn(server, opts)

        job.__qualname__ = spec
        jobs.append(job)
    return jobs


async def _amain(args: argparse.Namespace) -> None:
    config = _config(args)  # a bad flag is told before the engine loads
    server = WorkerServer(build_engine(args), config, background=_plugins(args))
    try:
        endpoints = await server.start()
    except zmq.ZMQError as exc:
        raise UserError(f"cannot bind {', '.join(args.bind)}: {exc}") from exc
    except BadAddress as exc:
        raise UserError(str(exc)) from exc
    except (OSError, ValueError) as exc:  # CURVE certificates
        raise UserError(f"{type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:  # a plugin failed as it started
        raise UserError(str(exc), code=1) from exc
    ready: dict[str, Any] = {"ready": endpoints, "pid": os.getpid(), "worker_id": server.worker_id}
    if args.metrics_port is not None:
        try:
            ready["metrics"] = start_http_server(args.metrics_port)
        except (ImportError, OSError) as exc:
            await server.close()
            raise UserError(f"--metrics-port {args.metrics_port}: {exc}") from exc
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.close()))
    # What exists now lives as long as the process: a full collection need not walk it
    # holding the GIL (delaying pongs).
    gc.freeze()
    print(json.dumps(ready), flush=True)
    await server.serve_forever()


def _use_loop(kind: str) -> None:
    """Make every loop of this process (the engine's, the socket thread's) ``kind``."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            raise UserError("--loop uvloop needs uvloop: pip install 'fastio[uvloop]'") from exc
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m transport.worker`` (see ``--help``)."""
    args = _parse_args(argv)
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=args.log_level, format=fmt, stream=sys.stderr)
    tune_malloc()  # this process is the worker's own: large messages reuse freed pages
    # The socket thread waits at most this long for a GIL held by engine code.
    sys.setswitchinterval(0.001)
    if args.engine not in _NO_TORCH:
        with contextlib.suppress(ImportError):
            import torch

            torch.set_num_threads(1)  # one generation thread per worker: workers share cores
    try:
        _use_loop(args.loop)
        asyncio.run(_amain(args))
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.code)
