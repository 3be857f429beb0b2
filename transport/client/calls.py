"""One ``agenerate`` call across its attempts: streamed tokens, interrupted segments,
and the response rebuilt around the caller's own request.

A call's output grows by *segments*: each attempt on a worker ends in a Result, and
one with ``stop_reason="interrupt"`` (a pause for a weight update) is accumulated and
the rest re-submitted as a continuation (prompt plus output so far, fewer new
tokens). When an attempt is lost (its worker died, or gave it up), the tokens it
already streamed are kept the same way, and the re-send continues after them. So
``on_chunk`` sees every output position once, in order, and the final
``output_tokens`` is what it was given, concatenated.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse, VLMRequest, VLMResponse
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from transport.client.workers import Call
from transport.constant import constant

__all__ = ["Call", "absorb_result", "keep_streamed", "on_stream"]


def _deliver(call: Call, pos: int, toks: TokenArray, lps: TokenArray, vers: TokenArray) -> None:
    """Hand ``on_chunk`` the part of tokens at output positions ``pos...`` that it has
    not had yet (by position: never a token twice, never one out of order)."""
    cb = call.on_chunk
    assert cb is not None
    skip = call.delivered - pos
    n = len(toks)
    if skip >= n:
        return
    if skip > 0:
        toks, lps, vers = toks[skip:], lps[skip:], vers[skip:]
    call.delivered = pos + n
    cb(toks, lps, vers)


def on_stream(call: Call, msg: fm.Stream) -> None:
    """A chunk of the current attempt arrived."""
    k = len(msg.output_tokens)
    if not k:
        return
    pos = call.base + call.seg_streamed
    call.seg_streamed += k
    call.chunks.append((msg.output_tokens, msg.output_logprobs, msg.output_versions))
    now = time.perf_counter()
    call.times.extend([now] * k)
    if call.on_chunk is not None:
        _deliver(call, pos, msg.output_tokens, msg.output_logprobs, msg.output_versions)


def _append(call: Call, toks: TokenArray, lps: TokenArray, vers: TokenArray) -> None:
    if call.out_tok is None:
        # Private copies: later segments are appended to them.
        call.out_tok, call.out_lp, call.out_ver = (
            TokenArray._wrap(t.array.copy()) for t in (toks, lps, vers)
        )
    else:
        assert call.out_lp is not None and call.out_ver is not None
        call.out_tok.extend(toks.array)
        call.out_lp.extend(lps.array)
        call.out_ver.extend(vers.array)


def _next_segment(call: Call) -> str | None:
    """After a segment ended early: set up the continuation, or return the stop reason
    when nothing is left to generate."""
    orig = call.orig
    assert call.out_tok is not None
    produced = len(call.out_tok)
    remaining = orig.gconfig.max_new_tokens - produced
    if remaining <= 0:
        return "length"
    stops = orig.gconfig.stop_token_ids
    if stops and produced and call.out_tok[-1] in stops:
        return "stop"
    call.segment = _continuation(orig, call.out_tok, produced, remaining)
    return None


def keep_streamed(call: Call) -> LLMResponse | None:
    """The current attempt was lost: keep the tokens it streamed as a segment and make
    the re-send continue after them. Returns the response when those tokens already
    complete the call (nothing left to generate), else None."""
    chunks = call.chunks
    call.chunks = []
    call.seg_streamed = 0
    if chunks:
        if len(chunks) == 1:
            toks, lps, vers = chunks[0]
        else:
            toks, lps, vers = (
                TokenArray._wrap(np.concatenate([c[i].array for c in chunks])) for i in range(3)
            )
        _append(call, toks, lps, vers)
    del call.times[call.base :]
    if call.out_tok is None:
        return None
    stop = _next_segment(call)
    if stop is None:
        return None
    assert call.out_lp is not None and call.out_ver is not None
    return _finish(call, call.out_tok, call.out_lp, call.out_ver, stop, time.perf_counter())


def absorb_result(call: Call, res: fm.Result) -> LLMResponse | None:
    """The current attempt ended with ``res``: the caller's response, or None when the
    call goes on (an interrupt with tokens left; ``call.segment`` is set)."""
    now = time.perf_counter()
    if (
        call.out_tok is None
        and not call.times
        and call.on_chunk is None
        and res.stop_reason != "interrupt"
    ):
        # The usual call: one segment, nothing streamed, nothing to hand on_chunk (as
        # below, without the bookkeeping).
        latency = now - call.t0
        return _response(
            call.orig, res.output_tokens, res.output_logprobs, res.output_versions,
            res.stop_reason, latency, latency, _zero_itl(len(res.output_tokens) - 1),
        )  # fmt: skip
    n = len(res.output_tokens)
    base = call.base
    if call.chunks:
        call.chunks = []
    if call.on_chunk is not None:
        # Tokens the stream did not carry (no streaming, or a final burst).
        _deliver(call, base, res.output_tokens, res.output_logprobs, res.output_versions)
    if not call.times and call.out_tok is None and res.stop_reason != "interrupt":
        # One segment, nothing streamed: every token arrived now. The worker's arrays
        # become the response as they are (views of the received frames).
        latency = now - call.t0
        return _response(
            call.orig, res.output_tokens, res.output_logprobs, res.output_versions,
            res.stop_reason, latency, latency, _zero_itl(n - 1),
        )  # fmt: skip
    # Tokens the stream did not announce arrive now.
    extra = base + n - len(call.times)
    if extra > 0:
        call.times.extend([now] * extra)
    elif extra < 0:
        del call.times[base + n :]
    stop_reason: str = res.stop_reason
    if call.out_tok is None and stop_reason != "interrupt":
        toks, lps, vers = res.output_tokens, res.output_logprobs, res.output_versions
    else:
        _append(call, res.output_tokens, res.output_logprobs, res.output_versions)
        assert call.out_tok is not None and call.out_lp is not None and call.out_ver is not None
        toks, lps, vers = call.out_tok, call.out_lp, call.out_ver
        if stop_reason == "interrupt":
            stop = _next_segment(call)
            if stop is None:
                call.interrupts += 1
                return None
            stop_reason = stop
    return _finish(call, toks, lps, vers, stop_reason, now)


def _zero_itl(n: int) -> TokenArray:
    """``n`` zero inter-token latencies (tokens that arrived together): a TokenArray
    over a read-only view of one shared zero array, whatever ``n`` (a TokenArray
    copies before it changes an array it does not own)."""
    return TokenArray._wrap(constant(n, np.float64))


def _finish(
    call: Call, toks: TokenArray, lps: TokenArray, vers: TokenArray, stop: str, now: float
) -> LLMResponse:
    times = call.times
    return _response(
        call.orig, toks, lps, vers, stop, now - call.t0,
        times[0] - call.t0 if times else now - call.t0,
        TokenArray(np.diff(np.asarray(times, dtype=np.float64))) if times else TokenArray(np.zeros(0)),
    )  # fmt: skip


def _response(
    orig: LLMRequest,
    toks: Any,
    lps: Any,
    vers: Any,
    stop_reason: Any,
    latency: float,
    ttft: float,
    itl: TokenArray,
) -> LLMResponse:
    """The caller's response: the worker's output around the caller's own prompt."""
    if isinstance(orig, VLMRequest):
        return VLMResponse(
            input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
            output_versions=vers, stop_reason=stop_reason, latency=latency, ttft=ttft, itl=itl,
            input_images=list(orig.image_data or []),
        )  # fmt: skip
    return LLMResponse(
        input_tokens=orig.input_ids, output_tokens=toks, output_logprobs=lps,
        output_versions=vers, stop_reason=stop_reason, latency=latency, ttft=ttft, itl=itl,
    )  # fmt: skip


def _continuation(
    orig: LLMRequest, out_tok: TokenArray, produced: int, remaining: int
) -> LLMRequest:
    """The rest of a request: prompt plus output so far, fewer new tokens."""
    g = orig.gconfig.new(
        max_new_tokens=remaining, min_new_tokens=max(0, orig.gconfig.min_new_tokens - produced)
    )
    ids = orig.input_ids + out_tok
    if isinstance(orig, VLMRequest):
        return VLMRequest(
            rid=orig.rid,
            input_ids=ids,
            gconfig=g,
            metadata=orig.metadata,
            model_id=orig.model_id,
            image_data=orig.image_data,
        )
    return LLMRequest(
        rid=orig.rid, input_ids=ids, gconfig=g, metadata=orig.metadata, model_id=orig.model_id
    )
