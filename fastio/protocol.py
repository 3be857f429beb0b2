"""Wire constants of the fastio protocol, in one place (``docs/PROTOCOL.md``)."""

from __future__ import annotations

import enum

__all__ = [
    "DEFAULT_INLINE_THRESHOLD", "DEFAULT_MAX_MESSAGE_SIZE", "DTYPE_NAMES", "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION", "READS", "ExtCode", "MsgKind", "TokenEncoding",
]  # fmt: skip

#: The version written by default and the newest read. Bump it for any change an older
#: peer cannot read (appending a field with a default is not one; docs/PROTOCOL.md).
PROTOCOL_VERSION = 2

#: The oldest version read and written (others: ``fastio.UnsupportedVersion``).
MIN_PROTOCOL_VERSION = 1

#: Arrays of fewer bytes travel inside the header (a frame costs more than copying a
#: few KiB: ``bench/codec.py``), larger ones as their own frame.
DEFAULT_INLINE_THRESHOLD = 8192

#: Default limit on the total size of one message's frames (16 GiB).
DEFAULT_MAX_MESSAGE_SIZE = 16 << 30


class MsgKind(enum.IntEnum):
    """Struct tags, the first element of every encoded Struct; never reused."""

    GENERATION_HYPERPARAMETERS = 1
    LLM_REQUEST = 2
    LLM_RESPONSE = 3
    VLM_REQUEST = 4
    VLM_RESPONSE = 5
    FINETUNE_SPEC = 6
    ALLOCATION_MODE = 7
    PARAM_SPEC = 8
    WEIGHT_UPDATE_META = 9
    SAVER_CONFIG = 10
    SAVE_LOAD_META = 11
    ROLLOUT_STAT = 12

    # Fabric (rollout clients <-> generation workers), 20-39: fastio/fabric_msgs.py
    FABRIC_SUBMIT = 20
    FABRIC_RESULT = 21
    FABRIC_STREAM = 22
    FABRIC_CANCEL = 23
    FABRIC_HEARTBEAT = 24
    FABRIC_CONTROL = 25
    FABRIC_CONTROL_REPLY = 26
    FABRIC_ERROR = 27
    FABRIC_WORKER_STATUS = 28

    # Weight updates (trainer -> generation workers), 40-59: fastio/weight_msgs.py
    WEIGHT_HELLO = 40
    WEIGHT_WELCOME = 41
    WEIGHT_ANNOUNCE = 42
    WEIGHT_HEARTBEAT = 43
    WEIGHT_FETCH = 44
    WEIGHT_BUCKET = 45
    WEIGHT_ACK = 46
    WEIGHT_ERROR = 47
    # The ipc route, 60-63: fastio/ipc_msgs.py
    IPC_HELLO = 60
    IPC_OFFER = 61
    IPC_READY = 62
    IPC_ACK = 63


class ExtCode(enum.IntEnum):
    """msgpack extension type codes; ``TOKENS_*`` are bases, ``+ d`` for dtype ``DTYPE_NAMES[d]``
    (payloads: ``docs/PROTOCOL.md``, "Extension types")."""

    NDARRAY = 1
    TENSOR = 2
    IMAGE = 3
    TOKENS = 4
    TOKENS_INLINE = 16
    TOKENS_FRAME = 32
    TOKENS_REF = 48


class TokenEncoding(enum.IntFlag):
    """Forms of token arrays on the wire, as bits: a peer states those it reads
    (``Heartbeat.token_encodings``), an :class:`~fastio.Encoder` writes one."""

    #: ext 4: what every reader reads.
    TOKENS = 1
    #: ext ``16 + d`` inline, ``32 + d`` in a frame.
    COMPACT = 2
    #: ext ``48 + d`` in a frame (``32 + d`` from frame 256), ``16 + d`` inline: the
    #: default; needs a reader of COMPACT too.
    REF = 4


#: The token encodings this code's decoder reads.
READS = TokenEncoding.TOKENS | TokenEncoding.COMPACT | TokenEncoding.REF


#: Canonical dtype names on the wire (little-endian always); ``d`` of ext ``16 + d``.
DTYPE_NAMES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip
