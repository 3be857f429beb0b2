"""A fake vLLM OpenAI-compatible server, as vLLM's public docs describe it.

Endpoints: ``POST /v1/completions`` (``model``, ``prompt`` as token ids, ``max_tokens``,
``min_tokens``, ``stop_token_ids``, ``logprobs``, ``return_tokens_as_token_ids``,
``stream``; streamed as ``data: {...}`` chunks of ``text_completion`` objects, one
token each, ending ``data: [DONE]``; ``choices[0].logprobs`` has ``tokens`` (``token_id:N``
with ``return_tokens_as_token_ids``), ``token_logprobs``, ``top_logprobs``,
``text_offset``; ``finish_reason`` ``null`` until ``length`` or ``stop``), ``GET
/v1/models``, ``GET /health``; a client that closes its stream aborts its request
(counted as ``disconnected``). A ``stop_token_ids`` entry outside the vocabulary is
answered as vLLM 0.32 does: HTTP 200, then one ``data: {"error": {"message": ...,
"code": 400}}`` event and ``[DONE]``. Idle kept connections close after ``--keepalive`` s
(uvicorn's ``timeout_keep_alive``, 5 s, under vLLM); ``--drop-reused`` closes, once per
time, a completion that arrived on a reused connection unanswered (the race of a
server closing an idle connection as it is reused). No weight reload endpoint and no
RL routes (the bridge falls back to ``/v1/completions``). ``GET /fake/stats`` for the
tests. Run: ``python -m tests.transport.fakes.vllm_server [--port 0] [options]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aiohttp import web

from tests.transport.fakes.common import (
    VOCAB,
    FakeState,
    context_hash,
    end_stream,
    open_stream,
    parse_args,
    serve,
    sse,
)


class VLLM(FakeState):
    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.model: str = args.model
        self.running = 0
        self.drop_reused: bool = getattr(args, "drop_reused", False)
        self.seen_transports: set[int] = set()

    def routes(self, app: web.Application) -> None:
        app.middlewares.append(self._track)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)

    def n_running(self) -> int:
        return self.running

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "vllm"}]}
        )

    def _choice(self, tok: int, lp: float, as_ids: bool, finish: Any) -> dict[str, Any]:
        name = f"token_id:{tok}" if as_ids else f"<{tok}>"
        return {
            "index": 0,
            "text": f"<{tok}>",
            "logprobs": {
                "text_offset": [0],
                "token_logprobs": [lp],
                "tokens": [name],
                "top_logprobs": [{name: lp}],
            },
            "finish_reason": finish,
            "stop_reason": None,
        }

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Mark a request that arrived on a connection an earlier one used."""
        key = id(request.transport)
        request["reused"] = key in self.seen_transports
        self.seen_transports.add(key)
        return await handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await self.fault_point()
        body = await request.json()
        if self.drop_reused and request.get("reused"):
            # The race of a server closing an idle kept connection just as the client
            # reuses it: the request is read, never answered, the connection closes.
            self.drop_reused = False
            self.count("dropped")
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if body.get("model") != self.model:
            return web.json_response(
                {"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                 "type": "NotFoundError", "code": 404}, status=404,
            )  # fmt: skip
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return web.json_response(
                {"object": "error", "message": "token ids only here"}, status=400
            )
        self.count("completions")
        bad = [t for t in body.get("stop_token_ids") or () if not 0 <= int(t) < VOCAB]
        if bad and body.get("stream"):
            self.count("rejected")
            resp = await open_stream(request)
            msg = (f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                   f"Vocabulary size: {VOCAB}")  # fmt: skip
            await resp.write(sse({"error": {"message": msg, "type": "BadRequestError",
                                            "param": "stop_token_ids", "code": 400}}))  # fmt: skip
            return await end_stream(resp)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        max_tokens = int(body.get("max_tokens") or 16)
        min_tokens = int(body.get("min_tokens") or 0)
        stop = set(body.get("stop_token_ids") or ())
        cid = f"cmpl-{self.stats['completions']}"
        created = int(time.time())
        stream = bool(body.get("stream"))
        self.running += 1
        try:
            resp: web.StreamResponse | None = None
            if stream:
                resp = await open_stream(request)
            h = context_hash(prompt)
            choices: list[dict[str, Any]] = []
            finish = None
            n = 0
            while finish is None:
                await self.fault_point()
                tok, lp, h = self.sample(h, stop, n, min_tokens)
                n += 1
                if tok in stop:
                    finish = "stop"
                elif n >= max_tokens:
                    finish = "length"
                choice = self._choice(tok, lp, as_ids, finish)
                if resp is None:
                    choices.append(choice)
                else:
                    chunk = {"id": cid, "object": "text_completion", "created": created,
                             "model": self.model, "choices": [choice]}  # fmt: skip
                    try:
                        await resp.write(sse(chunk))
                    except (ConnectionError, RuntimeError):
                        self.count("disconnected")  # vLLM aborts the request
                        return resp
                    if self.token_interval:
                        await asyncio.sleep(self.token_interval)  # the model's step time
                    if request.transport is None or request.transport.is_closing():
                        self.count("disconnected")
                        return resp
            if resp is None:
                merged = {
                    "index": 0, "text": "".join(c["text"] for c in choices),
                    "logprobs": {k: [x for c in choices for x in c["logprobs"][k]]
                                 for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")},
                    "finish_reason": finish, "stop_reason": None,
                }  # fmt: skip
                return web.json_response(
                    {"id": cid, "object": "text_completion", "created": created,
                     "model": self.model, "choices": [merged],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                               "total_tokens": len(prompt) + n}}
                )  # fmt: skip
            return await end_stream(resp)
        finally:
            self.running -= 1


def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--keepalive", type=float, default=5.0)
    own.add_argument("--drop-reused", action="store_true", help="close a reused connection once")
    mine, rest = own.parse_known_args(argv)
    args = parse_args(rest)
    args.drop_reused = mine.drop_reused
    serve(lambda: VLLM(args).app(), args.port, keepalive=mine.keepalive)


if __name__ == "__main__":
    main()
