"""``--engine vllm``: a worker fronting a running vLLM server on vLLM's native RL API
(``--engine-opt url=http://127.0.0.1:8000``); how requests, pauses and weights map onto
vLLM and how to start the server: ``docs/engines.md#vllm``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable
from typing import Any, Literal

from fastio import LLMRequest
from transport.engines.api import EngineUnavailable
from transport.engines.flight import Flight, sampling_common
from transport.engines.http import BridgeOptions, HTTPBridge, Seconds
from transport.engines.vllm_staging import PROTOCOL, UpdateState

__all__ = ["WEIGHTS_REFUSED", "VLLMEngine", "VLLMOptions", "factory"]

log = logging.getLogger("transport.engines")

#: Why a vLLM server without the RL routes takes no weights.
WEIGHTS_REFUSED = (
    "the vLLM server at {url} has no weight-transfer routes: start it with "
    'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{{"backend": "fastio"}}\' '
    "(docs/engines.md#vllm)"
)
_GENERATE = "/inference/v1/generate"


class VLLMOptions(BridgeOptions):
    """Those of :class:`BridgeOptions`, and

    Attributes
    ----------
    model:
        The served model name sent with each request (default: the first of ``/v1/models``).
    route:
        ``auto``: ``/inference/v1/generate`` where the server has it, else
        ``/v1/completions``; or one of ``generate``, ``completions``.
    pause:
        ``keep``: freeze requests in place where the server has ``/pause`` (KV cache
        kept); ``abort``: close their streams, the client re-sends the rest.
    shm_dir, weight_timeout:
        Where a version is staged for vLLM's workers (same host); seconds to load one.
    """

    model: str | None = None
    route: Literal["auto", "generate", "completions"] = "auto"
    pause: Literal["keep", "abort"] = "keep"
    shm_dir: str = "/dev/shm"
    weight_timeout: Seconds = 600.0


class VLLMEngine(HTTPBridge):
    """An :class:`~transport.Engine` that forwards to a vLLM server; ``url`` and the keywords
    of :class:`VLLMOptions` (``model`` is kept as :attr:`served_model`)."""

    name = "vLLM"
    extra = "vllm"
    Options = VLLMOptions
    closes_to_interrupt = True
    options: VLLMOptions

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.served_model = self.options.model
        #: The server's routes (None: not read yet).
        self.routes: set[str] | None = None
        #: The vocabulary size from the model's config.json, where the worker can read it.
        self.vocab_size: int | None = None
        self.state = UpdateState(_HTTPSync(self), f" at {url}")

    # -- what the server has ------------------------------------------------------------

    def probe(self, timeout: float = 5.0) -> None:
        """Read the server's routes, model name, weight version and vocabulary (blocking)."""
        get = functools.partial(self.fetch_json, timeout=timeout)
        try:
            self.routes = set(get("/openapi.json").get("paths", {}))
        except (OSError, ValueError):
            self.routes = set()  # docs disabled: the OpenAI routes only
        try:
            model = get("/v1/models")["data"][0]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise EngineUnavailable(f"{self.url}/v1/models names no model: {exc}") from exc
        if self.served_model is None:
            self.served_model = str(model["id"])
        config = os.path.join(str(model.get("root") or ""), "config.json")
        try:
            with open(config, "rb") as f:
                vocab = json.loads(f.read()).get("vocab_size")
            self.vocab_size = int(vocab) if vocab else None
        except (OSError, ValueError, TypeError):
            self.vocab_size = None  # not on this host: the server checks
        if "/weight_info" in self.routes:
            self.version = self.labels.start(get("/weight_info").get("weight_version"))
        if self.options.route == "generate" and _GENERATE not in self.routes:
            raise EngineUnavailable(
                f"{self.url} has no {_GENERATE}: start vLLM with --enable-scale-out"
            )

    @property
    def native(self) -> bool:
        """Requests go to ``/inference/v1/generate``."""
        o = self.options.route
        return o == "generate" or (o == "auto" and _GENERATE in (self.routes or ()))

    @property
    def no_weights_reason(self) -> str | None:  # type: ignore[override]
        """Why this server takes no weights (None: it has the weight-transfer routes)."""
        if self.routes is None or "/update_weights" in self.routes:
            return None
        return WEIGHTS_REFUSED.format(url=self.url)

    # -- requests -----------------------------------------------------------------------

    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """The native route's body, or ``/v1/completions``'s, streamed with logprobs."""
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(
                f"n_samples={g.n_samples}: the vLLM bridge streams one sample per "
                "request; send n requests (or use the group helpers of the client)"
            )
        # JSON wants a list: the one conversion of the prompt on this path.
        prompt = req.input_ids.array.tolist()
        if self.native:
            sp = sampling_common(g, "max_tokens", "min_tokens")
            sp["logprobs"] = 0
            body = {"request_id": rid, "token_ids": prompt, "sampling_params": sp, "stream": True}
            if self.served_model is not None:
                body["model"] = self.served_model
            return _GENERATE, body
        return "/v1/completions", {
            "model": self.served_model,
            "prompt": prompt,
            **sampling_common(g, "max_tokens", "min_tokens"),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "stream": True,
        }

    def take(self, chunk: Any, flight: Flight) -> int:
        """Emit the tokens of each streamed choice; keep the final chunk's version spans."""
        n = 0
        version = self.version
        for choice in chunk.get("choices") or ():
            lp = choice.get("logprobs") or {}
            ids = choice.get("token_ids")
            if "content" in lp:  # the native route: [{token_id, logprob, ...}]
                values = [c.get("logprob") for c in lp.get("content") or ()]
            else:
                values = lp.get("token_logprobs") or []
                if ids is None:
                    ids = [_token_id(name) for name in lp.get("tokens") or ()]
            ids = ids or ()
            for k, tok in enumerate(ids):
                flight.add(int(tok), values[k] if k < len(values) else None, version)
            n += len(ids)
            if choice.get("weight_versions"):
                flight.spans = choice["weight_versions"]
            flight.finish = choice.get("finish_reason") or flight.finish
        return n

    def abort(self, flight: Flight) -> None:
        """Close ``flight``'s stream; while paused in place, abort it by id too."""
        if flight.response is not None:
            flight.response.close()
        if self.state.kept:
            self.spawn(self._abort_by_id(flight.rid))

    async def _abort_by_id(self, rid: str) -> None:
        try:
            await self.post_json("/abort_requests", {"request_ids": [rid]})
        except (EngineUnavailable, RuntimeError) as exc:
            log.warning("vLLM /abort_requests %s: %s", rid, exc)

    # -- pause ---------------------------------------------------------------------------

    @property
    def pauses_in_place(self) -> bool:  # type: ignore[override]
        """The server is paused in place by this bridge (requests frozen, not ended)."""
        return self.state.kept

    async def pause_generation(self) -> None:  # type: ignore[override]
        """``/pause?mode=keep`` where the server has it, else interrupt every flight."""
        if self.options.pause == "keep" and "/pause" in (self.routes or ()):
            try:
                await self.state.pause()  # kept from now: streams read on, not interrupted
                return
            except (EngineUnavailable, RuntimeError) as exc:
                log.warning("vLLM /pause?mode=keep failed (%s): interrupting instead", exc)
        super().pause_generation()

    async def continue_generation(self) -> None:
        """``/resume`` a server this bridge paused, unless a failed load left it mixed."""
        await self.state.resume()

    # -- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Stage one verified version in shared memory and have vLLM's workers load it."""
        if (why := self.no_weights_reason) is not None:
            raise RuntimeError(why)
        if version is None:
            version = self.version + 1
        run = functools.partial(self.run_in_loop, timeout=self.options.weight_timeout)
        self.state.load_pairs(weights, version, self.options.shm_dir, run)


