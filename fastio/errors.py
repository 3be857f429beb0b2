"""Exceptions raised by :mod:`fastio`.

Exception tree::

    FastioError                      root of everything fastio raises
    ├── EncodeError(ValueError)      an object cannot be put on the wire
    ├── DecodeError(ValueError)      a frame list is not a valid fastio message
    │   ├── MessageTooLarge          the frames exceed the decoder's size limit
    │   └── FrameError               not a fastio message at all: the frame list, the
    │       │                        header or the frame count is wrong
    │       └── UnsupportedVersion   the header's protocol version is not one it reads
    └── IncompatiblePeer(ValueError) a peer states versions this side cannot serve

Errors from lower layers (msgspec, numpy, PIL) are translated once, at the codec
boundary, with ``raise ... from exc`` so the original cause stays attached.
"""

from __future__ import annotations

__all__ = [
    "DecodeError",
    "EncodeError",
    "FastioError",
    "FrameError",
    "IncompatiblePeer",
    "MessageTooLarge",
    "UnsupportedVersion",
]


class FastioError(Exception):
    """Root of every exception raised by fastio."""


class EncodeError(FastioError, ValueError):
    """An object cannot be encoded (unsupported type, dtype, or a live object)."""


class DecodeError(FastioError, ValueError):
    """The frames are not a valid fastio message; the message says what is wrong."""


class MessageTooLarge(DecodeError):
    """The total size of the frames exceeds the configured limit."""


class FrameError(DecodeError):
    """The frames are not a fastio message at all (frame list, header or frame count);
    nothing of the body was read."""


class UnsupportedVersion(FrameError):
    """The header carries a protocol version this decoder does not read."""


class IncompatiblePeer(FastioError, ValueError):
    """A peer states protocol versions or token encodings this side cannot serve; the
    message names both sides' versions."""
