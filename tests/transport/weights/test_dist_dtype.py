"""Dtype conversion on the process-group path (gloo, real processes): an fp32 trainer
broadcasts a transformers Llama model (random weights from a small config, tied
embeddings; nothing is downloaded) to a bf16 worker that declared the dtype it wants;
every worker parameter is bit-identical to ``trainer_tensor.to(torch.bfloat16)``. A
dtype mismatch nobody asked for is refused before any collective, naming the tensor,
and leaves the weights and the group usable."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fastio import AllocationMode, WeightUpdateMeta
from tests.helpers import free_port, mp_context
from tests.transport.weights.helpers import bits, make_lm, zeroed
from transport.weights.dist import WeightGroup, param_specs, trainer_rank, worker_rank
from transport.weights.errors import WeightMismatchError

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16


def _meta() -> WeightUpdateMeta:
    return WeightUpdateMeta.from_param_specs(
        AllocationMode.from_str("sglang.d1p1t1+d1p1t1"), param_specs(make_lm()),
        nccl_group_name="test-weights-dtype", master_address="127.0.0.1",
        master_port=free_port(),
    )  # fmt: skip


def _is_cast_of(worker: Any, trainer: Any) -> bool:
    got, want = worker.state_dict(), trainer.state_dict()
    return got.keys() == want.keys() and all(
        got[k].dtype == BF16 and torch.equal(bits(got[k]), bits(want[k].to(BF16))) for k in want
    )


def _group(meta: WeightUpdateMeta, rank: int) -> WeightGroup:
    return WeightGroup(meta, rank, backend="gloo", bucket_bytes=64 << 10, timeout=60)


def cast_worker(meta: WeightUpdateMeta) -> None:
    """bf16 worker: version 1 atomic with dtype=bf16, version 2 streaming with "auto"."""
    torch.set_num_threads(1)
    model = zeroed(make_lm(dtype=BF16))
    group = _group(meta, worker_rank(meta, 0))
    group.recv(model, atomic=True, dtype=BF16)
    if not _is_cast_of(model, make_lm(seed=1)):
        raise SystemExit(3)
    group.recv(model, atomic=False, dtype="auto")
    if not _is_cast_of(model, make_lm(seed=2)):
        raise SystemExit(4)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise SystemExit(5)
    group.pg.barrier().wait()


def refusing_worker(meta: WeightUpdateMeta) -> None:
    """bf16 worker that forgets dtype=: refused before any collective, weights untouched;
    a wrong shape is refused even with a cast asked for; then a proper recv succeeds."""
    torch.set_num_threads(1)
    model = zeroed(make_lm(dtype=BF16))
    group = _group(meta, worker_rank(meta, 0))
    try:
        group.recv(model)
    except WeightMismatchError as exc:
        msg = str(exc)
        if "dtype mismatch for 'model.embed_tokens.weight'" not in msg or "dtype=" not in msg:
            raise SystemExit(f"unclear error: {msg}") from None
    else:
        raise SystemExit(3)
    if any(p.count_nonzero() for p in model.parameters()):
        raise SystemExit(4)
    bad = dict(model.state_dict())
    bad["model.norm.weight"] = torch.zeros(7, dtype=BF16)
    try:
        group.recv(bad, dtype=BF16)
    except WeightMismatchError as exc:
        if "shape mismatch for 'model.norm.weight'" not in str(exc):
            raise SystemExit(f"unclear error: {exc}") from None
    else:
        raise SystemExit(5)
    group.pg.barrier().wait()  # tell the trainer to send
    group.recv(model, dtype="auto")
    if not _is_cast_of(model, make_lm(seed=1)):
        raise SystemExit(6)
    group.pg.barrier().wait()


def _run(target: Any, versions: list[int]) -> tuple[int | None, WeightGroup]:
    meta = _meta()
    p = mp_context().Process(target=target, args=(meta,), daemon=True)
    p.start()
    try:
        group = _group(meta, trainer_rank())
        for v in versions:
            if target is refusing_worker:
                group.pg.barrier().wait()
            group.send(make_lm(seed=v))
        group.pg.barrier().wait()
        p.join(60)
        return p.exitcode, group
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


def test_fp32_trainer_to_bf16_worker_over_gloo_is_bit_identical_to_tensor_to() -> None:
    exitcode, group = _run(cast_worker, [1, 2])
    assert exitcode == 0
    assert len(group.plan) > 2  # several buckets, two in flight


def test_unasked_dtype_mismatch_is_refused_clearly_and_loses_nothing() -> None:
    exitcode, _ = _run(refusing_worker, [1])
    assert exitcode == 0
