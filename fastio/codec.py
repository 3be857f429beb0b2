"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back.

The header is plain msgpack ``[protocol_version, n_buffers, body]``; numpy arrays, torch
tensors, ``TokenArray`` and PIL images in the body are msgpack extension values
(:class:`~fastio.protocol.ExtCode`). An array of at least ``inline_threshold`` bytes is
not copied into the header: its extension value names a frame, and the array's own
memory is that frame. ``docs/PROTOCOL.md`` is the specification; :class:`Encoder` lives
in :mod:`fastio.encoder`, :class:`Decoder` in :mod:`fastio.decoder`.

Zero-copy contract
------------------
*Encoding*: buffer frames are the caller's memory (a token array's numpy array itself,
1-D byte memoryviews of other arrays): do not mutate them until the send has completed
(pyzmq: ``copy=False, track=True``). Copies happen only where the wire form differs
from the memory: non-contiguous or big-endian arrays, CUDA tensors, PIL images.

*Decoding*: arrays are views of the received frames and keep them alive; writable when
the frame is (``zmq.Frame``, ``bytearray``), read-only for ``bytes``. Small token arrays
are views of the header, other small arrays private copies. ``TokenArray`` growth and
assignment copy before they write; tensors over a read-only frame are copied.

Trust
-----
msgspec checks every typed field and its constraints during the decode; the types'
``__post_init__`` checks token fields. ``Decoder(trusted=False)``, the default and the
only right choice for anything read from a socket, also holds the frames to
``max_message_size`` (by ``len()``: bytes for what a socket delivers, elements for an
encoder's numpy frames) before parsing; ``trusted=True`` skips only that.

Threads
-------
One ``Encoder`` or ``Decoder`` may be shared by threads and used re-entrantly: per-call
state is never kept on the instance. Messages of one frame go through one stateless
msgspec encoder/decoder; others take a per-call state (a msgspec encoder or decoder whose
hook reads that call's frame list) from a list of idle ones (``list.pop``/``append``
are atomic), or make one when every state is in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from fastio import io_struct as _s
from fastio import structs
from fastio.decoder import Decoder
from fastio.encoder import Encoder
from fastio.jsonhook import enc_hook
from fastio.structs import message_types

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

#: The seed's message types (each a tagged :class:`~fastio.WireStruct`).
MESSAGE_TYPES: tuple[type[_s.WireStruct], ...] = (
    _s.GenerationHyperparameters,
    _s.LLMRequest,
    _s.LLMResponse,
    _s.VLMRequest,
    _s.VLMResponse,
    _s.FinetuneSpec,
    _s.AllocationMode,
    _s.ParamSpec,
    _s.WeightUpdateMeta,
    _s.SaverConfig,
    _s.SaveLoadMeta,
    _s.RolloutStat,
)
#: Static type of a decoded seed message.
Message = Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007

#: Anything the decoder accepts as one frame: bytes-like objects or ``zmq.Frame``.
Frame = Any

_default_encoder = Encoder()
_default_decoders: dict[Any, Decoder] = {}


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames ``[header, *buffers]`` with a shared default
    :class:`Encoder` (see it for the zero-copy contract).

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
    # type=None's union grows when message modules are imported: key it by registry size.
    key = (None, structs._registry_generation) if type is None else type
    dec = _default_decoders.get(key)
    if dec is None:
        try:
            dec = _default_decoders[key] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
