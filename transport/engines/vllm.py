"""``--engine vllm``: a worker fronting a running vLLM OpenAI-compatible server.

::

    vllm serve MODEL --port 8000 &
    fastio-worker --bind tcp://0.0.0.0:5555 --engine vllm \\
        --engine-opt url=http://127.0.0.1:8000

What each part of the fabric's contract becomes:

* a request: ``POST /v1/completions`` with the prompt as token ids, ``max_tokens``,
  ``min_tokens``, the sampling parameters, ``stop_token_ids``, ``logprobs: 0`` (the
  sampled token's logprob), ``return_tokens_as_token_ids: true`` (tokens read back as
  ``token_id:N``) and ``stream: true``; each ``data: {...}`` chunk's tokens are emitted
  as they come, until ``data: [DONE]``;
* ``finish_reason`` ``length`` / ``stop`` -> the same stop reason (``abort`` -> ``abort``);
* pause: the stream of every request in flight is closed, which aborts it on the server
  (vLLM aborts a request whose client disconnected); the tokens received so far are
  returned with ``interrupt`` and the client resumes after them;
* a controller's abort or a client's cancel: the stream is closed the same way;
* weight versions: each token carries the worker's version when it arrived;
* weights: refused. The OpenAI-compatible server documents no endpoint that reloads
  weights (its RL endpoints exist only in a development mode), so :meth:`VLLMEngine.
  load_weights` raises with a message that says so and the trainer sees the version
  fail on this worker. Use the in-process adapter sketched in ``docs/engines.md``, or
  restart the server on the new checkpoint;
* a server that dies or hangs: the worker closes and its clients fail over (see
  :mod:`transport.engines.http`).

Options (``--engine-opt key=value``): ``url`` (required), ``model`` (the served model
name; default: the first of ``GET /v1/models``), ``request_timeout``,
``stall_timeout``, ``health_interval``, ``health_timeout``, ``health_failures``,
``check`` (``0``: do not probe the server when the worker starts).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import msgspec

from fastio import LLMRequest, LLMResponse
from transport.engines.api import EngineUnavailable, GenerationContext
from transport.engines.http import (
    JSON_HEADERS,
    Flight,
    HTTPBridge,
    raise_for_status,
    response,
    sampling_common,
    sse_events,
)

__all__ = ["WEIGHTS_REFUSED", "VLLMEngine", "factory"]

#: Why the vLLM bridge takes no weights.
WEIGHTS_REFUSED = (
    "the vLLM bridge cannot load weights: vLLM's OpenAI-compatible server documents no "
    "endpoint that reloads them (its RL endpoints need VLLM_SERVER_DEV_MODE); restart the "
    "server on the new checkpoint, or serve vLLM in-process through the engine interface "
    "(docs/engines.md)"
)


class _Closed(Exception):
    """The bridge closed the stream itself (pause)."""


class VLLMEngine(HTTPBridge):
    """An :class:`~transport.Engine` that forwards to a vLLM server (module docstring).

    Parameters
    ----------
    url:
        The server, ``http://host:port``.
    model:
        The model name sent with each request (``None``: asked of ``/v1/models``);
        :attr:`served_model`. (Not ``model``: that name is the weight route's in-place
        target, which this bridge has none of.)
    **kwargs:
        See :class:`~transport.engines.http.HTTPBridge`.
    """

    name = "vLLM"
    extra = "vllm"
    #: Why a weight route is refused (the worker's weights plugin fails at start with it).
    no_weights_reason = WEIGHTS_REFUSED

    def __init__(self, url: str, *, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.served_model = model

    def check_reachable(self, timeout: float = 5.0) -> None:
        """``/health``, and the model name from ``/v1/models`` when none was given."""
        super().check_reachable(timeout)
        if self.served_model is None:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=timeout) as r:
                    self.served_model = str(json.loads(r.read())["data"][0]["id"])
            except (OSError, ValueError, KeyError, IndexError) as exc:
                raise EngineUnavailable(f"{self.url}/v1/models names no model: {exc}") from exc

    async def _model(self) -> str:
        if self.served_model is None:
            async with self.session().get(self.url + "/v1/models") as resp:
                data = msgspec.json.decode(await resp.read())
            self.served_model = str(data["data"][0]["id"])
        return self.served_model

    def _body(self, req: LLMRequest, model: str) -> dict[str, Any]:
        g = req.gconfig
        body: dict[str, Any] = {
            "model": model,
            # JSON wants a list: the one conversion of the prompt on this path.
            "prompt": req.input_ids.array.tolist(),
            **sampling_common(g, "max_tokens", "min_tokens"),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "stream": True,
        }
        return body

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Forward ``req`` to ``/v1/completions`` and stream the answer through ``ctx``."""
        # The first step runs outside any task (the worker's eager start); aiohttp's
        # timeouts need one.
        await asyncio.sleep(0)
        aiohttp = self.aiohttp
        flight = self.new_flight(ctx)
        rid = flight.rid
        toks: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        finish: str | None = None
        try:
            body = self._body(req, await self._model())
            async with self.session().post(
                self.url + "/v1/completions", data=msgspec.json.encode(body), headers=JSON_HEADERS
            ) as resp:
                flight.response = resp
                await raise_for_status(resp, "vLLM /v1/completions")
                if ctx.interrupted:
                    self._interrupt(flight)  # paused while the request was on its way
                async for chunk in sse_events(resp.content):
                    for choice in chunk.get("choices") or ():
                        if self._take(choice, toks, lps, vers, ctx):
                            flight.first = True
                        finish = choice.get("finish_reason") or finish
                    if ctx.interrupted and not flight.interrupted:
                        self._interrupt(flight)
                        break
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            if not flight.interrupted:
                await self.server_gone(repr(exc))
        finally:
            self.end_flight(rid)
        if flight.interrupted and finish is None:
            return response(req, toks, lps, vers, "interrupt")
        if finish is None:
            await self.server_gone(f"the stream of {rid} ended without a finish_reason")
        stop = {"length": "length", "abort": "abort"}.get(str(finish), "stop")
        return response(req, toks, lps, vers, stop)

    def _take(
        self,
        choice: dict[str, Any],
        toks: list[int],
        lps: list[float],
        vers: list[int],
        ctx: GenerationContext,
    ) -> int:
        """Emit the tokens of one streamed choice; returns how many."""
        lp = choice.get("logprobs") or {}
        names = lp.get("tokens") or ()
        values = lp.get("token_logprobs") or ()
        ids = choice.get("token_ids")
        if ids is None:
            ids = [_token_id(n) for n in names]
        version = self.version
        for k, tok in enumerate(ids):
            v = values[k] if k < len(values) else None
            lpf = float(v) if v is not None else 0.0
            toks.append(int(tok))
            lps.append(lpf)
            vers.append(version)
            ctx.emit(int(tok), lpf, version)
        return len(ids)

    def _interrupt(self, flight: Flight) -> None:
        flight.interrupted = True
        if flight.response is not None:
            flight.response.close()  # the server aborts a request whose client left

    def pause_generation(self) -> None:
        """The worker pauses: close every stream (each returns ``interrupt``)."""
        for flight in list(self.flights.values()):
            if not flight.interrupted:
                self._interrupt(flight)


def _token_id(name: str) -> int:
    # return_tokens_as_token_ids: each token is written "token_id:<id>".
    head, _, tail = str(name).rpartition(":")
    if head != "token_id":
        raise ValueError(f"vLLM returned token {name!r}, not token_id:<id>")
    return int(tail)


def factory(opts: dict[str, str]) -> VLLMEngine:
    """``--engine vllm``: a :class:`VLLMEngine` from the ``--engine-opt`` strings;
    probes the server first (``check=0`` skips it)."""
    engine: VLLMEngine = VLLMEngine.from_opts(opts, ("model",))
    return engine
