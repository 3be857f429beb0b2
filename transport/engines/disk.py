"""The disk route to engines: a trainer writes a version once to a shared directory,
every worker has its engine load it, and each worker's version follows once its engine
confirms.

Trainer side::

    update_weights_on_disk(controller, "/shared/weights", model, version=step)

pauses every worker, writes ``version`` with :func:`transport.weights.disk.save_weights`
(atomically: a ``LATEST`` marker moves last), waits until every worker reports the
version (its health status), and resumes them.

Worker side, a plugin::

    fastio-worker ... --plugin transport.engines.disk:follow \\
        --plugin-opt weights_dir=/shared/weights

polls the directory's marker; for a newer version it pauses the worker if no one did
(generations end with ``interrupt``), has the engine load it, sets the worker's version
and resumes what it paused. The engine loads it with ``await
engine.load_weights_from_disk(path, version)`` when it has that hook (the SGLang bridge
hands the directory to its server), else by copying the file into ``engine.model`` in
place. A version that fails to load is logged and skipped; the worker keeps its
previous version (which the trainer sees).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from transport.errors import ControlError

__all__ = ["FOLLOW_OPTIONS", "follow", "update_weights_on_disk"]

log = logging.getLogger("transport.engines")

#: Options of :func:`follow` (``--plugin-opt key=value``).
FOLLOW_OPTIONS = frozenset({"weights_dir", "weights_poll", "weights_pause_timeout"})


async def load_version(server: Any, root: Path, version: int) -> None:
    """Have ``server.engine`` load ``version`` from ``root`` and set its version."""
    engine = server.engine
    path = root / f"v{version:08d}"
    hook = getattr(engine, "load_weights_from_disk", None)
    if hook is not None:
        await hook(str(path), version)
        engine.version = version
        return
    model = getattr(engine, "model", None)
    if model is None:
        raise TypeError(
            f"engine {type(engine).__name__} has no load_weights_from_disk and no .model"
        )
    from transport.weights.disk import load_weights

    await asyncio.to_thread(load_weights, root, model, version=version)
    engine.version = version


async def follow(server: Any, opts: dict[str, str]) -> None:
    """Worker plugin: follow the versions written under ``opts["weights_dir"]``.

    Options: ``weights_dir`` (required), ``weights_poll`` (seconds between looks at the
    marker, default 0.2), ``weights_pause_timeout`` (seconds to wait for generations
    to stop, default 30). Other keys are left to other plugins.
    """
    from transport.weights.disk import latest_version

    if not opts.get("weights_dir"):
        raise ValueError("the disk plugin needs --plugin-opt weights_dir=<directory>")
    root = Path(opts["weights_dir"])
    poll = float(opts.get("weights_poll", "0.2"))
    pause_timeout = float(opts.get("weights_pause_timeout", "30"))
    if server.engine is None:
        raise TypeError("the disk plugin needs an engine object, not a bare handler")
    failed: int | None = None
    while True:
        try:
            latest = await asyncio.to_thread(latest_version, root)
        except Exception as exc:
            log.warning("cannot read the weight marker under %s: %s", root, exc)
            latest = None
        current = int(getattr(server.engine, "version", 0))
        if latest is not None and latest > current and latest != failed:
            ours = not server.paused
            n = server.pause_requests
            try:
                if await server.pause(pause_timeout):
                    await load_version(server, root, latest)
                    log.info("worker %s loaded version %d from %s", server.worker_id, latest, root)
                else:
                    log.warning("generations still running: version %d not loaded yet", latest)
            except Exception as exc:
                failed = latest
                log.error("version %d under %s not loaded: %s", latest, root, exc)
            finally:
                # Resume only a pause this plugin made and no one renewed since.
                if ours and server.paused and server.pause_requests == n + 1:
                    await server.resume()
        await asyncio.sleep(poll)  # the marker is a file: look again later


def update_weights_on_disk(
    controller: Any, where: Any, state: Any, version: int, timeout: float = 60.0
) -> dict[str, int]:
    """Pause the workers, write ``version`` once under ``where``, wait until every
    worker reports it, resume them.

    Returns
    -------
    dict
        Worker address -> the version it reports after the resume.

    Raises
    ------
    transport.ControlError
        A worker could not be paused, or did not report the version within
        ``timeout`` (the workers are resumed either way).
    """
    from transport.weights.disk import save_weights

    controller.pause(timeout)
    try:
        save_weights(where, state, version)
        deadline = time.monotonic() + timeout
        while True:
            statuses = controller.health(timeout)
            behind = {a: s.version for a, s in statuses.items() if s.version < version}
            if statuses and not behind:
                break
            if time.monotonic() >= deadline:
                raise ControlError(
                    f"version {version} not loaded within {timeout} s by {behind or 'anyone'}",
                    {a: f"reports version {v}" for a, v in behind.items()},
                    statuses,
                )
            time.sleep(0.05)  # workers poll the marker: ask again shortly
    finally:
        statuses = controller.resume(timeout)
    return {a: s.version for a, s in statuses.items()}
