"""Wire messages of the ``ipc`` weight path: a trainer shares persistent buckets of its
own memory with generation workers on its node (CUDA IPC on a GPU, torch's shared-memory
files on CPU) and says, per version, what it packed into them.

Every message is one fastio message (``[header]``: none carries buffers) whose body is one
of the Structs below, tagged 60-63 (``MsgKind.IPC_*``, see :data:`IPC_TAGS`). The
handles are plain msgpack fields of :class:`IpcHandle`: bytes, integers and a flag. No
pickle.

Flow (trainer = exporter, worker = importer; see ``docs/PROTOCOL.md``, "The ipc path")::

    worker  -> trainer : IpcHello                   once (and again after a trainer restart)
    trainer -> worker  : IpcOffer                   once: every slot's handle + the layout
    worker  -> trainer : IpcAck(bucket=-1)          opened (ok) or refused (error)
    per version, per bucket:
    trainer -> worker  : IpcReady(version, bucket, slot)   after packing the slot
    worker  -> trainer : IpcAck(version, bucket, slot)     after the worker is done reading it
    worker  -> trainer : IpcAck(bucket=-2)          it unmapped the slots and leaves

A slot is packed again only when every worker that was sent its last ``IpcReady`` has
acked it or its process is gone.
"""

from __future__ import annotations

import msgspec

from fastio.io_struct import WireStruct
from fastio.protocol import MsgKind

__all__ = [
    "IPC_TAGS",
    "IpcAck",
    "IpcBucket",
    "IpcHandle",
    "IpcHello",
    "IpcOffer",
    "IpcReady",
    "IpcSlot",
    "IpcTensor",
]

#: Struct tags of the ipc messages (60-63 of ``fastio.protocol.MsgKind``).
IPC_TAGS = {
    "IpcHello": int(MsgKind.IPC_HELLO),
    "IpcOffer": int(MsgKind.IPC_OFFER),
    "IpcReady": int(MsgKind.IPC_READY),
    "IpcAck": int(MsgKind.IPC_ACK),
}

#: Bytes after a slot's payload: the checksum and the version of what was packed, two
#: little-endian int64, written by the trainer (on its device) after the payload.
TRAILER_BYTES = 16


class IpcHandle(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How another process opens one persistent bucket (a slot), exported once.

    ``kind="cuda"``: the fields of ``torch.UntypedStorage._share_cuda_()`` in order:
    ``device`` index, ``handle`` (the ``cudaIpcMemHandle_t`` bytes of the allocation),
    ``size`` (bytes of the storage), ``offset`` (bytes of the storage inside the
    allocation), ``ref_counter_handle``/``ref_counter_offset`` (torch's producer-side
    reference counter of this export), ``event_handle`` (the IPC handle of the event
    torch recorded at export), ``event_sync_required``. ``slot_event`` is the
    ``cudaIpcEventHandle_t`` of the slot's own inter-process event, recorded after every
    packing.

    ``kind="cpu"``: ``handle`` is the name of the shared-memory file (``/torch_...``)
    and ``manager`` the socket of the ``torch_shm_manager`` that owns it (the fields of
    ``_share_filename_cpu_()``); ``device`` is ``-1`` and the CUDA fields are empty.
    """

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
    """One persistent bucket of the trainer: ``capacity`` payload bytes (a multiple of
    512) followed by the trailer (see :data:`TRAILER_BYTES`)."""

    index: int
    capacity: int
    handle: IpcHandle


class IpcTensor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where one tensor lies in its bucket: torch dtype name, shape, byte offset, bytes
    (C order, packed back to back: offsets need no alignment, workers copy bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class IpcBucket(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One bucket of every version: its tensors and ``nbytes`` (the checksummed length,
    the tensors' bytes rounded up to 512 with zeros)."""

    index: int
    nbytes: int
    tensors: list[IpcTensor]


class IpcHello(WireStruct, tag=IPC_TAGS["IpcHello"]):
    """Worker -> trainer: I can take the ipc path.

    ``pid`` and ``start_time`` (field 22 of ``/proc/<pid>/stat``) let the trainer see the
    process die (and not mistake a reused pid for it); a trainer that cannot see that
    process is on another host or in another pid namespace and refuses. ``device`` is the
    worker's CUDA device index (``-1``: CPU tensors). ``version``: the one it holds.
    """

    worker_id: str
    pid: int
    start_time: int
    device: int = -1
    version: int = -1


class IpcOffer(WireStruct, tag=IPC_TAGS["IpcOffer"]):
    """Trainer -> worker, once per worker: every slot's handle and the layout of a
    version (``buckets``; bucket ``b`` of a version goes to slot ``b % len(slots)``).

    ``checksum`` is ``"sum64"`` (see :func:`transport.weights.routes.ipc.checksum`) or ``""``
    (not computed). A non-empty ``error`` is a refusal (nothing else is meaningful): the
    worker should take another path.
    """

    publisher_id: str
    pid: int
    start_time: int
    slots: list[IpcSlot]
    buckets: list[IpcBucket]
    checksum: str = "sum64"
    error: str = ""


class IpcReady(WireStruct, tag=IPC_TAGS["IpcReady"]):
    """Trainer -> worker: bucket ``bucket`` of ``version`` is packed in slot ``slot``
    (on CUDA: once the slot's event fires). ``n_buckets`` buckets make the version."""

    version: int
    bucket: int
    slot: int
    n_buckets: int


class IpcAck(WireStruct, tag=IPC_TAGS["IpcAck"]):
    """Worker -> trainer: done with ``slot`` (it may be packed again).

    ``bucket=-1`` answers an :class:`IpcOffer` (``ok``: every slot opened);
    ``bucket=-2`` says the worker unmapped every slot and leaves the path. Otherwise
    ``ok=False`` means the bucket was refused (checksum or version mismatch) and the
    worker kept ``current_version``. ``stats`` holds seconds (``wait_s``, ``verify_s``,
    ``copy_s``).
    """

    worker_id: str
    version: int
    bucket: int
    slot: int
    ok: bool
    current_version: int = -1
    error: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)
