"""The weight update as the training loop sees it, on top of the fabric.

Trainer side, one call::

    update_weights(controller, publisher, model, version=step, timeout=60)

pauses every generation worker (in-flight generations end with ``"interrupt"`` and
their clients re-submit the rest), publishes the version, waits until every worker has
applied it, and resumes. Each worker's engine stamps the new version on every token
generated after that (``output_versions``), because its subscriber sets
``engine.version`` before acknowledging.

Worker side, the fabric's plugin hook (``python -m transport.worker --plugin
transport.weights.update:subscribe --plugin-opt weights_endpoint=tcp://...``) or
:func:`attach_subscriber` from code: a :class:`WeightSubscriber` on ``engine.model``
whose copies run only while the worker is paused. A version that arrives while the
worker generates (a late joiner catching up, a trainer that did not pause) pauses the
worker itself for the copy and resumes it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from transport.weights.errors import UpdateIncomplete
from transport.weights.publisher import UpdateResult, WeightPublisher
from transport.weights.subscriber import WeightSubscriber

__all__ = ["attach_subscriber", "aupdate_weights", "subscribe", "update_weights"]


def update_weights(
    controller: Any,
    publisher: WeightPublisher,
    state: Any,
    version: int,
    timeout: float = 60.0,
    *,
    workers: Any = None,
    strict: bool = True,
) -> UpdateResult:
    """Pause generation, publish ``state`` as ``version``, await every worker, resume.

    Parameters
    ----------
    controller:
        A :class:`transport.FabricController` over the generation workers.
    publisher:
        The :class:`WeightPublisher` the workers' subscribers follow.
    state:
        Module, state dict or ``(name, tensor)`` pairs.
    version:
        The new version (greater than the last one).
    timeout:
        Seconds for the pause and for the workers to apply the version.
    workers:
        Weight-subscriber ids to wait for (default: every connected one).
    strict:
        Raise :class:`UpdateIncomplete` when a worker failed or did not answer. The
        workers are resumed either way: a worker that failed kept its previous weights
        and keeps generating with them, under its previous version number.

    Returns
    -------
    UpdateResult
        Who applied the version, who failed and why; ``elapsed_s`` is the whole call,
        pause and resume included.
    """
    t0 = time.monotonic()
    controller.pause(timeout)
    try:
        publisher.publish(state, version)
        res = publisher.wait(version, timeout, workers=workers)
    finally:
        controller.resume(timeout)
    res.elapsed_s = time.monotonic() - t0
    if strict and not res.ok:
        raise UpdateIncomplete(
            f"version {version}: applied by {sorted(res.applied)}, failed {res.failed}, "
            f"no answer from {res.missing}",
            res,
        )
    return res


async def aupdate_weights(
    controller: Any,
    publisher: WeightPublisher,
    state: Any,
    version: int,
    timeout: float = 60.0,
    **kwargs: Any,
) -> UpdateResult:
    """:func:`update_weights` for asyncio callers (runs in a thread)."""
    return await asyncio.to_thread(
        update_weights, controller, publisher, state, version, timeout, **kwargs
    )


class _PausedWhileCopying:
    """The subscriber's lock: the copy runs only while the worker is paused.

    When the controller paused the worker already (the normal update) this does
    nothing; otherwise it pauses the worker for the copy and resumes it afterwards.
    """

    def __init__(self, server: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self._ours = False

    def __enter__(self) -> None:
        self._ours = not self.server.paused
        if self._ours:
            asyncio.run_coroutine_threadsafe(self.server.pause(), self.loop).result()

    def __exit__(self, *exc: object) -> None:
        if self._ours:
            self._ours = False
            asyncio.run_coroutine_threadsafe(self.server.resume(), self.loop).result()


def attach_subscriber(
    server: Any, endpoint: str, loop: asyncio.AbstractEventLoop, **kwargs: Any
) -> WeightSubscriber:
    """Start a :class:`WeightSubscriber` that keeps ``server.engine.model`` current.

    Parameters
    ----------
    server:
        A :class:`transport.WorkerServer` whose engine has ``model`` and ``version``.
    endpoint:
        The publisher's ROUTER address.
    loop:
        The loop the server runs in (pause and resume are scheduled there).
    **kwargs:
        Passed to :class:`WeightSubscriber` (``shm``, ``report_digest``, timeouts...).
    """
    engine = server.engine
    if engine is None or not hasattr(engine, "model"):
        raise TypeError("the worker's engine has no .model to update")

    def applied(version: int) -> None:
        engine.version = version

    kwargs.setdefault("worker_id", server.worker_id)
    return WeightSubscriber(
        endpoint,
        engine.model,
        version=int(getattr(engine, "version", -1)),
        lock=_PausedWhileCopying(server, loop),
        on_applied=applied,
        **kwargs,
    ).start()


def _flag(v: str | None, default: bool) -> bool:
    return default if v is None else v.lower() in ("1", "true", "yes", "on")


async def subscribe(server: Any, opts: dict[str, str]) -> None:
    """Fabric worker plugin: follow the weight publisher at ``opts["weights_endpoint"]``.

    Options: ``weights_shm`` (default on), ``weights_digest`` (report weight digests,
    default off), ``weights_publisher_timeout`` (seconds), and for CurveZMQ
    ``weights_curve_secret`` (this worker's ``.key_secret``) with
    ``weights_curve_server`` (the publisher's ``.key``).
    """
    from transport.sockets import CurveConfig

    endpoint = opts.get("weights_endpoint")
    if not endpoint:
        raise ValueError("the weights plugin needs --plugin-opt weights_endpoint=<address>")
    curve = None
    if opts.get("weights_curve_secret"):
        curve = CurveConfig(
            secret_key_file=opts["weights_curve_secret"],
            server_public_key_file=opts.get("weights_curve_server"),
        )
    sub = attach_subscriber(
        server,
        endpoint,
        asyncio.get_running_loop(),
        shm=_flag(opts.get("weights_shm"), True),
        report_digest=_flag(opts.get("weights_digest"), False),
        publisher_timeout=float(opts.get("weights_publisher_timeout", "10")),
        curve=curve,
    )
    try:
        await asyncio.Event().wait()  # lives as long as the server; cancelled at close
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(sub.close)
