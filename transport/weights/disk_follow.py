"""The disk route's drivers: a worker plugin that follows a directory of versions
(:func:`follow`), and the trainer call that writes a version and waits until every
worker holds it (:func:`update_weights_on_disk`); ``docs/weights.md``, "Disk"."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from transport.errors import ControlError
from transport.options import NonEmptyStr, Seconds, parse_options
from transport.weights.disk import _dirname, latest_version, load_weights, save_weights
from transport.weights.errors import WeightUpdateError
from transport.weights.update import PausedWhileCopying

if TYPE_CHECKING:
    from transport.control import FabricController

__all__ = ["DISK_OPTIONS", "DiskFollower", "DiskOptions", "follow", "update_weights_on_disk",
           "wait_for_version"]  # fmt: skip

log = logging.getLogger("transport.weights.disk_follow")


class DiskFollower:
    """Keeps ``server.engine`` (with ``version`` and ``load_weights_from_disk`` or a
    ``model``) at the newest version under ``root``, loaded while the worker is paused
    (``docs/weights.md``, "Disk"); options as :class:`DiskOptions`. :attr:`refused` is
    the last version that failed to load (not retried; the worker keeps its weights)."""

    def __init__(
        self,
        server: Any,
        root: str | Path,
        *,
        poll: float = 0.05,
        pause_timeout: float = 30.0,
        strict: bool = True,
    ) -> None:
        engine = server.engine
        if engine is None:
            raise TypeError("the disk plugin needs an engine object, not a bare handler")
        self.hook = getattr(engine, "load_weights_from_disk", None)
        if self.hook is None and getattr(engine, "model", None) is None:
            raise TypeError(
                f"engine {type(engine).__name__} has no load_weights_from_disk and no .model "
                "to load weights into"
            )
        if poll <= 0 or pause_timeout <= 0:
            raise ValueError("disk_poll and disk_pause_timeout must be positive")
        self.server = server
        self.engine = engine
        self.root = Path(root)
        self.poll = poll
        self.pause_timeout = pause_timeout
        self.strict = strict
        self.refused: int | None = None
        # No generation under a running load; a resume waits for it.
        self.gate = PausedWhileCopying(server, pause_timeout)

    async def run(self) -> None:
        """Look at the marker every ``poll`` seconds until cancelled."""
        while True:
            try:
                v = await asyncio.to_thread(latest_version, self.root)
            except WeightUpdateError as exc:
                log.warning("worker %s: %s", self.server.worker_id, exc)
                v = None
            if v is not None and v > int(self.engine.version) and v != self.refused:
                await self.load(v)
            await asyncio.sleep(self.poll)  # the polling period, not a synchronisation

    async def load(self, version: int) -> bool:
        """Load ``version`` (or a newer one written meanwhile) while the worker is
        paused; True when the engine serves it."""
        s = self.server
        if not await self.gate.acquire():
            msg = "worker %s: generations still running %.1f s after pausing for version %d from disk; trying again"
            log.warning(msg, s.worker_id, self.pause_timeout, version)
            return False
        try:
            if self.hook is not None:
                await self.hook(str(self.root / _dirname(version)), version)
                self.engine.version = version
            else:  # the newest version, not ``version``: a clean-up meanwhile does not fail it
                self.engine.version = await asyncio.to_thread(
                    load_weights, self.root, self.engine.model, strict=self.strict
                )
        except Exception as exc:  # the engine's own loader may raise anything
            self.refused = version
            msg = "worker %s: version %d from %s refused, keeping version %d: %s"
            log.error(msg, s.worker_id, version, self.root, self.engine.version, exc)
            return False
        finally:
            await self.gate.release()
        log.info(
            "worker %s: loaded version %d from %s", s.worker_id, self.engine.version, self.root
        )
        return True


class DiskOptions(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename=lambda n: f"disk_{n}"
):
    """The plugin's options, ``--plugin-opt disk_<field>=value`` (see :func:`follow`)."""

    root: NonEmptyStr
    poll: Seconds = 0.05
    pause_timeout: Seconds = 30.0
    strict: bool = True


#: Options of the plugin (``--plugin-opt key=value``), see :func:`follow`.
DISK_OPTIONS = frozenset(DiskOptions.__struct_encode_fields__)


async def follow(server: Any, opts: dict[str, str]) -> None:
    """Fabric worker plugin: a :class:`DiskFollower` of ``opts["disk_root"]``.

    Options (``--plugin-opt key=value``, :class:`DiskOptions`): ``disk_root``
    (required), ``disk_poll`` (0.05 s), ``disk_pause_timeout`` (30 s), ``disk_strict``
    (1); other keys are left to other plugins. ``ValueError``: a missing root, an unknown
    ``disk_`` key or a malformed value; ``TypeError``: an engine that cannot load weights.
    """
    o = parse_options(opts, DiskOptions, "disk plugin option", prefix="disk_")
    follower = DiskFollower(
        server, o.root, poll=o.poll, pause_timeout=o.pause_timeout, strict=o.strict
    )
    await follower.run()


def wait_for_version(
    controller: FabricController, version: int, timeout: float, poll: float = 0.02
) -> dict[str, int]:
    """Block until every worker of ``controller`` reports ``version`` or newer; worker
    address -> version reported (:class:`WeightUpdateError` after ``timeout``)."""
    deadline = time.monotonic() + timeout
    addresses = controller.addresses
    while True:
        left = deadline - time.monotonic()
        try:
            statuses = controller.health(max(0.05, min(5.0, left)), strict=False)
        except ControlError:
            statuses = {}
        seen = {a: s.version for a, s in statuses.items()}
        if all(seen.get(a, -1) >= version for a in addresses):
            return seen
        if left <= 0:
            report = {a: seen.get(a, "no answer") for a in addresses}
            raise WeightUpdateError(
                f"version {version} not reported by every worker within {timeout} s: {report}"
            )
        time.sleep(min(poll, max(0.0, left)))  # the health polling period


def update_weights_on_disk(
    controller: FabricController,
    where: Any,
    state: Any,
    version: int,
    timeout: float = 60.0,
    *,
    keep: int = 2,
) -> dict[str, int]:
    """Pause the workers, write ``version`` under ``where`` (as
    :func:`~transport.weights.disk.save_weights`), wait up to ``timeout`` until every worker
    reports it, resume them; worker address -> version after the resume. Raises
    :class:`transport.ControlError` (pause or resume failed) or
    :class:`~transport.weights.WeightUpdateError` (not reported in time; resumed anyway)."""
    controller.pause(timeout)
    try:
        save_weights(where, state, version, keep=keep)
        wait_for_version(controller, version, timeout)
    finally:
        statuses = controller.resume(timeout)
    return {a: s.version for a, s in statuses.items()}
