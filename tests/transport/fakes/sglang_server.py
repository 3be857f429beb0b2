"""A fake SGLang server: the native HTTP API as SGLang's public docs (0.5) describe it.

Sources, cited at each route below: the "SGLang for RL Systems" page
(docs/advanced_features/sglang_for_rl.md: ``/pause_generation`` modes,
``/continue_generation``, ``/update_weights_from_disk`` and its fields and answer),
``io_struct.py`` (``PauseGenerationReqInput``'s docstring: what each mode keeps, that a
cache flush fails while requests are held in place), ``http_server.py`` (the stream's
error event, ``/flush_cache``, ``/model_info``) and ``tokenizer_manager.py`` (the
``meta_info`` of each chunk, requests held while paused, a load while not paused waiting
for the requests to end, the input-id check).

Endpoints: ``POST /generate`` (``input_ids``, ``sampling_params``, ``return_logprob``,
``stream``, ``rid``; streamed as ``data: {...}`` server-sent events ending ``data:
[DONE]``; ``meta_info`` with ``id``, ``finish_reason`` (``None`` until the end, then
``{"type": "length" | "stop" | "abort", ...}``), ``prompt_tokens``,
``completion_tokens``, ``weight_version``, ``output_token_logprobs`` as ``[logprob,
token_id, None]`` entries, cumulative, or incremental with ``--incremental``), ``POST
/abort_request`` (``rid``, or ``abort_all``), ``POST /pause_generation`` (``mode``) and
``/continue_generation``, ``POST /update_weights_from_disk`` (``model_path``: the weights
seed becomes a hash of its safetensors files, so the output changes; ``weight_version``,
``flush_cache``, ``abort_all_requests``), ``/flush_cache``, ``GET /model_info``, ``GET
/health``; ``GET /fake/stats`` for the tests. Idle keep-alive connections are closed
after ``--keepalive`` s (uvicorn's ``timeout_keep_alive``, 5 s, under SGLang). Run:
``python -m tests.transport.fakes.sglang_server [--port 0] [options]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from tests.transport.fakes.common import (
    VOCAB,
    FakeState,
    context_hash,
    end_stream,
    open_stream,
    parse_args,
    seed_of_path,
    serve,
    sse,
)


class SGLang(FakeState):
    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.incremental: bool = args.incremental
        self.register_delay: float = args.register_delay
        self.model_path = "fake-model"
        self.running: dict[str, asyncio.Event] = {}  # rid -> abort event
        self.idle = asyncio.Event()  # no request in the server
        self.idle.set()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.retracted: set[str] = set()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_post("/update_weights_from_disk", self.reload)
        app.router.add_route("*", "/flush_cache", self.flush)
        app.router.add_get("/model_info", self.model_info)

    def n_running(self) -> int:
        return len(self.running)

    def _enter(self, rid: str, abort: asyncio.Event) -> None:
        self.running[rid] = abort
        self.idle.clear()

    def _leave(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.retracted.discard(rid)
        if not self.running:
            self.idle.set()

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.count("abort_requests")
        if body.get("abort_all"):
            for ev in self.running.values():
                ev.set()
        elif body.get("rid") in self.running:
            self.running[body["rid"]].set()
        return web.Response(text="")

    async def pause(self, request: web.Request) -> web.Response:
        # sglang_for_rl.md "Pause Generation": mode abort (default) returns every
        # request at once, aborted; retract moves the running ones back to the waiting
        # queue (their KV recomputed after the resume); in_place leaves them as they
        # are, KV kept. io_struct.PauseGenerationReqInput says the same.
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": {"message": f"Invalid mode: {mode!r}"}}, status=400)
        self.count("pauses")
        self.count(f"pauses_{mode}")
        if mode == "abort":
            for ev in self.running.values():
                ev.set()
        elif mode == "retract":
            self.retracted.update(self.running)
        self.resumed.clear()
        return web.json_response({"message": "Generation paused successfully."})

    async def resume(self, request: web.Request) -> web.Response:
        self.count("continues")
        # A retracted request is prefilled again (its KV recomputed) when it resumes.
        self.count("prefills", len(self.retracted))
        self.retracted.clear()
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully."})

    def _pending(self) -> bool:
        return any(not ev.is_set() for ev in self.running.values())

    async def flush(self, request: web.Request) -> web.Response:
        # http_server.py /flush_cache: 200 once flushed, 400 while requests are pending
        # (the scheduler flushes only when it holds none).
        if self._pending():
            self.count("flush_refused")
            return web.Response(
                text="Cache not flushed because there are pending requests.", status=400
            )
        self.count("flushes")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")

    async def model_info(self, request: web.Request) -> web.Response:
        # http_server.py /model_info: model_path and the current weight_version label.
        return web.json_response(
            {
                "model_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }
        )

    async def reload(self, request: web.Request) -> web.Response:
        # sglang_for_rl.md "Update Weights from Disk": model_path, weight_version (a
        # label the server then reports), flush_cache (default true),
        # abort_all_requests; answer {success, message, num_paused_requests}.
        body = await request.json()
        if body.get("abort_all_requests"):
            for ev in self.running.values():
                ev.set()
        if self.resumed.is_set():
            # tokenizer_manager.update_weights_from_disk: not paused, the load takes the
            # model-update writer lock, so it waits for the requests in flight to end.
            await self.idle.wait()
        try:
            seed = seed_of_path(str(body["model_path"]))
        except (KeyError, OSError) as exc:
            return web.json_response(
                {"success": False, "message": f"cannot load: {exc}"}, status=400
            )
        if body.get("flush_cache", True) and self._pending():
            # The scheduler flushes the cache after a load; with requests held (a pause
            # in place) the flush fails (io_struct: "flush_cache will fail if there
            # are any requests in the running_batch"; SGLang 0.5 asserts on it).
            self.count("flush_failures")
            return web.json_response(
                {"success": False, "message": "Cache flush failed after updating weights"},
                status=400,
            )
        self.seed = seed
        self.model_path = str(body["model_path"])
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self.count("reloads")
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": len(self.running) if not self.resumed.is_set() else 0,
            }
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await self.fault_point()
        body = await request.json()
        ids = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        rid = str(body.get("rid") or f"r{len(self.running)}")
        stream = bool(body.get("stream"))
        self.count("generate")
        resp: web.StreamResponse | None = None
        if stream:  # http_server.py: a StreamingResponse, its headers sent at once
            resp = await open_stream(request)
        if self.register_delay:
            # Queued before the scheduler knows the rid: an abort now finds nothing.
            await asyncio.sleep(self.register_delay)
        # tokenizer_manager.generate_request: a request waits while the server is paused.
        await self.resumed.wait()
        if any(t >= VOCAB for t in ids):
            # tokenizer_manager._validate_input_ids_in_vocab raises ValueError; the
            # stream answers it as an error event, then [DONE] (http_server.py), a plain
            # request with 400 and the same {"error": {"message": ...}}.
            self.count("rejected")
            err = {
                "error": {
                    "message": f"The input_ids {ids} contains values greater than the "
                    f"vocab size ({VOCAB})."
                }
            }
            if resp is None:
                return web.json_response(err, status=400)
            await resp.write(sse(err))
            await end_stream(resp)
            return resp
        abort = asyncio.Event()
        self._enter(rid, abort)
        self.count("prefills")
        finish: Any = None
        try:
            out: list[int] = []
            lps: list[float] = []
            h = context_hash(ids)
            stop = set(sp.get("stop_token_ids") or ())
            max_new = int(sp.get("max_new_tokens", 128))
            min_new = int(sp.get("min_new_tokens", 0))
            sent = 0
            while finish is None:
                if len(out) >= max_new:
                    finish = {"type": "length", "length": len(out)}
                    break
                if not self.resumed.is_set() and not abort.is_set():
                    # Held by a pause (in place or retracted) until continue or an abort.
                    waits = [asyncio.ensure_future(e.wait()) for e in (self.resumed, abort)]
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    for w in waits:
                        w.cancel()
                if abort.is_set():
                    finish = {"type": "abort", "message": "Abort before the request finished."}
                    break
                await self.fault_point()
                tok, lp, h = self.sample(h, stop, len(out), min_new)
                out.append(tok)
                lps.append(lp)
                if tok in stop:
                    finish = {"type": "stop", "matched": tok}
                    break
                if stream and resp is not None:
                    await resp.write(self._chunk(rid, ids, out, lps, sent, None))
                    sent = len(out)
                if self.token_interval:
                    with contextlib.suppress(TimeoutError):  # a step, cut short by an abort
                        await asyncio.wait_for(abort.wait(), self.token_interval)
            if finish["type"] == "abort":
                self.count("aborted")
            if resp is None:
                return web.json_response(
                    json.loads(self._chunk(rid, ids, out, lps, 0, finish, raw=True))
                )
            await resp.write(self._chunk(rid, ids, out, lps, sent, finish))
            await end_stream(resp)
            return resp
        except ConnectionResetError:
            # The client left (a cancel, a closed stream): SGLang aborts such a request
            # (http_server.py: the StreamingResponse's background abort task).
            if finish is None or finish["type"] != "abort":
                self.count("aborted")
            raise
        finally:
            self._leave(rid)

    def _chunk(
        self,
        rid: str,
        ids: list[int],
        out: list[int],
        lps: list[float],
        sent: int,
        finish: Any,
        raw: bool = False,
    ) -> bytes:
        # tokenizer_manager._handle_batch_output: meta_info carries the server's
        # weight_version label at the time the chunk is sent.
        start = sent if self.incremental else 0
        body = {
            "text": "",
            "output_ids": out[start:],
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(lps[start:], out[start:], strict=True)
                ],
            },
        }
        return json.dumps(body).encode() if raw else sse(body)


def main(argv: list[str] | None = None) -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--keepalive", type=float, default=5.0,
        help="seconds an idle keep-alive connection stays open (uvicorn's default: 5)",
    )  # fmt: skip
    own, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    serve(lambda: SGLang(args).app(), args.port, keepalive=own.keepalive)


if __name__ == "__main__":
    main()
