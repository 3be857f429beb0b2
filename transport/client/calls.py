"""One ``agenerate`` call's output across its attempts (an interrupted or lost attempt
keeps what it produced: docs/concepts.md, "Pause and interrupt"), and the client's counts."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from fastio import LLMResponse, VLMRequest, VLMResponse
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from transport import metrics
from transport.client.workers import Call
from transport.constant import constant
from transport.counting import Counts

__all__ = ["Counters", "absorb_result", "drop_times", "keep_streamed", "on_stream"]

_NAMES = (
    "submitted", "completed", "failed", "resent", "interrupted", "timeouts", "cancelled",
    "stale", "bad_messages", "overloaded", "workers_died", "workers_joined", "no_worker",
    "poisoned",
)  # fmt: skip
_EXPORTED = {"resent": metrics.CLIENT_RESENDS, "workers_died": metrics.CLIENT_WORKER_DEATHS}

Chunk = tuple[TokenArray, TokenArray, TokenArray]


class Counters(Counts):
    """Event counts of one client (:class:`~transport.counting.Counts`; ``resent`` and
    ``workers_died`` also Prometheus counters); the latency histogram only with
    ``observe_latency``."""

    __slots__ = ("observe_latency",)

    def __init__(self, observe_latency: bool = False) -> None:
        super().__init__(_NAMES, _EXPORTED)
        self.observe_latency = observe_latency

    @property
    def stats(self) -> Counters:
        """The counts (this mapping itself)."""
        return self


def _deliver(call: Call, pos: int, toks: TokenArray, lps: TokenArray, vers: TokenArray) -> None:
    """Hand ``on_chunk`` the tokens at output positions ``pos...`` it has not had."""
    assert call.on_chunk is not None
    skip = call.delivered - pos
    if skip >= len(toks):
        return
    call.delivered = pos + len(toks)
    if skip > 0:
        toks, lps, vers = toks[skip:], lps[skip:], vers[skip:]
    call.on_chunk(toks, lps, vers)


def on_stream(call: Call, msg: fm.Stream) -> None:
    """A chunk of the current attempt arrived."""
    k = len(msg.output_tokens)
    if not k:
        return
    pos = call.base + call.seg_streamed
    call.seg_streamed += k
    chunk = (msg.output_tokens, msg.output_logprobs, msg.output_versions)
    if call.chunks:
        call.chunks.append(chunk)
    else:
        call.chunks = [chunk]
    _stamp(call, k, time.perf_counter())
    if call.on_chunk is not None:
        _deliver(call, pos, *chunk)


def _stamp(call: Call, n: int, now: float) -> None:
    """``n`` more output positions arrived at ``now``."""
    if call.times:
        call.times.extend([now] * n)
    else:
        call.times = [now] * n


def drop_times(call: Call, keep: int) -> None:
    """Forget the arrival times of output positions ``keep`` and on."""
    if len(call.times) > keep:
        assert isinstance(call.times, list)  # non-empty: a list
        del call.times[keep:]


def _append(call: Call, toks: TokenArray, lps: TokenArray, vers: TokenArray) -> None:
    if call.out_tok is None:  # private copies: later segments are appended to them
        call.out_tok, call.out_lp, call.out_ver = (
            TokenArray.wrap(t.array.copy()) for t in (toks, lps, vers)
        )
    else:
        assert call.out_lp is not None and call.out_ver is not None
        call.out_tok.extend(toks.array)
        call.out_lp.extend(lps.array)
        call.out_ver.extend(vers.array)


def _next_segment(call: Call) -> str | None:
    """Set up the continuation of a segment that ended early, or return why none is due."""
    orig, out = call.orig, call.out_tok
    assert out is not None
    g = orig.gconfig
    if g.max_new_tokens <= len(out):
        return "length"
    if g.stop_token_ids and len(out) and out[-1] in g.stop_token_ids:
        return "stop"
    g = g.new(
        max_new_tokens=g.max_new_tokens - len(out),
        min_new_tokens=max(0, g.min_new_tokens - len(out)),
    )
    call.segment = msgspec.structs.replace(orig, input_ids=orig.input_ids + out, gconfig=g)
    return None


def keep_streamed(call: Call) -> LLMResponse | None:
    """The current attempt was lost: keep what it streamed as a segment (the re-send goes
    on from there); the response when those tokens complete the call."""
    chunks, call.chunks, call.seg_streamed = call.chunks, (), 0
    if chunks:  # a rare path (a lost attempt): one more copy is no matter
        toks, lps, vers = (
            TokenArray.wrap(np.concatenate([c[i].array for c in chunks])) for i in range(3)
        )
        _append(call, toks, lps, vers)
    drop_times(call, call.base)
    stop = None if call.out_tok is None else _next_segment(call)
    if stop is None:
        return None
    assert call.out_tok is not None and call.out_lp is not None and call.out_ver is not None
    return _finish(call, call.out_tok, call.out_lp, call.out_ver, stop, time.perf_counter())


def absorb_result(call: Call, res: fm.Result) -> LLMResponse | None:
    """The current attempt ended with ``res``: the caller's response, or None when the
    call goes on (an interrupt with tokens left; ``call.segment`` is set)."""
    now = time.perf_counter()
    n = len(res.output_tokens)
    toks, lps, vers = res.output_tokens, res.output_logprobs, res.output_versions
    if call.on_chunk is not None:  # tokens the stream did not carry
        _deliver(call, call.base, toks, lps, vers)
    stop: str = res.stop_reason
    if not call.times and call.out_tok is None and stop != "interrupt":
        # One segment, nothing streamed: the worker's arrays (views of the received
        # frames) become the response as they are.
        latency = now - call.t0
        itl = TokenArray.wrap(_ZEROS[: n - 1]) if 0 < n <= _N_ZEROS else _zero_itl(n - 1)
        return _response(call, toks, lps, vers, stop, latency, latency, itl)
    call.chunks = ()
    extra = call.base + n - len(call.times)  # tokens the stream did not announce
    if extra > 0:
        _stamp(call, extra, now)
    else:
        drop_times(call, call.base + n)
    if call.out_tok is not None or stop == "interrupt":
        _append(call, toks, lps, vers)
        assert call.out_tok is not None and call.out_lp is not None and call.out_ver is not None
        toks, lps, vers = call.out_tok, call.out_lp, call.out_ver
        if stop == "interrupt":
            next_stop = _next_segment(call)
            if next_stop is None:
                return None
            stop = next_stop
    return _finish(call, toks, lps, vers, stop, now)


_NO_IMAGES: dict[str, Any] = {}
# The zeros of the usual response's itl, sliced without a call to constant().
_N_ZEROS = 4097
_ZEROS = constant(_N_ZEROS - 1, np.float64)


def _zero_itl(n: int) -> TokenArray:
    """``n`` zero inter-token latencies: a view of one shared read-only zero array."""
    return TokenArray.wrap(constant(n, np.float64))


def _finish(
    call: Call, toks: TokenArray, lps: TokenArray, vers: TokenArray, stop: str, now: float
) -> LLMResponse:
    times = call.times
    ttft = times[0] - call.t0 if times else now - call.t0
    itl = TokenArray(np.diff(np.asarray(times, dtype=np.float64))) if times else _zero_itl(0)
    return _response(call, toks, lps, vers, stop, now - call.t0, ttft, itl)


def _response(
    call: Call, toks: Any, lps: Any, vers: Any, stop: Any, latency: float, ttft: float, itl: Any
) -> LLMResponse:
    """The caller's response: the worker's output around the caller's own prompt."""
    orig, cls, images = call.orig, LLMResponse, _NO_IMAGES
    if isinstance(orig, VLMRequest):
        cls, images = VLMResponse, {"input_images": list(orig.image_data or [])}
    return cls(
        input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
        output_versions=vers, stop_reason=stop, latency=latency, ttft=ttft, itl=itl,
        **images,
    )  # fmt: skip
