"""What ``agenerate`` returns works with every asyncio API, and every way of giving
up on it cancels the request on its worker (one reference worker per module)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from tests.transport.conftest import WorkerProc, await_for
from transport import ClientConfig, FabricClient, FabricController, GenerateFuture

CFG = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=10, request_timeout=30)


def req(ids: list[int], n: int = 3) -> LLMRequest:
    return LLMRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=n))


LONG = 100_000  # tokens: runs until cancelled


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    w = WorkerProc(
        ["--bind", "tcp://127.0.0.1:0", "--engine", "reference", "--token-interval", "0.01"]
    )
    try:
        yield w.wait_ready()
    finally:
        w.kill()


Scenario = Callable[[FabricClient, Callable[[], Awaitable[int]]], Awaitable[None]]


def run(address: str, scenario: Scenario) -> None:
    """Run ``scenario(client, cancelled)`` in a fresh loop; ``cancelled()`` counts the
    cancellations the worker has seen since the scenario started."""

    async def main() -> None:
        async with FabricClient([address], CFG) as client, FabricController([address]) as ctl:
            base = (await ctl.ahealth())[address].counters["cancelled"]

            async def cancelled() -> int:
                return int((await ctl.ahealth())[address].counters["cancelled"]) - base

            await scenario(client, cancelled)

    asyncio.run(main())


async def until_cancelled(cancelled: Callable[[], Awaitable[int]], n: int) -> None:
    for _ in range(1000):
        if await cancelled() >= n:
            return
        await asyncio.sleep(0.01)  # poll tick
    raise AssertionError(f"the worker did not see {n} cancellations")


def test_the_result_is_a_future_not_a_coroutine(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        fut = client.agenerate(req([1]))
        assert isinstance(fut, GenerateFuture) and asyncio.isfuture(fut)
        assert not asyncio.iscoroutine(fut)
        assert (await fut).output_len == 3

    run(worker, scenario)


def test_gather(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        outs = await asyncio.gather(*(client.agenerate(req([i])) for i in range(20)))
        assert [o.output_len for o in outs] == [3] * 20
        assert [o.input_tokens.tolist() for o in outs] == [[i] for i in range(20)]

    run(worker, scenario)


def test_wait(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        short = [client.agenerate(req([i])) for i in range(3)]
        long = client.agenerate(req([9], n=LONG))
        done, pending = await asyncio.wait(short, return_when=asyncio.FIRST_COMPLETED)
        assert done and all(f.result().output_len == 3 for f in done)
        await asyncio.wait(short)  # however long a loaded machine takes
        # The long one cannot end within the timeout (it runs until cancelled).
        done, pending = await asyncio.wait([*short, long], timeout=0.2)
        assert done == set(short) and pending == {long}
        long.cancel()
        await until_cancelled(cancelled, 1)

    run(worker, scenario)


def test_as_completed(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        futs = [client.agenerate(req([i], n=2 + i)) for i in range(4)]
        lens = [(await f).output_len for f in asyncio.as_completed(futs)]
        assert sorted(lens) == [2, 3, 4, 5]

    run(worker, scenario)


def test_wait_for(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        assert (await asyncio.wait_for(client.agenerate(req([1])), 10)).output_len == 3
        long = client.agenerate(req([2], n=LONG))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(long, 0.3)
        assert long.cancelled()
        await until_cancelled(cancelled, 1)

    run(worker, scenario)


def test_shield(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        inner = client.agenerate(req([5], n=30))
        outer = asyncio.shield(inner)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert (await inner).output_len == 30  # the shielded request went on
        assert await cancelled() == 0

    run(worker, scenario)


def test_create_task(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        task = asyncio.create_task(client.agenerate(req([1])))  # type: ignore[arg-type]
        assert isinstance(task, asyncio.Task)
        assert (await task).output_len == 3
        # Cancelled before its first step, and cancelled while it waits.
        early = asyncio.create_task(client.agenerate(req([2], n=LONG)))  # type: ignore[arg-type]
        early.cancel()
        late = asyncio.create_task(client.agenerate(req([3], n=LONG)))  # type: ignore[arg-type]
        await await_for(lambda: client.workers[0].in_flight == 1, what="late submitted")
        await asyncio.sleep(0)  # let the task reach its await
        late.cancel()
        for t in (early, late):
            with pytest.raises(asyncio.CancelledError):
                await t
        await until_cancelled(cancelled, 2)
        assert client.pending == 0

    run(worker, scenario)


def test_task_group_create_task(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(client.agenerate(req([i]))) for i in range(3)]  # type: ignore[arg-type]
        assert [t.result().output_len for t in tasks] == [3, 3, 3]

        async def fail() -> None:
            await asyncio.sleep(0.2)
            raise KeyError("sibling failed")

        with pytest.raises(Exception) as raised:  # an ExceptionGroup (3.11)
            async with asyncio.TaskGroup() as tg:
                long = tg.create_task(client.agenerate(req([4], n=LONG)))  # type: ignore[arg-type]
                tg.create_task(fail())
        assert "sibling failed" in repr(raised.value)
        assert long.cancelled()
        await until_cancelled(cancelled, 1)

    run(worker, scenario)


def test_asyncio_run(worker: str) -> None:
    client = FabricClient([worker], CFG)
    # No running loop: a coroutine that submits when it runs, and binds the client.
    coro = client.agenerate(req([1, 2], n=4))
    assert asyncio.iscoroutine(coro)
    try:
        assert asyncio.run(coro).output_len == 4  # type: ignore[arg-type]
    finally:
        asyncio.run(client.close())  # its loop is gone: close from another one


def test_another_loop_is_refused_at_the_await(worker: str) -> None:
    async def scenario(client: FabricClient, cancelled: Any) -> None:
        wrong = await asyncio.to_thread(asyncio.run, _call_in_loop(client))
        assert isinstance(wrong, RuntimeError) and "another event loop" in str(wrong)

    run(worker, scenario)


async def _call_in_loop(client: FabricClient) -> BaseException | None:
    try:
        await client.agenerate(req([1]))
    except RuntimeError as exc:
        return exc
    return None
