"""A verified weight version laid out in one shared-memory file for vLLM's worker process
(:func:`stage`, :func:`open_staged`), and the rules that drive its load (:class:`UpdateState`;
``docs/engines.md#vllm``). No vLLM import here: the bridge's process has no vLLM.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastio._optional import require
from transport.engines.flight import VersionLabels

__all__ = [
    "PROTOCOL",
    "StagedCorrupt",
    "StagedVersion",
    "UpdateState",
    "VersionLabels",
    "WeightSync",
    "drive_update",
    "open_staged",
    "stage",
]

#: The layout's version, in ``update_info["protocol"]``; a backend refuses another.
PROTOCOL = 1
log = logging.getLogger("transport.engines")
_ALIGN = 64


class StagedCorrupt(ValueError):
    """A staged file whose size or hash is not what its ``update_info`` says (nothing
    was loaded)."""


@dataclass
class StagedVersion:
    """One staged version: its file and the ``update_info`` that names it."""

    path: str
    update_info: dict[str, Any]

    def close(self) -> None:
        """Remove the file (the backend holds no mapping after its update returns)."""
        with suppress(FileNotFoundError):
            os.unlink(self.path)


def _digest(buf: Any) -> str:
    return str(require("xxhash", "weights", "the xxh3_64 checksum").xxh3_64_hexdigest(buf))


def _view(mm: Any, dtype: torch.dtype, shape: list[int], offset: int) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def stage(
    pairs: Iterable[tuple[str, torch.Tensor]], version: int, directory: str = "/dev/shm"
) -> StagedVersion:
    """Write ``pairs`` (CPU or CUDA tensors) into a new file under ``directory`` (one
    copy each) and return it with its ``update_info``."""
    items = [(name, t.detach()) for name, t in pairs]
    layout: list[list[Any]] = []
    size = 0
    for name, t in items:
        size = -(-size // _ALIGN) * _ALIGN
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), size])
        size += t.numel() * t.element_size()
    path = os.path.join(directory, f"fastio-vllm-{os.getpid()}-v{version}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mm:
            for (_, t), (_, _, shape, off) in zip(items, layout, strict=True):
                if t.numel():
                    _view(mm, t.dtype, shape, off).copy_(t)
            digest = _digest(memoryview(mm)[:size])
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    info = {
        "protocol": PROTOCOL, "version": version, "path": path, "size": size,
        "xxh3_64": digest, "tensors": layout,
    }  # fmt: skip
    return StagedVersion(path, info)


@contextmanager
def open_staged(info: dict[str, Any]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The ``(name, tensor)`` views of a staged file, after its size and hash were
    checked (:class:`StagedCorrupt` otherwise); valid inside the ``with``."""
    if info.get("protocol") != PROTOCOL:
        raise StagedCorrupt(f"staged layout protocol {info.get('protocol')!r}, expected {PROTOCOL}")
    path, size = str(info["path"]), int(info["size"])
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if actual < size:
            raise StagedCorrupt(f"{path}: {actual} bytes, update_info says {size}")
        mm = mmap.mmap(f.fileno(), max(size, 1), prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       flags=mmap.MAP_PRIVATE)  # fmt: skip
    try:
        if (got := _digest(memoryview(mm)[:size])) != info["xxh3_64"]:
            raise StagedCorrupt(f"{path}: xxh3_64 {got}, update_info says {info['xxh3_64']}")
        views = [
            (str(name), _view(mm, getattr(torch, dtype), list(shape), int(off)))
            for name, dtype, shape, off in info["tensors"]
        ]
        yield views
        del views
    finally:
        with suppress(BufferError):  # a loader kept a view: the mapping goes with it
            mm.close()


class WeightSync(Protocol):
    """vLLM's weight-sync surface as fastio drives it: its HTTP routes (the bridge) or
    ``AsyncLLM``'s methods (vLLM in the worker)."""

    async def init_transfer(self) -> None:
        """``init_weight_transfer_engine`` with fastio's init info."""

    async def pause_in_place(self) -> None:
        """``pause_generation(mode="keep")``."""

    async def resume(self) -> None:
        """``resume_generation``."""

    async def start_update(self) -> None:
        """``start_weight_update``."""

    async def update(self, update_info: dict[str, Any]) -> None:
        """``update_weights`` with one staged version."""

    async def finish_update(self, label: str) -> None:
        """``finish_weight_update`` labelled ``label``."""

    async def label(self) -> str:
        """The weight version vLLM reports."""


async def drive_update(sync: WeightSync, info: dict[str, Any], version: int, paused: bool) -> None:
    """Load one staged version: pause in place unless ``paused`` (never an update while
    vLLM generates), start, update, finish labelled ``version``; raises unless vLLM then
    reports that label."""
    if not paused:
        await sync.pause_in_place()
    await sync.start_update()
    await sync.update(info)
    await sync.finish_update(str(version))
    if (label := await sync.label()) != str(version):
        raise RuntimeError(f"vLLM reports weight version {label!r} after loading {version}")


class UpdateState:
    """fastio's rules for one vLLM engine, the bridge's and vLLM in the worker alike: a
    pause keeps vLLM's requests in place; never an update while vLLM generates; a load
    that failed once vLLM started it leaves the engine paused (mixed) until a whole
    version lands. ``where`` names the engine in the log."""

    def __init__(self, sync: WeightSync, where: str = "") -> None:
        self.sync = sync
        self.where = where
        self._kept = False  # paused in place by fastio (requests frozen, not ended)
        self._mixed = False
        self._ready = False  # init_weight_transfer_engine done

    @property
    def kept(self) -> bool:
        """The engine is paused in place by fastio (its requests frozen, not ended)."""
        return self._kept

    @property
    def mixed(self) -> bool:
        """The last load failed after vLLM started it."""
        return self._mixed

    async def pause(self) -> None:
        """Pause in place; :attr:`kept` from the moment it is asked (streams are read on,
        not interrupted) until it failed or the engine resumed."""
        self._kept = True
        try:
            await self.sync.pause_in_place()
        except BaseException:
            self._kept = False
            raise

    async def resume(self) -> bool:
        """Resume an engine fastio paused, unless its weights are mixed; returns whether
        it resumed."""
        if not self._kept:
            return False
        if self._mixed:
            log.error("vLLM%s stays paused: its weights are mixed (a load failed)", self.where)
            return False
        await self.sync.resume()
        self._kept = False
        return True

    async def load(self, info: dict[str, Any], version: int) -> None:
        """:func:`drive_update` once the transfer is initialised; the engine stays paused
        in place after it, and :attr:`mixed` says whether the load failed."""
        if not self._ready:
            await self.sync.init_transfer()
            self._ready = True
        paused, self._kept = self._kept, True
        try:
            await drive_update(self.sync, info, version, paused)
        except BaseException:
            self._mixed = True
            raise
        self._mixed = False

    def load_pairs(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        version: int,
        directory: str,
        run: Callable[[Coroutine[Any, Any, None]], object],
    ) -> None:
        """Stage ``pairs`` under ``directory``, :meth:`load` them through ``run`` (which
        runs the coroutine on the engine's loop and waits), and remove the staged file."""
        staged = stage(pairs, version, directory)
        try:
            run(self.load(staged.update_info, version))
        finally:
            staged.close()
