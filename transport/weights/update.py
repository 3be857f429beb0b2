"""The weight update as the training loop sees it, on top of the fabric.

Trainer side: :func:`update_weights` pauses every generation worker, publishes, waits
until every worker applied the version and resumes. Worker side: the plugin
(``--plugin transport.weights.update:subscribe``) or :func:`attach_subscriber`, a
:class:`WeightSubscriber` whose copies run only while the worker is paused. Loop model:
the subscriber's thread enters the pause lock and waits on the worker's event loop
(``run_coroutine_threadsafe``); the pause lease runs on that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from fastio.weight_msgs import WeightAck  # noqa: F401  (names FabricUpdateResult's inherited fields)
from transport.errors import ControlError, ResumeRefused
from transport.options import parse_options, resolve_entry
from transport.weights.core.subscriber import PauseLease
from transport.weights.errors import UpdateIncomplete, WeightUpdateError
from transport.weights.publisher import WeightPublisher
from transport.weights.results import UpdateResult
from transport.weights.subscriber import WeightSubscriber

__all__ = [
    "PLUGIN_OPTIONS",
    "FabricUpdateResult",
    "PluginOptions",
    "attach_subscriber",
    "aupdate_weights",
    "subscribe",
    "subscriber_options",
    "update_weights",
]

log = logging.getLogger("transport.weights.update")


@dataclass
class FabricUpdateResult(UpdateResult):
    """:class:`UpdateResult` of :func:`update_weights`, plus what the fabric reported.

    Workers that could not be paused (``strict=False``) are in ``failed`` under their
    address; workers that acknowledged the version but report an older one after the
    resume are moved from ``applied`` to ``failed``.

    Attributes
    ----------
    resume_failed:
        Worker address -> why it did not confirm the resume (it may still be paused).
    """

    resume_failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every expected worker applied the version and generates again."""
        return super().ok and not self.resume_failed


def update_weights(
    controller: Any,
    publisher: WeightPublisher,
    state: Any,
    version: int,
    timeout: float = 60.0,
    *,
    workers: Any = None,
    strict: bool = True,
) -> FabricUpdateResult:
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
        Seconds for the pause, for the workers to apply the version, and for the resume.
    workers:
        Weight-subscriber ids to wait for (default: the worker id of every worker the
        controller paused, whether or not its subscriber reached the publisher).
    strict:
        Raise (see below) when a worker could not be paused, failed, did not answer,
        reports an older version after the resume or did not confirm it; ``False``
        goes on with the workers that paused and reports the others in ``failed``.
        Workers are resumed either way; one whose failure left its weights mixed
        stays paused (in ``resume_failed``) until a later version completes there.

    Returns
    -------
    FabricUpdateResult
        Who applied the version, who failed and why, who did not resume; ``elapsed_s``
        is the whole call, pause and resume included.

    Raises
    ------
    transport.ControlError
        ``strict`` and a worker could not be paused (nothing was published).
    UpdateIncomplete
        ``strict`` and the update did not reach every worker (see ``strict``).
    """
    t0 = time.monotonic()
    not_paused: dict[str, str] = {}
    resumed: dict[str, Any] | None = None
    resume_failed: dict[str, str] = {}
    try:
        try:
            paused = controller.pause(timeout)
        except ControlError as exc:
            paused, not_paused = dict(exc.statuses), dict(exc.failed)
            if strict:
                resumed, resume_failed = _resume(controller, timeout)
                left = f"; resume failed on {resume_failed}" if resume_failed else ""
                raise ControlError(
                    f"{exc}; nothing published, the others resumed{left}", exc.failed, exc.statuses
                ) from exc
        # (No worker paused at all: wait for those the publisher knows.)
        ids = [s.worker_id for s in paused.values()] or None
        publisher.publish(state, version)
        # Wait for every paused worker by id: a worker whose subscriber never reached
        # the publisher is unknown to it and would otherwise not be waited for at all.
        res = publisher.wait(version, timeout, workers=ids if workers is None else workers)
    finally:
        if resumed is None:
            resumed, resume_failed = _resume(controller, timeout)
    out = FabricUpdateResult(
        res.version,
        dict(res.applied),
        dict(res.failed),
        list(res.missing),
        paths=dict(res.paths),
        resume_failed=resume_failed,
    )
    for address, why in not_paused.items():
        # Known by its id if it answered the resume; one whose pause only timed out
        # may still have applied the version safely (its copy waits for idle).
        wid = resumed[address].worker_id if address in resumed else address
        if wid not in out.applied:
            out.failed.setdefault(wid, f"not paused: {why}")
    # An Ack says the subscriber applied the version; the worker's status says its
    # engine serves it. Check both: they differ if, e.g., the worker restarted since.
    for status in resumed.values():
        wid = status.worker_id
        if wid in out.applied and status.version < version:
            del out.applied[wid]
            out.failed[wid] = f"acknowledged, but reports version {status.version} after resume"
    out.elapsed_s = time.monotonic() - t0
    if strict and not out.ok:
        raise UpdateIncomplete(
            f"version {version}: applied by {sorted(out.applied)}, failed {out.failed}, "
            f"no answer from {out.missing}, not resumed {out.resume_failed}",
            out,
        )
    return out


def _resume(controller: Any, timeout: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Resume every worker (a worker whose pause timed out is paused too); one that
    cannot be reached must not keep the others paused, so failures are returned."""
    try:
        return controller.resume(timeout), {}
    except ControlError as exc:
        return dict(exc.statuses), dict(exc.failed)


