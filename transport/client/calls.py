"""One ``agenerate`` call (:class:`Call`: its output across attempts, which an interrupted
or lost attempt adds to: docs/concepts.md, "Pause and interrupt"), the
:class:`GenerateFuture` it answers, and the client's counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import msgspec
import numpy as np

from fastio import LLMRequest, LLMResponse, VLMRequest, VLMResponse
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from transport import metrics
from transport.constant import constant
from transport.counting import Counts

__all__ = ["Call", "ChunkCallback", "Counters", "GenerateFuture", "install_task_factory"]

_NAMES = (
    "submitted", "completed", "failed", "resent", "interrupted", "timeouts", "cancelled",
    "stale", "bad_messages", "overloaded", "workers_died", "workers_joined", "no_worker",
    "poisoned",
)  # fmt: skip
_EXPORTED = {"resent": metrics.CLIENT_RESENDS, "workers_died": metrics.CLIENT_WORKER_DEATHS}

#: ``on_chunk(tokens, logprobs, versions)``: output tokens not delivered before.
ChunkCallback = Callable[[TokenArray, TokenArray, TokenArray], None]
Chunk = tuple[TokenArray, ...]  # tokens, logprobs, versions


class Counters(Counts):
    """Event counts of one client (``resent`` and ``workers_died`` also Prometheus
    counters); the latency histogram only with ``observe_latency``."""

    __slots__ = ("observe_latency",)

    def __init__(self, observe_latency: bool = False) -> None:
        super().__init__(_NAMES, _EXPORTED)
        self.observe_latency = observe_latency

    @property
    def stats(self) -> Counters:
        """The counts (this mapping itself)."""
        return self


_NO_IMAGES: dict[str, Any] = {}
# The zeros of the usual response's itl, sliced without a call to constant().
_N_ZEROS = 4097
_ZEROS = constant(_N_ZEROS - 1, np.float64)


def _zero_itl(n: int) -> TokenArray:
    """``n`` zero inter-token latencies: a view of one shared read-only zero array."""
    return TokenArray.wrap(constant(n, np.float64))


class Call:
    """One ``agenerate`` call, across re-sends and resumptions, and its output so far."""

    __slots__ = (
        "backoff", "chunks", "deadline", "delivered", "died_on", "done", "fut", "on_chunk",
        "orig", "out", "resends", "seg_streamed", "segment", "sub_id", "t0", "timeout",
        "timer", "times",
    )  # fmt: skip

    def __init__(
        self, req: LLMRequest, fut: GenerateFuture, on_chunk: ChunkCallback | None, timeout: float
    ) -> None:
        self.orig = self.segment = req  # segment: what the current attempt asks for
        self.fut = fut
        self.on_chunk = on_chunk
        self.t0 = time.perf_counter()
        self.timer: asyncio.TimerHandle | None = None  # the scheduler's, for short timeouts
        self.backoff: asyncio.TimerHandle | None = None  # a re-send waiting its turn
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.sub_id = -1  # the current attempt's id (never reused)
        # Output of the finished segments (None until one ends with more to come).
        self.out: Chunk | None = None
        # Arrival time of each output position, and the current attempt's streamed chunks:
        # the shared empty tuple until the first (no list each for the GC to walk).
        self.times: list[float] | tuple[()] = ()
        self.chunks: list[Chunk] | tuple[()] = ()
        self.seg_streamed = 0  # positions the current attempt streamed
        self.delivered = 0  # output positions handed to on_chunk
        self.resends = 0
        self.died_on: tuple[str, ...] = ()  # the workers that died while running it
        self.done = False

    @property
    def base(self) -> int:
        """Output position where the current attempt's tokens start."""
        return len(self.out[0]) if self.out is not None else 0

    def sent(self, sub_id: int) -> None:
        """A new attempt runs as ``sub_id``."""
        self.sub_id, self.seg_streamed, self.chunks = sub_id, 0, ()

    def on_stream(self, msg: fm.Stream) -> None:
        """A chunk of the current attempt arrived."""
        k = len(msg.output_tokens)
        if not k:
            return
        pos = self.base + self.seg_streamed
        self.seg_streamed += k
        chunk = (msg.output_tokens, msg.output_logprobs, msg.output_versions)
        if self.chunks:
            self.chunks.append(chunk)
        else:
            self.chunks = [chunk]
        self._stamp(k, time.perf_counter())
        if self.on_chunk is not None:
            self._deliver(pos, chunk)

    def _deliver(self, pos: int, chunk: Chunk) -> None:
        """Hand ``on_chunk`` the tokens at output positions ``pos...`` it has not had."""
        assert self.on_chunk is not None
        toks, lps, vers = chunk
        skip = self.delivered - pos
        if skip >= len(toks):
            return
        self.delivered = pos + len(toks)
        if skip > 0:
            toks, lps, vers = toks[skip:], lps[skip:], vers[skip:]
        self.on_chunk(toks, lps, vers)

    def _stamp(self, n: int, now: float) -> None:
        """``n`` more output positions arrived at ``now``."""
        if self.times:
            self.times.extend([now] * n)
        else:
            self.times = [now] * n

    def _drop_times(self, keep: int) -> None:
        """Forget the arrival times of output positions ``keep`` and on."""
        if len(self.times) > keep:
            assert isinstance(self.times, list)  # non-empty: a list
            del self.times[keep:]

    def refused(self) -> None:
        """The worker refused the current attempt (OVERLOADED): forget what it streamed."""
        self.chunks = ()
        self._drop_times(self.base)

    def _append(self, chunk: Chunk) -> Chunk:
        """Add ``chunk`` to the output of the finished segments; returns that output."""
        if self.out is None:  # private copies: later segments are appended to them
            self.out = tuple(TokenArray.wrap(t.array.copy()) for t in chunk)
        else:
            for mine, t in zip(self.out, chunk, strict=True):
                mine.extend(t.array)
        return self.out

    def _next_segment(self) -> str | None:
        """Set up the continuation of a segment that ended early, or return why none is due."""
        orig = self.orig
        assert self.out is not None
        out, g = self.out[0], orig.gconfig
        if g.max_new_tokens <= len(out):
            return "length"
        if g.stop_token_ids and len(out) and out[-1] in g.stop_token_ids:
            return "stop"
        g = g.new(
            max_new_tokens=g.max_new_tokens - len(out),
            min_new_tokens=max(0, g.min_new_tokens - len(out)),
        )
        self.segment = msgspec.structs.replace(orig, input_ids=orig.input_ids + out, gconfig=g)
        return None

    def lost(self, died_on: str = "") -> LLMResponse | None:
        """The current attempt was lost (``died_on``: its worker died): keep what it streamed;
        the response if that is all."""
        self.resends += 1
        if died_on:
            self.died_on += (died_on,)
        chunks, self.chunks, self.seg_streamed = self.chunks, (), 0
        if chunks:  # a rare path (a lost attempt): one more copy is no matter
            cols = zip(*chunks, strict=True)  # the tokens, the logprobs, the versions
            self._append(tuple(TokenArray.wrap(np.concatenate([t.array for t in c])) for c in cols))
        self._drop_times(self.base)
        if self.out is None or (stop := self._next_segment()) is None:
            return None
        return self._response(self.out, stop, time.perf_counter())

    def absorb(self, res: fm.Result) -> LLMResponse | None:
        """The current attempt ended with ``res``: the caller's response, or None when the
        call goes on (an interrupt with tokens left; :attr:`segment` is set)."""
        now = time.perf_counter()
        n = len(res.output_tokens)
        got: Chunk = (res.output_tokens, res.output_logprobs, res.output_versions)
        if self.on_chunk is not None:  # tokens the stream did not carry
            self._deliver(self.base, got)
        stop: str | None = res.stop_reason
        if not self.times and self.out is None and stop != "interrupt":
            # One segment, nothing streamed: the worker's arrays (views of the received
            # frames) become the response as they are.
            itl = TokenArray.wrap(_ZEROS[: n - 1]) if 0 < n <= _N_ZEROS else _zero_itl(n - 1)
            return self._response(got, res.stop_reason, now, itl)
        self.chunks = ()
        extra = self.base + n - len(self.times)  # tokens the stream did not announce
        if extra > 0:
            self._stamp(extra, now)
        else:
            self._drop_times(self.base + n)
        if self.out is not None or stop == "interrupt":
            got = self._append(got)
            if stop == "interrupt" and (stop := self._next_segment()) is None:
                return None
        assert stop is not None
        return self._response(got, stop, now)

    def _response(
        self, out: Chunk, stop: Any, now: float, itl: TokenArray | None = None
    ) -> LLMResponse:
        """The caller's response: the output around the caller's own prompt."""
        times, orig, cls, images = self.times, self.orig, LLMResponse, _NO_IMAGES
        if itl is None:
            itl = TokenArray(np.diff(np.asarray(times, np.float64))) if times else _zero_itl(0)
        if isinstance(orig, VLMRequest):
            cls, images = VLMResponse, {"input_images": list(orig.image_data or [])}
        toks, lps, vers = out
        return cls(
            input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
            output_versions=vers, stop_reason=stop, latency=now - self.t0,
            ttft=times[0] - self.t0 if times else now - self.t0, itl=itl, **images,
        )  # fmt: skip

    def settle(self) -> GenerateFuture:
        """It is done: stop its timers and release its future (returned)."""
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if self.backoff is not None:
            self.backoff.cancel()
            self.backoff = None
        self.fut.unbind()
        return self.fut


