"""Public names of transport and the fabric wire messages."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest

import fastio
import transport
from fastio import LLMRequest, TokenArray
from fastio import fabric_msgs as fm
from fastio.protocol import MsgKind


@pytest.mark.parametrize("module", [transport, fm])
def test_all_is_sorted_and_complete(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    # isort-style order (ruff RUF022): CONSTANTS, then Classes, then functions.
    assert names == sorted(names, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))
    for name in names:
        assert getattr(module, name) is not None
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
        and getattr(v, "__module__", "").startswith(module.__name__)  # type: ignore[attr-defined]
    }  # fmt: skip
    assert public <= set(names)


def test_fabric_kinds_in_range_and_unique() -> None:
    kinds = [k for k in MsgKind if k.name.startswith("FABRIC_")]
    assert all(20 <= k <= 39 for k in kinds)
    structs = [
        fm.Submit,
        fm.Result,
        fm.Stream,
        fm.Cancel,
        fm.Heartbeat,
        fm.Control,
        fm.ControlReply,
        fm.Error,
        fm.WorkerStatus,
    ]
    tags = [s.__struct_config__.tag for s in structs]
    assert sorted(tags) == sorted(int(k) for k in kinds)


def test_round_trips_keep_arrays_zero_copy() -> None:
    ids = np.arange(100_000, dtype=np.int32)  # well above the inline threshold
    frames = fastio.encode(fm.Submit(id=3, request=LLMRequest(rid="r", input_ids=ids)))
    assert len(frames) == 2  # the token array travels as its own frame
    sub = fastio.decode(frames, type=fm.CLIENT_TO_WORKER)
    assert isinstance(sub, fm.Submit) and sub.id == 3 and sub.request.rid == "r"
    assert np.shares_memory(sub.request.input_ids.array, np.frombuffer(frames[1], np.uint8))
    res = fastio.decode(
        fastio.encode(fm.Result(id=4, output_tokens=TokenArray(ids), stop_reason="length")),
        type=fm.WORKER_TO_CLIENT,
    )
    assert isinstance(res, fm.Result) and res.output_tokens == ids.tolist()
    assert res.stop_reason == "length" and res.output_logprobs == []
    for msg in (
        fm.Cancel(id=1),
        fm.Heartbeat(sent_at=2.0, worker_id="w"),
        fm.Control(seq=1, op="pause"),
        fm.Error(id=-1, code=1),
    ):
        back = fastio.decode(fastio.encode(msg), type=type(msg))
        assert back == msg


def test_peek_names_what_it_can() -> None:
    frames = fastio.encode(fm.Submit(id=77, request=LLMRequest(input_ids=[1])))
    assert fm.peek(frames) == (fastio.PROTOCOL_VERSION, MsgKind.FABRIC_SUBMIT, 77)
    assert fm.peek([b"garbage"]) == (None, None, None)
    assert fm.peek([b"\x93\x01\x00\xa3abc"]) == (1, None, None)


def test_the_controllers_async_methods_run_what_the_object_has() -> None:
    calls: list[tuple[str, object]] = []

    class Logged(transport.FabricController):
        def pause(self, timeout: float | None = None, **kw: object) -> dict[str, object]:
            calls.append(("pause", timeout))
            return {}

    async def main(ctl: transport.FabricController) -> None:
        assert await ctl.apause(timeout=3) == {}
        assert await ctl.ahealth() == {"patched": 1}

    with Logged(["tcp://127.0.0.1:9"], timeout=1) as ctl:
        ctl.health = lambda *a, **k: {"patched": 1}  # type: ignore[method-assign]
        asyncio.run(main(ctl))
    assert calls == [("pause", 3)]
    assert inspect.signature(Logged.apause) == inspect.signature(transport.FabricController.pause)
