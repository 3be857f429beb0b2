"""Wire messages of weight updates from a trainer to generation workers (tags 40-59);
sockets, flows and every field's meaning: ``docs/PROTOCOL.md``, "Weight updates"."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from fastio.io_struct import WireStruct
from fastio.protocol import MsgKind

__all__ = [
    "PUBLISHER_TO_SUBSCRIBER", "SUBSCRIBER_TO_PUBLISHER", "WeightAck", "WeightAnnounce",
    "WeightBucket", "WeightBucketInfo", "WeightError", "WeightFetch", "WeightHeartbeat",
    "WeightHello", "WeightTensor", "WeightWelcome",
]  # fmt: skip


class WeightTensor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where one tensor lies inside its bucket (``src_dtype``: the trainer's dtype when it
    cast the tensor to ``dtype``, else ``""``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    src_dtype: str = ""


class WeightBucketInfo(msgspec.Struct, array_like=True, gc=False):
    """One flat bucket of a version: its size, checksum (``0`` until packed) and tensors."""

    index: int
    nbytes: int
    checksum: int
    tensors: list[WeightTensor]
    shm_offset: int = 0


class WeightHello(WireStruct, tag=int(MsgKind.WEIGHT_HELLO)):
    """Subscriber -> publisher: handshake, repeated as a heartbeat (``version -1``: none;
    ``source``: the ``publisher_id`` that version came from, ``""`` for initial weights or
    a peer that does not say)."""

    worker_id: str
    host_id: str
    pid: int
    version: int = -1
    digest: int | None = None
    dtype: str = ""
    start_time: int = 0
    source: str = ""


class WeightAnnounce(WireStruct, tag=int(MsgKind.WEIGHT_ANNOUNCE)):
    """A complete version is ready: its manifest (every bucket and tensor)."""

    publisher_id: str
    seq: int
    version: int
    checksum_algo: str
    total_bytes: int
    buckets: list[WeightBucketInfo]
    shm_name: str = ""
    aliases: dict[str, str] = msgspec.field(default_factory=dict)


class WeightWelcome(WireStruct, tag=int(MsgKind.WEIGHT_WELCOME)):
    """Publisher -> subscriber: reply to every Hello (``announce``: the snapshot)."""

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
    """Publisher -> all on PUB, periodically: the latest sequence number and version."""

    publisher_id: str
    seq: int
    version: int


class WeightFetch(WireStruct, tag=int(MsgKind.WEIGHT_FETCH)):
    """Subscriber -> publisher: send me bucket ``index`` of ``version``."""

    version: int
    index: int
    shm: bool = False
    pid: int = 0
    start_time: int = 0
    data: bool = False


class WeightBucket(WireStruct, tag=int(MsgKind.WEIGHT_BUCKET)):
    """Publisher -> subscriber: one piece of a bucket's bytes, as zero-copy frames."""

    version: int
    index: int
    offset: int
    checksum: int
    last: bool
    chunks: list[Any]
    nbytes: int = 0


class WeightAck(WireStruct, tag=int(MsgKind.WEIGHT_ACK)):
    """Subscriber -> publisher: the outcome of ``version`` on this worker."""

    worker_id: str
    version: int
    ok: bool
    current_version: int
    error: str = ""
    digest: int | None = None
    via: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    pid: int = 0
    start_time: int = 0


class WeightError(WireStruct, tag=int(MsgKind.WEIGHT_ERROR)):
    """Publisher -> subscriber: a request could not be served."""

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
