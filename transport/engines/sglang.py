"""``--engine sglang``: a worker in front of an SGLang server (``--engine-opt url=...``); how
it maps onto SGLang: ``docs/engines.md#the-sglang-and-vllm-bridges``."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from fastio import GenerationHyperparameters, LLMRequest
from transport.engines.flight import Flight, sampling_common
from transport.engines.http import BridgeOptions, HTTPBridge, ServerRejected
from transport.engines.sglang_disk import DONE, write_version
from transport.options import Seconds

__all__ = ["DONE", "SGLangEngine", "SGLangOptions", "factory", "sampling_params", "write_version"]

log = logging.getLogger("transport.engines")


class SGLangOptions(BridgeOptions):
    """The options of :class:`SGLangEngine`: those of :class:`BridgeOptions`, and these."""

    weights_dir: str | None = None
    """Where versions are written for the server (default: a temporary directory)."""
    model_config: str | None = None
    """A model directory whose non-weight files are linked into each version written."""
    reload_timeout: Seconds = 600.0
    """Seconds the server may take to load a version (or another worker to write it)."""
    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    """``in_place``/``retract``: requests kept in SGLang; ``abort``: each one interrupted."""


def sampling_params(g: GenerationHyperparameters) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``g`` (stop tokens kept in the output)."""
    sp = sampling_common(g, "max_new_tokens", "min_new_tokens")
    sp["no_stop_trim"] = True
    return sp


