"""A poison request is contained: one whose workers keep dying while they run it fails
after ``max_worker_deaths + 1`` of them (not after every worker), a request the engine
refuses is never re-sent, and a worker whose engine has a ``vocab_size`` refuses token
ids outside it before the engine sees them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastio import GenerationHyperparameters, LLMRequest
from fastio import fabric_msgs as fm
from tests.transport.conftest import await_for, wait_for
from tests.transport.poison_plugins import POISON, POISON_EXIT, REJECT, serve
from transport import ClientConfig, FabricClient, FabricController, PoisonRequest, RemoteError
from transport.worker.context import token_problem

# Deaths found within about 0.6 s; a live worker's pongs come from its socket thread,
# and half a second of silence is more than a loaded machine makes.
FAST = ClientConfig(heartbeat_interval=0.1, heartbeat_liveness=5, request_timeout=60)


def req(ids: list[int], stops: list[int] | None = None) -> LLMRequest:
    g = GenerationHyperparameters(max_new_tokens=8, stop_token_ids=stops or [])
    return LLMRequest(input_ids=ids, gconfig=g)


class Workers:
    """Worker processes (children of the tests' forkserver: no interpreter start-up
    each), bound at ipc addresses in the test's directory."""

    def __init__(self, procs: Callable[..., Any], tmp_path: Path, n: int, engine: str) -> None:
        self.addresses = [f"ipc://{tmp_path}/w{i}.sock" for i in range(n)]
        opts = {"vocab_size": "16"} if engine == "vocab" else {}
        self.procs = {a: procs(serve, a, engine, opts) for a in self.addresses}

    def exited(self) -> list[str]:
        """Addresses of those whose process ended."""
        return [a for a, p in self.procs.items() if p.exitcode is not None]

    def exit_code(self, address: str) -> int | None:
        return self.procs[address].exitcode


async def all_alive(client: FabricClient) -> None:
    await await_for(lambda: all(w.alive for w in client.workers), 60, "every worker up")


def test_poison_request_fails_after_max_worker_deaths_plus_one_workers_died(
    procs: Callable[..., Any], tmp_path: Path
) -> None:
    ws = Workers(procs, tmp_path, 4, "poison")

    async def main() -> None:
        async with FabricClient(ws.addresses, FAST) as client:
            assert client.config.max_worker_deaths == 2  # the default
            await all_alive(client)
            poison = req([1, POISON, 2])
            bad = client.agenerate(poison)
            # Unrelated requests sent with it, and more while it is being re-sent.
            first = [req([100 + i, i]) for i in range(8)]
            futs = [client.agenerate(r) for r in first]
            await await_for(lambda: client.stats["workers_died"] >= 1, 30, "a first death")
            second = [req([200 + i, i]) for i in range(8)]
            futs += [client.agenerate(r) for r in second]
            with pytest.raises(PoisonRequest) as info:
                await bad
            err = info.value
            # Failed when the third worker running it died: not sent to the fourth.
            assert client.stats["workers_died"] == 3
            dead = wait_for(lambda: len(ws.exited()) == 3 and ws.exited(), 10, "3 exits")
            assert all(ws.exit_code(a) == POISON_EXIT for a in dead)
            assert len(err.workers) == 3 and sorted(err.workers) == sorted(dead)
            assert err.rid == poison.rid and err.worker == err.workers[-1]
            text = str(err)
            assert poison.rid in text and "max_worker_deaths=2" in text
            assert all(a in text for a in err.workers)
            assert isinstance(err, RemoteError)  # caught where worker errors are
            # Every other request got its own answer, once.
            outs = await asyncio.gather(*futs)
            assert [o.output_tokens.tolist() for o in outs] == [
                r.input_ids.tolist() for r in first + second
            ]
            stats = client.stats
            assert (stats["poisoned"], stats["failed"], stats["completed"]) == (1, 1, 16)
            assert stats["resent"] >= 2  # the poison's; others' if a death took them too
            (survivor,) = set(ws.addresses) - set(dead)
            assert [w.address for w in client.workers if w.alive] == [survivor]
            assert client.pending == 0

    asyncio.run(main())
    assert len(ws.exited()) == 3  # the survivor serves on: nothing else died


