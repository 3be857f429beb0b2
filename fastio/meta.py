"""The seed's metadata types (AReaL's ``io_struct``), re-exported by
:mod:`fastio.io_struct`: fine-tuning size, allocation modes, parameter specs,
checkpoint and weight-update locations, rollout counters."""

from __future__ import annotations

import enum
import getpass
import math
import os
import re
import socket
from typing import Any, Literal, Protocol, overload

import msgspec

from fastio.protocol import MsgKind
from fastio.structs import WireStruct

__all__ = [
    "AllocationMode", "AllocationType", "FinetuneSpec", "ParamSpec", "RolloutStat", "SaveLoadMeta",
    "SaverConfig", "WeightUpdateMeta",
]  # fmt: skip


class FinetuneSpec(WireStruct, tag=int(MsgKind.FINETUNE_SPEC)):
    """Size of a fine-tuning run."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def total_train_steps(self) -> int:
        """Steps over all epochs, dropping the last incomplete batch."""
        return self.total_train_epochs * (self.dataset_size // self.train_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch, dropping the last incomplete batch."""
        return self.dataset_size // self.train_batch_size


class AllocationType(enum.Enum):
    """Which generation backend a decoupled allocation uses."""

    DECOUPLED_vLLM = 1
    DECOUPLED_SGLANG = 2


_STRATEGY = re.compile(r"([dpt])(\d+)([dpt])(\d+)([dpt])(\d+)")


def _invalid(whole: str, why: str) -> ValueError:
    return ValueError(
        f"invalid allocation mode {whole!r}: {why}. A valid mode looks like "
        "'sglang.d4p1t1+d2p2t1' or 'd2p2t1+vllm.d4t1p1'"
    )


def _parse_strategy(text: str, role: str, whole: str) -> dict[str, int]:
    m = _STRATEGY.fullmatch(text)
    if m is None or len({m[1], m[3], m[5]}) != 3:
        raise _invalid(
            whole,
            f"the {role} part {text!r} is not a parallel strategy; it must name each of "
            "d, p, t exactly once with a size, such as 'd4p1t1'",
        )
    strategy = {m[i]: int(m[i + 1]) for i in (1, 3, 5)}
    for axis, size in strategy.items():
        if size < 1:
            raise _invalid(whole, f"{role} size {axis}{size} must be >= 1")
    return strategy


_BACKENDS = {"vllm": AllocationType.DECOUPLED_vLLM, "sglang": AllocationType.DECOUPLED_SGLANG}


class _Size:
    """A read-only size of :class:`AllocationMode`: the product of ``axes`` sizes."""

    def __init__(self, part: str, axes: str, doc: str) -> None:
        self.part, self.axes, self.__doc__ = part, axes, doc

    @overload
    def __get__(self, obj: None, owner: Any = None) -> _Size: ...
    @overload
    def __get__(self, obj: AllocationMode, owner: Any = None) -> int: ...
    def __get__(self, obj: AllocationMode | None, owner: Any = None) -> int | _Size:
        if obj is None:
            return self
        sizes = obj.parallel_strat[self.part]
        return math.prod(sizes[axis] for axis in self.axes)


class AllocationMode(WireStruct, tag=int(MsgKind.ALLOCATION_MODE)):
    """Decoupled generation/training allocation, such as ``"sglang.d4p1t1+d2p2t1"``:
    ``parallel_strat["gen"]`` and ``["*"]`` hold the sizes, keyed by ``"d"``, ``"p"``, ``"t"``."""

    type_: AllocationType
    parallel_strat: dict[str, dict[str, int]]

    gen_tp_size = _Size("gen", "t", "Generation tensor-parallel size.")
    gen_pp_size = _Size("gen", "p", "Generation pipeline-parallel size.")
    gen_dp_size = _Size("gen", "d", "Generation data-parallel size.")
    gen_world_size = _Size("gen", "dpt", "Number of generation GPUs.")
    train_tp_size = _Size("*", "t", "Training tensor-parallel size.")
    train_pp_size = _Size("*", "p", "Training pipeline-parallel size.")
    train_dp_size = _Size("*", "d", "Training data-parallel size.")
    train_world_size = _Size("*", "dpt", "Number of training GPUs.")

    @classmethod
    def from_str(cls, allocation_mode: str) -> AllocationMode:
        """Parse ``"<backend>.<gen>+<train>"`` or ``"<train>+<backend>.<gen>"``
        (``vllm``/``sglang``; each of ``d``, ``p``, ``t`` once with a positive size);
        ``ValueError`` saying what is wrong otherwise.

        >>> AllocationMode.from_str("sglang.d4p1t1+d2p2t1").gen_world_size
        4
        """
        if not isinstance(allocation_mode, str):
            raise ValueError(f"allocation mode must be a string, got {allocation_mode!r}")
        parts = allocation_mode.split("+")
        if len(parts) != 2:
            raise _invalid(
                allocation_mode, "expected exactly one '+' between a generation and a training part"
            )
        gen = [i for i, p in enumerate(parts) if "." in p and p.split(".", 1)[0] in _BACKENDS]
        if len(gen) != 1:
            raise _invalid(
                allocation_mode,
                "exactly one part must name the generation backend as 'vllm.<strategy>' "
                "or 'sglang.<strategy>'",
            )
        backend, gen_text = parts[gen[0]].split(".", 1)
        train = _parse_strategy(parts[1 - gen[0]], "training", allocation_mode)
        strat = {"*": train, "gen": _parse_strategy(gen_text, "generation", allocation_mode)}
        return cls(_BACKENDS[backend], strat)

    @staticmethod
    def extract_parallelism_strategy(allocation_mode: str) -> dict[str, dict[str, int]]:
        """The seed's helper: ``"d2p2t1"`` -> ``{"*": {"d": 2, "p": 2, "t": 1}}``
        (``ValueError`` unless it names each of d, p, t once with a positive size)."""
        if not isinstance(allocation_mode, str):
            raise ValueError(f"parallel strategy must be a string, got {allocation_mode!r}")
        return {"*": _parse_strategy(allocation_mode, "parallel strategy", allocation_mode)}

    @staticmethod
    def extract_decoupled_alloc(allocation_mode: str) -> dict[str, dict[str, int]]:
        """The seed's helper: ``parallel_strat`` of :meth:`from_str`'s result."""
        return AllocationMode.from_str(allocation_mode).parallel_strat


