"""update_weights and the worker-side copy lock, with real worker processes.

Each test starts ``python -m transport.worker`` subprocesses (killed at teardown) that
follow an in-process :class:`WeightPublisher` through the weights plugin, and drives
them with a real :class:`FabricController` over loopback TCP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fastio import GenerationHyperparameters, LLMRequest
from fastio.weight_msgs import WeightAck
from tests.helpers import free_port
from tests.transport.conftest import wait_for
from tests.transport.weights.helpers import status, worker_args
from transport import ControlError, FabricController, SyncFabricClient
from transport.engine import ReferenceEngine, TinyLM
from transport.weights import UpdateIncomplete, WeightPublisher, WeightSubscriber, update_weights
from transport.weights.update import attach_subscriber

PLUGIN = "transport.weights.update:subscribe"
HERE = "tests.transport.weights.drivers.test_update"


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(
        "tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1, worker_timeout=2.0
    )
    yield pub
    pub.close()


# -- 1. a pause that fails on one worker must not leave the others paused ---------------
def test_failed_pause_resumes_the_others(
    spawn: Callable[..., Any], publisher: WeightPublisher
) -> None:
    live = spawn(*worker_args("live", publisher.endpoint, "--plugin", PLUGIN))
    dead = f"tcp://127.0.0.1:{free_port()}"  # a worker that died: nothing listens
    publisher.wait_for_workers(1, 30)
    # The timeout is what each call to the dead worker waits out, and also the live
    # worker's time to apply the version: not under 3 s on a loaded machine.
    with FabricController([live.address, dead]) as ctl:
        with pytest.raises(ControlError) as info:
            update_weights(ctl, publisher, TinyLM(seed=1), version=1, timeout=3.0)
        assert list(info.value.failed) == [dead]
        with FabricController([live.address]) as alive:
            st = status(alive)["live"]
            assert not st.paused, "the worker that did pause was left paused"
            assert st.version == 0, "nothing is published when strict pause fails"

        # Not strict: the update goes on with the workers that paused.
        res = update_weights(ctl, publisher, TinyLM(seed=1), 1, timeout=3.0, strict=False)
        assert sorted(res.applied) == ["live"]
        assert res.failed[dead].startswith("not paused")
        assert list(res.resume_failed) == [dead]
        assert not res.ok
        with FabricController([live.address]) as alive:
            st = status(alive)["live"]
            assert not st.paused and st.version == 1


# -- 2. a worker whose subscriber never reached the publisher is not "applied" ----------
def test_a_worker_unknown_to_the_publisher_is_missing(
    spawn: Callable[..., Any], publisher: WeightPublisher
) -> None:
    good = spawn(*worker_args("good", publisher.endpoint, "--plugin", PLUGIN), wait=False)
    # Its subscriber follows a wrong address: the publisher never hears of it.
    lost = spawn(*worker_args("lost", "tcp://127.0.0.1:1", "--plugin", PLUGIN), wait=False)
    good.wait_ready()
    lost.wait_ready()
    publisher.wait_for_workers(1, 30)
    with FabricController([good.address, lost.address]) as ctl:
        with pytest.raises(UpdateIncomplete) as info:
            # 5 s for "good" to apply; "lost" is waited for as long.
            update_weights(ctl, publisher, TinyLM(seed=1), version=1, timeout=5)
        res = info.value.result
        assert sorted(res.applied) == ["good"]
        assert res.missing == ["lost"]
        after = status(ctl)
        assert {w: s.version for w, s in after.items()} == {"good": 1, "lost": 0}
        assert not any(s.paused for s in after.values())


# -- 3. the copy lock and a controller's pause -------------------------------------------
class _GatedEngine:
    """The engine as the subscriber sees it: setting the version (the last step of a
    copy, under the lock) waits until a controller pauses the worker, so that pause
    lands in the middle of the copy."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.model = server.engine.model

    @property
    def version(self) -> int:
        return int(self._server.engine.version)

    @version.setter
    def version(self, v: int) -> None:
        # The copy's own pause is the worker's first; the gate opens at the controller's
        # (counting from here instead raced with a controller pause landing between the
        # copy's pause and this setter: the gate then waited for a pause never to come).
        deadline = time.monotonic() + 20
        while self._server.pause_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # polls a counter another thread bumps (bounded)
        self._server.engine.version = v


class _ServerView:
    """The worker server with :class:`_GatedEngine` as its engine."""

    def __init__(self, server: Any) -> None:
        self.engine = _GatedEngine(server)
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


async def gated_subscribe(server: Any, opts: dict[str, str]) -> None:
    """Worker plugin: the weights plugin with a copy that waits for a controller pause."""
    sub = attach_subscriber(
        _ServerView(server), opts["weights_endpoint"], asyncio.get_running_loop(), shm=False
    )
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.to_thread(sub.close)