def test_max_worker_deaths_zero_fails_at_the_first_death(
    procs: Callable[..., Any], tmp_path: Path
) -> None:
    ws = Workers(procs, tmp_path, 2, "poison")

    async def main() -> None:
        async with FabricClient(ws.addresses, FAST, max_worker_deaths=0) as client:
            await all_alive(client)
            with pytest.raises(PoisonRequest) as info:
                await client.agenerate(req([POISON]))
            (dead,) = wait_for(ws.exited, 10, "the poisoned worker's exit")
            assert ws.exit_code(dead) == POISON_EXIT
            assert info.value.workers == (dead,)
            assert "max_worker_deaths=0" in str(info.value)
            stats = client.stats
            assert (stats["workers_died"], stats["resent"], stats["poisoned"]) == (1, 0, 1)
            ok = await client.agenerate(req([5, 6]))  # the other serves on
            assert ok.output_tokens.tolist() == [5, 6]

    asyncio.run(main())
    assert len(ws.exited()) == 1


def test_max_worker_deaths_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_worker_deaths"):
        FabricClient([], max_worker_deaths=-1)


def worker_counts(address: str) -> dict[str, int]:
    with FabricController([address]) as ctl:
        return dict(ctl.health(10, strict=True)[address].counters)


def test_request_the_engine_refuses_fails_once_and_is_not_resent(
    procs: Callable[..., Any], tmp_path: Path
) -> None:
    ws = Workers(procs, tmp_path, 2, "vocab")

    async def main() -> None:
        async with FabricClient(ws.addresses, FAST) as client:
            await all_alive(client)
            with pytest.raises(RemoteError, match=f"ValueError: token {REJECT} is not") as info:
                await client.agenerate(req([1, REJECT]))
            assert type(info.value) is RemoteError
            assert info.value.code == fm.ErrorCode.HANDLER_ERROR
            assert info.value.worker in ws.addresses
            stats = client.stats
            assert (stats["failed"], stats["resent"], stats["workers_died"]) == (1, 0, 0)
            assert client.pending == 0

    asyncio.run(main())
    assert not ws.exited()
    counts = [worker_counts(a) for a in ws.addresses]
    # The one submission reached one worker, once, and its engine's error answered it.
    assert sum(c["received"] for c in counts) == 1
    assert sum(c["errors"] for c in counts) == 1


def test_worker_refuses_token_ids_outside_the_engines_vocabulary(
    procs: Callable[..., Any], tmp_path: Path
) -> None:
    ws = Workers(procs, tmp_path, 1, "vocab")

    async def main() -> None:
        async with FabricClient(ws.addresses, FAST) as client:
            await all_alive(client)
            for bad, match in [
                (req([1, 16, 2]), r"must lie in \[0, 16\) .*: input_ids holds token id 16$"),
                (req([-3, 2]), r"vocab_size=16\): input_ids holds token id -3$"),
                (req([1], stops=[2, 99]), r"16\): gconfig.stop_token_ids holds token id 99$"),
            ]:
                with pytest.raises(RemoteError, match=match) as info:
                    await client.agenerate(bad)
                # Answered as the engine's own refusal (a ValueError) would be.
                assert info.value.code == fm.ErrorCode.HANDLER_ERROR
            # In-vocabulary ids at both ends: served, by the same live worker.
            ok = await client.agenerate(req([0, 15], stops=[15]))
            assert ok.output_tokens.tolist() == [0, 15]
            stats = client.stats
            assert (stats["failed"], stats["resent"], stats["workers_died"]) == (3, 0, 0)

    asyncio.run(main())
    assert not ws.exited()  # the engine was never handed an id outside its vocabulary
    counts = worker_counts(ws.addresses[0])
    assert (counts["received"], counts["errors"], counts["bad_messages"]) == (4, 3, 0)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "uint32", "int64"])
def test_token_problem_finds_ids_outside_the_vocabulary(dtype: str) -> None:
    def problem(ids: list[int], stops: list[int] | None = None) -> str | None:
        g = GenerationHyperparameters(stop_token_ids=stops or [])
        r = LLMRequest(input_ids=np.array(ids, dtype=dtype), gconfig=g)
        assert r.input_ids.dtype == np.dtype(dtype)  # kept as sent
        return token_problem(r, 100)

    assert problem([0, 5, 99]) is None
    assert problem([0, 5, 99], stops=[0, 99]) is None
    assert problem([3, 100, 7]) == (
        "input ids must lie in [0, 100) (the engine's vocab_size=100): input_ids holds token id 100"
    )
    assert (problem([1], stops=[4, 100]) or "").endswith("stop_token_ids holds token id 100")
    if np.dtype(dtype).kind == "i":
        assert (problem([5, -1, 2]) or "").endswith("input_ids holds token id -1")
        assert (problem([-128, 127]) or "").endswith("input_ids holds token id -128")
