"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back.

The header is plain msgpack: ``[protocol_version, n_buffers, body]``. ``body`` is the
object, with numpy arrays, torch tensors, ``TokenArray`` and PIL images written as
msgpack extension values (:class:`~fastio.protocol.ExtCode`). An array of at least
``inline_threshold`` bytes is not copied into the header: its extension value names a
frame index and the array's own memory is that frame. ``docs/PROTOCOL.md`` is the full
specification.

Zero-copy contract
------------------
*Encoding*: the buffer frames returned by :meth:`Encoder.encode` are memoryviews of the
caller's arrays. Do not mutate those arrays until the send has completed (pyzmq:
``send_multipart(frames, copy=False, track=True)`` and wait on the tracker).
``TokenArray.append``/``extend`` never write into the part of memory already encoded.

*Decoding*: decoded arrays are views of the received frames, no copies. They stay valid
as long as the array lives (it keeps the frame alive). They are writable when the frame
is writable (``zmq.Frame``, ``bytearray``), read-only when it is ``bytes``.

Per-call state (the list of buffers being built, the frames being read) lives in a
thread-local slot set for the duration of one call, never across calls, so an
``Encoder``/``Decoder`` may be shared by threads.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

from fastio import io_struct as _s
from fastio.errors import DecodeError, EncodeError, MessageTooLarge
from fastio.protocol import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_MESSAGE_SIZE,
    PROTOCOL_VERSION,
    ExtCode,
)
from fastio.tokens import TokenArray

__all__ = ["MESSAGE_TYPES", "Decoder", "Encoder", "Frame", "Message", "decode", "encode"]

#: Every type a receiver decodes with ``type=None``.
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
Message = Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007

#: Anything the decoder accepts as one frame: bytes-like objects or ``zmq.Frame``.
Frame = Any

_NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}

_meta_encoder = msgspec.msgpack.Encoder()
_array_meta = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], Union[int, bytes]])
_image_meta = msgspec.msgpack.Decoder(tuple[str, int, int, Union[int, bytes]])
_header_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_int_decoder = msgspec.msgpack.Decoder(int)

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
_IMAGE_MODES = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4, "I": 4, "F": 4, "I;16": 2}


def _torch() -> Any:
    return sys.modules.get("torch")


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {
        "bool": torch.bool,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
    }


_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtype_map() -> dict[str, Any]:
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update(_torch_dtypes())
    return _TORCH_DTYPES


class Encoder:
    """Encodes fastio messages (and nested arrays, tensors, images) into frames.

    Parameters
    ----------
    inline_threshold:
        Arrays with fewer bytes than this travel inside the header; larger ones as
        their own zero-copy frame.

    Examples
    --------
    >>> enc = Encoder()
    >>> frames = enc.encode(LLMResponse(output_tokens=np.arange(4096, dtype=np.int32)))
    >>> len(frames)  # header + one buffer
    2
    """

    def __init__(self, *, inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> None:
        if inline_threshold < 0:
            raise ValueError("inline_threshold must be >= 0")
        self.inline_threshold = inline_threshold
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._local = threading.local()

    def encode(self, obj: Any) -> list[Any]:
        """Encode ``obj`` into ``[header, *buffers]``.

        The header is ``bytes``; buffers are memoryviews of the caller's arrays (see
        the module docstring for how long they must stay unmodified). Send them with
        ``socket.send_multipart(frames, copy=False)``.

        Raises
        ------
        EncodeError
            For objects fastio cannot put on the wire (unsupported types or dtypes).
        """
        frames: list[Any] = [b""]
        local = self._local
        if getattr(local, "frames", None) is not None:
            raise EncodeError("Encoder.encode is not re-entrant within one thread")
        local.frames = frames
        try:
            body = self._enc.encode(obj)
        except EncodeError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from exc
        finally:
            local.frames = None
        # The header wraps the body: [version, n_buffers, body]. msgpack arrays of
        # fewer than 16 elements start with one byte 0x90|n, ints 0..127 are one byte.
        n = len(frames) - 1
        frames[0] = _header_prefix(n) + body
        return frames

    # -- hooks -----------------------------------------------------------------------
    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, TokenArray):
            return self._array_ext(obj.array, ExtCode.NDARRAY)
        if isinstance(obj, np.ndarray):
            return self._array_ext(obj, ExtCode.NDARRAY)
        if isinstance(obj, np.generic):
            return obj.item()
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor_ext(obj)
        if _is_pil_image(obj):
            return self._image_ext(obj)
        name = getattr(obj, "name_or_path", None)
        if isinstance(name, str):
            # Tokenizers and processors travel as the name/path to load them from.
            return name
        raise EncodeError(
            f"fastio cannot encode objects of type {type(obj).__module__}.{type(obj).__qualname__}"
        )

    def _data_slot(self, buf: Any, nbytes: int) -> int | bytes:
        if nbytes < self.inline_threshold:
            return bytes(buf)
        frames: list[Any] = self._local.frames
        frames.append(buf)
        return len(frames) - 1

    def _array_ext(self, arr: np.ndarray[Any, Any], code: ExtCode) -> msgspec.msgpack.Ext:
        name = arr.dtype.name
        if name not in _NP_DTYPES:
            raise EncodeError(
                f"unsupported array dtype {arr.dtype}; supported: {sorted(_NP_DTYPES)}"
            )
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # one copy: the wire form is C order
        buf = memoryview(arr.reshape(-1).view(np.uint8)) if arr.ndim else arr.tobytes()
        slot = self._data_slot(buf, arr.nbytes)
        return msgspec.msgpack.Ext(int(code), _meta_encoder.encode((name, arr.shape, slot)))

    def _tensor_ext(self, t: Any) -> msgspec.msgpack.Ext:
        torch = _torch()
        t = t.detach()
        names = {v: k for k, v in _torch_dtype_map().items()}
        name = names.get(t.dtype)
        if name is None:
            raise EncodeError(f"unsupported tensor dtype {t.dtype}; supported: {sorted(names.values())}")
        if t.device.type != "cpu":
            # Device memory cannot be a frame: one copy through host memory.
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()
        slot = self._data_slot(memoryview(raw), raw.nbytes)
        return msgspec.msgpack.Ext(int(ExtCode.TENSOR), _meta_encoder.encode((name, shape, slot)))

    def _image_ext(self, img: Any) -> msgspec.msgpack.Ext:
        if img.mode not in _IMAGE_MODES:
            img = img.convert("RGBA" if "A" in img.getbands() or img.mode == "P" else "RGB")
        # PIL exposes no buffer of its pixels: one copy, on the encode side only.
        data = img.tobytes()
        slot = self._data_slot(data, len(data))
        w, h = img.size
        return msgspec.msgpack.Ext(int(ExtCode.IMAGE), _meta_encoder.encode((img.mode, w, h, slot)))


