"""How AReaL's weight-update calls land on fastio's weight routes.

* ``WeightUpdateMeta(type="disk")``: the trainer writes the version with
  :func:`save_for_rollout` (fastio's atomic safetensors layout,
  :mod:`transport.weights.disk`) under :func:`disk_root` of the meta; every worker runs
  fastio's disk plugin on that directory (``--plugin transport.weights.disk_follow:follow
  --plugin-opt disk_root=DIR``) and loads it while paused. AReaL pauses and resumes the
  workers itself, so this is the write of
  :func:`transport.weights.disk_follow.update_weights_on_disk` without its pause.
* ``WeightUpdateMeta(type="xccl")`` (AReaL's distributed update): the trainer publishes
  with a :class:`transport.weights.WeightPublisher` that every worker's weight plugin
  (``transport.weights.update:subscribe``) follows.

Either way the rollout side's future is done once every worker reports the version in
its status (:func:`wait_for_version`, the wait of the disk route's trainer side,
:mod:`transport.weights.disk_follow`), which a worker does only after the weights are in
place: AReaL's ``fut.result()`` means what it means with SGLang.
"""

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
    """The directory of fastio's disk versions for an AReaL disk ``WeightUpdateMeta``.

    AReaL's ``meta.with_version(v)`` turns ``.../weight_update`` into
    ``.../weight_update_v{v}`` (a directory per version, as SGLang loads them); fastio
    keeps every version under one directory with an atomic marker, so both name the
    same root: ``.../weight_update``.
    """
    if getattr(meta, "type", None) != "disk" or not getattr(meta, "path", None):
        raise ValueError("a disk weight update needs WeightUpdateMeta(type='disk', path=...)")
    path = Path(os.fspath(meta.path))
    if _VERSIONED.fullmatch(path.name):
        return path.parent / "weight_update"
    return path


def save_for_rollout(meta: Any, state: Any, version: int | None = None, *, keep: int = 2) -> Path:
    """Trainer side of the disk route: write ``state`` as ``version`` (default
    ``meta.version``) under :func:`disk_root` of ``meta``, atomically.

    Returns the version's file."""
    v = meta.version if version is None else version
    if v is None:
        raise ValueError("no version: pass version= or use meta.with_version(v)")
    return save_weights(disk_root(meta), state, int(v), keep=keep)