class _HTTPSync:
    """:class:`~transport.engines.vllm_staging.WeightSync` over the server's RL routes."""

    def __init__(self, bridge: VLLMEngine) -> None:
        self.b = bridge

    async def init_transfer(self) -> None:
        await self.b.post_json(
            "/init_weight_transfer_engine", {"init_info": {"protocol": PROTOCOL}}
        )

    async def pause_in_place(self) -> None:
        await self.b.post_json("/pause?mode=keep", {})

    async def resume(self) -> None:
        await self.b.post_json("/resume", {})

    async def start_update(self) -> None:
        await self.b.post_json("/start_weight_update", {})

    async def update(self, update_info: dict[str, Any]) -> None:
        t = self.b.options.weight_timeout
        await self.b.post_json("/update_weights", {"update_info": update_info}, timeout=t)

    async def finish_update(self, label: str) -> None:
        await self.b.post_json("/finish_weight_update", {"weight_version": label})

    async def label(self) -> str:
        return str((await self.b.get_json("/weight_info")).get("weight_version"))


def _token_id(name: str) -> int:
    # return_tokens_as_token_ids: each token is written "token_id:<id>".
    head, _, tail = str(name).rpartition(":")
    if head != "token_id":
        raise ValueError(f"vLLM returned token {name!r}, not token_id:<id>")
    return int(tail)


def factory(opts: dict[str, str]) -> Any:
    """``--engine vllm``: with ``url``, a :class:`VLLMEngine` in front of that server;
    with ``model`` (a path, no ``url``), vLLM in this worker
    (:mod:`transport.engines.vllm_inproc`)."""
    if not opts.get("url") and opts.get("model"):
        from transport.engines.vllm_inproc import factory as in_worker

        return in_worker(opts)
    if not opts.get("url"):
        raise ValueError(
            "needs --engine-opt url=http://host:port (a vLLM server) or model=PATH "
            "(vLLM in this worker)"
        )
    return VLLMEngine.from_opts(opts)
