"""``--engine vllm``: a worker in front of a vLLM server on its RL API (``--engine-opt url=...``);
how it maps onto vLLM and how to start the server: ``docs/engines.md#vllm``."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from fastio import LLMRequest
from transport.engines.api import EngineUnavailable
from transport.engines.flight import Flight, sampling_common
from transport.engines.http import BridgeOptions, HTTPBridge
from transport.engines.vllm_staging import PROTOCOL, UpdateState, WeightSync
from transport.options import Seconds
from transport.ratelog import RateLimitedLog

__all__ = ["WEIGHTS_REFUSED", "VLLMEngine", "VLLMOptions", "factory"]

log = logging.getLogger("transport.engines")
_warn = RateLimitedLog(log)

#: Why a vLLM server without the RL routes takes no weights.
WEIGHTS_REFUSED = (
    "the vLLM server at {url} has no weight-transfer routes: start it with "
    'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{{"backend": "fastio"}}\' '
    "(docs/engines.md#vllm)"
)
_GENERATE = "/inference/v1/generate"


class VLLMOptions(BridgeOptions):
    """The options of :class:`VLLMEngine`: those of :class:`BridgeOptions`, and these."""

    model: str | None = None
    """The served model name sent with each request (default: the first of ``/v1/models``)."""
    route: Literal["auto", "generate", "completions"] = "auto"
    """``auto``: ``/inference/v1/generate`` where the server has it, else ``/v1/completions``."""
    pause: Literal["keep", "abort"] = "keep"
    """``keep``: freeze requests in place where the server has ``/pause``; ``abort``: end them."""
    shm_dir: str = "/dev/shm"
    """Where a version is staged for vLLM's workers (on the same host)."""
    weight_timeout: Seconds = 600.0
    """Seconds vLLM may take to load a version."""


class VLLMEngine(HTTPBridge):
    """An :class:`~transport.Engine` in front of a vLLM server; ``url`` and the keywords of
    :class:`VLLMOptions` (``model`` is kept as :attr:`served_model`)."""

    name = "vLLM"
    extra = "vllm"
    Options = VLLMOptions
    closes_to_interrupt = True
    options: VLLMOptions

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.served_model = self.options.model
        self.routes: set[str] | None = None  # the server's routes (None: not read yet)
        self.vocab_size: int | None = None  # from the model's config.json, where readable
        self.state = UpdateState(_http_sync(self), f" at {url}")

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
        config = Path(str(model.get("root") or ""), "config.json")
        with contextlib.suppress(OSError, ValueError, TypeError):  # else the server checks
            self.vocab_size = int(json.loads(config.read_bytes()).get("vocab_size")) or None
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

    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """The native route's streamed body, or ``/v1/completions``'s, with logprobs."""
        g = req.gconfig
        if g.n_samples != 1:
            msg = "the vLLM bridge streams one sample per request; send n requests"
            raise ValueError(f"n_samples={g.n_samples}: {msg} (or the client's group helpers)")
        # JSON wants a list: the one conversion of the prompt on this path.
        prompt = req.input_ids.array.tolist()
        sp = {**sampling_common(g, "max_tokens", "min_tokens"), "logprobs": 0}
        if self.native:
            body = {"request_id": rid, "token_ids": prompt, "sampling_params": sp, "stream": True}
            if self.served_model is not None:
                body["model"] = self.served_model
            return _GENERATE, body
        return "/v1/completions", {
            "model": self.served_model, "prompt": prompt, **sp, "stream": True,
            "return_tokens_as_token_ids": True, "include_stop_str_in_output": True,
        }  # fmt: skip

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
        # A frozen request vLLM could not drop keeps its slot: worth a (rate-limited) warning.
        if (exc := await self._post_quietly("/abort_requests", {"request_ids": [rid]})) is not None:
            _warn.warning("failed abort", "vLLM /abort_requests for %s failed: %r", rid, exc)

    @property
    def pauses_in_place(self) -> bool:  # type: ignore[override]
        """This bridge paused the server in place (requests frozen, not ended)."""
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

    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Stage one verified version in shared memory and have vLLM's workers load it."""
        if (why := self.no_weights_reason) is not None:
            raise RuntimeError(why)
        if version is None:
            version = self.version + 1
        run = functools.partial(self.run_in_loop, timeout=self.options.weight_timeout)
        self.state.load_pairs(weights, version, self.options.shm_dir, run)


def _http_sync(b: VLLMEngine) -> WeightSync:
    post = b.post_json

    async def label() -> str:
        return str((await b.get_json("/weight_info")).get("weight_version"))

    return WeightSync(
        init_transfer=lambda: post(
            "/init_weight_transfer_engine", {"init_info": {"protocol": PROTOCOL}}
        ),
        pause_in_place=lambda: post("/pause?mode=keep", {}),
        resume=lambda: post("/resume", {}),
        start_update=lambda: post("/start_weight_update", {}),
        update=lambda info: post(
            "/update_weights", {"update_info": info}, timeout=b.options.weight_timeout
        ),
        finish_update=lambda v: post("/finish_weight_update", {"weight_version": v}),
        label=label,
    )


def _token_id(name: str) -> int:
    head, _, tail = str(name).rpartition(":")  # return_tokens_as_token_ids: "token_id:<id>"
    if head != "token_id":
        raise ValueError(f"vLLM returned token {name!r}, not token_id:<id>")
    return int(tail)


def factory(opts: dict[str, str]) -> Any:
    """``--engine vllm``: with ``url``, a :class:`VLLMEngine` in front of that server; with
    ``model`` (a path, no ``url``), vLLM in this worker (:mod:`.vllm_inproc`)."""
    if not opts.get("url") and opts.get("model"):
        from transport.engines.vllm_inproc import factory as in_worker

        return in_worker(opts)
    if not opts.get("url"):
        raise ValueError(
            "needs --engine-opt url=http://host:port (a vLLM server) or model=PATH "
            "(vLLM in this worker)"
        )
    return VLLMEngine.from_opts(opts)
