"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back
(``docs/PROTOCOL.md``; zero-copy, trust, threads: ``docs/concepts.md``, "The codec")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from fastio import io_struct, structs  # noqa: F401  (io_struct: the seed's types)
from fastio.decoder import Decoder
from fastio.encoder import Encoder
from fastio.jsonhook import enc_hook
from fastio.structs import WireStruct, message_types

__all__ = [
    "MESSAGE_TYPES", "Decoder", "Encoder", "Frame", "Message", "decode", "enc_hook", "encode",
    "message_types",
]  # fmt: skip

#: The seed's message types (:mod:`fastio.io_struct`), in tag order.
MESSAGE_TYPES: tuple[type[WireStruct], ...] = tuple(
    t for t in message_types() if t.__module__ in ("fastio.io_struct", "fastio.meta")
)
#: Static type of a decoded seed message.
Message = Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007

#: One frame: bytes-like or ``zmq.Frame``.
Frame = Any

_default_encoder = Encoder()
_default_decoders: dict[Any, Decoder] = {}


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames ``[header, *buffers]`` with a shared :class:`Encoder`.

    >>> from fastio import LLMRequest, decode, encode
    >>> frames = encode(LLMRequest(input_ids=[1, 2, 3]))
    >>> decode(frames).input_ids
    TokenArray([1, 2, 3], dtype=int32)
    """
    return _default_encoder.encode(obj)


def decode(frames: Sequence[Frame], type: Any = None) -> Any:
    """Decode frames into ``type`` (``None``: whichever fastio message arrived); any
    malformed input raises :class:`~fastio.DecodeError`."""
    # type=None's union grows as message modules are imported.
    key = (None, structs._registry_generation) if type is None else type
    dec = _default_decoders.get(key)
    if dec is None:
        try:
            dec = _default_decoders[key] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
