"""Engines: the interface a worker serves (:mod:`.api`), the registry of ``--engine``
names (:mod:`.registry`), the built-in factories (:mod:`.builtin`) and the bridges to
running SGLang / vLLM servers (:mod:`.sglang`, :mod:`.vllm`; extras ``fastio[sglang]`` /
``fastio[vllm]``, imported only when named). See ``docs/engines.md``.
"""

from transport.engines.api import (
    BoundHooks,
    Engine,
    EngineHooks,
    EngineUnavailable,
    GenerationContext,
    attach_engine,  # noqa: F401  (deprecated: out of __all__)
    engine_hooks,
)
from transport.engines.registry import ENGINES, register_engine, resolve_engine

__all__ = [
    "ENGINES",
    "BoundHooks",
    "Engine",
    "EngineHooks",
    "EngineUnavailable",
    "GenerationContext",
    "engine_hooks",
    "register_engine",
    "resolve_engine",
]
