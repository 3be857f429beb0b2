"""The weight update on the fabric: :func:`update_weights` (trainer side), the worker
plugin and :func:`attach_subscriber` (worker side); see ``docs/weights.md``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fastio.weight_msgs import WeightAck  # noqa: F401  (names FabricUpdateResult's inherited fields)
from transport.errors import ControlError, ResumeRefused
from transport.options import NonEmptyStr, NonNegativeSeconds, Seconds, parse_options, resolve_entry
from transport.sockets import CurveConfig
from transport.weights.binding import parse_dtype_spec
from transport.weights.config import SubscriberConfig
from transport.weights.core.subscriber import PauseLease
from transport.weights.errors import UpdateIncomplete, WeightUpdateError
from transport.weights.publisher import WeightPublisher
from transport.weights.results import UpdateResult
from transport.weights.subscriber import WeightSubscriber

__all__ = [
    "PLUGIN_OPTIONS", "FabricUpdateResult", "PausedWhileCopying", "PluginOptions",
    "attach_subscriber", "aupdate_weights", "subscribe", "subscriber_options", "update_weights",
]  # fmt: skip

log = logging.getLogger("transport.weights.update")


@dataclass
class FabricUpdateResult(UpdateResult):
    """:class:`UpdateResult` of :func:`update_weights`; ``resume_failed``: worker address
    -> why it did not confirm the resume."""

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

    ``controller``: a :class:`transport.FabricController` over the workers;
    ``publisher``: the :class:`WeightPublisher` they follow; ``timeout`` bounds the
    pause, the wait and the resume each; ``workers``: ids to wait for (default: every
    worker paused). ``strict`` raises :class:`transport.ControlError` when a worker
    could not be paused (nothing published) and :class:`UpdateIncomplete` unless all
    applied and resumed; ``False`` reports the others in ``failed``.
    """
    t0 = time.monotonic()
    not_paused: dict[str, str] = {}
    resumed: dict[str, Any] | None = None
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
        # Every paused worker by id, even one whose subscriber never reached the
        # publisher (none paused: those the publisher knows).
        ids = [s.worker_id for s in paused.values()] or None
        publisher.publish(state, version)
        res = publisher.wait(version, timeout, workers=ids if workers is None else workers)
    finally:
        if resumed is None:
            resumed, resume_failed = _resume(controller, timeout)
    out = FabricUpdateResult(
        res.version, dict(res.applied), dict(res.failed), list(res.missing),
        paths=dict(res.paths), resume_failed=resume_failed,
    )  # fmt: skip
    for address, why in not_paused.items():
        # One whose pause only timed out may still have applied the version safely.
        wid = resumed[address].worker_id if address in resumed else address
        if wid not in out.applied:
            out.failed.setdefault(wid, f"not paused: {why}")
    # The Ack says the subscriber applied it, the status that the engine serves it.
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
    """Resume every worker; failures returned, not raised."""
    try:
        return controller.resume(timeout), {}
    except ControlError as exc:
        return dict(exc.statuses), dict(exc.failed)


async def aupdate_weights(
    controller: Any, publisher: WeightPublisher, state: Any, version: int,
    timeout: float = 60.0, **kwargs: Any,
) -> FabricUpdateResult:  # fmt: skip
    """:func:`update_weights` for asyncio callers (runs in a thread)."""
    return await asyncio.to_thread(
        update_weights, controller, publisher, state, version, timeout, **kwargs
    )


