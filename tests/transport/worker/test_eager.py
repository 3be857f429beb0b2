"""The worker's eager start: a handler's first step runs in the receive callback, the
rest (if it awaits) in a task. Every way a handler can end must still give one correct
answer, free its slot and leave the worker serving."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from fastio import LLMRequest, LLMResponse
from fastio.fabric_msgs import ErrorCode
from tests.transport.conftest import WorkerProc, await_for, wait_for
from transport import ClientConfig, FabricClient, FabricController, RemoteError, RequestTimeout

# A long liveness (10 s): these tests count requests exactly, and a pong late on a loaded
# machine must not make a client take its worker for dead and re-send.
CFG = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=100, request_timeout=30, stream=False)

SYNC, RAISE_FIRST, AWAIT_ONCE, SLOW, FUTURE, RAISE_LATER = range(6)


def _echo(req: LLMRequest) -> LLMResponse:
    # Logprobs and versions as long as the tokens: the worker refuses anything else.
    n = len(req.input_ids) - 1
    return LLMResponse(
        output_tokens=req.input_ids[1:],
        output_logprobs=[0.0] * n,
        output_versions=[0] * n,
        stop_reason="stop",
    )


def modes_engine(opts: dict[str, str]) -> Any:
    """``--engine tests.transport.worker.test_eager:modes_engine``: ``input_ids[0]`` picks how
    the handler ends (the rest of the prompt is echoed back)."""

    def generate(req: LLMRequest, ctx: Any) -> Any:
        mode = req.input_ids[0]
        if mode == FUTURE:
            # Not a coroutine: an awaitable the worker must await in a task.
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(_echo(req))
            return fut
        return run(req, mode)

    async def run(req: LLMRequest, mode: int) -> LLMResponse:
        if mode == RAISE_FIRST:
            raise ValueError("refused before any await")
        if mode in (AWAIT_ONCE, RAISE_LATER):
            await asyncio.sleep(0)
            # Resumed inside the task that continues the eager start.
            assert asyncio.current_task() is not None
            if mode == RAISE_LATER:
                raise KeyError("failed after an await")
        elif mode == SLOW:
            await asyncio.sleep(60)
        return _echo(req)

    return generate


@pytest.fixture
def worker(spawn: Callable[..., WorkerProc]) -> WorkerProc:
    w: WorkerProc = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "tests.transport.worker.test_eager:modes_engine"
    )
    return w


def test_every_ending_of_an_eager_handler(worker: WorkerProc) -> None:
    async def main() -> None:
        async with FabricClient([worker.address], CFG) as client:
            for mode in (SYNC, AWAIT_ONCE, FUTURE):
                resp = await client.agenerate(LLMRequest(input_ids=[mode, 7, 8, 9]))
                assert resp.output_tokens == [7, 8, 9]
            for mode, code, text in (
                (RAISE_FIRST, ErrorCode.HANDLER_ERROR, "refused before any await"),
                (RAISE_LATER, ErrorCode.HANDLER_ERROR, "failed after an await"),
            ):
                with pytest.raises(RemoteError) as info:
                    await client.agenerate(LLMRequest(input_ids=[mode, 1]))
                assert info.value.code == code and text in str(info.value)
            # A mix in flight at once: each gets its own answer.
            mix = [SYNC, AWAIT_ONCE, FUTURE, RAISE_FIRST, RAISE_LATER] * 40
            outs = await asyncio.gather(
                *(client.agenerate(LLMRequest(input_ids=[m, i])) for i, m in enumerate(mix)),
                return_exceptions=True,
            )
            for i, (m, out) in enumerate(zip(mix, outs, strict=True)):
                if m in (RAISE_FIRST, RAISE_LATER):
                    assert isinstance(out, RemoteError)
                else:
                    assert isinstance(out, LLMResponse) and out.output_tokens == [i]

    asyncio.run(main())
    with FabricController([worker.address]) as ctl:
        # Every slot was given back, whatever the ending. (A slot is freed just after its
        # reply is queued, on the engine's thread: on a loaded machine the last one may
        # still be held when the socket thread answers, so ask until it is free.)
        def idle() -> Any:
            status = ctl.health(timeout=5)[worker.address]
            return status if status.running == 0 and status.waiting == 0 else None

        status = wait_for(idle, what="every slot given back")
    assert status.counters["errors"] == 2 + 80
    assert status.counters["completed"] == 3 + 120


def test_eager_handler_that_awaits_is_cancelled_on_the_worker(worker: WorkerProc) -> None:
    async def main() -> None:
        async with FabricClient([worker.address], CFG) as client:
            with pytest.raises(RequestTimeout):
                await client.agenerate(LLMRequest(input_ids=[SLOW, 1]), timeout=0.3)
            # The cancel reaches the task that continued the eager start.
            with FabricController([worker.address]) as ctl:
                await await_for(
                    lambda: ctl.health(timeout=5)[worker.address].counters["cancelled"] == 1,
                    what="the worker cancelled the slow handler",
                )
                assert ctl.health(timeout=5)[worker.address].running == 0
            resp = await client.agenerate(LLMRequest(input_ids=[SYNC, 5]))
            assert resp.output_tokens == [5]

    asyncio.run(main())


def test_cancel_in_the_same_batch_as_its_submit_frees_the_slot(worker: WorkerProc) -> None:
    """A Cancel that arrives with its Submit (one coalesced message) cancels the task
    before its first step: the worker must still free the slot and forget the id."""

    async def main() -> None:
        async with FabricClient([worker.address], CFG) as client:
            await client.agenerate(LLMRequest(input_ids=[SYNC, 1]))  # joined
            for _ in range(5):
                for mode in (SLOW, FUTURE, AWAIT_ONCE):
                    fut = client.agenerate(LLMRequest(input_ids=[mode, 2]))
                    fut.cancel()  # same loop iteration: both go in one burst
            with FabricController([worker.address]) as ctl:

                def settled() -> bool:
                    s = ctl.health(timeout=5)[worker.address]
                    return s.running == 0 and s.waiting == 0 and s.counters["cancelled"] >= 5

                await await_for(settled, what="every cancelled request freed its slot")
                # A pause waits for running handlers: it must not wait for a ghost.
                statuses = await ctl.apause(timeout=5)
                assert statuses[worker.address].paused and statuses[worker.address].running == 0
                await ctl.aresume()
            resp = await client.agenerate(LLMRequest(input_ids=[SYNC, 5]))
            assert resp.output_tokens == [5]

    asyncio.run(main())
