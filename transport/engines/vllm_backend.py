"""fastio as a vLLM weight-transfer backend, in vLLM's workers: it loads a version
:mod:`.vllm_staging` staged, whole or not at all (``docs/engines.md#vllm``); :func:`register`
is the ``vllm.general_plugins`` entry point of the ``fastio`` distribution."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from transport.engines.vllm_staging import PROTOCOL, open_staged

__all__ = ["BACKEND", "FastioWeightTransferEngine", "register"]

#: The backend's name in ``--weight-transfer-config``.
BACKEND = "fastio"
# Under vllm.: vLLM's logging configuration shows only its own loggers.
log = logging.getLogger("vllm.fastio")


def register() -> None:
    """``vllm.general_plugins`` entry point: register the ``fastio`` backend (idempotent)."""
    import os

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from transport.engines.vllm_inproc import PARENT_ENV, die_with_parent

    parent = os.environ.get(PARENT_ENV)
    if parent and parent != str(os.getpid()):  # spawned by vLLM in a fastio worker
        die_with_parent()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FastioWeightTransferEngine")


@dataclass
class FastioInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """``/init_weight_transfer_engine`` ``init_info``: the staged layout's protocol."""

    protocol: int = PROTOCOL


@dataclass
class FastioUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``/update_weights`` ``update_info``: :func:`~transport.engines.vllm_staging.stage`'s."""

    path: str
    size: int
    xxh3_64: str
    version: int
    tensors: list[list[Any]] = field(default_factory=list)
    protocol: int = PROTOCOL


def _empty_layers(model: torch.nn.Module) -> list[str]:
    # Layers still waiting for weights after a load (vLLM's reload puts their old ones back).
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    empty = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        # Layers with parameters of their own (not buffers a checkpoint never holds).
        owns = next(layer.parameters(recurse=False), None) is not None
        loadable = owns and info.can_load() and not is_deferred_attention_layer(layer)
        if loadable and info.load_numel == 0 and (info.load_numel_total or 0) > 0:
            empty.append(name or type(layer).__name__)
    return empty


class FastioWeightTransferEngine(WeightTransferEngine[FastioInitInfo, FastioUpdateInfo]):  # type: ignore[misc]
    """Loads versions staged in shared memory by fastio (module docstring)."""

    init_info_cls = FastioInitInfo
    update_info_cls = FastioUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: int | None = None  # the version loaded whole since the last start

    def init_transfer_engine(self, init_info: FastioInitInfo) -> None:
        """Check the staged layout's protocol."""
        if init_info.protocol != PROTOCOL:
            raise ValueError(
                f"fastio staged layout {init_info.protocol}, this side reads {PROTOCOL}"
            )

    def start_weight_update(self) -> None:
        """Arm an update (nothing is touched until a verified version arrives)."""
        self.loaded = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Verify and load one whole staged version."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FastioUpdateInfo) -> None:
        """Check the file, then load it through vLLM's layerwise reload."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        info = dict(vars(update_info))
        with open_staged(info) as pairs:  # StagedCorrupt: nothing loaded
            initialize_layerwise_reload(self.model)
            try:
                with disable_mtp_completeness_check():
                    self.model.load_weights(pairs)
                empty = _empty_layers(self.model)
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
        if empty:
            raise RuntimeError(
                f"fastio version {update_info.version}: no weights for {len(empty)} layers "
                f"({', '.join(empty[:4])}...); they kept their old weights: mixed"
            )
        self.loaded = update_info.version
        log.info("fastio: loaded version %d (%d tensors)", self.loaded, len(pairs))

    def finish_weight_update(self) -> None:
        """Refuse unless a whole version loaded since the start (the label then stays)."""
        if self.loaded is None:
            raise RuntimeError(
                "fastio: no whole version was loaded since start_weight_update; the "
                "version label does not move"
            )

    def shutdown(self) -> None:
        """Nothing is held between updates."""
