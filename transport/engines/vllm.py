"""``--engine vllm``: a worker fronting a running vLLM OpenAI-compatible server.

::

    vllm serve MODEL --port 8000 &
    fastio-worker --bind tcp://0.0.0.0:5555 --engine vllm \\
        --engine-opt url=http://127.0.0.1:8000

A request is ``POST /v1/completions`` (the prompt as token ids, streamed, with logprobs
and ``return_tokens_as_token_ids``); pause, abort and cancel close its stream, which
aborts it on the server (on a pause the tokens so far return with ``interrupt``).
Weights are refused (:data:`WEIGHTS_REFUSED`). Options: :class:`VLLMOptions`.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import msgspec

from fastio import LLMRequest
from transport.engines.api import EngineUnavailable
from transport.engines.http import BridgeOptions, Flight, HTTPBridge, sampling_common

__all__ = ["WEIGHTS_REFUSED", "VLLMEngine", "VLLMOptions", "factory"]

#: Why the vLLM bridge takes no weights.
WEIGHTS_REFUSED = (
    "the vLLM bridge cannot load weights: vLLM's OpenAI-compatible server documents no "
    "endpoint that reloads them (its RL endpoints need VLLM_SERVER_DEV_MODE); restart the "
    "server on the new checkpoint, or serve vLLM in-process through the engine interface "
    "(docs/engines.md)"
)


class VLLMOptions(BridgeOptions):
    """Those of :class:`BridgeOptions`, and ``model``: the served model name sent with
    each request (default: the first of ``GET /v1/models``)."""

    model: str | None = None


class VLLMEngine(HTTPBridge):
    """An :class:`~transport.Engine` that forwards to a vLLM server (module docstring);
    ``url`` and the keywords of :class:`VLLMOptions` (``model`` is kept as
    :attr:`served_model`: an engine's ``model`` is the weight route's in-place target)."""

    name = "vLLM"
    extra = "vllm"
    Options = VLLMOptions
    closes_to_interrupt = True
    #: Why a weight route is refused (the worker's weights plugin fails at start with it).
    no_weights_reason = WEIGHTS_REFUSED

    options: VLLMOptions

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.served_model = self.options.model

    def check_reachable(self, timeout: float = 5.0) -> None:
        """``/health``, and the model name from ``/v1/models`` when none was given."""
        super().check_reachable(timeout)
        if self.served_model is None:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=timeout) as r:
                    self.served_model = str(json.loads(r.read())["data"][0]["id"])
            except (OSError, ValueError, KeyError, IndexError) as exc:
                raise EngineUnavailable(f"{self.url}/v1/models names no model: {exc}") from exc

    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """``/v1/completions``, streamed, with the sampled tokens' logprobs as ids."""
        if self.served_model is None:
            async with self.session().get(self.url + "/v1/models") as resp:
                data = msgspec.json.decode(await resp.read())
            self.served_model = str(data["data"][0]["id"])
        return "/v1/completions", {
            "model": self.served_model,
            # JSON wants a list: the one conversion of the prompt on this path.
            "prompt": req.input_ids.array.tolist(),
            **sampling_common(req.gconfig, "max_tokens", "min_tokens"),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "stream": True,
        }

    def take(self, chunk: Any, flight: Flight) -> int:
        """Emit the tokens of each streamed choice."""
        n = 0
        version = self.version
        for choice in chunk.get("choices") or ():
            lp = choice.get("logprobs") or {}
            values = lp.get("token_logprobs") or ()
            ids = choice.get("token_ids")
            if ids is None:
                ids = [_token_id(name) for name in lp.get("tokens") or ()]
            for k, tok in enumerate(ids):
                flight.add(int(tok), values[k] if k < len(values) else None, version)
            n += len(ids)
            flight.finish = choice.get("finish_reason") or flight.finish
        return n

    def abort(self, flight: Flight) -> None:
        """Close ``flight``'s stream: the server aborts a request whose client left."""
        if flight.response is not None:
            flight.response.close()


def _token_id(name: str) -> int:
    # return_tokens_as_token_ids: each token is written "token_id:<id>".
    head, _, tail = str(name).rpartition(":")
    if head != "token_id":
        raise ValueError(f"vLLM returned token {name!r}, not token_id:<id>")
    return int(tail)


#: ``--engine vllm``: a :class:`VLLMEngine` from the ``--engine-opt`` strings.
factory = VLLMEngine.from_opts
