"""What every engine that streams from vLLM or SGLang shares, over HTTP or in the worker:
the requests in flight (:class:`Flight`, :class:`Flights`), their ids, the servers'
version labels and sampling parameters."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from fastio import LLMRequest, LLMResponse, TokenArray
from transport.engines.api import GenerationContext

__all__ = ["Flight", "Flights", "VersionLabels", "request_ids", "sampling_common"]

# GenerationHyperparameters.top_k at or above this means "no top-k" (the servers' -1).
_NO_TOP_K = 1 << 30


def sampling_common(g: Any, max_key: str, min_key: str) -> dict[str, Any]:
    """The servers' common sampling parameters of ``g`` (limits named ``max_key``, ``min_key``)."""
    sp: dict[str, Any] = {
        max_key: g.max_new_tokens,
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": g.top_p,
        "top_k": -1 if g.top_k >= _NO_TOP_K else g.top_k,
        "skip_special_tokens": False,
    }
    if g.min_new_tokens:
        sp[min_key] = g.min_new_tokens
    if g.stop_token_ids:
        sp["stop_token_ids"] = list(g.stop_token_ids)
    return sp


def request_ids() -> Iterator[str]:
    """Request ids unique to this process's life (servers key aborts by them)."""
    prefix = f"fastio-{os.getpid()}-{os.urandom(3).hex()}"
    return (f"{prefix}-{n}" for n in itertools.count())


class VersionLabels:
    """A server's weight-version labels as fastio's versions: labels are ``str(version)``;
    any other (``default``: the weights the server started on) is :attr:`base`."""

    def __init__(self, base: int = 0) -> None:
        self.base = base

    def version(self, label: Any) -> int:
        """The fastio version of a label."""
        text = str(label)
        return int(text) if text.lstrip("-").isdigit() else self.base

    def start(self, label: Any) -> int:
        """Take ``label``, the server's at start, as :attr:`base`; returns its version."""
        self.base = self.version(label)
        return self.base

    def stamp(self, versions: list[int], spans: Any) -> Any:
        """``versions`` (one per token) as int32, each of vLLM's ``weight_versions`` spans
        (``{version, start, end}`` mappings or objects) set to its label's version."""
        out = np.array(versions, dtype=np.int32)
        for span in spans or ():
            if not isinstance(span, dict):  # vLLM's WeightVersionSpan
                span = {"start": span.start, "end": span.end, "version": span.version}
            out[int(span["start"]) : int(span["end"])] = self.version(span["version"])
        return out


@dataclasses.dataclass(slots=True, eq=False)
class Flight:
    """One request in flight on the server, and its output so far."""

    rid: str
    ctx: GenerationContext
    first: bool = False  # a token arrived
    interrupted: bool = False  # the bridge asked the server to stop it (pause)
    blind_abort: bool = False  # interrupted before a token: sent again at the first chunk
    response: Any = None  # the open HTTP response
    finish: Any = None  # the server's finish reason
    toks: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    vers: list[int] = dataclasses.field(default_factory=list)
    spans: Any = None  # the server's per-token version spans, where it sends them

    def add(self, token: int, logprob: Any, version: int) -> None:
        """Keep one token and stream it through the request's context."""
        lp = float(logprob) if logprob is not None else 0.0
        self.toks.append(token)
        self.lps.append(lp)
        self.vers.append(version)
        self.ctx.emit(token, lp, version)

    def result(self, req: LLMRequest, stop: str, labels: VersionLabels) -> LLMResponse:
        """The :class:`~fastio.LLMResponse` so far, versions from the server's spans if any."""
        vers = labels.stamp(self.vers, self.spans)
        return LLMResponse(
            input_tokens=req.input_ids,
            output_tokens=TokenArray(np.array(self.toks, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(self.lps, dtype=np.float32)),
            output_versions=TokenArray(vers),
            stop_reason=stop,  # type: ignore[arg-type]  # one of four
        )


class Flights:
    """An engine's requests in flight: :attr:`version`, :attr:`labels`, ids, and how many
    have no token yet (:meth:`queue_depth`)."""

    def __init__(self) -> None:
        self.version = 0  # stamped on new tokens
        self.labels = VersionLabels()  # the server's version labels as fastio versions
        self.flights: dict[str, Flight] = {}
        self._waiting = 0  # flights without a token (read from the socket thread)
        self._rids = request_ids()

    def queue_depth(self) -> int:
        """Requests sent to the server that have no token yet (queued or in prefill)."""
        return self._waiting

    def new_rid(self) -> str:
        """A request id unique to this process's life (servers key aborts by it)."""
        return next(self._rids)

    def begin(self, ctx: GenerationContext) -> Flight:
        """A new flight for ``ctx``, waiting for its first token."""
        flight = Flight(self.new_rid(), ctx)
        self.flights[flight.rid] = flight
        self._waiting += 1
        return flight

    def got(self, flight: Flight, tokens: int) -> None:
        """``flight`` received ``tokens`` more."""
        if tokens and not flight.first:
            flight.first = True
            self._waiting -= 1

    def end(self, flight: Flight) -> None:
        """``flight`` ended."""
        if not flight.first:
            self._waiting -= 1
        self.flights.pop(flight.rid, None)
