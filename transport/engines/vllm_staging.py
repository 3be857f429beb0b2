"""A verified version staged in one shared-memory file for vLLM's workers (:func:`stage`,
:func:`open_staged`) and the rules of its load (:class:`UpdateState`). No vLLM import here:
the bridge's process has no vLLM (``docs/engines.md#vllm``)."""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch

from transport.weights.bucket import ALIGNMENT, Hasher, plan_spans

__all__ = ["PROTOCOL", "StagedCorrupt", "UpdateState", "WeightSync", "open_staged", "stage"]

#: The layout's version, in ``update_info["protocol"]``; a backend refuses another.
PROTOCOL = 1
log = logging.getLogger("transport.engines")


class StagedCorrupt(ValueError):
    """A staged file's size or hash is not its ``update_info``'s (nothing was loaded)."""


def _digest(buf: Any) -> str:
    h = Hasher("xxh3_64")
    h.update(buf)
    return f"{h.digest():016x}"


def _view(mm: Any, dtype: torch.dtype, shape: list[int], offset: int) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def stage(
    pairs: Iterable[tuple[str, torch.Tensor]], version: int, directory: str = "/dev/shm"
) -> dict[str, Any]:
    """Copy ``pairs`` (CPU or CUDA tensors) into a new file under ``directory``, each at a
    multiple of 64 bytes; its ``update_info`` (``path``: the file, the caller's to remove)."""
    items = [(name, t.detach()) for name, t in pairs]
    specs = [(name, str(t.dtype).removeprefix("torch."), t.shape) for name, t in items]
    spans = plan_spans(specs, sys.maxsize, ALIGNMENT, lambda d: getattr(torch, d))
    entries, size = next(spans, ([], 0))
    path = os.path.join(directory, f"fastio-vllm-{os.getpid()}-v{version}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mm:
            for (_, t), (_, _, shape, off, _) in zip(items, entries, strict=True):
                _view(mm, t.dtype, list(shape), off).copy_(t)
            digest = _digest(memoryview(mm)[:size])
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    layout = [[name, dtype, list(shape), off] for name, dtype, shape, off, _ in entries]
    return {
        "protocol": PROTOCOL, "version": version, "path": path, "size": size,
        "xxh3_64": digest, "tensors": layout,
    }  # fmt: skip


@contextmanager
def open_staged(info: dict[str, Any]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A staged file's ``(name, tensor)`` views, valid in the ``with``, once its size and hash
    were checked (:class:`StagedCorrupt` otherwise)."""
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


@dataclass(frozen=True, slots=True)
class WeightSync:
    """vLLM's weight-sync calls: the server's RL routes (the bridge) or ``AsyncLLM``'s."""

    init_transfer: Callable[[], Awaitable[Any]]
    pause_in_place: Callable[[], Awaitable[Any]]
    resume: Callable[[], Awaitable[Any]]
    start_update: Callable[[], Awaitable[Any]]
    update: Callable[[dict[str, Any]], Awaitable[Any]]
    finish_update: Callable[[str], Awaitable[Any]]
    label: Callable[[], Awaitable[str]]  # the weight version vLLM reports


class UpdateState:
    """fastio's rules for one vLLM engine, the bridge's and vLLM in the worker alike: a
    pause keeps vLLM's requests in place; never an update while vLLM generates; a load
    that failed once vLLM started it leaves the engine paused (mixed) until a whole
    version lands. ``where`` names the engine in the log."""

    def __init__(self, sync: WeightSync, where: str = "") -> None:
        self.sync = sync
        self.where = where
        self.kept = False  # paused in place by fastio (its requests frozen, not ended)
        self.mixed = False  # the last load failed after vLLM started it
        self._ready = False  # init_weight_transfer_engine done

    async def pause(self) -> None:
        """Pause in place; :attr:`kept` from the moment it is asked until it failed or resumed."""
        self.kept = True
        try:
            await self.sync.pause_in_place()
        except BaseException:
            self.kept = False
            raise

    async def resume(self) -> bool:
        """Resume an engine fastio paused, unless its weights are mixed; whether it resumed."""
        if not self.kept:
            return False
        if self.mixed:
            log.error("vLLM%s stays paused: its weights are mixed (a load failed)", self.where)
            return False
        await self.sync.resume()
        self.kept = False
        return True

    async def load(self, info: dict[str, Any], version: int) -> None:
        """Pause in place (unless :attr:`kept`), start, update, finish labelled ``version``;
        raises (and :attr:`mixed`) unless vLLM then reports it. vLLM stays paused."""
        sync = self.sync
        if not self._ready:
            await sync.init_transfer()
            self._ready = True
        paused, self.kept = self.kept, True
        try:
            if not paused:
                await sync.pause_in_place()
            await sync.start_update()
            await sync.update(info)
            await sync.finish_update(str(version))
            if (label := await sync.label()) != str(version):
                raise RuntimeError(f"vLLM reports weight version {label!r} after loading {version}")
        except BaseException:
            self.mixed = True
            raise
        self.mixed = False

    def load_pairs(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        version: int,
        directory: str,
        run: Callable[[Coroutine[Any, Any, None]], object],
    ) -> None:
        """Stage ``pairs`` under ``directory``, :meth:`load` them through ``run`` (on the
        engine's loop, waiting), remove the staged file."""
        info = stage(pairs, version, directory)
        try:
            run(self.load(info, version))
        finally:
            with suppress(FileNotFoundError):
                os.unlink(info["path"])