class SGLangEngine(HTTPBridge):
    """An :class:`~transport.Engine` in front of an SGLang server; ``url`` and the keywords
    of :class:`SGLangOptions`."""

    name = "SGLang"
    extra = "sglang"
    Options = SGLangOptions
    options: SGLangOptions

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.weights_dir = Path(
            self.options.weights_dir or tempfile.mkdtemp(prefix="fastio-sglang-")
        )
        self.has_pause: bool | None = None  # the server has /pause_generation (None: not asked)
        self._kept = False  # the server is paused in place (or retracted) by us
        self._flush_due = False  # a version was loaded without flushing the cache

    def probe(self, timeout: float = 5.0) -> None:
        """The server's weight version (``/model_info``), where it has one."""
        with contextlib.suppress(Exception):  # no /model_info: numbers still count
            info = self.fetch_json("/model_info", timeout)
            self.version = self.labels.start(info.get("weight_version"))

    async def close(self) -> None:
        """As the base; a server this bridge holds paused is resumed first (nothing else would)."""
        if self._kept:
            self._kept = False
            await self._post_quietly("/continue_generation", {}, 2.0)
        await super().close()

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

    def end(self, flight: Flight) -> None:
        """As the base; after the last one, the flush a load under frozen requests put off."""
        super().end(flight)
        self._flush_when_idle()

    def _flush_when_idle(self) -> None:
        if self._flush_due and not self.flights:
            self.spawn(self._flush(quiet=True))

    def take(self, chunk: Any, flight: Flight) -> int:
        """Emit a chunk's new ``[logprob, token_id, text]``, at its ``weight_version``."""
        meta = chunk.get("meta_info") or {}
        items = meta.get("output_token_logprobs") or ()
        seen = len(flight.toks)
        # Cumulative chunks repeat what came before: skip it. (Incremental ones hold
        # only the new tokens; with nothing seen yet both read the same.)
        new = items[seen:] if seen and meta.get("completion_tokens") == len(items) else items
        label = meta.get("weight_version")
        version = self.version if label is None else self.labels.version(label)
        for item in new:
            flight.add(int(item[1]), item[0], version)
        flight.finish = meta.get("finish_reason")
        return len(new)

    def abort(self, flight: Flight) -> None:
        """``POST /abort_request`` for ``flight``'s rid, in the background."""
        self.spawn(self._post_quietly("/abort_request", {"rid": flight.rid}))

    @property
    def pauses_in_place(self) -> bool:  # type: ignore[override]
        """This bridge paused the server with its requests frozen (their streams stay open)."""
        return self._kept

    def _keeps(self) -> bool:
        return self.options.pause_mode != "abort" and self.has_pause is not False

    async def pause_generation(self) -> None:  # type: ignore[override]
        """``/pause_generation`` in ``pause_mode`` where it keeps them, else interrupt each."""
        if self._keeps():
            self._hold(True)  # from the start: a chunk arriving meanwhile interrupts nothing
            try:
                if await self._server_pause(self.options.pause_mode):
                    return
            except Exception as exc:  # a pause must never fail the worker's pause
                log.warning("SGLang /pause_generation failed (%r): interrupting instead", exc)
            self._hold(False)
        super().pause_generation()

    async def continue_generation(self) -> None:
        """``/continue_generation`` for a server this bridge paused (the streams go on)."""
        if not self._kept:
            return
        if (exc := await self._post_quietly("/continue_generation", {})) is not None:
            log.error("SGLang /continue_generation failed: %r", exc)
        self._hold(False)  # not before: until the resume, a chunk must interrupt nothing
        self._flush_when_idle()

    def interrupt(self, flight: Flight) -> None:
        """As the base, except while the server holds the requests frozen."""
        if not self._kept:
            super().interrupt(flight)

    def _hold(self, kept: bool) -> None:
        # No stall timeout on the streams while held: a frozen stream is silent.
        self._kept = kept
        for flight in self.flights.values():
            with contextlib.suppress(AttributeError):
                proto = flight.response.connection.protocol
                proto.read_timeout = None if kept else self.options.stall_timeout
                proto.start_timeout()

    async def _server_pause(self, mode: str) -> bool:
        if self.has_pause is False:
            return False
        try:
            await self.post_json("/pause_generation", {"mode": mode})
        except ServerRejected as exc:
            if exc.status in (404, 405):
                self.has_pause = False
                return False
            raise
        self.has_pause = True
        return True

    async def _flush(self, quiet: bool = False) -> None:
        # SGLang answers 400 while it holds requests: asked again once none of ours is left.
        # A server that cannot be reached fails the load (its cache holds the old weights);
        # in the background (quiet), it is asked again when idle.
        if not self._flush_due:
            return
        try:
            await self.post_json("/flush_cache", {})
            self._flush_due = False
        except ServerRejected as exc:
            if exc.status in (404, 405):
                self._flush_due = False  # no such route: nothing to ask again
            log.debug("SGLang /flush_cache: %r", exc)
        except RuntimeError as exc:
            if not quiet:
                raise
            log.warning("SGLang /flush_cache failed (asked again when idle): %r", exc)

    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Write one verified version under :attr:`weights_dir` (once per directory) and have
        the server load it; raises when the server does not confirm the load."""
        if version is None:
            version = self.version + 1
        path = write_version(
            self.weights_dir, list(weights), version,
            timeout=self.options.reload_timeout, prepare=self._link_config,
        )  # fmt: skip
        self.run_in_loop(
            self.load_weights_from_disk(str(path), version), self.options.reload_timeout + 10
        )

    def _link_config(self, path: Path) -> None:
        if self.options.model_config is None:
            return
        for f in Path(self.options.model_config).iterdir():
            weights = f.suffix in (".safetensors", ".bin", ".pt")
            if f.is_file() and not weights and not (path / f.name).exists():
                os.symlink(f.resolve(), path / f.name)

    async def load_weights_from_disk(self, path: str, version: int | None = None) -> None:
        """Have the server load the model at ``path`` labelled ``str(version)`` and set
        :attr:`version` once it confirms; :class:`~transport.weights.WeightUpdateError` if not."""
        from transport.weights.errors import WeightUpdateError

        if version is not None:
            with contextlib.suppress(Exception):
                info = await self.get_json("/model_info")
                if info.get("model_path") == path and info.get("weight_version") == str(version):
                    self.version = version
                    return
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = str(version)
        keeps = self._keeps()
        if keeps:
            # SGLang flushes its cache after a load unless told not to, and a flush
            # fails (in 0.5 an assertion) while it holds requests.
            body["flush_cache"] = False
        paused, failed = False, True
        if not self._kept:
            paused = await self._server_pause(self.options.pause_mode if keeps else "abort")
        try:
            timeout = self.options.reload_timeout
            data = await self.post_json("/update_weights_from_disk", body, timeout=timeout)
            failed = False
        except RuntimeError as exc:
            raise WeightUpdateError(f"SGLang did not load {path}: {exc}") from exc
        finally:  # after a failed load, the load's error is the one to report
            if paused and (err := await self._post_quietly("/continue_generation", {})):
                if not failed:
                    raise err
                log.error("SGLang /continue_generation after a failed load failed: %r", err)
        if not isinstance(data, dict) or not data.get("success"):
            msg = data.get("message") if isinstance(data, dict) else data
            raise WeightUpdateError(f"SGLang did not load {path}: {msg}")
        if "flush_cache" in body:
            self._flush_due = True
            if not self.flights:
                try:
                    await self._flush()
                except RuntimeError as exc:  # the load's requests would read stale KV
                    raise WeightUpdateError(
                        f"SGLang loaded {path}, but /flush_cache failed: {exc}"
                    ) from exc
        if version is not None:
            self.version = version


#: ``--engine sglang``: an :class:`SGLangEngine` from the ``--engine-opt`` strings.
factory = SGLangEngine.from_opts
