"""Engines: the public interface a worker serves, the registry of names, the bridges.

- :mod:`transport.engines.api`: :class:`Engine`, :class:`GenerationContext`, the optional
  hooks (:class:`EngineHooks`)
- :mod:`transport.engines.registry`: ``--engine NAME`` -> ``module:factory``
- :mod:`transport.engines.builtin`: factories of ``reference``, ``echo``, ``hf``
- :mod:`transport.engines.sglang`, :mod:`transport.engines.vllm`: bridges to running
  SGLang / vLLM servers over HTTP (extras ``fastio[sglang]`` / ``fastio[vllm]``;
  imported only when named)

See ``docs/engines.md``.
"""

from transport.engines.api import (
    Engine,
    EngineHooks,
    EngineUnavailable,
    GenerationContext,
    attach_engine,
)
from transport.engines.registry import ENGINES, register_engine, resolve_engine

__all__ = [
    "ENGINES",
    "Engine",
    "EngineHooks",
    "EngineUnavailable",
    "GenerationContext",
    "attach_engine",
    "register_engine",
    "resolve_engine",
]
