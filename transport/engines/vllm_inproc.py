"""``--engine vllm --engine-opt model=PATH``: vLLM's ``AsyncLLM`` in the worker, the other keys
vLLM's engine arguments (:func:`engine_args`); ``docs/engines.md#vllm-in-the-worker``."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
from collections.abc import Iterable
from typing import Any

import msgspec

from fastio import LLMRequest, LLMResponse
from transport.engines.api import GenerationContext
from transport.engines.flight import Flights, sampling_common
from transport.engines.vllm_staging import PROTOCOL, UpdateState, WeightSync
from transport.options import parse_options

__all__ = ["PARENT_ENV", "AsyncLLMEngine", "die_with_parent", "engine_args", "factory"]

#: The worker's pid, in its environment: vLLM processes it starts die with their parent.
PARENT_ENV = "FASTIO_VLLM_DIE_WITH_PARENT"


_PRCTL: Any
try:  # resolved before any fork: a forked child only calls it
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: vLLM's own shutdown only
    _PRCTL = None


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it is already gone."""
    if _PRCTL is None:
        return
    _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def engine_args(opts: dict[str, str]) -> Any:
    """vLLM's ``AsyncEngineArgs`` from ``--engine-opt`` strings, through vLLM's own CLI
    parser (``max_model_len=1024`` is ``--max-model-len 1024``; booleans take 1/0,
    true/false); ``ValueError`` naming an unknown key or a bad value."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
    actions = {a.dest: a for a in parser._actions}
    opts = {"weight_transfer_config": '{"backend": "fastio"}', **opts}
    argv: list[str] = []
    for key, value in opts.items():
        action = actions.get(dest := key.replace("-", "_"))
        if action is None or not action.option_strings:
            raise ValueError(f"unknown vLLM engine option {key!r} (vLLM's engine arguments)")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            one = msgspec.defstruct("Flag", [(dest, bool, True)], kw_only=True)
            on = getattr(parse_options({dest: value}, one, "vLLM engine option"), dest)
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if on else "--no-" + flag[2:])
            elif on:
                argv.append(flag)
        else:
            argv += [flag, value]
    try:
        ns = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"bad vLLM engine option: {exc}") from None
    return AsyncEngineArgs.from_cli_args(ns)


class AsyncLLMEngine(Flights):
    """A :class:`~transport.Engine` running vLLM's ``AsyncLLM`` in the worker; ``args``:
    vLLM's ``AsyncEngineArgs``."""

    def __init__(self, args: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        super().__init__()
        # vLLM's processes (engine core, its workers) die with this one: forked ones
        # through this hook, spawned ones through the plugin's register().
        os.environ[PARENT_ENV] = str(os.getpid())
        os.register_at_fork(after_in_child=die_with_parent)
        self.llm = AsyncLLM.from_engine_args(args)
        self.vocab_size: int | None = self.llm.model_config.get_vocab_size()
        self.state = UpdateState(_llm_sync(self.llm))
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pauses_in_place(self) -> bool:
        """A pause froze vLLM's requests in place (they go on after the resume)."""
        return self.state.kept

    async def start(self, worker: Any) -> None:
        """Keep the worker's loop (weights are driven from the subscriber's thread)."""
        self._loop = asyncio.get_running_loop()
        self.version = self.labels.start(await self.llm.get_weight_version())

    async def close(self) -> None:
        """Shut vLLM's engine down (its processes exit)."""
        self.llm.shutdown()

    async def generate(self, req: LLMRequest, ctx: GenerationContext) -> LLMResponse:
        """Generate through ``AsyncLLM.generate``, streamed token by token if the client streams."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(f"n_samples={g.n_samples}: one sample per request; send n requests")
        params = SamplingParams(
            **sampling_common(g, "max_tokens", "min_tokens"),
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA
            if getattr(ctx, "stream", True)
            else RequestOutputKind.FINAL_ONLY,
        )
        # vLLM's prompt is a list: the one conversion of the prompt on this path.
        prompt = TokensPrompt(prompt_token_ids=req.input_ids.array.tolist())
        flight = self.begin(ctx)
        try:
            async for out in self.llm.generate(prompt, params, flight.rid):
                version = self.version
                for c in out.outputs:
                    lps = c.logprobs or ()
                    for k, tok in enumerate(c.token_ids):
                        lp = lps[k][tok].logprob if k < len(lps) else None
                        flight.add(tok, lp, version)
                    self.got(flight, len(c.token_ids))
                    flight.finish = c.finish_reason or flight.finish
                    flight.spans = c.weight_versions or flight.spans
        finally:
            self.end(flight)
        stop = {"length": "length", "abort": "abort"}.get(str(flight.finish), "stop")
        return flight.result(req, stop, self.labels)

    async def pause_generation(self) -> None:
        """Freeze vLLM's requests in place (``mode="keep"``)."""
        await self.state.pause()

    async def continue_generation(self) -> None:
        """Resume vLLM, unless a failed load left its weights mixed."""
        await self.state.resume()

    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Stage one verified version in shared memory and load it into vLLM's workers."""
        if self._loop is None:
            raise RuntimeError("the vLLM engine has not started")
        v = self.version + 1 if version is None else version
        loop, shm_dir = self._loop, os.environ.get("FASTIO_SHM_DIR", "/dev/shm")
        self.state.load_pairs(
            weights, v, shm_dir, lambda c: asyncio.run_coroutine_threadsafe(c, loop).result()
        )


def _llm_sync(llm: Any) -> WeightSync:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    async def label() -> str:
        return str(await llm.get_weight_version())

    return WeightSync(
        init_transfer=lambda: llm.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info={"protocol": PROTOCOL})
        ),
        pause_in_place=lambda: llm.pause_generation(mode="keep", clear_cache=False),
        resume=llm.resume_generation,
        start_update=llm.start_weight_update,
        update=lambda info: llm.update_weights(WeightTransferUpdateRequest(update_info=info)),
        finish_update=llm.finish_weight_update,
        label=label,
    )


def factory(opts: dict[str, str]) -> AsyncLLMEngine:
    """``--engine vllm --engine-opt model=PATH ...``: vLLM in this worker."""
    if not opts.get("model"):
        raise ValueError("vLLM in the worker needs --engine-opt model=PATH")
    # The worker's stdout carries its ready line: vLLM logs to stderr (before its import).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return AsyncLLMEngine(engine_args(opts))
