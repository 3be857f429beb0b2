"""Eager start (as Python 3.12's eager tasks): a handler's first step runs in the
callback that took its Submit, so one that answers without waiting costs no task; one
that awaits continues in a task through :class:`Resume`. On the engine's loop.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

from fastio import LLMRequest, LLMResponse

__all__ = ["Resume", "abandon", "first_step"]

CoroutineType = types.CoroutineType


class Resume:
    """Continues a coroutine already stepped once, as if the awaiting task had started
    it (cancellation and errors pass through)."""

    __slots__ = ("_coro", "_step")

    def __init__(self, coro: Coroutine[Any, Any, LLMResponse], step: Any) -> None:
        self._coro = coro
        self._step = step

    def close(self) -> None:
        """End the handler's coroutine (its task was cancelled before awaiting it)."""
        self._coro.close()

    def __await__(self) -> Generator[Any, None, LLMResponse]:
        coro, out = self._coro, self._step
        self._step = None
        while True:
            try:
                yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    out = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
            else:
                try:
                    out = coro.send(None)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]


def first_step(
    handler: Callable[[LLMRequest, Any], Any], req: LLMRequest, ctx: Any
) -> tuple[Any, BaseException | None, Awaitable[LLMResponse] | None]:
    """Call ``handler`` and run its first step now: ``(response, error, rest)``, where
    ``rest`` is what a task must await when the handler did not finish at once."""
    try:
        aw = handler(req, ctx)
        if type(aw) is not CoroutineType:
            if not hasattr(aw, "__await__"):  # a sync handler's answer
                return aw, None, None
            return None, None, aw  # an awaitable that is not a coroutine (a Future)
        step = aw.send(None)
    except StopIteration as stop:
        return stop.value, None, None
    except (Exception, asyncio.CancelledError) as exc:
        return None, exc, None
    return None, None, Resume(aw, step)


def abandon(rest: Awaitable[LLMResponse] | None) -> None:
    """End what :func:`first_step` left, its task cancelled before it awaited it."""
    if isinstance(rest, Resume):
        rest.close()
    elif asyncio.isfuture(rest):
        rest.cancel()
