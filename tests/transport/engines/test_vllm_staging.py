"""The vLLM side's pieces that need no vLLM: a version staged in shared memory, checked
before loading; vLLM's version labels; the order of a weight update (no socket)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from transport.engines.flight import VersionLabels
from transport.engines.vllm_staging import (
    StagedCorrupt,
    UpdateState,
    WeightSync,
    open_staged,
    stage,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.bias": torch.randn(5, generator=g).to(torch.float16),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }


def test_a_staged_version_reads_back_bit_for_bit(tmp_path: Path) -> None:
    state = _state()
    info = stage(state.items(), 4, str(tmp_path))
    try:
        assert info["version"] == 4 and os.path.exists(info["path"])
        assert all(off % 64 == 0 for _, _, _, off in info["tensors"])
        with open_staged(info) as pairs:
            got = dict(pairs)
            assert list(got) == list(state)
            for name, t in state.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape
                assert torch.equal(got[name], t), name
    finally:
        os.unlink(info["path"])


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_corrupt_or_short_file_is_refused_before_anything_loads(tmp_path: Path) -> None:
    info = stage(_state().items(), 1, str(tmp_path))
    try:
        _flip(info["path"], info["tensors"][1][3] + 3)
        with pytest.raises(StagedCorrupt, match="xxh3_64"), open_staged(info):
            pytest.fail("a corrupt file must not be opened")
        os.truncate(info["path"], info["size"] // 2)
        with pytest.raises(StagedCorrupt, match="bytes"), open_staged(info):
            pytest.fail("a short file must not be opened")
        with pytest.raises(StagedCorrupt, match="protocol"), open_staged({**info, "protocol": 99}):
            pytest.fail("another layout must not be read")
    finally:
        os.unlink(info["path"])


def test_labels_map_vllms_spans_to_fastio_versions() -> None:
    labels = VersionLabels(base=3)
    assert labels.version("default") == 3 and labels.version("12") == 12
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 5}]
    assert labels.stamp([9] * 5, spans).tolist() == [3, 3, 7, 7, 7]
    assert labels.stamp([1, 2], None).tolist() == [1, 2]


class _Sync:
    """The steps of a WeightSync (:meth:`sync`), recording the calls (and failing one)."""

    def __init__(self, fail: str = "", label: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self._label = label

    async def _do(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} refused")

    async def init_transfer(self) -> None:
        await self._do("init")

    async def pause_in_place(self) -> None:
        await self._do("pause")

    async def resume(self) -> None:
        await self._do("resume")

    async def start_update(self) -> None:
        await self._do("start")

    async def update(self, update_info: dict[str, Any]) -> None:
        await self._do("update")

    async def finish_update(self, label: str) -> None:
        await self._do(f"finish:{label}")
        self._label = self._label or label

    async def label(self) -> str:
        return str(self._label)

    def sync(self) -> WeightSync:
        return WeightSync(
            self.init_transfer, self.pause_in_place, self.resume, self.start_update,
            self.update, self.finish_update, self.label,
        )  # fmt: skip


def _load(s: _Sync, version: int, paused: bool) -> UpdateState:
    st = UpdateState(s.sync())
    if paused:
        asyncio.run(st.pause())
        s.calls.clear()
    asyncio.run(st.load({}, version))
    return st


def test_an_update_is_paused_started_loaded_finished_and_confirmed() -> None:
    s = _Sync()
    _load(s, 5, paused=False)
    assert s.calls == ["init", "pause", "start", "update", "finish:5"]
    s = _Sync()
    _load(s, 6, paused=True)
    assert s.calls == ["init", "start", "update", "finish:6"]  # never an update without a pause
    s = _Sync(fail="update")
    with pytest.raises(RuntimeError, match="update refused"):
        _load(s, 7, paused=True)
    assert s.calls == ["init", "start", "update"]  # never finished: vLLM's label stays
    s = _Sync(label="4")  # vLLM reports another version after the finish
    with pytest.raises(RuntimeError, match="reports weight version '4'"):
        _load(s, 8, paused=True)


def test_a_failed_pause_keeps_nothing_and_the_engine_is_not_resumed() -> None:
    s = _Sync(fail="pause")
    st = UpdateState(s.sync())
    with pytest.raises(RuntimeError, match="pause refused"):
        asyncio.run(st.pause())
    assert not st.kept  # the bridge interrupts its flights instead
    assert asyncio.run(st.resume()) is False and "resume" not in s.calls


def test_mixed_weights_keep_the_engine_paused_until_a_whole_version_lands() -> None:
    sync = _Sync(fail="update")
    st = UpdateState(sync.sync())
    asyncio.run(st.pause())
    with pytest.raises(RuntimeError):
        asyncio.run(st.load({}, 1))
    assert st.kept and st.mixed
    assert asyncio.run(st.resume()) is False  # never serves mixed weights
    assert "resume" not in sync.calls
    sync.fail = ""
    asyncio.run(st.load({}, 2))  # already paused: no second pause
    assert sync.calls == ["pause", "init", "start", "update", "start", "update", "finish:2"]
    assert not st.mixed and asyncio.run(st.resume()) is True and not st.kept
    assert sync.calls[-1] == "resume"
    assert asyncio.run(st.resume()) is False  # nothing fastio paused now


def test_a_load_of_pairs_stages_loads_and_removes_the_file(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Recording(_Sync):
        async def update(self, update_info: dict[str, Any]) -> None:
            with open_staged(update_info) as views:  # the file is there while vLLM loads
                seen.append({name: t.clone() for name, t in views})
            await super().update(update_info)

    sync = Recording()
    st = UpdateState(sync.sync())
    st.load_pairs(_state().items(), 3, str(tmp_path), asyncio.run)
    assert sync.calls == ["init", "pause", "start", "update", "finish:3"]  # paused first
    assert st.kept and not st.mixed
    assert all(torch.equal(seen[0][k], v) for k, v in _state().items())
    assert os.listdir(tmp_path) == []  # removed after the load
    sync.fail = "update"
    with pytest.raises(RuntimeError):
        st.load_pairs(_state().items(), 4, str(tmp_path), asyncio.run)
    assert st.mixed and os.listdir(tmp_path) == []  # removed after a failed load too
