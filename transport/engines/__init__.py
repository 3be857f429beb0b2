"""Engines: the interface a worker serves (:mod:`.api`), the ``--engine`` names
(:mod:`.registry`, :mod:`.builtin`) and the bridges to SGLang and vLLM (:mod:`.sglang`,
:mod:`.vllm`: extras ``fastio[sglang]`` / ``fastio[vllm]``, imported only when named)."""

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
    "ENGINES", "BoundHooks", "Engine", "EngineHooks", "EngineUnavailable", "GenerationContext",
    "engine_hooks", "register_engine", "resolve_engine",
]  # fmt: skip
