"""Wire messages of the fabric between rollout clients and generation workers.

Each is one fastio message whose body is a Struct below (tags 20-39); a request
travels nested in its :class:`Submit` (one decode per hop, token arrays stay frames).
Directions (client = DEALER, worker = ROUTER)::

    client -> worker : Submit, Cancel, Heartbeat (ping), Control, Error
    worker -> client : Result, Stream, Heartbeat (pong), ControlReply, Error

``id`` is the client's, unique per *submission* (a re-sent request gets a new one), so
a late answer to an old submission is dropped as stale.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Union

import msgspec

from fastio._diagnose import _header_decoder as _raw_list
from fastio._diagnose import _header_ints
from fastio._diagnose import _int_decoder as _int
from fastio.io_struct import LLMRequest, VLMRequest, WireStruct
from fastio.protocol import MsgKind
from fastio.tokens import TokenArray

__all__ = [
    "BATCH_MARKER",
    "CLIENT_TO_WORKER",
    "MAX_BATCHED_FRAME",
    "WORKER_TO_CLIENT",
    "Cancel",
    "Control",
    "ControlOp",
    "ControlReply",
    "Error",
    "ErrorCode",
    "Heartbeat",
    "Result",
    "Stream",
    "Submit",
    "WorkerStatus",
    "pack_batch",
    "peek",
    "split",
]


class ErrorCode(enum.IntEnum):
    """Codes of :class:`Error` replies (wire values)."""

    #: Frames that are not a fastio message at all.
    BAD_MESSAGE = 1
    #: A header carrying another protocol version.
    UNSUPPORTED_VERSION = 2
    #: A well-formed message of a kind this side does not accept.
    UNKNOWN_KIND = 3
    #: The message's frames add up to more than the receiver's limit.
    TOO_LARGE = 4
    #: A Submit whose request does not validate (wrong types, bad values).
    BAD_REQUEST = 5
    #: The generate handler raised; ``message`` holds its error.
    HANDLER_ERROR = 6
    #: The worker holds too many requests; re-send later or elsewhere.
    OVERLOADED = 7
    #: The request was aborted by a controller.
    ABORTED = 8
    #: The request's worker-side time limit passed.
    TIMEOUT = 9
    #: A Control message naming an unknown operation.
    UNKNOWN_OP = 10
    #: The client could not use a worker's answer (informational, to the worker).
    BAD_RESPONSE = 11
    #: The worker gave the submission up (client presumed gone, answer undeliverable);
    #: sent when the client is heard from again. Re-send it.
    LOST = 12


#: Operations of a :class:`Control` message.
ControlOp = Literal["pause", "resume", "abort", "health"]


class Submit(WireStruct, tag=int(MsgKind.FABRIC_SUBMIT)):
    """Client -> worker: run one generation."""

    id: int
    request: Union[LLMRequest, VLMRequest]  # noqa: UP007 - msgspec tagged union
    #: Seconds the worker may spend on it (0: no limit); the client enforces its own.
    timeout: float = 0.0
    #: Whether the worker should send :class:`Stream` chunks while generating.
    stream: bool = True


class Result(WireStruct, tag=int(MsgKind.FABRIC_RESULT)):
    """Worker -> client: the final answer to a :class:`Submit`, the output only (the
    client rebuilds the :class:`~fastio.LLMResponse` with what it sent and measured)."""

    id: int
    output_tokens: TokenArray = msgspec.field(default_factory=TokenArray)
    output_logprobs: TokenArray = msgspec.field(default_factory=TokenArray)
    output_versions: TokenArray = msgspec.field(default_factory=TokenArray)
    #: ``"abort"``: a controller aborted the generation; the output so far.
    stop_reason: Literal["length", "stop", "interrupt", "abort"] = "stop"


class Stream(WireStruct, tag=int(MsgKind.FABRIC_STREAM)):
    """Worker -> client: output tokens since the previous chunk (``seq`` from 0); the
    :class:`Result` carries the whole output again."""

    id: int
    seq: int
    output_tokens: TokenArray = msgspec.field(default_factory=TokenArray)
    output_logprobs: TokenArray = msgspec.field(default_factory=TokenArray)
    output_versions: TokenArray = msgspec.field(default_factory=TokenArray)


class Cancel(WireStruct, tag=int(MsgKind.FABRIC_CANCEL)):
    """Client -> worker: abandon submission ``id`` (no reply)."""

    id: int


class Heartbeat(WireStruct, tag=int(MsgKind.FABRIC_HEARTBEAT)):
    """Both ways: a client's ping; the worker's pong echoes ``sent_at``, adding its
    identity and load."""

    sent_at: float = 0.0
    #: Worker -> client only: a stable name and a random id of this process's life.
    worker_id: str = ""
    incarnation: str = ""
    in_flight: int = 0
    paused: bool = False
    version: int = 0
    #: Worker -> client only: handlers running, submissions waiting, and seconds the
    #: engine is behind: these tell a busy worker from a dead one.
    running: int = 0
    waiting: int = 0
    engine_lag: float = 0.0
    #: Both ways: the versions and ``TokenEncoding`` bits the sender reads (defaults: a
    #: version-1 peer, see ``fastio.versions``).
    protocol: int = 1
    protocol_min: int = 1
    token_encodings: int = 1


class WorkerStatus(WireStruct, tag=int(MsgKind.FABRIC_WORKER_STATUS)):
    """A worker's state, carried by :class:`ControlReply`."""

    worker_id: str = ""
    incarnation: str = ""
    version: int = 0
    paused: bool = False
    #: Requests whose handler is running.
    running: int = 0
    #: Requests waiting for resume or a concurrency slot.
    waiting: int = 0
    #: Counters since start (received, completed, errors, ...).
    counters: dict[str, int] = msgspec.field(default_factory=dict)


