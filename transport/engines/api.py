"""What a worker asks of an engine (:class:`Engine`, its optional :class:`EngineHooks`; or a
coroutine ``handler(req, ctx)``). The rules: ``docs/engines.md#the-interface``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastio import LLMRequest, LLMResponse

if TYPE_CHECKING:
    import torch

__all__ = [
    "BoundHooks", "Engine", "EngineHooks", "EngineUnavailable", "GenerationContext",
    "engine_hooks",
]  # fmt: skip


class EngineUnavailable(RuntimeError):
    """The engine's backend cannot serve (a server that is down, hangs or refuses)."""


@runtime_checkable
class GenerationContext(Protocol):
    """What a worker tells an engine about one request (a :class:`~transport.RequestContext`):
    ``id``, the submission id (unique per client connection); ``deadline``, the
    ``time.monotonic()`` by which the client wants the answer (``inf``: none)."""

    id: int
    deadline: float

    @property
    def interrupted(self) -> bool:
        """True once the worker is pausing: return the output so far (``"interrupt"``)."""
        ...

    @property
    def version(self) -> int:
        """The weight version the worker serves now (its engine's ``version``)."""
        ...

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        """Stream one generated token (call it on the worker's loop)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """A generation engine served by a worker; ``version``: the weight version stamped on
    each token generated now (example: ``docs/engines.md#a-complete-example``)."""

    version: int

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Generate for ``req``; stream through ``ctx``; return the whole output."""
        ...


class EngineHooks(Protocol):
    """The optional hooks of an :class:`Engine`, by name (``docs/engines.md#the-interface``)."""

    async def start(self, worker: Any) -> None:
        """The worker (a :class:`~transport.WorkerServer`) serves; raising fails its start."""

    async def close(self) -> None:
        """The worker closes."""

    def pause_generation(self) -> Awaitable[None] | None:
        """The worker pauses: make running generations return ``"interrupt"`` soon."""

    def continue_generation(self) -> Awaitable[None] | None:
        """The worker resumes."""

    pauses_in_place: bool
    """True while :meth:`pause_generation` froze running generations in place."""

    def queue_depth(self) -> int:
        """Requests inside the engine not yet generating (from the socket thread: no lock)."""
        ...

    model: Any
    """An ``nn.Module``: a weight update copies each verified version into it in place."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one verified version as read-only ``(name, tensor)`` pairs, valid during
        the call; raise to fail the version on this worker."""


@dataclasses.dataclass(frozen=True, slots=True)
class BoundHooks:
    """An engine's optional hooks as a worker takes them (:func:`engine_hooks`)."""

    on_pause: tuple[Callable[[], Any], ...] = ()
    on_resume: tuple[Callable[[], Any], ...] = ()
    keeps_in_place: Callable[[], bool] | None = None  # None: never freezes requests
    queue_depth: Callable[[], int] | None = None
    #: A background job: ``start(worker)``, then ``close()`` when the worker cancels it.
    lifetime: Callable[[Any], Awaitable[None]] | None = None


def engine_hooks(engine: Any) -> BoundHooks:
    """The optional hooks ``engine`` has, found by name (``None``: no engine, no hooks)."""
    if engine is None:
        return BoundHooks()
    pause, resume, depth = (
        getattr(engine, n, None) for n in ("pause_generation", "continue_generation", "queue_depth")
    )
    start, close = getattr(engine, "start", None), getattr(engine, "close", None)
    lifetime = None
    if inspect.iscoroutinefunction(start) or inspect.iscoroutinefunction(close):

        async def engine_lifetime(worker: Any) -> None:
            if inspect.iscoroutinefunction(start):
                await start(worker)  # a failure fails the server's start
            try:
                await asyncio.Event().wait()  # cancelled at the server's close
            finally:
                if inspect.iscoroutinefunction(close):
                    with contextlib.suppress(Exception):
                        await close()

        engine_lifetime.__qualname__ = f"{type(engine).__name__}.start"
        lifetime = engine_lifetime
    keeps = hasattr(engine, "pauses_in_place")
    return BoundHooks(
        on_pause=(pause,) if callable(pause) else (),
        on_resume=(resume,) if callable(resume) else (),
        keeps_in_place=(lambda: bool(engine.pauses_in_place)) if keeps else None,
        queue_depth=depth if callable(depth) else None,
        lifetime=lifetime,
    )


def attach_engine(server: Any, engine: Any) -> None:
    """Deprecated: a :class:`~transport.WorkerServer` wires its engine's hooks itself."""
    msg = "attach_engine is deprecated: WorkerServer(engine) wires the hooks (engine_hooks)"
    warnings.warn(msg, DeprecationWarning, stacklevel=2)
    server.add_hooks(engine_hooks(engine))
