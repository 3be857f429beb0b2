"""Wire constants of the fastio protocol, in one place.

See ``docs/PROTOCOL.md`` for the full description of the frame layout.
"""

from __future__ import annotations

import enum

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DTYPE_NAMES",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "READS",
    "ExtCode",
    "MsgKind",
    "TokenEncoding",
]

#: Version of the wire protocol this code writes by default, and the newest it reads.
#: Version 2: peers state what they read in their Heartbeats, token arrays may use
#: every code of :class:`ExtCode`. Version 1 (fastio before version 2): nothing
#: stated; the one token-array code every version-1 reader reads is ext 4. Bump it for
#: any change an older peer cannot read (see "Versions" in docs/PROTOCOL.md); appending
#: a field with a default to a Struct is not such a change.
PROTOCOL_VERSION = 2

#: The oldest version this code reads and writes. A decoder rejects headers outside
#: ``MIN_PROTOCOL_VERSION .. PROTOCOL_VERSION`` (``fastio.UnsupportedVersion``).
MIN_PROTOCOL_VERSION = 1

#: Arrays whose data is smaller than this many bytes travel inside the header;
#: larger ones travel as their own frame, sent without a copy. Chosen by measurement
#: (``bench/codec.py``, case ``inline_threshold``): a ZeroMQ frame costs more than
#: copying several KiB into the header, so a request of up to 2047 int32 tokens stays
#: one frame (small enough to join a fabric batch frame, 16 KiB), a longer one sends
#: its ids without a copy.
DEFAULT_INLINE_THRESHOLD = 8192

#: Default limit on the total size of one message's frames (16 GiB).
DEFAULT_MAX_MESSAGE_SIZE = 16 << 30


class MsgKind(enum.IntEnum):
    """Struct tags: the first element of every encoded Struct (``array_like``).

    Values are part of the wire format and never reused.
    """

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

    # -- fabric messages (transport between rollout clients and generation workers),
    # -- range 20-39; see ``fastio/fabric_msgs.py`` and the "Fabric" section of PROTOCOL.md
    FABRIC_SUBMIT = 20
    FABRIC_RESULT = 21
    FABRIC_STREAM = 22
    FABRIC_CANCEL = 23
    FABRIC_HEARTBEAT = 24
    FABRIC_CONTROL = 25
    FABRIC_CONTROL_REPLY = 26
    FABRIC_ERROR = 27
    FABRIC_WORKER_STATUS = 28

    # -- weight updates (trainer -> generation workers), range 40-59; see
    # -- ``fastio/weight_msgs.py`` and the "Weight updates" section of PROTOCOL.md
    WEIGHT_HELLO = 40
    WEIGHT_WELCOME = 41
    WEIGHT_ANNOUNCE = 42
    WEIGHT_HEARTBEAT = 43
    WEIGHT_FETCH = 44
    WEIGHT_BUCKET = 45
    WEIGHT_ACK = 46
    WEIGHT_ERROR = 47
    # -- range 60-63; see ``fastio/ipc_msgs.py`` and "The ipc path" in PROTOCOL.md
    IPC_HELLO = 60
    IPC_OFFER = 61
    IPC_READY = 62
    IPC_ACK = 63


class ExtCode(enum.IntEnum):
    """msgpack extension type codes used for out-of-band and binary payloads."""

    #: numpy array: payload ``[dtype, shape, data]``.
    NDARRAY = 1
    #: torch tensor: same payload as NDARRAY, decoded as a ``torch.Tensor``.
    TENSOR = 2
    #: PIL image: payload ``[mode, width, height, data]`` (raw pixel bytes).
    IMAGE = 3
    #: ``TokenArray``: same payload as NDARRAY with a 1-D shape, decoded as a
    #: ``TokenArray``. A code of its own so the decoder builds the right type without
    #: knowing which field it is in (the hot path skips msgspec's per-field hook).
    #: What fastio writes at protocol version 1: every version-1 reader reads it.
    TOKENS = 4
    #: ``TokenArray`` with its data inline: codes ``16 + d`` for the dtype at index
    #: ``d`` of :data:`DTYPE_NAMES`; the payload is the raw little-endian elements.
    #: No nested msgpack value to decode: the dtype is the code, the length the payload's.
    TOKENS_INLINE = 16
    #: ``TokenArray`` in a buffer frame: codes ``32 + d``; the payload is 8 bytes, the
    #: frame index and the element count, each a 4-byte little-endian unsigned int.
    #: Written for frame indices above 255; always accepted.
    TOKENS_FRAME = 32
    #: ``TokenArray`` in a buffer frame, compact: codes ``48 + d``; the payload is one
    #: byte, the frame index (1-255); the element count is the frame's length divided
    #: by the itemsize. What the encoder writes for frames 1-255.
    TOKENS_REF = 48


class TokenEncoding(enum.IntFlag):
    """Forms of token arrays on the wire, as bits: a peer states the forms it reads
    (``Heartbeat.token_encodings``), an :class:`~fastio.Encoder` writes one of them."""

    #: ext 4 ``[dtype, shape, data]``: what every reader of every version reads.
    TOKENS = 1
    #: ext ``16 + d`` inline and ``32 + d`` (frame index and element count) in a frame.
    COMPACT = 2
    #: ext ``48 + d`` (a one-byte frame index) in a frame, with ext ``16 + d`` inline
    #: and ``32 + d`` for frames from 256 on: what fastio writes by default. Writing it
    #: needs a peer that reads COMPACT too.
    REF = 4


#: The token encodings this code's decoder reads.
READS = TokenEncoding.TOKENS | TokenEncoding.COMPACT | TokenEncoding.REF


#: Canonical dtype names on the wire (little-endian always).
DTYPE_NAMES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
