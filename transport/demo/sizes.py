"""Model sizes the demo serves, and the defaults that depend on them."""

from __future__ import annotations

__all__ = ["REFERENCE_SIZES", "SIZES", "SIZE_DEFAULTS"]

#: The sizes ``--model-size`` takes (those of :data:`transport.hf_engine.MODEL_SIZES`).
SIZES = ("tiny", "small", "medium", "large")

#: name -> (vocab_size, hidden, layers) of the reference engine's TinyLM.
REFERENCE_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 64, 2),
    "small": (4096, 256, 2),
    "medium": (32000, 512, 2),
    "large": (32000, 1024, 4),
}

#: Defaults that depend on the model size: (requests in flight per client, seconds
#: between weight updates). After each update every interrupted request is prefilled
#: again under the new weights, so a larger model gets fewer requests in flight and
#: rarer updates to keep serving on two cores.
SIZE_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (32, 5.0),
    "small": (16, 5.0),
    "medium": (8, 10.0),
    "large": (4, 15.0),
}
