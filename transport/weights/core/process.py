"""Which process a peer is: its pid and start time (``/proc/<pid>/stat``)."""

from __future__ import annotations

__all__ = ["process_alive", "process_start_time"]


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), ``None`` when this
    process cannot see ``pid`` (gone, a zombie, or another pid namespace)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])  # a zombie runs no code


def process_alive(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` started at ``start_time`` still runs (a reused pid has
    another start time)."""
    return process_start_time(pid) == start_time
