"""Weight updates from a trainer to generation workers (``docs/weights.md``):
:class:`WeightPublisher`, :class:`WeightSubscriber`, :func:`update_weights`; names are
imported on first use."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them; at run time, on first use
    from transport.weights.binding import check_manifest, state_digest
    from transport.weights.bucket import (
        DEFAULT_BUCKET_BYTES,
        BucketApplier,
        pack_bucket,
        plan_buckets,
    )
    from transport.weights.errors import UpdateIncomplete, WeightMismatchError, WeightUpdateError
    from transport.weights.publisher import WeightPublisher
    from transport.weights.results import SubscriberInfo, UpdateResult, UpdateStats
    from transport.weights.subscriber import WeightSubscriber
    from transport.weights.update import (
        FabricUpdateResult,
        attach_subscriber,
        aupdate_weights,
        update_weights,
    )

_MODULES = {
    "binding": ("check_manifest", "state_digest"),
    "bucket": ("BucketApplier", "DEFAULT_BUCKET_BYTES", "pack_bucket", "plan_buckets"),
    "errors": ("UpdateIncomplete", "WeightMismatchError", "WeightUpdateError"),
    "publisher": ("WeightPublisher",),
    "results": ("SubscriberInfo", "UpdateResult", "UpdateStats"),
    "subscriber": ("WeightSubscriber",),
    "update": ("FabricUpdateResult", "attach_subscriber", "aupdate_weights", "update_weights"),
}
_LAZY = {n: f"transport.weights.{m}" for m, names in _MODULES.items() for n in names}

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketApplier",
    "FabricUpdateResult",
    "SubscriberInfo",
    "UpdateIncomplete",
    "UpdateResult",
    "UpdateStats",
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
    if name in ("ChecksumError", "VersionUnavailable"):  # deprecated, never raised
        from transport.weights.errors import deprecated

        return deprecated(name)
    if name not in _LAZY:
        raise AttributeError(f"module 'transport.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
