"""Around a handler's call: its eager start (:func:`first_step`) and the checks of its
input and its answer. All on the engine's loop."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse
from fastio.tokens import TokenArray

__all__ = ["InvalidHandlerOutput", "abandon", "first_step", "output_problem", "token_problem"]


class InvalidHandlerOutput(ValueError):
    """A handler's answer cannot be sent as a Result (the client gets ``HANDLER_ERROR``)."""


_STOP_REASONS = frozenset(("length", "stop", "interrupt", "abort"))


def output_problem(resp: Any) -> str | None:
    """Why ``resp`` cannot be sent as a Result, or None."""
    if type(resp) is LLMResponse:  # the usual answer: its arrays are TokenArrays
        tok, lp, ver = resp.output_tokens, resp.output_logprobs, resp.output_versions
        if type(tok) is TokenArray and type(lp) is TokenArray and type(ver) is TokenArray:
            n = len(tok._a)
            if len(lp._a) == n and len(ver._a) == n and resp.stop_reason in _STOP_REASONS:
                return None
    if not isinstance(resp, LLMResponse):
        return f"the handler returned {type(resp).__name__}, not an LLMResponse"
    try:
        n = len(resp.output_tokens)
        n_lp, n_ver = len(resp.output_logprobs), len(resp.output_versions)
    except TypeError as exc:
        return f"output arrays without a length ({exc})"
    if n_lp != n or n_ver != n:
        return (
            "output_tokens, output_logprobs and output_versions must have equal lengths, "
            f"got {n}, {n_lp} and {n_ver}"
        )
    if resp.stop_reason not in _STOP_REASONS:
        return f"stop_reason must be one of {sorted(_STOP_REASONS)}, got {resp.stop_reason!r}"
    return None


# Signed token dtype -> the unsigned one of its size: one max() then also finds a
# negative id (it reads as a huge one).
_UNSIGNED = {np.dtype(f"i{n}"): np.dtype(f"u{n}") for n in (1, 2, 4, 8)}


def token_problem(req: LLMRequest, vocab_size: int) -> str | None:
    """Why ``req`` holds a token id outside ``[0, vocab_size)`` (in ``input_ids`` or
    ``gconfig.stop_token_ids``), naming the field and such an id, or None."""
    ids = req.input_ids._a
    u = _UNSIGNED.get(ids.dtype)
    bad: int | None
    if ids.size and int((ids if u is None else ids.view(u)).max()) >= vocab_size:
        lo = int(ids.min())
        what, field, bad = "input ids", "input_ids", lo if lo < 0 else int(ids.max())
    else:
        what, field = "stop token ids", "gconfig.stop_token_ids"
        stops = req.gconfig.stop_token_ids
        bad = next((t for t in stops if not 0 <= t < vocab_size), None) if stops else None
        if bad is None:
            return None
    # Worded as the reference and HF engines' own refusal ("input ids must lie in ...").
    return (
        f"{what} must lie in [0, {vocab_size}) (the engine's vocab_size={vocab_size}): "
        f"{field} holds token id {bad}"
    )


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
            error: BaseException | None = None
            try:
                yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                error = exc
            try:
                out = coro.send(None) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


def first_step(
    handler: Callable[[LLMRequest, Any], Any], req: LLMRequest, ctx: Any
) -> tuple[Any, BaseException | None, Awaitable[LLMResponse] | None]:
    """Call ``handler`` and run its first step now: ``(response, error, rest)``, where
    ``rest`` is what a task must await when the handler did not finish at once."""
    try:
        aw = handler(req, ctx)
        if type(aw) is not types.CoroutineType:
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
