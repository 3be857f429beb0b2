"""``--engine sglang``: a worker fronting a running SGLang server over its native HTTP API.

::

    python -m sglang.launch_server --model-path MODEL --port 30000 &
    fastio-worker --bind tcp://0.0.0.0:5555 --engine sglang \\
        --engine-opt url=http://127.0.0.1:30000

What each part of the fabric's contract becomes:

* a request: ``POST /generate`` with ``input_ids``, ``sampling_params``,
  ``return_logprob: true``, ``stream: true`` and a ``rid`` of the bridge's own; each
  server-sent chunk's new ``meta_info.output_token_logprobs`` entries (``[logprob,
  token_id, text]``, cumulative or incremental: both are read) are emitted as they come;
* ``finish_reason.type`` ``length`` / ``stop`` -> the same stop reason; ``abort`` ->
  ``interrupt`` when the worker paused (the client resumes after the partial tokens),
  else ``abort``;
* pause: every request in flight is aborted by rid (``POST /abort_request``); the server
  ends each stream with its partial output and ``finish_reason`` ``abort``;
* a controller's abort or a client's cancel: ``/abort_request`` for that rid;
* weight versions: each token carries the worker's version when it arrived (weights
  change only while the worker is paused and nothing is in flight);
* weights: the weight route's worker plugin (``--plugin transport.weights.update:subscribe``)
  hands each verified version to :meth:`SGLangEngine.load_weights`, which writes it once
  as safetensors under ``weights_dir`` and has the server load it with ``POST
  /update_weights_from_disk``; the version is acknowledged to the trainer when the
  server says ``success``, and only then does the worker's version move.
  :meth:`SGLangEngine.load_weights_from_disk` loads a version a trainer already wrote
  (the disk route's plugin, :mod:`transport.weights.disk_follow`, calls it).
  ``/pause_generation`` and ``/continue_generation`` bracket the load where the server
  has them;
* a server that dies or hangs: the worker closes and its clients fail over (see
  :mod:`transport.engines.http`).

Options (``--engine-opt key=value``): ``url`` (required), ``weights_dir`` (default a
temporary directory), ``model_config`` (a directory whose config and tokenizer files
are linked into each version written, so that the server can load it as a model),
``request_timeout``, ``stall_timeout``, ``reload_timeout``, ``health_interval``,
``health_timeout``, ``health_failures``, ``check`` (``0``: do not probe ``/health``
when the worker starts).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse
from transport.engines.api import GenerationContext
from transport.engines.http import (
    JSON_HEADERS,
    Flight,
    HTTPBridge,
    raise_for_status,
    response,
    sampling_common,
    sse_events,
)

__all__ = ["SGLangEngine", "factory", "sampling_params"]

log = logging.getLogger("transport.engines")


def sampling_params(g: GenerationHyperparameters) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``g`` (stop tokens kept in the output, as the
    fabric's engines do)."""
    sp = sampling_common(g, "max_new_tokens", "min_new_tokens")
    sp["no_stop_trim"] = True
    return sp


