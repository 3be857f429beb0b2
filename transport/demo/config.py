"""The demo's configuration: :class:`DemoConfig`, and the flags made from its fields."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import typing
from collections.abc import Sequence
from typing import Annotated, Literal, NoReturn

import msgspec
from msgspec import Meta

from fastio._optional import install_hint
from transport.options import configure

__all__ = ["REFERENCE_SIZES", "SIZES", "SIZE_DEFAULTS", "DemoConfig", "UserError", "parse_config"]

Size = Literal["tiny", "small", "medium", "large"]
#: The sizes ``--model-size`` takes (those of :data:`transport.hf_engine.MODEL_SIZES`).
SIZES: tuple[str, ...] = typing.get_args(Size)

#: name -> (vocab_size, hidden, layers) of the reference engine's TinyLM.
REFERENCE_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 64, 2), "small": (4096, 256, 2), "medium": (32000, 512, 2),
    "large": (32000, 1024, 4),
}  # fmt: skip

#: Size -> (requests in flight per client, seconds between weight updates): every update
#: makes the interrupted requests prefill again, so a larger model gets fewer of both.
SIZE_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (32, 5.0), "small": (16, 5.0), "medium": (8, 10.0), "large": (4, 15.0),
}  # fmt: skip

#: Field -> help text: the fields that are flags of ``python -m transport.demo``.
HELP = {
    "workers": "generation worker processes",
    "clients": "rollout client processes",
    "engine": "hf: a transformers causal LM; reference: a tiny GRU",
    "model_size": "size of the randomly initialised model",
    "model_path": "--engine hf: a local from_pretrained directory",
    "device": "the workers' torch device (default: cuda when present)",
    "concurrency": "requests in flight per client (default: 32, 16, 8, 4 for tiny..large)",
    "duration": "seconds to run",
    "update_every": "seconds between weight updates (default: 5, 5, 10, 15 for tiny..large)",
    "max_new_tokens": "each request asks for 8 to this many tokens",
    "prompt_len": "each prompt has 8 to this many tokens",
    "token_interval": "simulated extra seconds per token (or step)",
    "transport": "how the processes connect",
    "auth": "CurveZMQ encryption + client authentication",
    "seed": "the models' weights",
    "chaos": "kill one worker with SIGKILL at 40%% of --duration; it is restarted "
    "and the run must still answer every request once",
    "progress_every": "seconds between progress lines when the output is not a terminal",
    "keep_logs": "keep the run's directory (kept anyway when it fails)",
}


class DemoConfig(msgspec.Struct, kw_only=True):
    """One demo run: the fields of :data:`HELP` are its flags; the others tell a child
    role where it reports, whom it talks to and the model's vocabulary size."""

    workers: Annotated[int, Meta(ge=1)] = 2
    clients: Annotated[int, Meta(ge=1)] = 2
    engine: Literal["hf", "reference"] = "hf"
    model_size: Size = "small"
    model_path: str | None = None
    device: str | None = None
    concurrency: Annotated[int, Meta(ge=1)] = 16
    duration: Annotated[float, Meta(gt=0)] = 30.0
    update_every: Annotated[float, Meta(gt=0)] = 5.0
    max_new_tokens: Annotated[int, Meta(ge=1)] = 32
    prompt_len: Annotated[int, Meta(ge=8)] = 32
    token_interval: Annotated[float, Meta(ge=0)] = 0.0
    transport: Literal["tcp", "ipc"] = "tcp"
    auth: bool = False
    seed: int = 0
    chaos: bool = False
    progress_every: Annotated[float, Meta(ge=0)] = 5.0
    keep_logs: bool = False
    report: str = ""
    addresses: list[str] = msgspec.field(default_factory=list)
    publisher: str = ""
    keys: str | None = None
    index: int = 0
    vocab: int = 0


class UserError(Exception):
    """A mistake of the person running the demo: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(message)


def parse_config(argv: Sequence[str]) -> tuple[str, DemoConfig]:
    """The role and the :class:`DemoConfig` of a command line; a :class:`UserError`
    (one line naming the flag) for a bad value or flags that do not go together.
    Each field of :data:`HELP` is a flag; the values, strings, are checked here."""
    p = _Parser(
        prog="python -m transport.demo",
        description="The whole system on one machine, in one command.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults, types = DemoConfig(), typing.get_type_hints(DemoConfig)
    for name, help in HELP.items():
        flag, tp = "--" + name.replace("_", "-"), types[name]
        if tp is bool:
            p.add_argument(flag, action="store_true", help=help)
        elif name in ("concurrency", "update_every"):  # defaults that depend on the size
            p.add_argument(flag, help=help)
        else:
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            p.add_argument(flag, default=getattr(defaults, name), choices=choices, help=help)
    # Internal: a child role and its DemoConfig as JSON.
    p.add_argument("--role", choices=("orchestrator", "client", "trainer"),
                   default="orchestrator", help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role != "orchestrator":
        return args.role, msgspec.json.decode(args.config, type=DemoConfig)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("role", "config")}
    given.setdefault("concurrency", SIZE_DEFAULTS[args.model_size][0])
    given.setdefault("update_every", SIZE_DEFAULTS[args.model_size][1])
    try:
        c = configure(DemoConfig, None, given, "demo option")
    except ValueError as exc:  # "demo option NAME=VALUE: expected ...": named by its flag
        m = re.fullmatch(r"demo option (\w+)=.*?: (expected .*)", str(exc))
        if m is None:
            raise UserError(str(exc)) from None
        raise UserError(f"--{m[1].replace('_', '-')} {given[m[1]]}: {m[2]}") from None
    if c.chaos and c.workers < 2:
        raise UserError("--chaos needs --workers 2 or more (someone must serve meanwhile)")
    if c.model_path and c.engine != "hf":
        raise UserError("--model-path needs --engine hf")
    if c.model_path and not os.path.isfile(os.path.join(c.model_path, "config.json")):
        raise UserError(f"--model-path {c.model_path}: no config.json there")
    if c.engine == "hf" and importlib.util.find_spec("transformers") is None:
        raise UserError(f"--engine hf needs transformers: {install_hint('hf')}")
    if importlib.util.find_spec("rich") is None:
        raise UserError(f"the demo needs rich: {install_hint('demo')}")
    return "orchestrator", c
