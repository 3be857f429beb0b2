"""Factories of the built-in engines for the registry (options as strings)."""

from __future__ import annotations

from typing import Any

__all__ = ["echo", "hf", "reference"]

_REFERENCE = {"vocab_size": int, "hidden": int, "layers": int, "seed": int, "token_interval": float}


def reference(opts: dict[str, str]) -> Any:
    """:class:`~transport.ReferenceEngine`; options ``vocab_size``, ``hidden``,
    ``layers``, ``seed``, ``token_interval``."""
    from transport.engine import ReferenceEngine

    kwargs: dict[str, Any] = {}
    for key, value in opts.items():
        conv = _REFERENCE.get(key)
        if conv is None:
            raise ValueError(f"--engine-opt {key}: the reference engine takes {sorted(_REFERENCE)}")
        try:
            kwargs[key] = conv(value)
        except ValueError as exc:
            raise ValueError(f"--engine-opt {key}={value}: {exc}") from exc
    return ReferenceEngine(**kwargs)


def echo(opts: dict[str, str]) -> Any:
    """The echo handler (:func:`~transport.echo_handler`); no options."""
    if opts:
        raise ValueError("--engine echo takes no --engine-opt")
    from transport.worker.echo import echo_handler

    return echo_handler


def hf(opts: dict[str, str]) -> Any:
    """:func:`transport.hf_engine.create_engine` with the options."""
    from transport.hf_engine import create_engine

    return create_engine(**opts)
