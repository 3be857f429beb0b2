"""Disk route: versions as safetensors files under ``WeightUpdateMeta.path``, written
atomically and read with every name, shape and dtype checked (layout:
``docs/PROTOCOL.md``, "Disk path")."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

try:
    import torch
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "weights", "transport.weights.disk") from exc

from fastio._optional import require
from fastio.io_struct import WeightUpdateMeta
from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.binding import Binding, DtypeSpec, Rename, parse_dtype_spec
from transport.weights.bucket import BucketApplier, named_tensors, split_aliases
from transport.weights.errors import WeightMismatchError, WeightUpdateError

__all__ = ["MARKER", "latest_version", "load_weights", "save_weights"]

#: Name of the file that points at the newest complete version.
MARKER = "LATEST"
_FILE = "model.safetensors"
# safetensors dtype -> the bucket's dtype name
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}  # fmt: skip


def _root(where: WeightUpdateMeta | str | os.PathLike[str]) -> Path:
    if isinstance(where, WeightUpdateMeta):
        if where.type != "disk" or not where.path:
            raise ValueError("a disk weight update needs WeightUpdateMeta(type='disk', path=...)")
        return Path(where.path)
    return Path(where)


def _dirname(version: int) -> str:
    return f"v{version:08d}"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(
    where: WeightUpdateMeta | str | os.PathLike[str], state: Any, version: int, *, keep: int = 2
) -> Path:
    """Write ``state`` (module, state dict or ``(name, tensor)`` pairs) as ``version``
    under ``where`` (a ``type="disk"`` :class:`WeightUpdateMeta` or a directory) and make
    it the latest, atomically; keep the newest ``keep`` versions. Returns its file;
    ``ValueError`` when ``version`` is not newer than the latest on disk."""
    root = _root(where)
    root.mkdir(parents=True, exist_ok=True)
    current = latest_version(root)
    if current is not None and version <= current:
        raise ValueError(f"version {version} is not newer than the latest on disk ({current})")
    unique, aliases = split_aliases(named_tensors(state))
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for n, t in unique.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()  # overlapping views of one storage: safetensors wants them apart
        storages.add(ptr)
        tensors[n] = t
    name = _dirname(version)
    tmp = root / f".tmp-{name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        f = tmp / _FILE
        meta = {"fastio_version": str(version)}
        if aliases:  # tied weights: stored once, applied to every name
            meta["fastio_aliases"] = json.dumps(aliases, sort_keys=True)
        _save_file(tensors, str(f), metadata=meta)
        fsync_path(f)
        fsync_path(tmp)
        final = root / name
        if final.exists():  # left by a writer that died before moving the marker
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(root)
    marker_tmp = root / f".{MARKER}.{secrets.token_hex(4)}"
    marker_tmp.write_text(json.dumps({"version": version, "dir": name}))
    fsync_path(marker_tmp)
    os.replace(marker_tmp, root / MARKER)
    fsync_path(root)
    _gc(root, keep=max(1, keep))
    return root / name / _FILE


def _save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    st = require("safetensors.torch", "weights", "saving weights to disk")
    st.save_file(tensors, path, metadata=metadata)


def _gc(root: Path, keep: int) -> None:
    versions = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    for p in versions[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # temporaries of writers that died
        if p.name.startswith(".tmp-") and p.is_dir():
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < os.path.getmtime(root / MARKER) - 60:
                    shutil.rmtree(p, ignore_errors=True)


def _marker(root: Path) -> tuple[int, str] | None:  # the latest version and its directory
    try:
        data = json.loads((root / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"unreadable weight marker {root / MARKER}: {exc}") from exc
    ok = isinstance(data, dict) and isinstance(data.get("version"), int)
    if not ok or not isinstance(data.get("dir"), str):
        raise WeightUpdateError(f"malformed weight marker {root / MARKER}: {data!r}")
    return data["version"], data["dir"]


def latest_version(where: WeightUpdateMeta | str | os.PathLike[str]) -> int | None:
    """The newest complete version under ``where`` (``None`` if there is none)."""
    m = _marker(_root(where))
    return None if m is None else m[0]


def _parse(mm: mmap.mmap, path: Path) -> tuple[WeightBucketInfo, int, dict[str, str]]:
    """The header as one bucket (offsets from the data start), the data start, aliases."""
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(bytes(mm[8 : 8 + n]))
    except (struct.error, ValueError) as exc:
        raise WeightUpdateError(f"{path}: not a safetensors file ({exc})") from exc
    try:
        raw = (header.pop("__metadata__", None) or {}).get("fastio_aliases") or "{}"
        aliases = {str(k): str(v) for k, v in json.loads(raw).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise WeightUpdateError(f"{path}: bad fastio_aliases metadata ({exc})") from exc
    tensors = []
    for name, spec in header.items():
        dt = _ST_DTYPES.get(spec.get("dtype"))
        if dt is None:
            raise WeightMismatchError(f"{path}: unsupported dtype {spec.get('dtype')} of {name!r}")
        a, b = spec["data_offsets"]
        tensors.append(WeightTensor(name, dt, tuple(spec["shape"]), int(a), int(b) - int(a)))
    tensors.sort(key=lambda t: t.offset)
    return WeightBucketInfo(0, len(mm) - 8 - n, 0, tensors), 8 + n, aliases


def load_weights(
    where: WeightUpdateMeta | str | os.PathLike[str],
    target: Any,
    *,
    version: int | None = None,
    strict: bool = True,
    dtype: DtypeSpec = None,
    rename: Rename = None,
) -> int:
    """Copy the latest (or the given) version into ``target`` in place; returns it.

    Tied weights are applied to every name; ``dtype`` and ``rename`` as for
    :class:`transport.weights.WeightSubscriber`. Raises :class:`WeightMismatchError`
    (names, shapes or dtypes differ; nothing written) or :class:`WeightUpdateError` (no
    version on disk, an unreadable file)."""
    root = _root(where)
    targets = named_tensors(target)
    spec = parse_dtype_spec(dtype)
    for _ in range(5):  # lost a race with the writer's clean-up: follow the new marker
        m = (version, _dirname(version)) if version is not None else _marker(root)
        if m is None:
            raise WeightUpdateError(f"no weights under {root} (no {MARKER} marker)")
        path = root / m[1] / _FILE
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            if version is not None:
                raise WeightUpdateError(f"version {version} is not on disk under {root}") from None
            continue
        try:
            info, start, aliases = _parse(mm, path)
            binding = Binding(
                [info], targets, aliases=aliases, rename=rename, dtype=spec, strict=strict
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mapping, only read
                data = (
                    [torch.frombuffer(mm, dtype=torch.uint8, offset=start)] if info.nbytes else []
                )
            applier = BucketApplier(targets)
            applier.apply(info, data, binding.dests)
            applier.finish()
            del data
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        return m[0]
    raise WeightUpdateError(f"could not read a stable version under {root}")
