"""Engines by name: what ``--engine NAME`` of the worker CLI resolves.

Each name maps to a ``module:factory`` string resolved with :func:`pkgutil.resolve_name`
on use (so naming an engine imports only its module). A factory takes the engine
options as strings (``--engine-opt key=value``) and returns an :class:`~transport.Engine`
or a handler; an unknown option should raise ``ValueError`` naming it. Any other
``module:factory`` works the same way without being registered.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any

__all__ = ["ENGINES", "register_engine", "resolve_engine"]

#: Built-in and bridged engines: name -> ``module:factory``.
ENGINES: dict[str, str] = {
    "reference": "transport.engines.builtin:reference",
    "echo": "transport.engines.builtin:echo",
    "hf": "transport.engines.builtin:hf",
    "sglang": "transport.engines.sglang:factory",
    "vllm": "transport.engines.vllm:factory",
}

Factory = Callable[[dict[str, str]], Any]


def register_engine(name: str, spec: str) -> None:
    """Make ``--engine name`` build ``spec`` (``module:factory``)."""
    if ":" in name or not name:
        raise ValueError(f"an engine name has no ':' and is not empty, got {name!r}")
    if not all(spec.partition(":")[::2]):
        raise ValueError(f"expected module:factory, got {spec!r}")
    ENGINES[name] = spec


def resolve_engine(name: str) -> Factory:
    """The factory ``name`` stands for: a registered name or ``module:factory``.

    Raises
    ------
    ValueError
        An unknown name, or a ``module:factory`` that cannot be imported or found (the
        message says which).
    """
    spec = ENGINES.get(name)
    if spec is None:
        if not all(name.partition(":")[::2]):
            raise ValueError(
                f"unknown engine {name!r} (choose from {', '.join(ENGINES)}, or module:factory)"
            )
        spec = name
    try:
        fn = pkgutil.resolve_name(spec)
    except ImportError as exc:
        raise ValueError(f"engine {name!r}: cannot import {spec.partition(':')[0]}: {exc}") from exc
    except AttributeError as exc:
        raise ValueError(f"engine {name!r}: {spec} not found ({exc})") from exc
    if not callable(fn):
        raise ValueError(f"engine {name!r}: {spec} is not callable")
    return fn  # type: ignore[no-any-return]
