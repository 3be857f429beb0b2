"""fastio: the message types and zero-copy msgpack codec of the fastio stack.

``fastio`` knows types and bytes, never sockets: it turns a message into frames
``[header, *buffers]`` and back. See ``docs/PROTOCOL.md`` for the wire format.

>>> import fastio
>>> frames = fastio.encode(fastio.LLMRequest(input_ids=[1, 2, 3]))
>>> fastio.decode(frames).input_ids == [1, 2, 3]
True
"""

from fastio.codec import (
    MESSAGE_TYPES,
    Decoder,
    Encoder,
    Frame,
    Message,
    decode,
    enc_hook,
    encode,
    message_types,
)
from fastio.errors import (
    DecodeError,
    EncodeError,
    FastioError,
    FrameError,
    IncompatiblePeer,
    MessageTooLarge,
    UnsupportedVersion,
)
from fastio.io_struct import (
    MAX_NEW_TOKENS,
    AllocationMode,
    AllocationType,
    FinetuneSpec,
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    RolloutStat,
    SaveLoadMeta,
    SaverConfig,
    VLMRequest,
    VLMResponse,
    WeightUpdateMeta,
    WireStruct,
)
from fastio.jsonhook import to_builtins, to_json
from fastio.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, ExtCode, MsgKind, TokenEncoding
from fastio.tokens import TokenArray

__version__ = "0.1.0"

__all__ = [
    "MAX_NEW_TOKENS", "MESSAGE_TYPES", "MIN_PROTOCOL_VERSION", "PROTOCOL_VERSION",
    "AllocationMode", "AllocationType", "DecodeError", "Decoder", "EncodeError", "Encoder",
    "ExtCode", "FastioError", "FinetuneSpec", "Frame", "FrameError", "GenerationHyperparameters",
    "IncompatiblePeer", "LLMRequest", "LLMResponse", "Message", "MessageTooLarge", "MsgKind",
    "ParamSpec", "RolloutStat", "SaveLoadMeta", "SaverConfig", "TokenArray", "TokenEncoding",
    "UnsupportedVersion", "VLMRequest", "VLMResponse", "WeightUpdateMeta", "WireStruct",
    "__version__", "decode", "enc_hook", "encode", "message_types", "to_builtins", "to_json",
]  # fmt: skip
