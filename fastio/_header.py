"""Frames and the header ``[protocol_version, n_buffers, body]``: the encoder's header
prefixes, byte views of received frames, and the general header parse the decoder's
error path uses."""

from __future__ import annotations

from typing import Any

import msgspec

from fastio._ext import _EMPTY, _meta_encode
from fastio.errors import FrameError, UnsupportedVersion
from fastio.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

_header_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_int_decoder = msgspec.msgpack.Decoder(int)

#: The protocol versions a decoder reads, oldest first.
_READ_VERSIONS = tuple(range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1))

_PREFIXES: dict[tuple[int, int], bytes] = {}
#: Header prefixes ``93 <version> <n>`` of fewer than 128 buffers, by version.
_SMALL_PREFIXES = {v: tuple(b"\x93" + bytes([v, n]) for n in range(128)) for v in _READ_VERSIONS}


def _header_prefix(n: int, version: int = PROTOCOL_VERSION) -> bytes:
    prefix = _PREFIXES.get((n, version))
    if prefix is None:
        # msgpack fixarray(3), version, n_buffers (both as msgpack ints)
        prefix = b"\x93" + _meta_encode(version) + _meta_encode(n)
        if n < 1024:
            _PREFIXES[(n, version)] = prefix
    return prefix


def _unsupported(version: int) -> UnsupportedVersion:
    lo, hi = MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
    return UnsupportedVersion(
        f"unsupported protocol version {version}; this decoder reads versions {lo}-{hi}"
    )


# Frame types whose len() is their size in bytes and that np.frombuffer reads directly.
# zmq.Frame joins when first seen (fastio does not import zmq itself).
_LEN_SIZED: set[type] = {bytes, bytearray}


def _buffer(frame: Any) -> memoryview:
    """A 1-D unsigned-byte memoryview of one frame (no copy)."""
    tp = type(frame)
    if tp.__module__.startswith("zmq") and tp.__name__ == "Frame":
        _LEN_SIZED.add(tp)
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if not isinstance(buf, memoryview):
        try:
            buf = memoryview(frame)
        except TypeError as exc:
            raise FrameError(f"frame of type {type(frame).__name__} is not bytes-like") from exc
    if not buf.c_contiguous:
        raise FrameError("frame is not a contiguous buffer")
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B") if buf.nbytes else _EMPTY
    return buf


def _read_int(h: memoryview, pos: int) -> tuple[int, int] | None:
    """A msgpack integer at ``h[pos]``: (value, next position), None if not an int."""
    if pos >= len(h):
        return None
    b = h[pos]
    if b < 0x80:
        return b, pos + 1
    if b >= 0xE0:
        return b - 0x100, pos + 1
    widths = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    size = widths.get(b)
    if size is None or pos + 1 + size > len(h):
        return None
    return (
        int.from_bytes(h[pos + 1 : pos + 1 + size], "big", signed=b >= 0xD0),
        pos + 1 + size,
    )


def _parse_header(h: memoryview) -> tuple[int, memoryview]:
    """General header parse (any msgpack int widths); checks the protocol version
    (:class:`~fastio.UnsupportedVersion` outside the versions it reads)."""
    try:
        parts = _header_decoder.decode(h)
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed header: {exc}") from exc
    if len(parts) != 3:
        raise FrameError(
            f"malformed header: expected [version, n_buffers, body], got {len(parts)} items"
        )
    try:
        version = _int_decoder.decode(parts[0])
        n_buffers = _int_decoder.decode(parts[1])
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed header: version and n_buffers must be ints: {exc}") from exc
    if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise _unsupported(version)
    # The body is the header's tail after the two ints (Raw holds a copy we do not need).
    # msgspec accepted an array of 3, so the first byte is fixarray, array16 or array32.
    pos = {0xDC: 3, 0xDD: 5}.get(h[0], 1)
    for _ in range(2):
        parsed = _read_int(h, pos)
        if parsed is None:  # pragma: no cover - msgspec accepted the ints above
            raise FrameError("malformed header")
        pos = parsed[1]
    return n_buffers, h[pos:]
