"""AReaL's rollout engine over the fastio fabric (needs the ``areal`` package).

``import transport`` never imports this package; it imports ``areal``. See
:mod:`transport.areal.engine` for how each ``InferenceEngine`` method maps onto the
fabric, and :mod:`transport.areal.weights` for the weight routes.
"""

from transport.areal.convert import to_llm_request, to_model_response
from transport.areal.engine import FabricInferenceEngine
from transport.areal.weights import disk_root, save_for_rollout, wait_for_version

__all__ = [
    "FabricInferenceEngine",
    "disk_root",
    "save_for_rollout",
    "to_llm_request",
    "to_model_response",
    "wait_for_version",
]
