"""Factories of the built-in engines for the registry (options as strings)."""

from __future__ import annotations

from typing import Any

import msgspec

from transport.engines.registry import engine_options

__all__ = ["ReferenceOptions", "echo", "hf", "reference"]


class ReferenceOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--engine-opt`` keys of :class:`~transport.ReferenceEngine` (unset: its defaults)."""

    vocab_size: int | None = None
    hidden: int | None = None
    layers: int | None = None
    seed: int | None = None
    token_interval: float | None = None


def reference(opts: dict[str, str]) -> Any:
    """:class:`~transport.ReferenceEngine` with the options of :class:`ReferenceOptions`."""
    from transport.engine import ReferenceEngine

    given = msgspec.structs.asdict(engine_options(opts, ReferenceOptions, "reference"))
    return ReferenceEngine(**{k: v for k, v in given.items() if v is not None})


def echo(opts: dict[str, str]) -> Any:
    """The echo handler (:func:`~transport.echo_handler`); no options."""
    if opts:
        raise ValueError(f"the echo engine takes no options, got {sorted(opts)}")
    from transport.worker.echo import echo_handler

    return echo_handler


def hf(opts: dict[str, str]) -> Any:
    """:func:`transport.hf_engine.create_engine` with the options."""
    from transport.hf_engine import create_engine

    return create_engine(**opts)
