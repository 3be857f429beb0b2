"""Wire messages of weight updates from a trainer to generation workers.

Every message is one fastio message (``[header, *buffers]``, see ``docs/PROTOCOL.md``)
whose body is one of the Structs below, tagged with a :class:`~fastio.protocol.MsgKind`
in the range 40-59. The transport lives in :mod:`transport.weights`; this module only
says what travels.

Sockets and directions (publisher = trainer side, subscriber = worker side)::

    subscriber DEALER -> publisher ROUTER : Hello (handshake and heartbeat), Fetch, Ack
    publisher ROUTER  -> subscriber DEALER: Welcome, Bucket, Error
    publisher PUB     -> subscriber SUB   : Announce, Heartbeat   (sequence-numbered)

The PUB channel carries only small notices; every byte of weights travels over the
flow-controlled ROUTER/DEALER pair (one ``Fetch`` per bucket, a bounded window of them
in flight) or through shared memory, so nothing a worker needs can be dropped silently
at a high-water mark (the zguide's Clone pattern: notices by PUB, state by ROUTER).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from fastio.io_struct import WireStruct
from fastio.protocol import MsgKind

__all__ = [
    "PUBLISHER_TO_SUBSCRIBER",
    "SUBSCRIBER_TO_PUBLISHER",
    "WeightAck",
    "WeightAnnounce",
    "WeightBucket",
    "WeightBucketInfo",
    "WeightError",
    "WeightFetch",
    "WeightHeartbeat",
    "WeightHello",
    "WeightTensor",
    "WeightWelcome",
]


class WeightTensor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where one tensor lies inside its bucket.

    ``dtype`` is a torch dtype name (``"bfloat16"``, ``"float32"``, ...), ``offset`` the
    byte offset of its C-ordered data inside the bucket, ``nbytes`` its size in bytes.
    ``src_dtype`` is the trainer's dtype when the trainer cast the tensor to ``dtype``
    for the workers (``""``: it travels as the trainer holds it).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    src_dtype: str = ""


class WeightBucketInfo(msgspec.Struct, array_like=True, gc=False):
    """One flat bucket of a version: its size, checksum and tensors.

    ``checksum`` is computed over the bucket's ``nbytes`` bytes with the version's
    ``checksum_algo`` (``0`` while not yet known: see :class:`WeightBucket`); ``shm_offset`` is where the bucket starts inside the version's
    shared-memory segment (meaningless without one).
    """

    index: int
    nbytes: int
    checksum: int
    tensors: list[WeightTensor]
    shm_offset: int = 0


class WeightHello(WireStruct, tag=int(MsgKind.WEIGHT_HELLO)):
    """Subscriber -> publisher: handshake, repeated as a heartbeat.

    Carries the version the worker holds (``-1``: none) and, when known, a digest of
    its weights (:func:`transport.weights.state_digest`), so a publisher (also a
    restarted one) learns every worker's state. ``dtype`` is the one dtype the worker
    wants every floating tensor in (``""``: none declared); when every worker wants the
    same narrower dtype, the trainer casts while packing. ``start_time`` is the
    worker process's start time (field 22 of ``/proc/<pid>/stat``; ``0``: unknown): a
    trainer on the same host that sees the same ``pid`` with the same start time knows
    when that process is gone, and no longer waits for it to release shared memory.
    """

    worker_id: str
    host_id: str
    pid: int
    version: int = -1
    digest: int | None = None
    dtype: str = ""
    start_time: int = 0


class WeightAnnounce(WireStruct, tag=int(MsgKind.WEIGHT_ANNOUNCE)):
    """A complete version is ready: its manifest (every bucket and tensor).

    Sent on PUB with the next sequence number, and nested in :class:`WeightWelcome`.
    ``shm_name`` names the shared-memory segment (under ``/dev/shm``) that holds every
    bucket at its ``shm_offset``; empty when the publisher staged in private memory.
    ``aliases`` maps names that share memory with a travelling tensor (tied weights) to
    that tensor's name: their bytes travel once and are applied to every name.
    """

    publisher_id: str
    seq: int
    version: int
    checksum_algo: str
    total_bytes: int
    buckets: list[WeightBucketInfo]
    shm_name: str = ""
    aliases: dict[str, str] = msgspec.field(default_factory=dict)


class WeightWelcome(WireStruct, tag=int(MsgKind.WEIGHT_WELCOME)):
    """Publisher -> subscriber: reply to every Hello.

    ``shm_probe`` names a small file in ``/dev/shm`` holding ``shm_token``: a subscriber
    that can read it shares the publisher's host *and* its ``/dev/shm`` and may read
    buckets from shared memory. ``announce`` is the latest version when the Hello showed
    the worker behind it (the snapshot of the Clone pattern), else ``None``.
    ``data_port`` (0: none) is the publisher's data-link listener on its host, and
    ``data_token`` the secret a worker presents there (``transport.weights.routes.tcp``).
    """

    publisher_id: str
    host_id: str
    pub_endpoint: str
    seq: int
    shm_probe: str = ""
    shm_token: str = ""
    announce: WeightAnnounce | None = None
    data_port: int = 0
    data_token: bytes = b""


class WeightHeartbeat(WireStruct, tag=int(MsgKind.WEIGHT_HEARTBEAT)):
    """Publisher -> all on PUB, periodically: the latest sequence number and version.

    A subscriber whose last seen ``seq`` is lower missed an Announce (slow joiner, HWM
    drop) and asks for the state again with a Hello.
    """

    publisher_id: str
    seq: int
    version: int


class WeightFetch(WireStruct, tag=int(MsgKind.WEIGHT_FETCH)):
    """Subscriber -> publisher: send me bucket ``index`` of ``version``.

    The publisher answers once the bucket is packed (a version is announced before its
    buckets are packed, so that packing overlaps sending). With ``shm`` the worker reads
    the bytes from shared memory and the answer is one :class:`WeightBucket` without
    chunks: "ready, with this checksum".
    """

    version: int
    index: int
    shm: bool = False
    #: The asking process (pid and start time, as in :class:`WeightHello`): with
    #: ``shm`` the publisher keeps that process as a reader of the segment until that
    #: same process answers or is gone. 0: the worker's last Hello names it.
    pid: int = 0
    start_time: int = 0
    #: Send the bytes on the worker's data link (``transport.weights.routes.tcp``)
    #: rather than as ZeroMQ frames (when the publisher has that link open).
    data: bool = False


class WeightBucket(WireStruct, tag=int(MsgKind.WEIGHT_BUCKET)):
    """Publisher -> subscriber: one piece of a bucket's bytes, as zero-copy frames.

    A Fetch is answered by the pieces of the bucket in order, each its own message
    (``offset`` is where the piece starts in the bucket, ``last`` marks the final one),
    so a receiver checksums piece k while piece k+1 is on the wire and the sender
    interleaves pieces for several workers. ``chunks`` are 1-D ``uint8`` arrays (each a
    frame) whose concatenation is the piece. ``checksum`` is the bucket's checksum, set
    on the last piece (``0`` on the others) and authoritative (an Announce goes out
    before its buckets are packed, with zeros in their place).

    To a same-host worker (its Fetch said ``shm``) the pieces carry no chunks: each says
    that ``nbytes`` bytes from ``offset`` are packed in the shared segment.
    """

    version: int
    index: int
    offset: int
    checksum: int
    last: bool
    chunks: list[Any]
    nbytes: int = 0


class WeightAck(WireStruct, tag=int(MsgKind.WEIGHT_ACK)):
    """Subscriber -> publisher: the outcome of ``version`` on this worker.

    ``ok=False`` means the worker kept ``current_version`` (its previous weights) and
    ``error`` says why. ``via`` is ``"shm"`` or ``"tcp"``; ``stats`` holds timings in
    seconds (``fetch_s``, ``verify_s``, ``apply_s``, ``total_s``) and per-bucket figures.
    """

    worker_id: str
    version: int
    ok: bool
    current_version: int
    error: str = ""
    digest: int | None = None
    via: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    #: The answering process (see :class:`WeightFetch`); 0: the last Hello names it.
    pid: int = 0
    start_time: int = 0


class WeightError(WireStruct, tag=int(MsgKind.WEIGHT_ERROR)):
    """Publisher -> subscriber: a request could not be served.

    ``version``/``index`` echo the request (``-1`` when it could not be decoded);
    ``latest_version`` tells a subscriber that asked for a retired version where to go.
    """

    version: int
    index: int
    reason: str
    latest_version: int = -1


#: Messages a publisher's ROUTER accepts.
SUBSCRIBER_TO_PUBLISHER = Union[WeightHello, WeightFetch, WeightAck]  # noqa: UP007
#: Messages a subscriber accepts on its DEALER and SUB sockets.
PUBLISHER_TO_SUBSCRIBER = Union[  # noqa: UP007
    WeightWelcome, WeightBucket, WeightError, WeightAnnounce, WeightHeartbeat
]
