"""A fake SGLang server: the native HTTP API as SGLang's public docs describe it.

Endpoints: ``POST /generate`` (``input_ids``, ``sampling_params``, ``return_logprob``,
``stream``, ``rid``; streamed as ``data: {...}`` server-sent events ending ``data:
[DONE]``; ``meta_info`` with ``id``, ``finish_reason`` (``None`` until the end, then
``{"type": "length" | "stop" | "abort", ...}``), ``prompt_tokens``,
``completion_tokens``, ``output_token_logprobs`` as ``[logprob, token_id, None]``
entries, cumulative, or incremental with ``--incremental``), ``POST /abort_request``
(``rid``, or ``abort_all``), ``POST /pause_generation`` (``mode``: ``abort`` aborts
what runs; others hold it) and ``/continue_generation``, ``POST
/update_weights_from_disk`` (``model_path``: the weights seed becomes a hash of its
safetensors files, so the output changes), ``GET /health``; ``GET /fake/stats`` for the
tests. Run: ``python -m tests.transport.fakes.sglang_server [--port 0] [options]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from tests.transport.fakes.common import (
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
        self.running: dict[str, asyncio.Event] = {}  # rid -> abort event
        self.resumed = asyncio.Event()
        self.resumed.set()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_post("/update_weights_from_disk", self.reload)

    def n_running(self) -> int:
        return len(self.running)

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
        body = await request.json() if request.can_read_body else {}
        self.count("pauses")
        if body.get("mode", "abort") == "abort":
            for ev in self.running.values():
                ev.set()
        self.resumed.clear()
        return web.json_response({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.count("continues")
        self.resumed.set()
        return web.json_response({"success": True})

    async def reload(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            seed = seed_of_path(str(body["model_path"]))
        except (KeyError, OSError) as exc:
            return web.json_response(
                {"success": False, "message": f"cannot load: {exc}"}, status=400
            )
        self.seed = seed
        self.weight_version = str(body.get("weight_version", self.weight_version))
        self.count("reloads")
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
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
        if self.register_delay:
            # Queued before the scheduler knows the rid: an abort now finds nothing.
            await asyncio.sleep(self.register_delay)
        abort = asyncio.Event()
        self.running[rid] = abort
        resp: web.StreamResponse | None = None
        if stream:
            resp = await open_stream(request)
        try:
            out, lps, finish = [], [], None
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
                    # Held by a pause (in place) until continue or an abort.
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
            return await end_stream(resp)
        finally:
            self.running.pop(rid, None)

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
    args = parse_args(argv)
    serve(lambda: SGLang(args).app(), args.port)


if __name__ == "__main__":
    main()