class PausedWhileCopying:
    """The worker paused and idle while weights are written into its engine;
    ``with`` from another thread runs :meth:`acquire` and :meth:`release` on ``loop``."""

    #: Refuses to serve mixed weights: subscribers default to one-pass mode under it.
    refuses_mixed = True

    def __init__(
        self, server: Any, timeout: float, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.server = server
        self.loop = loop
        self.timeout = timeout
        self._sub: Any = None  # the subscriber whose copies this lock guards
        self._mine: int | None = None  # server.pause_requests right after our own pause
        self._free = asyncio.Event()  # set while no copy runs; used in the loop only
        self._free.set()
        server.on_resume.insert(0, self.hold_resume)  # before the engine's own hook

    def guard(self, sub: Any) -> None:
        """Guard ``sub``'s copies (its weights decide :meth:`mixed`)."""
        self._sub = sub

    def mixed(self) -> bool:
        """The guarded subscriber's weights hold no complete version."""
        return self._sub is not None and not self._sub.consistent

    async def hold_resume(self) -> None:
        """``server.on_resume``: wait for a copy; :class:`ResumeRefused` while mixed."""
        await self._free.wait()
        if self.mixed():
            raise ResumeRefused(
                f"worker {self.server.worker_id}: weights are mixed (a version failed "
                "midway); it stays paused until a complete version lands"
            )

    async def acquire(self) -> bool:
        """Pause and wait for idle; False (released) if still busy after ``timeout``."""
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
            await self.release()
        return bool(ok)

    async def release(self) -> None:
        """The copy is over: resume a pause of ours unless the weights are mixed."""
        s = self.server
        self._free.set()  # resumes see whether the copy left them mixed
        if self.mixed():
            # Refuse to serve: stay paused, keep the pause ours, health says -1.
            engine = getattr(s, "engine", None)
            if engine is not None:
                engine.version = -1
            return
        mine, self._mine = self._mine, None
        if mine is not None and s.paused and s.pause_requests == mine:
            await s.resume()

    def keepalive(self) -> None:
        """Called while waiting on the loop: the subscriber's Hello when one is due."""
        if self._sub is not None:
            self._sub.keepalive()

    @property
    def copying(self) -> bool:
        """Whether a copy holds the lock now."""
        return not self._free.is_set()

    async def lease(self, lease: float) -> None:
        """Resume a worker left paused by a trainer that is gone (:class:`PauseLease`)."""
        rule, sub = PauseLease(lease), self._sub
        while not sub.closed:
            await asyncio.sleep(min(1.0, lease / 4))
            quiet = rule.tick(
                time.monotonic(),
                paused=self.server.paused,
                copying=self.copying,
                mixed=self.mixed(),
                last_heard=sub.last_heard,
            )
            if quiet is not None:
                log.warning(
                    "worker %s paused for %.1f s with no word from the weight publisher (the "
                    "trainer is gone?): resuming on version %d, the last complete one",
                    self.server.worker_id, quiet, sub.version,
                )  # fmt: skip
                await self.server.resume()

    def _call(self, coro: Any) -> Any:
        assert self.loop is not None, "with PausedWhileCopying needs the server's loop"
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + self.timeout + 10.0
        while True:
            try:
                return fut.result(max(0.0, min(0.25, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    fut.cancel()
                    raise
                self.keepalive()  # waiting for generations can outlast worker_timeout

    def __enter__(self) -> None:
        if not self._call(self.acquire()):
            raise RuntimeError(
                f"worker {self.server.worker_id} still generating {self.timeout} s after "
                "pausing for the weight copy"
            )

    def __exit__(self, *exc: object) -> None:
        self._call(self.release())


def attach_subscriber(
    server: Any,
    endpoint: str,
    loop: asyncio.AbstractEventLoop,
    *,
    pause_timeout: float = 30.0,
    pause_lease: float = 30.0,
    **kwargs: Any,
) -> WeightSubscriber:
    """Start a :class:`WeightSubscriber` that keeps ``server.engine`` current (its
    ``model`` in place, or its ``load_weights``).

    ``server``: a :class:`transport.WorkerServer` running in ``loop``; ``endpoint``: the
    publisher's ROUTER; ``kwargs`` go to :class:`WeightSubscriber`; ``pause_timeout``:
    seconds a copy waits for generations to stop; ``pause_lease``: seconds paused with
    a silent publisher before the worker resumes (``0``: never).
    """
    engine = server.engine
    model = getattr(engine, "model", None)
    load_weights = getattr(engine, "load_weights", None)
    why = getattr(engine, "no_weights_reason", None)
    if why or engine is None or (model is None and not callable(load_weights)):
        raise TypeError(why or "the worker's engine has no .model to update and no load_weights")
    if callable(load_weights) and "loader" not in kwargs:
        kwargs["loader"] = load_weights
        kwargs.setdefault("atomic", True)

    lock = PausedWhileCopying(server, pause_timeout, loop)
    kwargs.setdefault("worker_id", server.worker_id)
    sub = WeightSubscriber(
        endpoint,
        model,
        version=int(getattr(engine, "version", -1)),
        lock=lock,
        on_applied=lambda version: setattr(engine, "version", version),
        **kwargs,
    )
    lock.guard(sub)
    sub.start()
    if pause_lease > 0:
        asyncio.run_coroutine_threadsafe(lock.lease(pause_lease), loop)
    return sub


#: The plugin's options taken from :class:`SubscriberConfig` -> its field (the keyword).
_FROM_CONFIG = {
    "shm": "shm", "path": "route", "atomic": "atomic", "data_link": "data_link",
    "digest": "report_digest", "strict": "strict", "publisher_timeout": "publisher_timeout",
}  # fmt: skip
_ALWAYS = ("shm", "digest", "strict")  # passed with the config's default; others if given
_CONFIG = {f.name: f for f in msgspec.structs.fields(SubscriberConfig)}

_PLUGIN_DOC = """The worker plugin's options, ``--plugin-opt weights_<field>=value`` (the
table in ``docs/weights.md``, "On a worker"); those of
:class:`~transport.weights.config.SubscriberConfig` keep its types and defaults."""

PluginOptions = msgspec.defstruct(
    "PluginOptions",
    [
        ("endpoint", NonEmptyStr),
        *(
            (k, _CONFIG[f].type, _CONFIG[f].default)
            if k in _ALWAYS
            else (k, _CONFIG[f].type | None, None)
            for k, f in _FROM_CONFIG.items()
        ),
        *((k, str | None, None) for k in ("dtype", "rename", "loader")),
        ("pause_timeout", Seconds | None, None),
        ("pause_lease", NonNegativeSeconds | None, None),
        *((k, str | None, None) for k in ("curve_secret", "curve_server")),
    ],
    kw_only=True,
    forbid_unknown_fields=True,
    rename=lambda n: f"weights_{n}",
    module=__name__,
    namespace={"__doc__": _PLUGIN_DOC},
)

#: Options of the worker plugin (``--plugin-opt key=value``), see :func:`subscribe`.
PLUGIN_OPTIONS = frozenset(PluginOptions.__struct_encode_fields__)


def subscriber_options(opts: dict[str, str], model: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`attach_subscriber` (but the endpoint) from the
    plugin's options; ``ValueError`` naming a bad or unknown one."""
    o = msgspec.structs.asdict(parse_options(opts, PluginOptions, "weights plugin option"))
    kw: dict[str, Any] = {"report_digest" if k == "digest" else k: o[k] for k in _ALWAYS}
    passed = [k for k in _FROM_CONFIG if k not in _ALWAYS] + ["pause_timeout", "pause_lease"]
    kw.update({k: o[k] for k in passed if o[k] is not None})
    if o["dtype"]:
        try:
            kw["dtype"] = parse_dtype_spec(o["dtype"])
        except WeightUpdateError as exc:
            raise ValueError(f"weights_dtype: {exc}") from None
    if o["rename"] and o["rename"].lstrip().startswith("{"):
        try:
            kw["rename"] = msgspec.json.decode(o["rename"], type=dict[str, str])
        except msgspec.DecodeError as exc:
            raise ValueError(f"weights_rename: not a JSON object of names ({exc})") from None
    elif o["rename"]:
        kw["rename"] = resolve_entry(o["rename"], "weights_rename")
    if o["loader"]:
        fn = resolve_entry(o["loader"], "weights_loader")
        if not callable(fn):
            raise ValueError(f"weights_loader {o['loader']!r} is not callable")
        kw["loader"] = lambda weights: fn(model, weights)
    if o["curve_secret"]:
        kw["curve"] = CurveConfig(
            secret_key_file=o["curve_secret"], server_public_key_file=o["curve_server"]
        )
    return kw


async def subscribe(server: Any, opts: dict[str, str]) -> None:
    """Worker plugin: follow the publisher at ``opts["weights_endpoint"]`` (options:
    :class:`PluginOptions`); ``ValueError`` at start for a bad or unknown option."""
    kw = subscriber_options(opts, getattr(server.engine, "model", None))
    sub = attach_subscriber(server, opts["weights_endpoint"], asyncio.get_running_loop(), **kw)
    try:
        await asyncio.Event().wait()  # lives as long as the server; cancelled at close
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(sub.close)
