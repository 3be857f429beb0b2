"""Worker side of the disk path: follow a directory of versions and load each new one.

A trainer writes versions with :func:`transport.weights.disk.save_weights` (atomic
safetensors files and a ``LATEST`` marker). A worker started with this plugin::

    python -m transport.worker ... --plugin transport.weights.disk_follow:follow \\
        --plugin-opt disk_root=/shared/weights

watches the marker and loads every newer complete version into ``engine.model`` in
place, then sets ``engine.version``; the worker's status (health, pongs) reports it, so
a controller sees when every worker holds a version. A copy never overlaps a generation
step: it runs while the worker is paused. When a controller paused the worker already
(the usual ``pause -> write -> wait -> resume`` of a weight update) the copy only waits
until no handler runs, and a resume meanwhile waits for the copy to end; otherwise the
follower pauses the worker itself for the copy and resumes it after.

A version whose names, shapes or dtypes do not match the model is refused before any
byte is written (the worker keeps its weights and version, and logs why); it is not
retried, a later version is.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from transport.weights.disk import latest_version, load_weights
from transport.weights.errors import WeightUpdateError

__all__ = ["DISK_OPTIONS", "DiskFollower", "follow"]

log = logging.getLogger("transport.weights.disk_follow")

#: Options of the plugin (``--plugin-opt key=value``), see :func:`follow`.
DISK_OPTIONS = frozenset({"disk_root", "disk_poll", "disk_pause_timeout", "disk_strict"})


class DiskFollower:
    """Keeps ``server.engine`` at the newest version under ``root``.

    Parameters
    ----------
    server:
        A :class:`transport.WorkerServer` whose engine has ``model`` and ``version``.
    root:
        The directory :func:`~transport.weights.disk.save_weights` writes into.
    poll:
        Seconds between two looks at the marker (one small file read).
    pause_timeout:
        Seconds a copy waits for running generations to stop; past that the version
        is tried again at the next look.
    strict:
        Every parameter of the model must be in the file.
    """

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
        if engine is None or not hasattr(engine, "model"):
            raise TypeError("the worker's engine has no .model to load weights into")
        if poll <= 0 or pause_timeout <= 0:
            raise ValueError("disk_poll and disk_pause_timeout must be positive")
        self.server = server
        self.engine = engine
        self.root = Path(root)
        self.poll = poll
        self.pause_timeout = pause_timeout
        self.strict = strict
        #: The last version refused (not retried; a newer one is).
        self.refused: int | None = None
        self._free = asyncio.Event()  # set while no copy runs
        self._free.set()
        server.on_resume.append(self._hold_resume)

    async def _hold_resume(self) -> None:
        # A controller's resume must not let generation start under a running copy.
        await self._free.wait()

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
        ours = not s.paused
        n = s.pause_requests
        self._free.clear()
        try:
            if not await s.pause(self.pause_timeout):
                log.warning(
                    "worker %s: generations still running %.1f s after pausing for version "
                    "%d from disk; trying again",
                    s.worker_id,
                    self.pause_timeout,
                    version,
                )
                return False
            try:
                loaded = await asyncio.to_thread(
                    load_weights, self.root, self.engine.model, strict=self.strict
                )
            except WeightUpdateError as exc:
                self.refused = version
                log.error(
                    "worker %s: version %d from %s refused, keeping version %d: %s",
                    s.worker_id,
                    version,
                    self.root,
                    self.engine.version,
                    exc,
                )
                return False
            self.engine.version = loaded
            log.info("worker %s: loaded version %d from %s", s.worker_id, loaded, self.root)
            return True
        finally:
            self._free.set()
            # Resume only a pause we took and no one renewed: a controller that paused
            # meanwhile was promised that nothing generates until it resumes.
            if ours and s.paused and s.pause_requests == n + 1:
                await s.resume()


def _flag(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"disk_strict: expected a boolean, got {v!r}")


async def follow(server: Any, opts: dict[str, str]) -> None:
    """Fabric worker plugin: follow the disk versions under ``opts["disk_root"]``.

    Options (``--plugin-opt key=value``): ``disk_root`` (required), ``disk_poll``
    (seconds, default 0.05), ``disk_pause_timeout`` (seconds, default 30),
    ``disk_strict`` (default 1). Raises ``ValueError`` at start for a missing root or a
    malformed value.
    """
    root = opts.get("disk_root")
    if not root:
        raise ValueError("the disk plugin needs --plugin-opt disk_root=<directory>")
    kw: dict[str, Any] = {}
    for key, arg in (("disk_poll", "poll"), ("disk_pause_timeout", "pause_timeout")):
        if key in opts:
            try:
                kw[arg] = float(opts[key])
            except ValueError:
                raise ValueError(f"{key}: expected seconds, got {opts[key]!r}") from None
    if "disk_strict" in opts:
        kw["strict"] = _flag(opts["disk_strict"])
    await DiskFollower(server, root, **kw).run()
