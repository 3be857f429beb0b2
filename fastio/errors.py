"""Exceptions raised by :mod:`fastio` (the tree: ``docs/troubleshooting.md``). Errors from
msgspec, numpy or PIL are translated at the codec boundary, ``from`` the original."""

from __future__ import annotations

__all__ = [
    "DecodeError", "EncodeError", "FastioError", "FrameError", "IncompatiblePeer",
    "MessageTooLarge", "UnsupportedVersion",
]  # fmt: skip


class FastioError(Exception):
    """Root of every exception raised by fastio."""


class EncodeError(FastioError, ValueError):
    """An object cannot be encoded (unsupported type, dtype, or a live object)."""


class DecodeError(FastioError, ValueError):
    """The frames are not a valid fastio message; the message says what is wrong."""


class MessageTooLarge(DecodeError):
    """The total size of the frames exceeds the configured limit."""


class FrameError(DecodeError):
    """Not a fastio message at all (frame list, header or frame count): no body read."""


class UnsupportedVersion(FrameError):
    """The header carries a protocol version this decoder does not read."""


class IncompatiblePeer(FastioError, ValueError):
    """A peer states protocol versions or token encodings this side cannot serve."""
