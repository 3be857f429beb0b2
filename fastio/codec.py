"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back.

The header is msgpack ``[protocol_version, n_buffers, body]``; arrays, tensors,
``TokenArray`` and PIL images in the body are extension values
(:class:`~fastio.protocol.ExtCode`); an array of ``inline_threshold`` bytes or more is
its own frame, without a copy. ``docs/PROTOCOL.md`` is the specification.

Zero-copy: encoded buffer frames are the caller's memory (do not mutate them until
sent; copies only where the wire form differs: non-contiguous or big-endian arrays,
CUDA tensors, PIL images). Decoded arrays are views of the frames and keep them alive,
writable when the frame is; small token arrays view the header, other small arrays are
private copies; tensors over read-only frames are copied.

Trust: msgspec checks every typed field and constraint, ``__post_init__`` the token
fields; ``Decoder(trusted=False)``, the default for anything from a socket, also holds
the frames to ``max_message_size`` (by ``len()``) before parsing.

Threads: an ``Encoder`` or ``Decoder`` may be shared by threads and used re-entrantly:
per-call state is taken from a list of idle ones (atomic ``pop``/``append``), never
kept on the instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from fastio import io_struct, structs  # noqa: F401  (io_struct: the seed's types)
from fastio.decoder import Decoder
from fastio.encoder import Encoder
from fastio.jsonhook import enc_hook
from fastio.structs import WireStruct, message_types

__all__ = [
    "MESSAGE_TYPES",
    "Decoder",
    "Encoder",
    "Frame",
    "Message",
    "decode",
    "enc_hook",
    "encode",
    "message_types",
]

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
    """Decode frames into ``type`` (``None``: whichever fastio message arrived).

    Raises :class:`~fastio.DecodeError` for any malformed input.
    """
    # type=None's union grows as message modules are imported.
    key = (None, structs._registry_generation) if type is None else type
    dec = _default_decoders.get(key)
    if dec is None:
        try:
            dec = _default_decoders[key] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
