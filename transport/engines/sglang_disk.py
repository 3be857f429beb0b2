"""A weight version written once per directory, for servers that load from disk (the
SGLang bridge's ``weights_dir``): workers that share the directory write it once."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DONE", "write_version"]

#: The file in a version directory that says it is complete (and what it holds).
DONE = "fastio-version.json"
_WEIGHTS = "model.safetensors"
_VERSION_DIR = re.compile(r"^\.?v(\d{8})-[0-9a-f]+(\.lock)?$")
_LOCK_POLL_S = 0.02  # how often a worker looks again at a version another one writes


def write_version(
    root: Path,
    weights: Sequence[tuple[str, Any]],
    version: int,
    *,
    timeout: float = 600.0,
    prepare: Callable[[Path], None] | None = None,
) -> Path:
    """The directory of ``version`` of ``weights`` under ``root``, written there once for
    every process that shares ``root`` (how: ``docs/engines.md``, "a version written once
    per host"); ``prepare(dir)`` adds files before it is renamed into place; waits at most
    ``timeout`` s for another writer."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    fp = _fingerprint(weights)
    name = f"v{version:08d}-{fp}"
    final = root / name
    if _intact(final, version, fp):
        return final
    fd = os.open(root / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    from transport.weights.errors import WeightUpdateError

                    raise WeightUpdateError(
                        f"{final} is still being written by another worker after {timeout} s"
                    ) from None
                time.sleep(_LOCK_POLL_S)  # another worker is writing it
        try:
            if not _intact(final, version, fp):
                _write(root, final, weights, version, fp, prepare)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    _forget_old(root, version)
    return final


def _fingerprint(weights: Sequence[tuple[str, Any]]) -> str:
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(weights, key=lambda p: p[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        flat = t.detach().reshape(-1)
        n = flat.numel()
        if not n:
            continue
        idx = torch.linspace(0, n - 1, min(n, 64), device=flat.device).long()
        h.update(flat.index_select(0, idx).to("cpu").contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _crc32(path: Path) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return zlib.crc32(mm)


def _intact(final: Path, version: int, fp: str) -> bool:
    try:  # a complete version directory of these weights (DONE agrees)
        done = json.loads((final / DONE).read_text())
        f = final / _WEIGHTS
        ok = done.get("version") == version and done.get("fingerprint") == fp
        return bool(ok and f.stat().st_size == done.get("size") and _crc32(f) == done.get("crc32"))
    except (OSError, ValueError, AttributeError):
        return False


def _write(
    root: Path,
    final: Path,
    weights: Sequence[tuple[str, Any]],
    version: int,
    fp: str,
    prepare: Callable[[Path], None] | None,
) -> None:
    from transport.weights.disk import fsync_path, save_weights

    scratch = root / f".tmp-{final.name}-{secrets.token_hex(4)}"
    try:
        f = save_weights(scratch, weights, version)  # fsynced, in its own directory
        d = f.parent
        if prepare is not None:
            prepare(d)
        done = {"version": version, "fingerprint": fp, "size": f.stat().st_size, "crc32": _crc32(f)}
        (d / DONE).write_text(json.dumps(done))
        fsync_path(d / DONE)
        fsync_path(d)
        if final.exists():  # a directory that failed its check
            shutil.rmtree(final)
        os.rename(d, final)
        fsync_path(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _forget_old(root: Path, version: int) -> None:
    for p in root.iterdir():
        m = _VERSION_DIR.match(p.name)
        if m is None or int(m.group(1)) >= version - 1:
            continue
        with contextlib.suppress(OSError):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
