"""The demo's configuration: :class:`DemoConfig`, and the flags made from its fields."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NoReturn

import msgspec

from fastio._optional import install_hint

__all__ = ["REFERENCE_SIZES", "SIZES", "SIZE_DEFAULTS", "DemoConfig", "UserError", "parse_config"]

Size = Literal["tiny", "small", "medium", "large"]
#: The sizes ``--model-size`` takes (those of :data:`transport.hf_engine.MODEL_SIZES`).
SIZES: tuple[str, ...] = typing.get_args(Size)

#: name -> (vocab_size, hidden, layers) of the reference engine's TinyLM.
REFERENCE_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 64, 2),
    "small": (4096, 256, 2),
    "medium": (32000, 512, 2),
    "large": (32000, 1024, 4),
}

#: Size -> (requests in flight per client, seconds between weight updates): every update
#: makes the interrupted requests prefill again, so a larger model gets fewer of both.
SIZE_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (32, 5.0),
    "small": (16, 5.0),
    "medium": (8, 10.0),
    "large": (4, 15.0),
}


def _flag(help: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=help, **constraints)


class DemoConfig(msgspec.Struct, kw_only=True):
    """One demo run: a field with a description is a flag of ``python -m transport.demo``;
    the others tell a child role where it reports and whom it talks to."""

    workers: Annotated[int, _flag("generation worker processes", ge=1)] = 2
    clients: Annotated[int, _flag("rollout client processes", ge=1)] = 2
    engine: Annotated[
        Literal["hf", "reference"], _flag("hf: a transformers causal LM; reference: a tiny GRU")
    ] = "hf"
    model_size: Annotated[Size, _flag("size of the randomly initialised model")] = "small"
    model_path: Annotated[str | None, _flag("--engine hf: a local from_pretrained directory")] = (
        None
    )
    device: Annotated[
        str | None, _flag("the workers' torch device (default: cuda when present)")
    ] = None
    concurrency: Annotated[
        int, _flag("requests in flight per client (default: 32, 16, 8, 4 for tiny..large)", ge=1)
    ] = 16
    duration: Annotated[float, _flag("seconds to run", gt=0)] = 30.0
    update_every: Annotated[
        float, _flag("seconds between weight updates (default: 5, 5, 10, 15 for tiny..large)", gt=0)
    ] = 5.0
    max_new_tokens: Annotated[int, _flag("each request asks for 8 to this many tokens", ge=1)] = 32
    prompt_len: Annotated[int, _flag("each prompt has 8 to this many tokens", ge=8)] = 32
    token_interval: Annotated[float, _flag("simulated extra seconds per token (or step)", ge=0)] = (
        0.0
    )
    transport: Annotated[Literal["tcp", "ipc"], _flag("how the processes connect")] = "tcp"
    auth: Annotated[bool, _flag("CurveZMQ encryption + client authentication")] = False
    seed: Annotated[int, _flag("the models' weights")] = 0
    chaos: Annotated[
        bool,
        _flag(
            "kill one worker with SIGKILL at 40%% of --duration; it is restarted "
            "and the run must still answer every request once"
        ),
    ] = False
    progress_every: Annotated[
        float, _flag("seconds between progress lines when the output is not a terminal", ge=0)
    ] = 5.0
    keep_logs: Annotated[bool, _flag("keep the run's directory (kept anyway when it fails)")] = (
        False
    )
    report: str = ""
    addresses: list[str] = msgspec.field(default_factory=list)
    publisher: str = ""
    keys: str | None = None
    index: int = 0


_KINDS = {"int": "an integer", "float": "a number"}


class UserError(Exception):
    """A mistake of the person running the demo: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(message)


def _flags() -> dict[str, tuple[Any, msgspec.Meta]]:
    """Field name -> (its type, its Meta) for each field that is a flag."""
    out = {}
    for f in msgspec.structs.fields(DemoConfig):
        meta = next(
            (m for m in getattr(f.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None
        )
        if meta is not None and meta.description:
            out[f.name] = (typing.get_args(f.type)[0], meta)
    return out


def parser() -> argparse.ArgumentParser:
    """The demo's argument parser, one flag per described :class:`DemoConfig` field; the
    values stay strings, converted and checked by :func:`parse_config`."""
    p = _Parser(
        prog="python -m transport.demo",
        description="The whole system on one machine, in one command.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig()
    for name, (tp, meta) in _flags().items():
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if tp is bool:
            p.add_argument(flag, action="store_true", help=meta.description)
        elif name in ("concurrency", "update_every"):  # defaults that depend on the size
            p.add_argument(flag, help=meta.description)
        else:
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            p.add_argument(flag, default=default, choices=choices, help=meta.description)
    # Internal: a child role and its DemoConfig as JSON.
    p.add_argument("--role", choices=("orchestrator", "client", "trainer"),
                   default="orchestrator", help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p


def parse_config(argv: Sequence[str]) -> tuple[str, DemoConfig]:
    """The role and the :class:`DemoConfig` of a command line.

    Raises
    ------
    UserError
        One line naming the flag: a bad value, or flags that do not go together.
    """
    args = parser().parse_args(argv)
    if args.role != "orchestrator":
        return args.role, msgspec.json.decode(args.config, type=DemoConfig)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("role", "config")}
    concurrency, update_every = SIZE_DEFAULTS[args.model_size]
    given.setdefault("concurrency", concurrency)
    given.setdefault("update_every", update_every)
    try:
        c = msgspec.convert(given, DemoConfig, strict=False)
    except msgspec.ValidationError as exc:
        m = re.fullmatch(r"Expected `(\w+)`(?: (>=?) (\S+))?.* - at `\$\.(\w+)`", str(exc))
        if m is None:
            raise UserError(str(exc)) from None
        flag, value = "--" + m[4].replace("_", "-"), given[m[4]]
        if m[2]:
            bound = "at least" if m[2] == ">=" else "more than"
            raise UserError(f"{flag} must be {bound} {m[3]} (got {value})") from None
        raise UserError(f"{flag} {value!r}: expected {_KINDS.get(m[1], m[1])}") from None
    if c.chaos and c.workers < 2:
        raise UserError("--chaos needs --workers 2 or more (someone must serve meanwhile)")
    if c.model_path:
        if c.engine != "hf":
            raise UserError("--model-path needs --engine hf")
        if not os.path.isfile(os.path.join(c.model_path, "config.json")):
            raise UserError(f"--model-path {c.model_path}: no config.json there")
    if c.engine == "hf" and importlib.util.find_spec("transformers") is None:
        raise UserError(f"--engine hf needs transformers: {install_hint('hf')}")
    return "orchestrator", c