def test_a_controller_pause_during_a_copy_is_not_undone(spawn: Callable[..., Any]) -> None:
    # The gate holds the subscriber's thread (no Hellos) until the controller's pause
    # lands, which under load took longer than the shared fixture's 2 s worker_timeout:
    # the worker was then declared lost. (Hellos from inside the gate would be wrong: a
    # Hello at the new version counts as its Ack, before the engine has the version.)
    publisher = WeightPublisher(
        "tcp://127.0.0.1:*", shm=False, heartbeat_interval=0.1, worker_timeout=30.0
    )
    w = spawn(*worker_args("w", publisher.endpoint, "--plugin", f"{HERE}:gated_subscribe"))
    publisher.wait_for_workers(1, 30)
    with publisher, FabricController([w.address]) as ctl:
        # No controller pause: the subscriber pauses the worker for the copy itself.
        publisher.publish(TinyLM(seed=1), 1)
        wait_for(lambda: status(ctl)["w"].paused, 20, "the worker pausing for the copy")
        ctl.pause(timeout=5)  # mid-copy; from its reply on nothing may generate
        res = publisher.wait(1, 20, workers=["w"])
        assert sorted(res.applied) == ["w"]
        st = status(ctl)["w"]
        assert st.version == 1
        assert st.paused, "the copy resumed a worker the controller had paused"
        ctl.resume(timeout=5)
        assert not status(ctl)["w"].paused


class StubbornEngine(ReferenceEngine):
    """A model whose generations ignore interrupts (a stuck kernel, say)."""

    async def generate(self, req: LLMRequest, ctx: Any = None) -> Any:
        await asyncio.sleep(60)  # simulated uninterruptible work, ended by abort or kill
        return await super().generate(req, ctx)


def stubborn_engine(opts: dict[str, str]) -> StubbornEngine:
    return StubbornEngine(seed=0)


def test_no_copy_while_a_generation_still_runs(
    spawn: Callable[..., Any], publisher: WeightPublisher
) -> None:
    w = spawn(
        *worker_args("w", publisher.endpoint, "--plugin", PLUGIN),
        "--engine",
        f"{HERE}:stubborn_engine",
        "--plugin-opt",
        # Longer than the publisher's worker_timeout: the wait must not look like death.
        "weights_pause_timeout=3",
    )
    publisher.wait_for_workers(1, 30)
    req = LLMRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=4))
    with FabricController([w.address]) as ctl, SyncFabricClient([w.address]) as client:
        client.submit(req)
        wait_for(lambda: status(ctl)["w"].running == 1, 20, "the generation to start")
        publisher.publish(TinyLM(seed=1), 1)
        res = publisher.wait(1, 10, workers=["w"])
        assert "w" in res.failed and not res.applied, res
        assert "still generating" in res.failed["w"], res.failed
        assert status(ctl)["w"].version == 0, "copied into the weights under a running generation"
        # The subscriber may retry the version (each attempt pauses, waits 3 s, fails and
        # resumes): the copy's own pauses must be undone, so the worker is seen generating
        # again, between attempts or once it gives up.
        wait_for(lambda: not status(ctl)["w"].paused, 30, "the copy's own pause undone")
        assert status(ctl)["w"].version == 0
        ctl.abort(timeout=5)


# -- a lost Ack ---------------------------------------------------------------------------
class _DropsFirstAck(WeightSubscriber):
    """A subscriber whose first Ack is lost (as when its socket cannot take it)."""

    dropped = 0

    def _send(self, msg: Any) -> None:
        if isinstance(msg, WeightAck) and not self.dropped:
            self.dropped += 1
            return
        super()._send(msg)


def test_a_lost_ack_is_recovered_from_the_next_hello(publisher: WeightPublisher) -> None:
    sub = _DropsFirstAck(
        publisher.endpoint, TinyLM(seed=0), worker_id="w", shm=False, heartbeat_interval=0.1
    ).start()
    try:
        publisher.wait_for_workers(1, 10)
        publisher.publish(TinyLM(seed=1), 1)
        res = publisher.wait(1, 5, workers=["w"])
        assert sub.dropped == 1
        assert sorted(res.applied) == ["w"] and res.ok, res
    finally:
        sub.close()


def test_the_copy_lock_reads_mixed_weights_from_the_subscriber_it_guards() -> None:
    from types import SimpleNamespace

    from transport.errors import ResumeRefused
    from transport.weights.update import PausedWhileCopying

    server = SimpleNamespace(on_resume=[], worker_id="w")
    lock = PausedWhileCopying(server, 1.0)
    assert server.on_resume == [lock.hold_resume] and not lock.mixed()  # guards none yet
    hellos: list[int] = []
    sub = SimpleNamespace(consistent=True, keepalive=lambda: hellos.append(1))
    lock.guard(sub)
    lock.keepalive()
    assert hellos == [1] and not lock.mixed()
    sub.consistent = False
    assert lock.mixed()
    with pytest.raises(ResumeRefused, match="weights are mixed"):
        asyncio.run(lock.hold_resume())
