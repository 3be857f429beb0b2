"""Wire messages of the fabric between rollout clients and generation workers (tags
20-39). Sockets, directions and every field's meaning: ``docs/PROTOCOL.md``, "Fabric".
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Union

import msgspec

from fastio import _ext
from fastio.io_struct import LLMRequest, VLMRequest, WireStruct
from fastio.protocol import MsgKind
from fastio.tokens import TokenArray

__all__ = [
    "BATCH_MARKER", "CLIENT_TO_WORKER", "MAX_BATCHED_FRAME", "WORKER_TO_CLIENT", "Cancel",
    "Control", "ControlOp", "ControlReply", "Error", "ErrorCode", "Heartbeat", "Result", "Stream",
    "Submit", "WorkerStatus", "pack_batch", "peek", "split",
]  # fmt: skip


class ErrorCode(enum.IntEnum):
    """Codes of :class:`Error` replies (wire values; see ``docs/PROTOCOL.md``, "Fabric")."""

    BAD_MESSAGE = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_KIND = 3
    TOO_LARGE = 4
    BAD_REQUEST = 5
    HANDLER_ERROR = 6
    OVERLOADED = 7
    ABORTED = 8
    TIMEOUT = 9
    UNKNOWN_OP = 10
    BAD_RESPONSE = 11
    LOST = 12


#: Operations of a :class:`Control` message.
ControlOp = Literal["pause", "resume", "abort", "health"]


class Submit(WireStruct, tag=int(MsgKind.FABRIC_SUBMIT)):
    """Client -> worker: run one generation."""

    id: int
    request: Union[LLMRequest, VLMRequest]  # noqa: UP007 - msgspec tagged union
    timeout: float = 0.0
    stream: bool = True


class Result(WireStruct, tag=int(MsgKind.FABRIC_RESULT)):
    """Worker -> client: the final answer to a :class:`Submit` (the output only)."""

    id: int
    output_tokens: TokenArray = msgspec.field(default_factory=TokenArray)
    output_logprobs: TokenArray = msgspec.field(default_factory=TokenArray)
    output_versions: TokenArray = msgspec.field(default_factory=TokenArray)
    stop_reason: Literal["length", "stop", "interrupt", "abort"] = "stop"


class Stream(WireStruct, tag=int(MsgKind.FABRIC_STREAM)):
    """Worker -> client: output tokens since the previous chunk (``seq`` from 0)."""

    id: int
    seq: int
    output_tokens: TokenArray = msgspec.field(default_factory=TokenArray)
    output_logprobs: TokenArray = msgspec.field(default_factory=TokenArray)
    output_versions: TokenArray = msgspec.field(default_factory=TokenArray)


class Cancel(WireStruct, tag=int(MsgKind.FABRIC_CANCEL)):
    """Client -> worker: abandon submission ``id`` (no reply)."""

    id: int


class Heartbeat(WireStruct, tag=int(MsgKind.FABRIC_HEARTBEAT)):
    """Both ways: a client's ping; the worker's pong echoes ``sent_at`` with its state."""

    sent_at: float = 0.0
    worker_id: str = ""
    incarnation: str = ""
    in_flight: int = 0
    paused: bool = False
    version: int = 0
    running: int = 0
    waiting: int = 0
    engine_lag: float = 0.0
    protocol: int = 1
    protocol_min: int = 1
    token_encodings: int = 1


class WorkerStatus(WireStruct, tag=int(MsgKind.FABRIC_WORKER_STATUS)):
    """A worker's state, carried by :class:`ControlReply`."""

    worker_id: str = ""
    incarnation: str = ""
    version: int = 0
    paused: bool = False
    running: int = 0
    waiting: int = 0
    counters: dict[str, int] = msgspec.field(default_factory=dict)


class Control(WireStruct, tag=int(MsgKind.FABRIC_CONTROL)):
    """Controller -> worker: one operation; answered by :class:`ControlReply` (same seq)."""

    seq: int
    op: str
    timeout: float = 30.0


class ControlReply(WireStruct, tag=int(MsgKind.FABRIC_CONTROL_REPLY)):
    """Worker -> controller: outcome of :class:`Control` ``seq``."""

    seq: int
    ok: bool
    error: str = ""
    status: WorkerStatus = msgspec.field(default_factory=WorkerStatus)


class Error(WireStruct, tag=int(MsgKind.FABRIC_ERROR)):
    """Either way: a message could not be served; ``id`` is its submission, or -1."""

    id: int
    code: int
    message: str = ""


#: What a worker decodes (a tagged union).
CLIENT_TO_WORKER = Union[Submit, Cancel, Heartbeat, Control, Error]  # noqa: UP007
#: What a client or controller decodes.
WORKER_TO_CLIENT = Union[Result, Stream, Heartbeat, ControlReply, Error]  # noqa: UP007


def peek(frames: list[Any]) -> tuple[int | None, int | None, int | None]:
    """Best-effort ``(protocol_version, kind, first_field)`` of a message that failed to
    decode (for the error reply's id); ``None`` for unknown parts."""
    version = kind = first = None
    try:
        parts = _ext.raw_list.decode(getattr(frames[0], "buffer", frames[0]))
        version = _ext.int_decoder.decode(parts[0])
        body = _ext.raw_list.decode(parts[2])
        kind = _ext.int_decoder.decode(body[0])
        first = _ext.int_decoder.decode(body[1])
    except Exception:
        pass
    return version, kind, first


#: First byte of a batch frame: msgpack's never-used ``0xc1`` (no header starts so).
BATCH_MARKER = 0xC1
#: Single-frame messages up to this size are joined into batch frames (a copy).
MAX_BATCHED_FRAME = 16 * 1024

_batch_enc = msgspec.msgpack.Encoder()
_batch_dec = msgspec.msgpack.Decoder(list[bytes])
_BATCH_PREFIX = bytes([BATCH_MARKER])


def pack_batch(headers: list[Any]) -> bytes:
    """One batch frame carrying single-frame messages' headers: ``0xc1``, then a
    msgpack array of bin (ZeroMQ's cost per frame paid once)."""
    return _BATCH_PREFIX + _batch_enc.encode(headers)


def split(frames: list[Any]) -> list[list[Any]]:
    """Split the frames of one ZeroMQ message into the fastio messages it carries
    (back to back, and in batch frames); frames that do not parse are returned as one
    message, for the decoder to reject."""
    if len(frames) == 1:
        f = frames[0]
        buf = getattr(f, "buffer", f)  # zmq.Frame
        if not len(buf) or buf[0] != BATCH_MARKER:
            return [frames]
    out: list[list[Any]] = []
    i, total = 0, len(frames)
    while i < total:
        f = frames[i]
        buf = getattr(f, "buffer", f)
        if len(buf) and buf[0] == BATCH_MARKER:
            try:
                out.extend([h] for h in _batch_dec.decode(memoryview(buf)[1:]))
            except msgspec.DecodeError:
                out.append([f])  # not a batch: one bad message
            i += 1
            continue
        if len(buf) >= 3 and buf[0] == 0x93 and buf[1] < 0x80 and buf[2] < 0x80:
            n = buf[2]  # both fixints (a header without its body still says its count)
        else:
            try:
                n = _ext.header_ints(buf)[1]
            except Exception:
                n = -1
        if n < 0:
            out.append(frames[i:])
            break
        out.append(frames[i : i + 1 + n])
        i += 1 + n
    return out
