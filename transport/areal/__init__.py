"""AReaL's rollout engine over the fastio fabric (imports ``areal``, which ``import
transport`` never does); how each ``InferenceEngine`` method maps: ``docs/areal.md``."""

from transport.areal.convert import to_llm_request, to_model_response
from transport.areal.engine import FabricInferenceEngine
from transport.areal.weights import disk_root, save_for_rollout, wait_for_version

__all__ = [
    "FabricInferenceEngine", "disk_root", "save_for_rollout", "to_llm_request",
    "to_model_response", "wait_for_version",
]  # fmt: skip
