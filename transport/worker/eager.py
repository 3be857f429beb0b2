"""Eager start: a handler's first step runs in the callback that took its Submit.

As Python 3.12's eager tasks: a handler that answers without waiting (an echo, a cache
hit, a refusal) costs no task, no loop iteration and no timer, and its reply leaves in
the same wake-up. A handler that awaits continues in a task, driven through
:class:`Resume`. This runs on the engine's loop, never on the socket thread.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Protocol

from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from transport.worker.context import RequestContext

__all__ = ["CoroutineType", "Resume", "reap", "start_eager"]


class _Server(Protocol):
    """What the eager start uses of a :class:`~transport.WorkerServer` (declared here so
    that this module needs not import the server's)."""

    _running: int

    @property
    def handler(self) -> Callable[[LLMRequest, RequestContext], Awaitable[LLMResponse]]: ...
    @property
    def _tasks(self) -> dict[tuple[bytes, int], tuple[asyncio.Task[None], RequestContext]]: ...
    def _ended(
        self,
        ctx: RequestContext,
        sub: fm.Submit,
        resp: LLMResponse | None,
        err: BaseException | None,
    ) -> None: ...
    def _cancelled(self, ctx: RequestContext) -> None: ...
    def _spawn(
        self,
        key: tuple[bytes, int],
        ctx: RequestContext,
        sub: fm.Submit,
        started: Awaitable[LLMResponse] | None = None,
    ) -> None: ...


CoroutineType = types.CoroutineType


class Resume:
    """Awaitable that continues a coroutine already stepped once, from the value its
    first step yielded: the task awaiting it drives the coroutine as if it had started
    it (cancellation and errors are passed through)."""

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


def reap(server: _Server, ctx: RequestContext, sub: fm.Submit, started: Any, _: object) -> None:
    """A task ended. If it was cancelled (a Cancel or an abort in the same batch as
    its Submit) before its first step, the body of ``WorkerServer._run`` never ran: do what
    it would have done, or the request would hold its slot and table entry forever
    (and a pause would wait for it) and an abort would never be answered."""
    if ctx._ran:
        return
    if isinstance(started, Resume):
        started.close()
    elif asyncio.isfuture(started):
        started.cancel()
    if started is not None:
        server._ended(ctx, sub, None, asyncio.CancelledError())
    else:
        server._tasks.pop((ctx.peer, ctx.id), None)
        server._cancelled(ctx)


def start_eager(
    server: _Server, key: tuple[bytes, int], ctx: RequestContext, sub: fm.Submit
) -> None:
    """Run the handler's first step now (it takes a slot); continue in a task if it
    awaits."""
    server._running += 1
    try:
        aw = server.handler(sub.request, ctx)
        if type(aw) is not CoroutineType:
            if not hasattr(aw, "__await__"):  # a sync handler's answer
                server._ended(ctx, sub, aw, None)  # type: ignore[arg-type]
                return
            # An awaitable that is not a coroutine (a Future, say): a task awaits it.
            server._spawn(key, ctx, sub, aw)
            return
        step = aw.send(None)
    except StopIteration as stop:
        server._ended(ctx, sub, stop.value, None)
        return
    except (Exception, asyncio.CancelledError) as exc:
        server._ended(ctx, sub, None, exc)
        return
    server._spawn(key, ctx, sub, Resume(aw, step))
