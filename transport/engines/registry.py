"""Engines by name: what ``--engine NAME`` of the worker CLI resolves. Each name maps to a
``module:factory`` imported on use (any other ``module:factory`` works unregistered); a
factory reads the ``--engine-opt`` strings (:func:`engine_options`), returns an engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from transport.options import parse_options, resolve_entry

__all__ = ["ENGINES", "engine_options", "register_engine", "resolve_engine"]

#: Built-in and bridged engines: name -> ``module:factory``.
ENGINES: dict[str, str] = {
    "reference": "transport.engines.builtin:reference",
    "echo": "transport.engines.builtin:echo",
    "hf": "transport.engines.builtin:hf",
    "sglang": "transport.engines.sglang:factory",
    "vllm": "transport.engines.vllm:factory",
}

Factory = Callable[[dict[str, str]], Any]
T = TypeVar("T", bound=msgspec.Struct)


def register_engine(name: str, spec: str) -> None:
    """Make ``--engine name`` build ``spec`` (``module:factory``)."""
    if ":" in name or not name:
        raise ValueError(f"an engine name has no ':' and is not empty, got {name!r}")
    if not all(spec.partition(":")[::2]):
        raise ValueError(f"expected module:factory, got {spec!r}")
    ENGINES[name] = spec


def resolve_engine(name: str) -> Factory:
    """The factory ``name`` stands for: a registered name or ``module:factory``;
    ``ValueError`` for one that is unknown or cannot be imported or found."""
    spec = ENGINES.get(name)
    if spec is None and not all(name.partition(":")[::2]):
        raise ValueError(
            f"unknown engine {name!r} (choose from {', '.join(ENGINES)}, or module:factory)"
        )
    fn = resolve_entry(spec or name, "engine")
    if not callable(fn):
        raise ValueError(f"engine {name!r}: {spec or name} is not callable")
    return fn  # type: ignore[no-any-return]


def engine_options(opts: Mapping[str, str], type_: type[T], engine: str) -> T:
    """An engine factory's ``--engine-opt`` strings as its options Struct ``type_``
    (:func:`transport.options.parse_options`); ``ValueError`` naming a bad key or value."""
    known = sorted(f.encode_name for f in msgspec.structs.fields(type_))
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the {engine} engine takes {known}")
    return parse_options(opts, type_, f"{engine} engine option")
