"""The worker's request table (:class:`transport.worker.requests.Requests`) without a
socket or a thread: admission, one answer per submission, slots freed on every ending."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from fastio import LLMRequest, LLMResponse
from fastio import fabric_msgs as fm
from transport.worker.config import WorkerConfig
from transport.worker.counters import Shard
from transport.worker.requests import PauseGate, Requests

PEER = b"client"


def _answer(req: LLMRequest) -> LLMResponse:
    n = len(req.input_ids)
    return LLMResponse(
        output_tokens=req.input_ids, output_logprobs=[0.0] * n, output_versions=[3] * n,
        stop_reason="stop",
    )  # fmt: skip


def _table(handler: Any, **config: Any) -> tuple[Requests, list[Any], Shard, PauseGate]:
    sent: list[Any] = []
    gate = PauseGate(config.pop("max_concurrency", 4), Shard())
    send = lambda peer, msg: sent.append((peer, msg))  # noqa: E731
    engine = types.SimpleNamespace(version=3)  # no vocab_size: no token check
    table = Requests(handler, engine, WorkerConfig(**config), gate, send)
    return table, sent, gate.counts, gate


def _submit(id: int, ids: list[int] | None = None, **kw: Any) -> fm.Submit:
    return fm.Submit(id=id, request=LLMRequest(input_ids=[1, 2] if ids is None else ids), **kw)


def test_an_eager_answer_needs_no_task_and_a_resend_is_answered_once() -> None:
    async def main() -> None:
        calls = []

        async def handler(req: LLMRequest, ctx: Any) -> LLMResponse:
            calls.append(ctx.version)
            return _answer(req)

        table, sent, counts, gate = _table(handler)
        table.submit(PEER, _submit(1))
        assert not table.held and gate.running == 0  # answered in the Submit's callback
        ((peer, res),) = sent
        assert peer == PEER and type(res) is fm.Result and res.id == 1 and calls == [3]
        assert counts.counts["completed"] == 1 and counts.outcomes["ok"] == 1

        gate_open = asyncio.Event()

        async def slow(req: LLMRequest, ctx: Any) -> LLMResponse:
            await gate_open.wait()
            return _answer(req)

        table, sent, counts, gate = _table(slow)
        table.submit(PEER, _submit(2))
        table.submit(PEER, _submit(2))  # a re-send while it runs
        assert len(table.held) == 1 and counts.counts["duplicates"] == 1
        gate_open.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert [type(m) for _, m in sent] == [fm.Result] and not table.held
        assert gate.running == 0

    asyncio.run(main())


def test_refusals_name_their_reason_and_hold_nothing() -> None:
    async def main() -> None:
        async def never(req: LLMRequest, ctx: Any) -> LLMResponse:
            await asyncio.Event().wait()
            raise AssertionError

        table, sent, counts, _ = _table(never, max_pending=1)
        table.submit(PEER, _submit(-1))
        table.submit(PEER, _submit(5, ids=[]))
        table.submit(PEER, _submit(6))
        table.submit(PEER, _submit(7))  # one held already: over max_pending
        codes = [(m.id, fm.ErrorCode(m.code)) for _, m in sent]
        assert codes == [
            (-1, fm.ErrorCode.BAD_REQUEST),
            (5, fm.ErrorCode.BAD_REQUEST),
            (7, fm.ErrorCode.OVERLOADED),
        ]
        assert counts.counts["bad_messages"] == 2 and counts.counts["overloaded"] == 1
        assert list(table.held) == [(PEER, 6)]
        assert table.forget(PEER) == [6]
        await asyncio.wait(table.tasks(), timeout=5)
        assert not table.held and len(sent) == 3  # forgotten: no answer

    asyncio.run(main())


def test_cancel_abort_and_forget_free_every_slot() -> None:
    async def main() -> None:
        async def forever(req: LLMRequest, ctx: Any) -> LLMResponse:
            await asyncio.Event().wait()
            raise AssertionError

        table, sent, counts, gate = _table(forever, max_concurrency=1)
        for id in (1, 2, 3):  # 1 runs, 2 and 3 wait for the one slot
            table.submit(PEER, _submit(id))
        table.submit(b"other", _submit(4))
        await asyncio.sleep(0)
        assert gate.running == 1 and len(table.held) == 4
        table.cancel(PEER, 1)  # running: cancelled, no answer
        await asyncio.sleep(0)
        assert table.abort_all() == 3  # 2 and 3 (waiting) and the other peer's 4
        tasks = table.tasks()
        await asyncio.wait(tasks, timeout=5)
        assert not table.held and gate.running == 0
        aborted = sorted(m.id for _, m in sent if m.code == fm.ErrorCode.ABORTED)
        assert aborted == [2, 3, 4] and counts.counts["cancelled"] == 1
        assert counts.counts["aborted"] == 3

        table.submit(PEER, _submit(9))
        await asyncio.sleep(0)
        assert table.forget(PEER) == [9]
        await asyncio.wait(table.tasks(), timeout=5)
        assert not table.held and gate.running == 0 and len(sent) == 3  # no answer

    asyncio.run(main())


def test_streamed_tokens_leave_before_the_result() -> None:
    async def main() -> None:
        async def streams(req: LLMRequest, ctx: Any) -> LLMResponse:
            ctx.emit(7, -0.5, 3)
            await asyncio.sleep(0)  # the first token leaves at the end of this iteration
            ctx.emit(8, -0.25, 3)
            return _answer(req)  # the second leaves just before the Result

        table, sent, _, _ = _table(streams)
        table.submit(PEER, _submit(1, stream=True))
        await asyncio.wait(table.tasks(), timeout=5)
        kinds = [(type(m).__name__, getattr(m, "seq", None)) for _, m in sent]
        assert kinds == [("Stream", 0), ("Stream", 1), ("Result", None)]
        assert [m.output_tokens.tolist() for _, m in sent[:2]] == [[7], [8]]

    asyncio.run(main())
