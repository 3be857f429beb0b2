"""The public engine interface: what a generation worker asks of an engine.

An engine is any object with a weight ``version`` and a coroutine ``generate(req, ctx)``
(:class:`Engine`). The worker (:class:`~transport.WorkerServer`) calls ``generate`` once
per request, in its own task on the worker's event loop, with a
:class:`GenerationContext`; everything else is optional and found by name
(:class:`EngineHooks`):

========================  ==============================================================
``generate(req, ctx)``    required: stream tokens with ``ctx.emit(token, logprob,
                          version)``, return an :class:`~fastio.LLMResponse`
``version``               required: the weight version stamped on new tokens
``start(worker)``         awaited when the worker starts serving (open connections,
                          check the backend); raising fails the start
``close()``               awaited when the worker closes
``pause_generation()``    called when the worker pauses (interrupt what runs now)
``continue_generation()`` called when it resumes
``queue_depth()``         requests the engine holds that wait for capacity inside it
                          (added to the ``waiting`` load in the worker's pongs)
``model``                 an ``nn.Module``: a weight update copies into it in place
``load_weights(pairs)``   called with every verified weight version as ``(name,
                          tensor)`` pairs (after the in-place copy when there is a
                          ``model``); the worker's version follows once it returns
========================  ==============================================================

The contract, in short:

* **Streaming**: ``ctx.emit`` once per token, in order; the response's arrays hold the
  same tokens, logprobs and versions. Tokens emitted in one loop iteration travel in
  one Stream message.
* **Interrupt**: once ``ctx.interrupted`` is true (the worker is pausing, usually for a
  weight update) return what was generated so far with ``stop_reason="interrupt"``; the
  client re-submits the prompt plus those tokens after the resume. ``pause_generation``
  is the prompt way to learn it without polling.
* **Abort and cancel**: the request's task is cancelled (a controller's abort, a client
  that cancelled or died): let ``asyncio.CancelledError`` propagate, after telling the
  backend to stop.
* **Versions**: stamp each token with the version of the weights that produced it.
  Weight updates happen while the worker is paused and no ``generate`` runs.
* **Blocking**: ``generate`` runs on the worker's loop; heartbeats are answered on
  another thread whatever it does, but other requests wait while it blocks. Run heavy
  compute on a thread of the engine's own (as :mod:`transport.hf_engine` does) or in
  another process (as the SGLang and vLLM bridges do).

A plain coroutine function ``handler(req, ctx)`` is also accepted by the worker (the
echo engine is one); it has version 0 unless it reads ``ctx.version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastio import LLMRequest, LLMResponse

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "EngineHooks", "EngineUnavailable", "GenerationContext", "attach_engine"]

log = logging.getLogger("transport.engines")


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

    def queue_depth(self) -> int:
        """Requests held inside the engine and not yet generating (called from the
        worker's socket thread: read a counter, take no lock)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one verified weight version (called on the weight subscriber's thread
        while the worker is paused; tensors are read-only and valid during the call).
        Raise to fail the version on this worker (the trainer is told why)."""


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