class ParamSpec(WireStruct, tag=int(MsgKind.PARAM_SPEC)):
    """Name, shape and dtype (a torch dtype name such as ``"bfloat16"``) of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class SaverConfig(WireStruct, tag=int(MsgKind.SAVER_CONFIG)):
    """Where and how often checkpoints are saved."""

    experiment_name: str
    trial_name: str
    fileroot: str
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None


class _HasParamSpecs(Protocol):
    def get_param_specs(self) -> list[ParamSpec]: ...


class WeightUpdateMeta(WireStruct, tag=int(MsgKind.WEIGHT_UPDATE_META)):
    """How new weights reach the generation workers: ``type="disk"``, a safetensors
    checkpoint at ``path``; ``type="nccl"``, a torch.distributed broadcast (world size
    ``alloc_mode.gen_world_size + 1``) at ``nccl_master_address:nccl_master_port``."""

    type: Literal["disk", "nccl"]
    path: str | None = None
    alloc_mode: AllocationMode | None = None
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29500
    nccl_param_specs: list[ParamSpec] = msgspec.field(default_factory=list)
    nccl_group_name: str = "update_weight_group"

    @classmethod
    def from_disk(cls, saver_config: SaverConfig) -> WeightUpdateMeta:
        """Disk path ``{fileroot}/checkpoints/{user}/{experiment}/{trial}/default/weight_update``;
        creates ``.../default`` as the seed does, not ``weight_update``."""
        root = os.path.join(saver_config.fileroot, "checkpoints", getpass.getuser())
        root = os.path.join(root, saver_config.experiment_name, saver_config.trial_name, "default")
        os.makedirs(root, exist_ok=True)
        return cls(type="disk", path=os.path.join(root, "weight_update"))

    @classmethod
    def from_param_specs(
        cls,
        allocation_mode: AllocationMode,
        param_specs: list[ParamSpec],
        nccl_group_name: str = "update_weight_group",
        master_address: str | None = None,
        master_port: int | None = None,
    ) -> WeightUpdateMeta:
        """Process-group update of the given parameters; ``master_address`` defaults to
        this host's resolved name (else :class:`OSError`), ``master_port`` to a free port."""
        if not master_address:  # as AReaL: no 127.0.0.1, which other hosts could not reach
            name = socket.gethostname()
            try:
                master_address = socket.gethostbyname(name)
            except OSError as exc:
                raise OSError(
                    f"cannot find this host's address: its name {name!r} does not resolve "
                    f"({getattr(exc, 'strerror', None) or exc}); pass master_address="
                ) from exc
        if master_port is None:  # a free one
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                master_port = int(s.getsockname()[1])
        return cls(
            type="nccl",
            alloc_mode=allocation_mode,
            nccl_master_address=master_address,
            nccl_master_port=master_port,
            nccl_param_specs=list(param_specs),
            nccl_group_name=nccl_group_name,
        )

    @classmethod
    def from_fsdp_nccl(
        cls,
        allocation_mode: AllocationMode,
        fsdp_engine: _HasParamSpecs,
        nccl_group_name: str = "update_weight_group",
    ) -> WeightUpdateMeta:
        """The seed's factory: parameter specs taken from a training engine."""
        return cls.from_param_specs(
            allocation_mode, fsdp_engine.get_param_specs(), nccl_group_name=nccl_group_name
        )


class SaveLoadMeta(WireStruct, tag=int(MsgKind.SAVE_LOAD_META)):
    """Where and how to save or load a model. Live ``tokenizer`` and ``processor``
    objects travel as their ``name_or_path`` strings, which a decoded one holds."""

    path: str
    weight_format: str
    with_optim: bool
    tokenizer: Any
    processor: Any
    base_model_path: str | None
    naive_distributed: bool = False


class RolloutStat(WireStruct, tag=int(MsgKind.ROLLOUT_STAT)):
    """Counters that drive staleness control."""

    submitted: int = 0
    accepted: int = 0
    running: int = 0
