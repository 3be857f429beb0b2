"""How AReaL's weight-update calls land on fastio's weight routes (``docs/areal.md#weights``):
the trainer's disk write (:func:`save_for_rollout`), the rollout side's wait for every
worker (:func:`wait_for_version`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from transport.weights.disk import save_weights
from transport.weights.disk_follow import wait_for_version

__all__ = ["disk_root", "save_for_rollout", "wait_for_version"]

_VERSIONED = re.compile(r"weight_update_v\d+")


def disk_root(meta: Any) -> Path:
    """The directory of fastio's disk versions for an AReaL disk ``WeightUpdateMeta``:
    ``.../weight_update`` for AReaL's per-version ``.../weight_update_v{v}`` too (fastio
    keeps every version under one directory)."""
    if getattr(meta, "type", None) != "disk" or not getattr(meta, "path", None):
        raise ValueError("a disk weight update needs WeightUpdateMeta(type='disk', path=...)")
    path = Path(os.fspath(meta.path))
    return path.parent / "weight_update" if _VERSIONED.fullmatch(path.name) else path


def save_for_rollout(meta: Any, state: Any, version: int | None = None, *, keep: int = 2) -> Path:
    """Trainer side of the disk route: write ``state`` as ``version`` (default
    ``meta.version``) under :func:`disk_root` of ``meta``, atomically; returns its file."""
    v = meta.version if version is None else version
    if v is None:
        raise ValueError("no version: pass version= or use meta.with_version(v)")
    return save_weights(disk_root(meta), state, int(v), keep=keep)
