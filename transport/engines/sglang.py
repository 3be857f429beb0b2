"""``--engine sglang``: a worker fronting a running SGLang server over its native HTTP API.

::

    python -m sglang.launch_server --model-path MODEL --port 30000 &
    fastio-worker --bind tcp://0.0.0.0:5555 --engine sglang \\
        --engine-opt url=http://127.0.0.1:30000

A request is ``POST /generate`` (streamed, with logprobs, under a rid of the bridge's
own); pause, abort and cancel are ``POST /abort_request`` for the rid. Each verified
weight version is written as safetensors and loaded with ``/update_weights_from_disk``
(:meth:`SGLangEngine.load_weights`); options: :class:`SGLangOptions`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastio import GenerationHyperparameters, LLMRequest
from transport.engines.http import BridgeOptions, Flight, HTTPBridge, Seconds, sampling_common

__all__ = ["SGLangEngine", "SGLangOptions", "factory", "sampling_params"]

log = logging.getLogger("transport.engines")


class SGLangOptions(BridgeOptions):
    """The options of :class:`SGLangEngine`: those of :class:`BridgeOptions`, and

    Attributes
    ----------
    weights_dir:
        Where received versions are written (default: a new temporary directory); the
        server must be able to read it.
    model_config:
        A model directory whose non-weight files (``config.json``, tokenizer files) are
        linked into each version directory written.
    reload_timeout:
        Seconds the server may take to load a version.
    """

    weights_dir: str | None = None
    model_config: str | None = None
    reload_timeout: Seconds = 600.0


def sampling_params(g: GenerationHyperparameters) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``g`` (stop tokens kept in the output, as the
    fabric's engines do)."""
    sp = sampling_common(g, "max_new_tokens", "min_new_tokens")
    sp["no_stop_trim"] = True
    return sp


class SGLangEngine(HTTPBridge):
    """An :class:`~transport.Engine` that forwards to an SGLang server (module docstring);
    ``url`` and the keywords of :class:`SGLangOptions`."""

    name = "SGLang"
    extra = "sglang"
    Options = SGLangOptions
    options: SGLangOptions

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.weights_dir = Path(
            self.options.weights_dir or tempfile.mkdtemp(prefix="fastio-sglang-")
        )
        #: Whether the server has /pause_generation (None: not asked yet).
        self.has_pause: bool | None = None

    async def request(self, req: LLMRequest, rid: str) -> tuple[str, Any]:
        """``/generate``, streamed, with the sampled tokens' logprobs."""
        return "/generate", {
            # JSON wants a list: the one conversion of the prompt on this path.
            "input_ids": req.input_ids.array.tolist(),
            "sampling_params": sampling_params(req.gconfig),
            "return_logprob": True,
            "stream": True,
            "rid": rid,
        }

    def take(self, chunk: Any, flight: Flight) -> int:
        """Emit the tokens of one chunk that are new (``[logprob, token_id, text]``)."""
        meta = chunk.get("meta_info") or {}
        items = meta.get("output_token_logprobs") or ()
        seen = len(flight.toks)
        # Cumulative chunks repeat what came before: skip it. (Incremental ones hold
        # only the new tokens; with nothing seen yet both read the same.)
        new = items[seen:] if seen and meta.get("completion_tokens") == len(items) else items
        version = self.version
        for item in new:
            flight.add(int(item[1]), item[0], version)
        flight.finish = meta.get("finish_reason")
        return len(new)

    def abort(self, flight: Flight) -> None:
        """``POST /abort_request`` for ``flight``'s rid, in the background."""
        self.spawn(self._abort(flight.rid))

    async def _abort(self, rid: str) -> None:
        try:
            await self.post_json("/abort_request", {"rid": rid})
        except Exception as exc:  # the server may be gone; the watchdog deals with it
            log.debug("abort of %s failed: %r", rid, exc)

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
        self.run_in_loop(self.load_weights_from_disk(str(path)), self.options.reload_timeout + 10)

    def _link_config(self, path: Path) -> None:
        if self.options.model_config is None:
            return
        for f in Path(self.options.model_config).iterdir():
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
        paused, failed = await self._server_pause(), True
        try:
            timeout = self.options.reload_timeout
            data = await self.post_json("/update_weights_from_disk", body, timeout=timeout)
            failed = False
        except RuntimeError as exc:
            raise WeightUpdateError(f"SGLang did not load {path}: {exc}") from exc
        finally:
            await self._server_continue(paused, failed=failed)
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

    async def _server_continue(self, paused: bool, *, failed: bool) -> None:
        """``/continue_generation`` after a paused load. After a failed load its own
        failure is logged, never raised: the load's error is the one to report."""
        if not paused:
            return
        try:
            await self.post_json("/continue_generation", {})
        except Exception as exc:
            if not failed:
                raise
            log.error("SGLang /continue_generation after a failed load failed: %r", exc)


#: ``--engine sglang``: an :class:`SGLangEngine` from the ``--engine-opt`` strings.
factory = SGLangEngine.from_opts
