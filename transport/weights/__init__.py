"""Weight updates from a trainer to generation workers.

:class:`WeightPublisher` / :class:`WeightSubscriber` publish versions (flat buckets,
:mod:`transport.weights.bucket`) over ZeroMQ, by route ``ipc``, ``shm`` or ``tcp``;
:func:`update_weights` pauses generation, publishes, waits and resumes;
:mod:`transport.weights.disk` (safetensors at ``WeightUpdateMeta.path``) and
:mod:`transport.weights.dist` (torch.distributed) are the other two ways. Layers
(``docs/weights.md``): the protocol core without I/O (:mod:`transport.weights.core`),
the routes (:mod:`transport.weights.routes`), the drivers (``publisher``,
``subscriber``, ``update``).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transport.weights.bucket import (
        DEFAULT_BUCKET_BYTES,
        BucketApplier,
        pack_bucket,
        plan_buckets,
    )
    from transport.weights.errors import (
        ChecksumError,
        UpdateIncomplete,
        VersionUnavailable,
        WeightMismatchError,
        WeightUpdateError,
    )
    from transport.weights.manifest import check_manifest, state_digest
    from transport.weights.publisher import WeightPublisher
    from transport.weights.results import SubscriberInfo, UpdateResult, UpdateStats
    from transport.weights.subscriber import WeightSubscriber
    from transport.weights.update import (
        FabricUpdateResult,
        attach_subscriber,
        aupdate_weights,
        update_weights,
    )

# Imported on first use: each room pulls in what it needs (torch, the data link, the
# fabric) only when asked for, so ``import transport.weights.bucket`` stays light.
_LAZY = {
    "BucketApplier": "transport.weights.bucket",
    "ChecksumError": "transport.weights.errors",
    "DEFAULT_BUCKET_BYTES": "transport.weights.bucket",
    "FabricUpdateResult": "transport.weights.update",
    "SubscriberInfo": "transport.weights.results",
    "UpdateIncomplete": "transport.weights.errors",
    "UpdateResult": "transport.weights.results",
    "UpdateStats": "transport.weights.results",
    "VersionUnavailable": "transport.weights.errors",
    "WeightMismatchError": "transport.weights.errors",
    "WeightPublisher": "transport.weights.publisher",
    "WeightSubscriber": "transport.weights.subscriber",
    "WeightUpdateError": "transport.weights.errors",
    "attach_subscriber": "transport.weights.update",
    "aupdate_weights": "transport.weights.update",
    "check_manifest": "transport.weights.manifest",
    "pack_bucket": "transport.weights.bucket",
    "plan_buckets": "transport.weights.bucket",
    "state_digest": "transport.weights.manifest",
    "update_weights": "transport.weights.update",
}

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketApplier",
    "ChecksumError",
    "FabricUpdateResult",
    "SubscriberInfo",
    "UpdateIncomplete",
    "UpdateResult",
    "UpdateStats",
    "VersionUnavailable",
    "WeightMismatchError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightUpdateError",
    "attach_subscriber",
    "aupdate_weights",
    "check_manifest",
    "pack_bucket",
    "plan_buckets",
    "state_digest",
    "update_weights",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transport.weights' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
