"""A worker's background jobs (a weight subscriber, an engine's lifetime): coroutines
started with the server on the engine's loop and cancelled when it closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["start_jobs"]

log = logging.getLogger("transport.worker")


async def start_jobs(
    jobs: Sequence[Callable[[Any], Awaitable[None]]], arg: Any
) -> list[asyncio.Task[Any]]:
    """Start each ``job(arg)`` in a task; returns the tasks.

    Raises
    ------
    RuntimeError
        A job failed as it started (bad options, say), naming it: a worker must not
        report ready without what it was told to run. Every task is cancelled then.
    """
    tasks = [asyncio.ensure_future(job(arg)) for job in jobs]
    if tasks:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    for task, job in zip(tasks, jobs, strict=True):
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            for other in tasks:
                other.cancel()
            await asyncio.wait(tasks, timeout=5)
            name = getattr(job, "__qualname__", repr(job))
            raise RuntimeError(
                f"background job {name} failed at start: {type(exc).__name__}: {exc}"
            ) from exc
    for task in tasks:
        task.add_done_callback(_log_failure)
    return tasks


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background job failed", exc_info=task.exception())