class SGLangEngine(HTTPBridge):
    """An :class:`~transport.Engine` that forwards to an SGLang server (module docstring).

    Parameters
    ----------
    url:
        The server, ``http://host:port``.
    weights_dir:
        Where versions received from the weight route are written (default: a new
        temporary directory). Must be readable by the server (same host or a shared
        file system).
    model_config:
        A model directory whose non-weight files (``config.json``, tokenizer files) are
        linked into each version directory written.
    reload_timeout:
        Seconds the server may take to load a version.
    **kwargs:
        See :class:`~transport.engines.http.HTTPBridge`.
    """

    name = "SGLang"
    extra = "sglang"

    def __init__(
        self,
        url: str,
        *,
        weights_dir: str | None = None,
        model_config: str | None = None,
        reload_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(url, **kwargs)
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="fastio-sglang-"))
        self.model_config = Path(model_config) if model_config else None
        self.reload_timeout = reload_timeout
        #: Whether the server has /pause_generation (None: not asked yet).
        self.has_pause: bool | None = None

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Forward ``req`` to ``/generate`` and stream the answer through ``ctx``."""
        # The worker runs a handler's first step outside any task (its eager start);
        # aiohttp's timeouts need one: continue in the request's task.
        await asyncio.sleep(0)
        aiohttp = self.aiohttp
        flight = self.new_flight(ctx)
        rid = flight.rid
        body = {
            # JSON wants a list: the one conversion of the prompt on this path.
            "input_ids": req.input_ids.array.tolist(),
            "sampling_params": sampling_params(req.gconfig),
            "return_logprob": True,
            "stream": True,
            "rid": rid,
        }
        toks: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        finish: Any = None
        try:
            try:
                async with self.session().post(
                    self.url + "/generate", data=msgspec.json.encode(body), headers=JSON_HEADERS
                ) as resp:
                    await raise_for_status(resp, "SGLang /generate")
                    async for chunk in sse_events(resp.content):
                        meta = chunk.get("meta_info") or {}
                        if self._take(meta, toks, lps, vers, ctx):
                            flight.first = True
                        finish = meta.get("finish_reason")
                        if finish:
                            break
                        if ctx.interrupted and (not flight.interrupted or flight.blind_abort):
                            # Paused while the request was on its way: the server
                            # knows the rid now that it streams.
                            self._interrupt(flight)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                await self.server_gone(repr(exc))
            if not finish:
                await self.server_gone(f"the stream of {rid} ended without a finish_reason")
        except asyncio.CancelledError:
            if not finish:
                self.spawn(self._abort(rid))  # aborted or cancelled: stop the server's work
            raise
        finally:
            self.end_flight(rid)
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort":
            stop = "interrupt" if (flight.interrupted or ctx.interrupted) else "abort"
        elif kind == "length":
            stop = "length"
        else:
            stop = "stop"
        return response(req, toks, lps, vers, stop)

    def _take(
        self,
        meta: dict[str, Any],
        toks: list[int],
        lps: list[float],
        vers: list[int],
        ctx: GenerationContext,
    ) -> int:
        """Emit the tokens of one chunk that are new; returns how many."""
        items = meta.get("output_token_logprobs") or ()
        seen = len(toks)
        total = meta.get("completion_tokens")
        # Cumulative chunks repeat what came before: skip it. (Incremental ones hold
        # only the new tokens; with nothing seen yet both read the same.)
        new = items[seen:] if seen and total == len(items) else items
        version = self.version
        for item in new:
            lp, tok = item[0], int(item[1])
            lpf = float(lp) if lp is not None else 0.0
            toks.append(tok)
            lps.append(lpf)
            vers.append(version)
            ctx.emit(tok, lpf, version)
        return len(new)

    # -- interrupt / abort ------------------------------------------------------------------
    def _interrupt(self, flight: Flight) -> None:
        flight.blind_abort = not flight.first
        flight.interrupted = True
        self.spawn(self._abort(flight.rid))

    async def _abort(self, rid: str) -> None:
        try:
            await self.post_json("/abort_request", {"rid": rid})
        except Exception as exc:  # the server may be gone; the watchdog deals with it
            self._log_abort_failure(rid, exc)

    @staticmethod
    def _log_abort_failure(rid: str, exc: BaseException) -> None:
        log.debug("abort of %s failed: %r", rid, exc)

    def pause_generation(self) -> None:
        """The worker pauses: abort every request in flight (each returns its partial
        output, stop reason ``interrupt``)."""
        for flight in list(self.flights.values()):
            if not flight.interrupted:
                self._interrupt(flight)

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Write one verified version under :attr:`weights_dir` and have the server load
        it (called on the weight subscriber's thread while the worker is paused). Raises
        when the server does not confirm the load: the version then fails on this worker
        and the trainer is told why."""
        from transport.weights.disk import latest_version, save_weights

        root = self.weights_dir
        n = (latest_version(root) or 0) + 1
        path = save_weights(root, list(weights), n).parent
        self._link_config(path)
        self.run_in_loop(self.load_weights_from_disk(str(path)), self.reload_timeout + 10)

    def _link_config(self, path: Path) -> None:
        if self.model_config is None:
            return
        for f in self.model_config.iterdir():
            if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt"):
                dest = path / f.name
                if not dest.exists():
                    os.symlink(f.resolve(), dest)

    async def load_weights_from_disk(self, path: str, version: int | None = None) -> None:
        """Have the server load the model at ``path`` (``/update_weights_from_disk``);
        set :attr:`version` to ``version`` when given, once the server confirms.

        Raises
        ------
        transport.weights.WeightUpdateError
            The server answered without ``success``.
        """
        from transport.weights.errors import WeightUpdateError

        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = str(version)
        paused = await self._server_pause()
        try:
            try:
                data = await self.post_json(
                    "/update_weights_from_disk", body, timeout=self.reload_timeout
                )
            except RuntimeError as exc:
                raise WeightUpdateError(f"SGLang did not load {path}: {exc}") from exc
        finally:
            if paused:
                await self.post_json("/continue_generation", {})
        if not isinstance(data, dict) or not data.get("success"):
            msg = data.get("message") if isinstance(data, dict) else data
            raise WeightUpdateError(f"SGLang did not load {path}: {msg}")
        if version is not None:
            self.version = version

    async def _server_pause(self) -> bool:
        """``/pause_generation`` where the server has it (asked once)."""
        if self.has_pause is False:
            return False
        try:
            await self.post_json("/pause_generation", {})
        except RuntimeError as exc:
            if " 404" in str(exc) or " 405" in str(exc):
                self.has_pause = False
                return False
            raise
        self.has_pause = True
        return True


def factory(opts: dict[str, str]) -> SGLangEngine:
    """``--engine sglang``: an :class:`SGLangEngine` from the ``--engine-opt`` strings;
    probes ``/health`` first (``check=0`` skips it)."""
    engine: SGLangEngine = SGLangEngine.from_opts(
        opts, ("weights_dir", "model_config"), ("reload_timeout",)
    )
    return engine
