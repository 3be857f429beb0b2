"""What :meth:`FabricClient.agenerate` returns: a plain future (no task per request),
and the task factory that lets ``create_task`` take it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from fastio import LLMResponse

__all__ = ["GenerateFuture", "bind", "install_task_factory", "unbind"]


class GenerateFuture(asyncio.Future[LLMResponse]):
    """The pending result of :meth:`FabricClient.agenerate`: an :class:`asyncio.Future`
    (``create_task`` takes it through the client's task factory). Cancelling it cancels
    the request on its worker."""

    # No __init__ of its own (asyncio's C one alone is cheaper): see bind().
    __slots__ = ("_call", "_canceller")
    _call: object | None
    _canceller: Callable[[Any], None] | None

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the future and the request behind it."""
        if not super().cancel(msg):
            return False
        call = getattr(self, "_call", None)
        canceller = getattr(self, "_canceller", None)
        self._call = None
        if call is not None and canceller is not None:
            canceller(call)
        return True


def bind(fut: GenerateFuture, call: object, canceller: Callable[[Any], None]) -> None:
    """Cancelling ``fut`` calls ``canceller(call)`` until :func:`unbind`."""
    fut._call = call
    fut._canceller = canceller


def unbind(fut: GenerateFuture) -> None:
    """The call ended: drop the reference (the call holds the future too)."""
    fut._call = None


class _Awaiting(Coroutine[Any, Any, LLMResponse]):
    """``return await fut`` as an object: a task cancelled (or closed) before its first
    step still cancels the request."""

    __slots__ = ("_fut",)

    def __init__(self, fut: GenerateFuture) -> None:
        self._fut = fut

    def send(self, value: Any) -> Any:
        fut = self._fut
        if not fut.done():
            fut._asyncio_future_blocking = True
            return fut
        raise StopIteration(fut.result())

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        exc = typ if isinstance(typ, BaseException) else (typ() if val is None else val)
        if isinstance(exc, asyncio.CancelledError):
            self._fut.cancel()
        raise exc

    def close(self) -> None:
        self._fut.cancel()

    def __await__(self) -> Generator[Any, None, LLMResponse]:
        return self._fut.__await__()


_TaskFactory = Callable[..., "asyncio.Future[Any]"]


def install_task_factory(loop: asyncio.AbstractEventLoop) -> None:
    """Let ``loop.create_task`` take a :class:`GenerateFuture`, as a task awaiting it
    (other coroutines go to the factory set before). Installing twice is a no-op."""
    prev: _TaskFactory | None = loop.get_task_factory()
    if getattr(prev, "_fastio_generate", False):
        return

    def factory(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
        **kwargs: Any,
    ) -> asyncio.Future[Any]:
        if isinstance(coro, GenerateFuture):
            coro = _Awaiting(coro)
        if prev is not None:
            return prev(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    factory._fastio_generate = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)
