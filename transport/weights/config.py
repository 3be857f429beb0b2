"""Settings of the weight publisher and subscriber, as constrained Structs (also taken
as keyword arguments: :func:`make_config`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from transport.options import Port, Positive, Seconds, configure
from transport.weights.bucket import DEFAULT_BUCKET_BYTES, Hasher

__all__ = ["PublisherConfig", "Route", "SubscriberConfig", "make_config"]

#: How a version's bytes reach a worker (``docs/weights.md``, "The routes").
Route = Literal["ipc", "shm", "tcp"]


class PublisherConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.weights.WeightPublisher`."""

    #: PUB address to bind (default: a free port next to the ROUTER, or ``<path>.pub``).
    pub_endpoint: str | None = None
    #: Upper bound of a flat bucket (a larger tensor gets a bucket of its own).
    bucket_bytes: Positive = DEFAULT_BUCKET_BYTES
    #: Size of the chunks a bucket travels in over TCP.
    chunk_bytes: Positive = 4 << 20
    #: Stage versions in ``/dev/shm`` for same-host workers (``None``: when available).
    shm: bool | None = None
    #: ``"xxh3_64"`` or ``"crc32"``.
    checksum: str = "xxh3_64"
    #: Seconds between Heartbeat notices on PUB.
    heartbeat_interval: Seconds = 0.5
    #: A worker silent this long (no Hello, Fetch or Ack) is lost.
    worker_timeout: Seconds = 10.0
    #: Recent versions that keep their buffer when no one needs them any more.
    keep_versions: Positive = 2
    #: Send TCP workers' bytes on a plain (unencrypted) TCP connection per worker (``None``: for
    #: a ``tcp://`` endpoint without CURVE).
    data_link: bool | None = None
    #: The data link's port (0: a free one, told in the Welcome).
    data_port: Port = 0
    #: When same-host workers take ``ipc``: ``"auto"`` (CUDA tensors), ``"cpu"`` or ``"off"``.
    ipc: Literal["auto", "cpu", "off"] = "auto"
    #: Persistent buckets of the ``ipc`` route (2: double buffering; ``None``: all).
    ipc_slots: Positive | None = 2
    #: Seconds a publish waits for a live ``ipc`` worker to release a slot.
    ipc_timeout: Seconds = 60.0

    def __post_init__(self) -> None:
        Hasher(self.checksum)  # names an unknown algorithm now, not at the first publish


class SubscriberConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`~transport.weights.WeightSubscriber`."""

    #: Unique id of this worker (default: a random one; a restarted worker may reuse it).
    worker_id: str | None = None
    #: The version the weights hold now (``-1``: none).
    version: Annotated[int, Meta(ge=-1)] = -1
    #: Read same-host versions from shared memory when the handshake shows it works.
    shm: bool = True
    #: ``True``: verify first; ``False``: one pass (``docs/weights.md``); ``None``: ``False`` under
    #: a lock that ``refuses_mixed`` without a loader, else ``True``.
    atomic: bool | None = None
    #: Buckets asked ahead over TCP.
    window: Positive = 2
    #: Seconds before an unanswered Fetch is sent again.
    fetch_timeout: Seconds = 5.0
    #: Attempts per bucket and per version before it fails.
    retries: Positive = 3
    #: Seconds between Hellos to the publisher.
    heartbeat_interval: Seconds = 0.5
    #: With no word from the publisher this long, a version in progress fails.
    publisher_timeout: Seconds = 10.0
    #: Send :func:`~transport.weights.state_digest` of the weights in Hellos and Acks.
    report_digest: bool = False
    #: A version must cover every tensor of the target.
    strict: bool = True
    #: Largest frame taken from the publisher (``ZMQ_MAXMSGSIZE``).
    max_message_size: Positive = 1 << 30
    #: Process-wide, on glibc: keep freed memory for the next version.
    tune_malloc: bool = False
    #: Force a route (``None``: chosen; ``"shm"``: never ``ipc``; ``"ipc"``: an error where it
    #: cannot be); keyword ``path`` too.
    route: Route | None = None
    #: Threads that copy a version into CPU parameters (default: one per 4 cores, at most 4).
    copy_threads: Positive | None = None
    #: Over TCP, take the publisher's data link when offered.
    data_link: bool = True


C = TypeVar("C", PublisherConfig, SubscriberConfig)


def make_config(cls: type[C], config: C | None, settings: dict[str, Any]) -> C:
    """``config`` (default: ``cls()``) with ``settings`` applied (``path``: ``route``); an
    unknown keyword is a ``TypeError``, a bad value a ``ValueError``, each naming it."""
    alias = "path" in settings
    if alias:
        settings["route"] = settings.pop("path")
    what = "publisher setting" if cls is PublisherConfig else "subscriber setting"
    try:
        return configure(cls, config, settings, what)
    except ValueError as exc:  # named as the caller wrote it
        if alias and f"{what} route=" in str(exc):
            raise ValueError(str(exc).replace(" route=", " path=", 1)) from None
        raise