class Control(WireStruct, tag=int(MsgKind.FABRIC_CONTROL)):
    """Controller -> worker: one operation; answered by :class:`ControlReply` (same seq)."""

    seq: int
    op: str
    #: pause: seconds to wait for running generations to stop before answering.
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


def _buf(frame: Any) -> Any:
    buf = getattr(frame, "buffer", None)
    return frame if buf is None else buf


def peek(frames: list[Any]) -> tuple[int | None, int | None, int | None]:
    """Best-effort ``(protocol_version, kind, first_field)`` of a message that failed to
    decode (for the error reply's id); ``None`` for unknown parts."""
    version = kind = first = None
    try:
        parts = _raw_list.decode(_buf(frames[0]))
        version = _int.decode(parts[0])
        body = _raw_list.decode(parts[2])
        kind = _int.decode(body[0])
        first = _int.decode(body[1])
    except Exception:
        pass
    return version, kind, first


def _n_buffers(frame: Any) -> int | None:
    buf = _buf(frame)
    if len(buf) >= 3 and buf[0] == 0x93 and buf[1] < 0x80 and buf[2] < 0x80:
        return int(buf[2])
    try:
        n = _header_ints(buf)[1]
    except Exception:
        return None
    return n if n >= 0 else None


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
        buf = getattr(f, "buffer", f)  # _buf, inline: the hot path
        if not len(buf) or buf[0] != BATCH_MARKER:
            return [frames]
    out: list[list[Any]] = []
    i, total = 0, len(frames)
    while i < total:
        f = frames[i]
        buf = _buf(f)
        if len(buf) and buf[0] == BATCH_MARKER:
            try:
                items = _batch_dec.decode(memoryview(buf)[1:])
            except msgspec.DecodeError:
                out.append([f])  # not a batch: one bad message
            else:
                out.extend([h] for h in items)
            i += 1
            continue
        n = _n_buffers(f)
        if n is None:
            out.append(frames[i:])
            break
        out.append(frames[i : i + 1 + n])
        i += 1 + n
    return out
