"""Exceptions raised by :mod:`fastio`.

Exception tree::

    FastioError                      root of everything fastio raises
    ├── EncodeError(ValueError)      an object cannot be put on the wire
    └── DecodeError(ValueError)      a frame list is not a valid fastio message
        └── MessageTooLarge          the frames exceed the decoder's size limit

Errors from lower layers (msgspec, numpy, PIL) are translated once, at the codec
boundary, with ``raise ... from exc`` so the original cause stays attached.
"""

from __future__ import annotations

__all__ = ["DecodeError", "EncodeError", "FastioError", "MessageTooLarge"]


class FastioError(Exception):
    """Root of every exception raised by fastio."""


class EncodeError(FastioError, ValueError):
    """An object cannot be encoded (unsupported type, dtype, or a live object)."""


class DecodeError(FastioError, ValueError):
    """The frames are not a valid fastio message; the message says what is wrong."""


class MessageTooLarge(DecodeError):
    """The total size of the frames exceeds the configured limit."""