def _is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(obj, pil.Image)


_PREFIXES: dict[int, bytes] = {}


def _header_prefix(n: int) -> bytes:
    prefix = _PREFIXES.get(n)
    if prefix is None:
        # msgpack fixarray(3), version, n_buffers (as a msgpack int)
        prefix = b"\x93" + _meta_encoder.encode(PROTOCOL_VERSION) + _meta_encoder.encode(n)
        if n < 1024:
            _PREFIXES[n] = prefix
    return prefix


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf if isinstance(buf, memoryview) else memoryview(buf)
    try:
        return memoryview(frame)
    except TypeError as exc:
        raise DecodeError(f"frame of type {type(frame).__name__} is not bytes-like") from exc


class Decoder:
    """Decodes ``[header, *buffers]`` frames into typed objects.

    Parameters
    ----------
    type:
        The expected type; ``None`` accepts any fastio message type (a tagged union).
    max_message_size:
        Frames adding up to more bytes raise :class:`~fastio.MessageTooLarge`.
    device:
        Where decoded torch tensors go (``"cpu"`` views the frame, no copy; e.g.
        ``"cuda:0"`` copies onto that device).

    Examples
    --------
    >>> dec = Decoder(LLMResponse)
    >>> resp = dec.decode(Encoder().encode(LLMResponse(output_tokens=[1, 2])))
    >>> resp.output_tokens == [1, 2]
    True
    """

    def __init__(
        self,
        type: Any = None,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        device: str | None = None,
    ) -> None:
        self.type = Message if type is None else type
        self.max_message_size = max_message_size
        self.device = None if device in (None, "cpu") else device
        self._local = threading.local()
        self._dec = msgspec.msgpack.Decoder(
            self.type, ext_hook=self._ext_hook, dec_hook=_dec_hook
        )

    def decode(self, frames: Sequence[Frame]) -> Any:
        """Decode a frame list (bytes, memoryview, bytearray or ``zmq.Frame`` items).

        Raises
        ------
        DecodeError
            Saying what is wrong with the frames; never any other exception for bad
            input.
        """
        if not isinstance(frames, (list, tuple)) or not frames:
            raise DecodeError("expected a non-empty list of frames [header, *buffers]")
        bufs = [_buffer(f) for f in frames]
        total = 0
        for b in bufs:
            total += b.nbytes
        if total > self.max_message_size:
            raise MessageTooLarge(
                f"message of {total} bytes exceeds the limit of {self.max_message_size} bytes"
            )
        try:
            parts = _header_decoder.decode(bufs[0])
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed header: {exc}") from exc
        if len(parts) != 3:
            raise DecodeError(
                f"malformed header: expected [version, n_buffers, body], got {len(parts)} items"
            )
        try:
            version = _int_decoder.decode(parts[0])
            n_buffers = _int_decoder.decode(parts[1])
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed header: {exc}") from exc
        if version != PROTOCOL_VERSION:
            raise DecodeError(
                f"unsupported protocol version {version}; this decoder speaks "
                f"version {PROTOCOL_VERSION}"
            )
        if n_buffers != len(bufs) - 1:
            raise DecodeError(
                f"wrong frame count: header announces {n_buffers} buffers, got {len(bufs) - 1}"
            )
        local = self._local
        local.frames = bufs
        try:
            return self._dec.decode(parts[2])
        except DecodeError:
            raise
        except msgspec.DecodeError as exc:
            raise DecodeError(f"invalid message body: {exc}") from exc
        except Exception as exc:  # boundary: nothing else may escape for bad input
            raise DecodeError(f"invalid message body: {type(exc).__name__}: {exc}") from exc
        finally:
            local.frames = None

    # -- hooks -----------------------------------------------------------------------
    def _data(self, slot: int | bytes, nbytes: int, what: str) -> memoryview | bytes:
        if isinstance(slot, bytes):
            data: memoryview | bytes = slot
        else:
            frames: list[memoryview] = self._local.frames
            if not 1 <= slot < len(frames):
                raise DecodeError(
                    f"{what} refers to frame {slot}, but the message has frames 1..{len(frames) - 1}"
                )
            data = frames[slot]
        got = len(data) if isinstance(data, bytes) else data.nbytes
        if got != nbytes:
            raise DecodeError(f"{what} needs {nbytes} bytes of data, frame holds {got}")
        return data

    def _ext_hook(self, code: int, payload: memoryview) -> Any:
        if code == ExtCode.NDARRAY or code == ExtCode.TENSOR:
            try:
                name, shape, slot = _array_meta.decode(payload)
            except msgspec.DecodeError as exc:
                raise DecodeError(f"malformed array descriptor: {exc}") from exc
            if any(d < 0 for d in shape):
                raise DecodeError(f"negative dimension in array shape {shape}")
            count = math.prod(shape)
            if code == ExtCode.TENSOR:
                return self._tensor(name, shape, count, slot)
            dtype = _NP_DTYPES.get(name)
            if dtype is None:
                raise DecodeError(f"unknown array dtype {name!r}")
            data = self._data(slot, count * dtype.itemsize, f"array {name}{list(shape)}")
            return np.frombuffer(data, dtype=dtype, count=count).reshape(shape)
        if code == ExtCode.IMAGE:
            return self._image(payload)
        raise DecodeError(f"unknown extension type code {code}")

    def _tensor(self, name: str, shape: tuple[int, ...], count: int, slot: int | bytes) -> Any:
        import torch

        dtype = _torch_dtype_map().get(name)
        if dtype is None:
            raise DecodeError(f"unknown tensor dtype {name!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        data = self._data(slot, count * itemsize, f"tensor {name}{list(shape)}")
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.flags.writeable:
            t = torch.from_numpy(raw)
        else:
            with warnings.catch_warnings():
                # Read-only input (bytes): the tensor is documented as read-only.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(raw)
        t = t.view(dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)
        if self.device is not None:
            t = t.to(self.device, non_blocking=False)
        return t

    def _image(self, payload: memoryview) -> Any:
        from PIL import Image

        try:
            mode, w, h, slot = _image_meta.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed image descriptor: {exc}") from exc
        bpp = _IMAGE_MODES.get(mode)
        if bpp is None:
            raise DecodeError(f"unsupported image mode {mode!r}")
        if w <= 0 or h <= 0:
            raise DecodeError(f"invalid image size {w}x{h}")
        data = self._data(slot, w * h * bpp, f"image {mode} {w}x{h}")
        return Image.frombuffer(mode, (w, h), data, "raw", mode, 0, 1)


def _dec_hook(tp: Any, obj: Any) -> Any:
    if tp is TokenArray:
        if isinstance(obj, np.ndarray):
            if obj.ndim != 1:
                raise ValueError(f"token array must be 1-D, got shape {obj.shape}")
            return TokenArray(obj)
        if isinstance(obj, list):
            # Peers in other languages may send plain msgpack arrays of numbers.
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj):
                raise ValueError("token array must hold only numbers")
            return TokenArray(obj)
        raise TypeError(f"expected an array, got {type(obj).__name__}")
    if isinstance(tp, type) and isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {getattr(tp, '__name__', tp)}, got {type(obj).__name__}")


_default_encoder = Encoder()
_default_decoders: dict[Any, Decoder] = {}


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames ``[header, *buffers]`` with a shared default
    :class:`Encoder` (see it for the zero-copy contract).

    >>> frames = encode(LLMRequest(input_ids=[1, 2, 3]))
    >>> decode(frames).input_ids
    TokenArray([1, 2, 3], dtype=int32)
    """
    return _default_encoder.encode(obj)


def decode(frames: Sequence[Frame], type: Any = None) -> Any:
    """Decode frames into ``type`` (``None``: whichever fastio message arrived).

    Raises :class:`~fastio.DecodeError` for any malformed input.
    """
    dec = _default_decoders.get(type)
    if dec is None:
        try:
            dec = _default_decoders[type] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
