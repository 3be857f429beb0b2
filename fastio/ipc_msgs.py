"""Wire messages of the ``ipc`` weight route (tags 60-63): a trainer shares buckets of its
memory with the workers on its host (no pickle). ``docs/PROTOCOL.md``, "The ipc path"."""

from __future__ import annotations

import msgspec

from fastio.io_struct import WireStruct
from fastio.protocol import MsgKind

__all__ = [
    "IPC_TAGS", "IpcAck", "IpcBucket", "IpcHandle", "IpcHello", "IpcOffer", "IpcReady", "IpcSlot",
    "IpcTensor",
]  # fmt: skip

#: Bytes after a slot's payload: its checksum and version, two little-endian int64.
TRAILER_BYTES = 16


class IpcHandle(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How another process opens one slot (the fields of torch's ``_share_cuda_()`` or
    ``_share_filename_cpu_()``)."""

    kind: str
    device: int
    handle: bytes
    size: int
    offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    slot_event: bytes = b""
    manager: bytes = b""


class IpcSlot(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One persistent bucket of the trainer: ``capacity`` payload bytes, then the trailer."""

    index: int
    capacity: int
    handle: IpcHandle


class IpcTensor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where one tensor lies in its bucket (C order, packed back to back)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class IpcBucket(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One bucket of every version: its tensors and ``nbytes`` (rounded up to 512)."""

    index: int
    nbytes: int
    tensors: list[IpcTensor]


class IpcHello(WireStruct, tag=int(MsgKind.IPC_HELLO)):
    """Worker -> trainer: I can take the ipc path."""

    worker_id: str
    pid: int
    start_time: int
    device: int = -1
    version: int = -1


class IpcOffer(WireStruct, tag=int(MsgKind.IPC_OFFER)):
    """Trainer -> worker, once: every slot's handle and the layout (``error``: refused)."""

    publisher_id: str
    pid: int
    start_time: int
    slots: list[IpcSlot]
    buckets: list[IpcBucket]
    checksum: str = "sum64"
    error: str = ""


class IpcReady(WireStruct, tag=int(MsgKind.IPC_READY)):
    """Trainer -> worker: bucket ``bucket`` of ``version`` is packed in slot ``slot``."""

    version: int
    bucket: int
    slot: int
    n_buckets: int


class IpcAck(WireStruct, tag=int(MsgKind.IPC_ACK)):
    """Worker -> trainer: done with ``slot`` (``bucket=-1``: the offer's answer, ``-2``: leaving)."""

    worker_id: str
    version: int
    bucket: int
    slot: int
    ok: bool
    current_version: int = -1
    error: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)


#: Struct tags of the ipc messages (60-63 of ``fastio.protocol.MsgKind``).
IPC_TAGS = {t.__name__: t.__struct_config__.tag for t in (IpcHello, IpcOffer, IpcReady, IpcAck)}