class GenerateFuture(asyncio.Future[LLMResponse]):
    """The pending result of :meth:`FabricClient.agenerate`: an :class:`asyncio.Future`
    (``create_task`` takes it through the client's task factory). Cancelling it cancels
    the request on its worker."""

    # No __init__ of its own (asyncio's C one alone is cheaper): see bind().
    __slots__ = ("_call", "_canceller")
    _call: Call | None
    _canceller: Callable[[Call], None]

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the future and the request behind it."""
        if not super().cancel(msg):
            return False
        call = getattr(self, "_call", None)
        self._call = None
        if call is not None:
            self._canceller(call)
        return True

    def bind(self, call: Call, canceller: Callable[[Call], None]) -> None:
        """Cancelling calls ``canceller(call)`` until :meth:`unbind`."""
        self._call = call
        self._canceller = canceller

    def unbind(self) -> None:
        """The call ended: drop the reference (the call holds the future too)."""
        self._call = None


class _Awaiting(Coroutine[Any, Any, LLMResponse]):
    """``return await fut`` as an object: a task cancelled (or closed) before its first
    step still cancels the request."""

    __slots__ = ("_fut",)

    def __init__(self, fut: GenerateFuture) -> None:
        self._fut = fut

    def send(self, value: Any) -> Any:
        if self._fut.done():
            raise StopIteration(self._fut.result())
        self._fut._asyncio_future_blocking = True
        return self._fut

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        exc = typ if isinstance(typ, BaseException) else (typ() if val is None else val)
        if isinstance(exc, asyncio.CancelledError):
            self._fut.cancel()
        raise exc

    def close(self) -> None:
        self._fut.cancel()

    def __await__(self) -> Generator[Any, None, LLMResponse]:
        return self._fut.__await__()


def install_task_factory(loop: asyncio.AbstractEventLoop) -> None:
    """Let ``loop.create_task`` take a :class:`GenerateFuture` (other coroutines go to the
    factory set before); installing twice is a no-op."""
    prev: Callable[..., asyncio.Future[Any]] | None = loop.get_task_factory()
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