async def aupdate_weights(
    controller: Any,
    publisher: WeightPublisher,
    state: Any,
    version: int,
    timeout: float = 60.0,
    **kwargs: Any,
) -> FabricUpdateResult:
    """:func:`update_weights` for asyncio callers (runs in a thread)."""
    return await asyncio.to_thread(
        update_weights, controller, publisher, state, version, timeout, **kwargs
    )


def _nothing() -> None:
    pass


def _never() -> bool:
    return False


class _PausedWhileCopying:
    """The subscriber's lock: the copy runs only while the worker is paused and idle.

    Entering pauses the server (or waits for idle under a controller's pause) and
    raises if it does not go idle in time; leaving resumes only a pause the lock owns
    and nobody renewed. A controller's resume waits for the copy; after a copy that
    left the weights mixed the worker stays paused and its engine's version is ``-1``.
    """

    #: Refuses to serve mixed weights: subscribers default to one-pass mode under it.
    refuses_mixed = True

    def __init__(self, server: Any, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.server = server
        self.loop = loop
        self.timeout = timeout
        #: Called while waiting on the loop (the subscriber's Hello when one is due).
        self.keepalive: Callable[[], None] = _nothing
        #: Whether the weights are mixed now (the subscriber's ``not consistent``).
        self.mixed: Callable[[], bool] = _never
        self._mine: int | None = None  # server.pause_requests right after our own pause
        self._free = asyncio.Event()  # set while no copy runs; used in the loop only
        self._free.set()

    async def hold_resume(self) -> None:
        """``server.on_resume`` callback: a resume waits for a running copy, and is
        refused (:class:`~transport.errors.ResumeRefused`) while the weights
        are mixed."""
        await self._free.wait()
        if self.mixed():
            raise ResumeRefused(
                f"worker {self.server.worker_id}: weights are mixed (a version failed "
                "midway); it stays paused until a complete version lands"
            )

    async def _acquire(self) -> None:
        s = self.server
        # Still holding the pause of a copy that left the weights mixed: ours again.
        held = self._mine is not None and s.paused and s.pause_requests == self._mine
        ours = held or not s.paused
        n = s.pause_requests  # pause() counts itself before its first await
        self._free.clear()
        try:
            ok = await s.pause(self.timeout)
        except BaseException:
            self._free.set()  # never leave a controller's resume waiting on us
            raise
        self._mine = n + 1 if ours else None
        if not ok:
            await self._release()
            raise RuntimeError(
                f"worker {s.worker_id} still generating {self.timeout} s after pausing "
                "for the weight copy"
            )

    async def _release(self) -> None:
        s = self.server
        self._free.set()  # the copy is over (resumes see whether it left them mixed)
        if self.mixed():
            # Refuse to serve: stay paused, keep the pause ours, health says -1.
            engine = getattr(s, "engine", None)
            if engine is not None:
                engine.version = -1
            return
        mine, self._mine = self._mine, None
        if mine is not None and s.paused and s.pause_requests == mine:
            await s.resume()

    @property
    def copying(self) -> bool:
        """Whether a copy holds the lock now."""
        return not self._free.is_set()

    def _call(self, coro: Any) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + self.timeout + 10.0
        while True:
            try:
                fut.result(max(0.0, min(0.25, deadline - time.monotonic())))
                return
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    fut.cancel()
                    raise
                # Waiting for generations to stop can outlast the publisher's
                # worker_timeout: keep saying we are alive meanwhile.
                self.keepalive()

    def __enter__(self) -> None:
        self._call(self._acquire())

    def __exit__(self, *exc: object) -> None:
        self._call(self._release())


def attach_subscriber(
    server: Any,
    endpoint: str,
    loop: asyncio.AbstractEventLoop,
    *,
    pause_timeout: float = 30.0,
    pause_lease: float = 30.0,
    **kwargs: Any,
) -> WeightSubscriber:
    """Start a :class:`WeightSubscriber` that keeps ``server.engine`` current: its
    ``model`` by an in-place copy, its ``load_weights(pairs)`` (when it has one) with
    each verified version (see :mod:`transport.engines.api`).

    Parameters
    ----------
    server:
        A :class:`transport.WorkerServer` whose engine has ``model`` and ``version``.
    endpoint:
        The publisher's ROUTER address.
    loop:
        The loop the server runs in (pause and resume are scheduled there).
    pause_timeout:
        Seconds a copy waits for the worker's generations to stop; past that the
        version fails on this worker, which keeps its previous weights.
    pause_lease:
        Seconds paused (by anyone but its own copy) with no word from the publisher
        (the trainer died) before the worker resumes on its last complete version,
        with a warning. ``0`` disables the lease.
    **kwargs:
        Passed to :class:`WeightSubscriber` (``shm``, ``report_digest``, ``dtype``,
        ``rename``, ``loader``, timeouts...).
    """
    engine = server.engine
    model = getattr(engine, "model", None)
    load_weights = getattr(engine, "load_weights", None)
    if engine is None or (model is None and not callable(load_weights)):
        why = getattr(engine, "no_weights_reason", None)
        raise TypeError(why or "the worker's engine has no .model to update and no load_weights")
    if callable(load_weights) and "loader" not in kwargs:
        # An engine that places weights itself (a server bridge, fused layouts) takes
        # each verified version whole, after the in-place copy into .model if any.
        kwargs["loader"] = load_weights
        kwargs.setdefault("atomic", True)

    def applied(version: int) -> None:
        engine.version = version

    lock = _PausedWhileCopying(server, loop, pause_timeout)
    server.on_resume.append(lock.hold_resume)
    kwargs.setdefault("worker_id", server.worker_id)
    sub = WeightSubscriber(
        endpoint,
        model,
        version=int(getattr(engine, "version", -1)),
        lock=lock,
        on_applied=applied,
        **kwargs,
    )
    # The lock is entered in the subscriber's thread, which may send on its socket.
    lock.keepalive = sub.keepalive
    lock.mixed = lambda: not sub.consistent
    sub.start()
    if pause_lease > 0:
        asyncio.run_coroutine_threadsafe(_pause_lease(server, sub, lock, pause_lease), loop)
    return sub


async def _pause_lease(
    server: Any, sub: WeightSubscriber, lock: _PausedWhileCopying, lease: float
) -> None:
    """Resume a worker left paused by a trainer that is gone (see ``pause_lease``)."""
    rule = PauseLease(lease)
    while not sub.closed:
        await asyncio.sleep(min(1.0, lease / 4))
        quiet = rule.tick(
            time.monotonic(),
            paused=server.paused,
            copying=lock.copying,
            mixed=lock.mixed(),
            last_heard=sub.last_heard,
        )
        if quiet is not None:
            log.warning(
                "worker %s paused for %.1f s with no word from the weight publisher (the "
                "trainer is gone?): resuming on version %d, the last complete one",
                server.worker_id,
                quiet,
                sub.version,
            )
            await server.resume()


class PluginOptions(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename=lambda n: f"weights_{n}"
):
    """The worker plugin's options, ``--plugin-opt weights_<field>=value`` (``None``:
    the default of :func:`attach_subscriber`).

    ``endpoint`` (required), ``shm``, ``path`` (the route), ``atomic``, ``data_link``,
    ``strict``, ``publisher_timeout``: as in
    :class:`~transport.weights.config.SubscriberConfig`; ``digest``: its
    ``report_digest``; ``dtype``: ``auto`` or one dtype name; ``rename``: a JSON object
    ``{"trainer name": "engine name"}`` or ``module:name``; ``loader``:
    ``module:function`` called as ``function(model, weights)`` with each verified
    version; ``pause_timeout``, ``pause_lease``: as in :func:`attach_subscriber`;
    ``curve_secret`` (this worker's ``.key_secret``), ``curve_server`` (the
    publisher's ``.key``): CurveZMQ.
    """

    endpoint: Annotated[str, Meta(min_length=1)]
    shm: bool = True
    path: Literal["ipc", "shm", "tcp"] | None = None
    atomic: bool | None = None
    data_link: bool | None = None
    digest: bool = False
    strict: bool = True
    dtype: str | None = None
    rename: str | None = None
    loader: str | None = None
    publisher_timeout: Annotated[float, Meta(gt=0)] | None = None
    pause_timeout: Annotated[float, Meta(gt=0)] | None = None
    pause_lease: Annotated[float, Meta(ge=0)] | None = None
    curve_secret: str | None = None
    curve_server: str | None = None


#: Options of the worker plugin (``--plugin-opt key=value``), see :func:`subscribe`.
PLUGIN_OPTIONS = frozenset(PluginOptions.__struct_encode_fields__)


def subscriber_options(opts: dict[str, str], model: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`attach_subscriber` (but the endpoint) from the
    plugin's options; ``ValueError`` naming the option for anything unknown or malformed."""
    from transport.sockets import CurveConfig
    from transport.weights.binding import parse_dtype_spec

    o = parse_options(opts, PluginOptions, "weights plugin option")
    kw: dict[str, Any] = {"shm": o.shm, "report_digest": o.digest, "strict": o.strict}
    for arg in ("path", "atomic", "data_link", "publisher_timeout", "pause_timeout", "pause_lease"):
        if getattr(o, arg) is not None:
            kw[arg] = getattr(o, arg)
    if o.dtype:
        try:
            kw["dtype"] = parse_dtype_spec(o.dtype)
        except WeightUpdateError as exc:
            raise ValueError(f"weights_dtype: {exc}") from None
    if o.rename and o.rename.lstrip().startswith("{"):
        try:
            kw["rename"] = msgspec.json.decode(o.rename, type=dict[str, str])
        except msgspec.DecodeError as exc:
            raise ValueError(f"weights_rename: not a JSON object of names ({exc})") from None
    elif o.rename:
        kw["rename"] = resolve_entry(o.rename, "weights_rename")
    if o.loader:
        fn = resolve_entry(o.loader, "weights_loader")
        if not callable(fn):
            raise ValueError(f"weights_loader {o.loader!r} is not callable")
        kw["loader"] = lambda weights: fn(model, weights)
    if o.curve_secret:
        kw["curve"] = CurveConfig(
            secret_key_file=o.curve_secret, server_public_key_file=o.curve_server
        )
    return kw


async def subscribe(server: Any, opts: dict[str, str]) -> None:
    """Fabric worker plugin: follow the weight publisher at ``opts["weights_endpoint"]``
    (``--plugin transport.weights.update:subscribe --plugin-opt weights_<field>=value``,
    the fields of :class:`PluginOptions`). Raises ``ValueError`` at start for a missing
    endpoint or a bad or unknown option."""
    engine = server.engine
    kw = subscriber_options(opts, getattr(engine, "model", None))
    sub = attach_subscriber(server, opts["weights_endpoint"], asyncio.get_running_loop(), **kw)
    try:
        await asyncio.Event().wait()  # lives as long as the server; cancelled at close
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(sub.close)
