"""The demo's configuration: :class:`DemoConfig`, the model sizes it serves and the
defaults that depend on them."""

from __future__ import annotations

import msgspec

__all__ = ["REFERENCE_SIZES", "SIZES", "SIZE_DEFAULTS", "DemoConfig"]

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


class DemoConfig(msgspec.Struct, kw_only=True):
    """One demo run: the flags of ``python -m transport.demo`` and, handed to a child
    role as JSON, where it reports and whom it talks to."""

    workers: int = 2
    clients: int = 2
    engine: str = "hf"
    model_size: str = "small"
    model_path: str | None = None
    device: str | None = None
    concurrency: int = 16
    duration: float = 30.0
    update_every: float = 5.0
    max_new_tokens: int = 32
    prompt_len: int = 32
    token_interval: float = 0.0
    transport: str = "tcp"
    auth: bool = False
    seed: int = 0
    chaos: bool = False
    progress_every: float = 5.0
    keep_logs: bool = False
    #: In a child: the orchestrator's report socket, the workers' addresses, the weight
    #: publisher's address, the CurveZMQ keys directory, the client's index.
    report: str = ""
    addresses: list[str] = msgspec.field(default_factory=list)
    publisher: str = ""
    keys: str | None = None
    index: int = 0
