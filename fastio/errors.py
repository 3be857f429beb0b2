"""Exceptions raised by :mod:`fastio` (the tree: ``docs/troubleshooting.md``); errors of
lower layers (msgspec, numpy, PIL) are translated once, at the codec boundary, with
``raise ... from exc``."""

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
