"""Settings of the weight publisher and subscriber, as constrained Structs.

``config=PublisherConfig(...)`` and the keyword arguments (``bucket_bytes=...``) are
the same thing, converted once by :func:`make_config`, which names a bad key or value.
Objects (a lock, callbacks, a ZeroMQ context, CURVE keys, a loader) stay keywords.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

__all__ = ["PublisherConfig", "Route", "SubscriberConfig", "make_config"]

#: How a version's bytes reach a worker: ``"ipc"`` (the trainer's memory, CUDA IPC or
#: torch shared storage), ``"shm"`` (a shared-memory segment) or ``"tcp"``.
Route = Literal["ipc", "shm", "tcp"]

Seconds = Annotated[float, Meta(gt=0)]
Positive = Annotated[int, Meta(ge=1)]


class PublisherConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.weights.WeightPublisher`.

    Parameters
    ----------
    pub_endpoint:
        PUB address to bind; by default next to the ROUTER's (a free port, or
        ``<ipc path>.pub``).
    bucket_bytes:
        Upper bound of a flat bucket (a larger tensor gets a bucket of its own).
    chunk_bytes:
        Size of the chunks a bucket travels in over TCP (same-host workers get a
        "bytes ready" notice every 8 MiB or every chunk, whichever is larger).
    shm:
        Stage versions in ``/dev/shm`` so same-host workers read them in place
        (``None``: when available); private memory when it cannot.
    checksum:
        ``"xxh3_64"`` or ``"crc32"``.
    heartbeat_interval:
        Seconds between Heartbeat notices on PUB.
    worker_timeout:
        A worker silent this long (no Hello, Fetch or Ack) is lost.
    keep_versions:
        Recent versions that keep their buffer when no one needs them any more.
    data_link:
        Send TCP workers' bytes on a plain TCP connection per worker
        (:mod:`transport.weights.routes.tcp`). ``None``: on for a ``tcp://`` endpoint
        without CURVE (the link is not encrypted).
    data_port:
        The data link's port (0: a free one, told in the Welcome).
    ipc:
        When same-host workers take the ``ipc`` route: ``"auto"`` (CUDA tensors),
        ``"cpu"`` (CPU tensors too; slower than ``shm`` on CPU) or ``"off"``.
    ipc_slots:
        Persistent buckets of the ``ipc`` route (2: double buffering; ``None``: the
        whole model).
    ipc_timeout:
        Seconds a publish waits for a live ``ipc`` worker to release a slot.
    """

    pub_endpoint: str | None = None
    bucket_bytes: Positive = 256 << 20
    chunk_bytes: Positive = 4 << 20
    shm: bool | None = None
    checksum: str = "xxh3_64"
    heartbeat_interval: Seconds = 0.5
    worker_timeout: Seconds = 10.0
    keep_versions: Positive = 2
    data_link: bool | None = None
    data_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    ipc: str = "auto"
    ipc_slots: Positive | None = 2
    ipc_timeout: Seconds = 60.0

    def __post_init__(self) -> None:
        if self.ipc not in ("auto", "cpu", "off"):
            raise ValueError(f"ipc must be one of ('auto', 'cpu', 'off'), not {self.ipc!r}")


class SubscriberConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.weights.WeightSubscriber`.

    Parameters
    ----------
    worker_id:
        Unique id of this worker (default: a random one); a restarted worker may reuse
        it and counts as the same worker.
    version:
        The version the weights hold now (``-1``: none).
    shm:
        Read same-host versions from shared memory when the handshake shows it works.
    atomic:
        ``True``: the previous weights stay whole until a version is verified
        entirely; ``False``: verify and copy in one pass, the weights mixed from the
        version's first write to its end (and after a version failing midway, until
        one completes: version ``-1`` reported). ``None``: ``False`` under a lock that
        refuses to serve mixed weights (``refuses_mixed``) without a loader, else
        ``True``. See ``docs/PROTOCOL.md``, "Apply and commit".
    window:
        Buckets asked ahead over TCP.
    fetch_timeout:
        Seconds before an unanswered Fetch is sent again.
    retries:
        Attempts per bucket and per version before it fails.
    heartbeat_interval:
        Seconds between Hellos to the publisher.
    publisher_timeout:
        With no word from the publisher this long, a version in progress fails.
    report_digest:
        Send a digest of the weights (:func:`~transport.weights.state_digest`) in
        Hellos and Acks.
    strict:
        A version must cover every tensor of the target.
    max_message_size:
        Largest frame taken from the publisher (``ZMQ_MAXMSGSIZE``).
    tune_malloc:
        Process-wide, on glibc: keep freed memory for the next version
        (:func:`transport.weights.malloc.tune_malloc`).
    route:
        ``None``: ``ipc`` when offered and the worker copies into its target as is,
        else ``shm`` or ``tcp``; ``"shm"``: never ``ipc``; ``"tcp"``: neither;
        ``"ipc"``: as ``None``, an error where ``ipc`` cannot be (keyword ``path``).
    copy_threads:
        Threads that copy a verified version into CPU parameters (default: one per
        4 cores, at most 4).
    data_link:
        Over TCP, take the publisher's data link when offered.
    """

    worker_id: str | None = None
    version: Annotated[int, Meta(ge=-1)] = -1
    shm: bool = True
    atomic: bool | None = None
    window: Positive = 2
    fetch_timeout: Seconds = 5.0
    retries: Positive = 3
    heartbeat_interval: Seconds = 0.5
    publisher_timeout: Seconds = 10.0
    report_digest: bool = False
    strict: bool = True
    max_message_size: Positive = 1 << 30
    tune_malloc: bool = False
    route: Route | None = None
    copy_threads: Positive | None = None
    data_link: bool = True


C = TypeVar("C", PublisherConfig, SubscriberConfig)


def make_config(cls: type[C], config: C | None, settings: dict[str, Any]) -> C:
    """``config`` (default: ``cls()``) with ``settings`` (keyword arguments) applied,
    checked once; ``TypeError`` names an unknown keyword, ``ValueError`` a bad value."""
    if "path" in settings:  # the route's keyword before it was called one
        settings["route"] = settings.pop("path")
    if settings.get("route") not in (None, "ipc", "shm", "tcp"):
        raise ValueError(
            f"path must be None or one of ('ipc', 'shm', 'tcp'), not {settings['route']!r}"
        )
    base = msgspec.structs.asdict(config) if config is not None else {}
    unknown = sorted(set(settings) - set(cls.__struct_fields__))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(map(repr, unknown))}")
    try:
        return msgspec.convert({**base, **settings}, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from None
