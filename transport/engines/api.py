"""The public engine interface: what a generation worker asks of an engine.

An engine is any object with a weight ``version`` and a coroutine ``generate(req, ctx)``
(:class:`Engine`), called once per request in its own task on the worker's loop; the
optional hooks are found by name (:class:`EngineHooks`). The contract:

* **Streaming**: ``ctx.emit`` once per token, in order; the response holds the same.
* **Interrupt**: once ``ctx.interrupted`` (the worker pauses) return the output so far
  with ``stop_reason="interrupt"``; the client re-submits the rest after the resume.
* **Abort and cancel**: the task is cancelled: tell the backend to stop, let
  ``asyncio.CancelledError`` propagate.
* **Versions**: stamp each token with the version of the weights that produced it.
* **Blocking**: heartbeats are answered whatever ``generate`` does, but other requests
  wait while it blocks: run heavy compute on a thread of the engine's own or in another
  process (the bridges).

A plain coroutine function ``handler(req, ctx)`` is accepted too (the echo engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastio import LLMRequest, LLMResponse

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "EngineHooks", "EngineUnavailable", "GenerationContext", "attach_engine"]


class EngineUnavailable(RuntimeError):
    """The engine's backend cannot serve (a server that is down, hangs or refuses)."""


@runtime_checkable
class GenerationContext(Protocol):
    """What a worker tells an engine about one request (:class:`~transport.RequestContext`
    implements it).

    Attributes
    ----------
    id:
        The submission id (unique per client connection, not across clients).
    deadline:
        ``time.monotonic()`` by which the client wants the answer (``inf``: none).
    """

    id: int
    deadline: float

    @property
    def interrupted(self) -> bool:
        """True once the worker is pausing: return the output so far with
        ``stop_reason="interrupt"``."""
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
    """A generation engine served by a worker (see the module docstring).

    Attributes
    ----------
    version:
        Weight version stamped on every token generated now; a weight update sets it
        once the new weights are in place.

    Examples
    --------
    >>> import numpy as np
    >>> from fastio import LLMResponse, TokenArray
    >>> class Countdown:
    ...     version = 0
    ...     async def generate(self, req, ctx):
    ...         toks = []
    ...         for t in range(req.gconfig.max_new_tokens, 0, -1):
    ...             if ctx.interrupted:
    ...                 break
    ...             ctx.emit(t, 0.0, self.version)
    ...             toks.append(t)
    ...         n = len(toks)
    ...         return LLMResponse(
    ...             input_tokens=req.input_ids,
    ...             output_tokens=TokenArray(np.array(toks, np.int32)),
    ...             output_logprobs=TokenArray(np.zeros(n, np.float32)),
    ...             output_versions=TokenArray(np.full(n, self.version, np.int32)),
    ...             stop_reason="interrupt" if ctx.interrupted else "length",
    ...         )
    >>> isinstance(Countdown(), Engine)
    True
    """

    version: int

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Generate for ``req``; stream through ``ctx``; return the whole output."""
        ...


class EngineHooks(Protocol):
    """The optional hooks of an :class:`Engine`, found by name (none is required)."""

    async def start(self, worker: Any) -> None:
        """Awaited once the worker serves; ``worker`` is the :class:`~transport.WorkerServer`
        (``await worker.close()`` takes the worker down when the backend is gone, so
        clients re-send its requests elsewhere). Raising fails the worker's start."""

    async def close(self) -> None:
        """Awaited when the worker closes."""

    def pause_generation(self) -> Awaitable[None] | None:
        """The worker pauses: make running generations return ``"interrupt"`` soon."""

    def continue_generation(self) -> Awaitable[None] | None:
        """The worker resumes."""

    pauses_in_place: bool
    """True while :meth:`pause_generation` freezes running generations in place
    instead of interrupting them (they continue after the resume, each token stamped
    with the version that produced it): the worker's pause then completes at once, and
    a weight update loads under the frozen requests."""

    def queue_depth(self) -> int:
        """Requests held inside the engine and not yet generating, added to the
        ``waiting`` load of the worker's pongs (called from the worker's socket thread:
        read a counter, take no lock)."""
        ...

    model: Any
    """An ``nn.Module``: a weight update copies each verified version into it in place."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one verified weight version as ``(name, tensor)`` pairs, after the
        in-place copy into :attr:`model` if any (called on the weight subscriber's thread
        while the worker is paused; tensors are read-only and valid during the call). The
        worker's version follows once it returns; raise to fail the version on this
        worker (the trainer is told why)."""


def attach_engine(server: Any, engine: Any) -> None:
    """Wire ``engine``'s optional hooks into ``server`` (a :class:`~transport.WorkerServer`;
    called by its constructor)."""
    for name, callbacks in (
        ("pause_generation", server.on_pause),
        ("continue_generation", server.on_resume),
    ):
        hook = getattr(engine, name, None)
        if callable(hook):
            callbacks.append(hook)
    if hasattr(engine, "pauses_in_place"):
        server.gate.keeps_in_place = lambda: bool(engine.pauses_in_place)
    depth = getattr(engine, "queue_depth", None)
    if callable(depth):
        server.engine_load = depth
    start = getattr(engine, "start", None)
    close = getattr(engine, "close", None)
    if not (inspect.iscoroutinefunction(start) or inspect.iscoroutinefunction(close)):
        return

    async def engine_lifetime(worker: Any) -> None:
        # A background job: started with the server (a failure fails its start) and
        # cancelled at close, when the engine is closed.
        if inspect.iscoroutinefunction(start):
            await start(worker)
        try:
            await asyncio.Event().wait()
        finally:
            if inspect.iscoroutinefunction(close):
                with contextlib.suppress(Exception):
                    await close()

    engine_lifetime.__qualname__ = f"{type(engine).__name__}.start"
    server.background.insert(0, engine_lifetime)
