"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back.

The header is plain msgpack: ``[protocol_version, n_buffers, body]``. ``body`` is the
object, with numpy arrays, torch tensors, ``TokenArray`` and PIL images written as
msgpack extension values (:class:`~fastio.protocol.ExtCode`). An array of at least
``inline_threshold`` bytes is not copied into the header: its extension value names a
frame index and the array's own memory is that frame. ``docs/PROTOCOL.md`` is the full
specification.

Zero-copy contract
------------------
*Encoding*: the buffer frames returned by :meth:`Encoder.encode` are byte memoryviews of
the caller's arrays. Do not mutate those arrays until the send has completed (pyzmq:
``send_multipart(frames, copy=False, track=True)`` and wait on the tracker).
``TokenArray.append``/``extend`` never write into the part of memory already encoded.
Copies happen only where the wire form differs from the memory: non-contiguous or
big-endian arrays, CUDA tensors (through host memory) and PIL images (no buffer API).

*Decoding*: decoded arrays are views of the received frames, no copies. They stay valid
as long as the array lives (it keeps the frame alive). They are writable when the frame
is writable (``zmq.Frame``, ``bytearray``), read-only when it is ``bytes``. Token arrays
below the inline threshold travel inside the header and decode as views of it too;
other arrays below it decode as small private (writable) copies. ``TokenArray`` growth
and item assignment never write into a received frame (they copy first). Torch tensors
over a read-only frame are copied, because torch has no read-only tensors and a write
would corrupt an immutable ``bytes`` object.

Token arrays travel as extension codes ``16 + d`` (inline) and ``32 + d`` (buffer
frame) whose dtype is the code: decoding one is a table lookup and ``np.frombuffer``,
no nested msgpack decode (``docs/PROTOCOL.md``, "Extension types").

Trust
-----
A :class:`Decoder` validates where data enters, in one pass. msgspec checks every
typed field and its constraints (sampling parameters, stop reasons) during the decode
itself, in C; the types' ``__post_init__`` checks what msgspec cannot type (token
fields are ``Any`` to it, for speed: one type and one kind check each). The Python
checks of construction (``GenerationHyperparameters(...)``) never run on decode.

``Decoder(trusted=False)``, the default and the only right choice for anything read
from a socket, also checks the frame list before parsing: that every frame is
bytes-like and that together they stay under ``max_message_size``. ``trusted=True``
skips that (one pass over the frames) for frames this program produced itself (a
queue between its own threads, a file it wrote); every other check stays.

Threads
-------
Per-call state (the list of buffers being built, the frames being read) lives in a
thread-local slot set for the duration of one call, never across calls, so one
``Encoder``/``Decoder`` may be shared by threads.
"""

from __future__ import annotations

import math
import re
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

from fastio import io_struct as _s
from fastio.errors import DecodeError, EncodeError, MessageTooLarge
from fastio.protocol import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_MESSAGE_SIZE,
    DTYPE_NAMES,
    PROTOCOL_VERSION,
    ExtCode,
)
from fastio.tokens import TokenArray

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

#: Maximum number of dimensions of a decoded array (numpy's own limit).
_MAX_NDIM = 64

_EXT_NDARRAY = int(ExtCode.NDARRAY)
_EXT_TENSOR = int(ExtCode.TENSOR)
_EXT_IMAGE = int(ExtCode.IMAGE)
_EXT_TOKENS = int(ExtCode.TOKENS)
_ARRAY_CODES = frozenset((_EXT_NDARRAY, _EXT_TENSOR, _EXT_TOKENS))

# Wire dtype name -> little-endian numpy dtype. bfloat16 has no numpy dtype: it only
# travels as a torch tensor.
_NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<") for name in DTYPE_NAMES if name != "bfloat16"
}
# numpy dtype -> wire name, for the dtypes that need no conversion. Keyed by dtype
# object: ``arr.dtype.name`` costs about 2 us per call, a dict lookup 30 ns.
_WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in _NP_DTYPES.items()}
for _name, _dt in list(_NP_DTYPES.items()):
    # Single-byte types have byteorder "|"; "=" equals "<" on every supported host.
    _WIRE_NAMES[np.dtype(_name)] = _name
if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in CI
    raise ImportError("fastio supports little-endian hosts only")


_meta_encode = msgspec.msgpack.Encoder().encode
# Inline data decodes straight into a bytearray: the private writable copy the module
# docstring promises, made by msgspec itself (no second copy).
_array_meta_decode = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray]).decode
_image_meta = msgspec.msgpack.Decoder(tuple[str, int, int, int | bytearray])
_header_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_int_decoder = msgspec.msgpack.Decoder(int)
_Ext = msgspec.msgpack.Ext
_any_decoder = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)

# Token arrays: ext code -> (numpy dtype, whether the payload is a frame index).
_TOKENS_INLINE = int(ExtCode.TOKENS_INLINE)
_TOKENS_FRAME = int(ExtCode.TOKENS_FRAME)
_TOKEN_CODES: dict[int, tuple[np.dtype[Any], bool]] = {}
_INLINE_CODE: dict[np.dtype[Any], int] = {}  # dtype -> inline ext code
_FRAME_CODE: dict[np.dtype[Any], int] = {}  # dtype -> frame ext code
_FRAME_REF = struct.Struct("<II")  # frame index, element count
for _d, _name in enumerate(DTYPE_NAMES):
    if _name in _NP_DTYPES:
        _TOKEN_CODES[_TOKENS_INLINE + _d] = (_NP_DTYPES[_name], False)
        _TOKEN_CODES[_TOKENS_FRAME + _d] = (_NP_DTYPES[_name], True)
for _dt, _name in _WIRE_NAMES.items():
    _INLINE_CODE[_dt] = _TOKENS_INLINE + DTYPE_NAMES.index(_name)
    _FRAME_CODE[_dt] = _TOKENS_FRAME + DTYPE_NAMES.index(_name)


_new_object = object.__new__
_EMPTY = memoryview(b"")
_BF16_STORAGE = np.dtype("<u2")

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
_IMAGE_MODES = {
    "L": 1,
    "LA": 2,
    "RGB": 3,
    "RGBA": 4,
    "CMYK": 4,
    "YCbCr": 3,
    "I": 4,
    "F": 4,
    "I;16": 2,
}

# torch is a dependency, but importing it costs ~1 s: do it only when a tensor is
# actually encoded (then torch is already in sys.modules) or decoded.
_torch_names: dict[Any, str] = {}  # torch.dtype -> wire name
_torch_dtypes: dict[str, tuple[Any, int]] = {}  # wire name -> (torch.dtype, itemsize)


def _torch_tables() -> None:
    import torch

    for name in DTYPE_NAMES:
        dt = getattr(torch, name, None)
        if name in ("uint16", "uint32", "uint64") or dt is None:
            # torch's unsigned wide types lack most kernels (view, copy): not supported.
            continue
        _torch_dtypes[name] = (dt, torch.empty((), dtype=dt).element_size())
        _torch_names[dt] = name


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(obj, pil.Image)


_PREFIXES: dict[int, bytes] = {}
_SMALL_PREFIXES = tuple(b"\x93" + bytes([PROTOCOL_VERSION, n]) for n in range(128))


def _header_prefix(n: int) -> bytes:
    prefix = _PREFIXES.get(n)
    if prefix is None:
        # msgpack fixarray(3), version, n_buffers (both as msgpack ints)
        prefix = b"\x93" + _meta_encode(PROTOCOL_VERSION) + _meta_encode(n)
        if n < 1024:
            _PREFIXES[n] = prefix
    return prefix


class Encoder:
    """Encodes fastio messages (and nested arrays, tensors, images) into frames.

    Parameters
    ----------
    inline_threshold:
        Arrays with fewer bytes than this travel inside the header; the others as their
        own zero-copy frame. ``0`` sends every array as a frame.

    Examples
    --------
    >>> import numpy as np
    >>> from fastio import Encoder, LLMResponse
    >>> enc = Encoder()
    >>> frames = enc.encode(LLMResponse(output_tokens=np.arange(4096, dtype=np.int32)))
    >>> len(frames)  # header + one buffer
    2
    """

    def __init__(self, *, inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> None:
        if not isinstance(inline_threshold, int) or inline_threshold < 0:
            raise ValueError(f"inline_threshold must be an int >= 0, got {inline_threshold!r}")
        self._threshold = inline_threshold
        # Per thread: a msgspec encoder whose hook appends to that thread's frame list
        # (a one-item box set for the duration of one call), so one Encoder serves many
        # threads without a thread-local lookup per array.
        self._tls = threading.local()

    @property
    def inline_threshold(self) -> int:
        """Arrays with fewer bytes travel inside the header (read-only)."""
        return self._threshold

    def _thread_state(self) -> tuple[msgspec.msgpack.Encoder, list[Any]]:
        box: list[Any] = [None]
        threshold = self._threshold
        inline_code = _INLINE_CODE
        ext = _Ext
        pack = _FRAME_REF.pack
        other = self._enc_hook

        def hook(obj: Any) -> Any:
            # The hot path, every token array of every message, inlined.
            if type(obj) is TokenArray:
                arr = obj._a
                code = inline_code.get(arr.dtype)
                if code is not None:
                    mv = arr.data
                    if mv.c_contiguous:
                        if mv.nbytes < threshold:
                            # The elements are the payload: msgspec copies them into the
                            # header.
                            return ext(code, mv)
                        frames = box[0]
                        frames.append(mv.cast("B"))
                        return ext(code + 16, pack(len(frames) - 1, len(mv)))
            return other(obj, box[0])

        state = (msgspec.msgpack.Encoder(enc_hook=hook), box)
        self._tls.state = state
        return state

    def encode(self, obj: Any) -> list[Any]:
        """Encode ``obj`` into ``[header, *buffers]``.

        The header is ``bytes``; buffers are 1-D byte memoryviews of the caller's arrays
        (see the module docstring for how long they must stay unmodified). Send them
        with ``socket.send_multipart(frames, copy=False)``.

        Raises
        ------
        EncodeError
            For objects fastio cannot put on the wire (unsupported types or dtypes).
        """
        try:
            enc, box = self._tls.state
        except AttributeError:
            enc, box = self._thread_state()
        if box[0] is not None:
            raise EncodeError("Encoder.encode is not re-entrant within one thread")
        frames: list[Any] = [b""]
        box[0] = frames
        try:
            body = enc.encode(obj)
        except EncodeError:
            raise
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from exc
        finally:
            box[0] = None
        n = len(frames) - 1
        frames[0] = (_SMALL_PREFIXES[n] if n < 128 else _header_prefix(n)) + body
        return frames

    # -- hooks -----------------------------------------------------------------------
    def _enc_hook(self, obj: Any, frames: list[Any]) -> Any:
        """Everything but the hot path: other arrays, tensors, images, live objects."""
        tp = type(obj)
        if tp is TokenArray:
            return self._tokens_ext(obj._a, frames)
        if tp is np.ndarray:
            return self._array_ext(obj, _EXT_NDARRAY, frames)
        if isinstance(obj, TokenArray):
            return self._tokens_ext(obj._a, frames)
        if isinstance(obj, np.ndarray):
            return self._array_ext(np.asarray(obj), _EXT_NDARRAY, frames)
        if isinstance(obj, np.generic):
            return obj.item()
        if _is_tensor(obj):
            return self._tensor_ext(obj, frames)
        if _is_pil_image(obj):
            return self._image_ext(obj, frames)
        name = getattr(obj, "name_or_path", None)
        if isinstance(name, str):
            # Tokenizers and processors (SaveLoadMeta) never travel as live objects:
            # they travel as the name/path the receiver loads them from.
            return name
        raise EncodeError(f"fastio cannot encode objects of type {tp.__module__}.{tp.__qualname__}")

    def _tokens_ext(self, arr: np.ndarray[Any, Any], frames: list[Any]) -> msgspec.msgpack.Ext:
        """Slow path of token arrays: a dtype to normalise or a strided view."""
        if arr.dtype not in _INLINE_CODE:
            arr, _ = _normalise_dtype(arr)
        arr = np.ascontiguousarray(arr)  # one copy: the wire form is packed
        code = _INLINE_CODE[arr.dtype]
        if arr.nbytes < self._threshold:
            return _Ext(code, arr.tobytes())
        frames.append(arr.data.cast("B"))
        return _Ext(code + 16, _FRAME_REF.pack(len(frames) - 1, arr.shape[0]))

    def _slot(self, arr: np.ndarray[Any, Any], frames: list[Any]) -> int | bytes:
        """Inline bytes for a small C-contiguous array, else the index of its frame."""
        nbytes = arr.nbytes
        if nbytes < self._threshold:
            return arr.tobytes()
        # 1-D unsigned-byte views so that len(frame) is its size in bytes.
        frames.append(memoryview(arr).cast("B") if nbytes else _EMPTY)  # type: ignore[arg-type]
        return len(frames) - 1

    def _array_ext(
        self, arr: np.ndarray[Any, Any], code: int, frames: list[Any]
    ) -> msgspec.msgpack.Ext:
        name = _WIRE_NAMES.get(arr.dtype)
        if name is None:
            arr, name = _normalise_dtype(arr)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # one copy: the wire form is C order
        # _slot inlined: this is the per-array hot path of every message.
        nbytes = arr.nbytes
        if nbytes < self._threshold:
            return _Ext(code, _meta_encode((name, arr.shape, arr.tobytes())))
        frames.append(memoryview(arr).cast("B") if nbytes else _EMPTY)  # type: ignore[arg-type]
        return _Ext(code, _meta_encode((name, arr.shape, len(frames) - 1)))

    def _tensor_ext(self, t: Any, frames: list[Any]) -> msgspec.msgpack.Ext:
        if not _torch_names:
            _torch_tables()
        name = _torch_names.get(t.dtype)
        if name is None:
            raise EncodeError(
                f"unsupported tensor dtype {t.dtype}; supported: {sorted(_torch_dtypes)}"
            )
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            # Device memory cannot be a frame: one copy through host memory.
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        if name in _NP_DTYPES:
            raw = t.numpy()
        else:
            # bfloat16 has no numpy dtype: ship its bytes. view() needs >= 1 dim.
            import torch

            raw = t.reshape(-1).view(torch.uint8).numpy()
        return _Ext(_EXT_TENSOR, _meta_encode((name, shape, self._slot(raw, frames))))

    def _image_ext(self, img: Any, frames: list[Any]) -> msgspec.msgpack.Ext:
        if img.mode not in _IMAGE_MODES:
            # Palette and bilevel images travel as their decoded pixels.
            if img.mode == "1":
                img = img.convert("L")
            elif img.mode == "P" and "transparency" not in img.info:
                img = img.convert("RGB")
            else:
                img = img.convert("RGBA" if img.mode in ("P", "PA", "La", "RGBa") else "RGB")
        # PIL exposes no buffer of its pixels: one copy, on the encode side only.
        data = np.frombuffer(img.tobytes(), np.uint8)
        w, h = img.size
        return _Ext(_EXT_IMAGE, _meta_encode((img.mode, w, h, self._slot(data, frames))))


def _normalise_dtype(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], str]:
    """Slow path of :meth:`Encoder._array_ext`: byte-swap or reject the dtype."""
    dt = arr.dtype
    if dt.byteorder == ">" and dt.newbyteorder("<") in _WIRE_NAMES:
        arr = arr.astype(dt.newbyteorder("<"))
        return arr, _WIRE_NAMES[arr.dtype]
    for known, name in _WIRE_NAMES.items():
        # Equal dtypes that hash differently (e.g. with metadata) still map.
        if dt == known:
            return arr.view(known), name
    raise EncodeError(
        f"unsupported array dtype {dt}; supported: {sorted(_NP_DTYPES)} "
        "(and bfloat16 as a torch tensor)"
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
            raise DecodeError(f"frame of type {type(frame).__name__} is not bytes-like") from exc
    if not buf.c_contiguous:
        raise DecodeError("frame is not a contiguous buffer")
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


class Decoder:
    """Decodes ``[header, *buffers]`` frames into typed objects.

    Parameters
    ----------
    type:
        The expected type. ``None`` accepts any fastio message: a tagged union of every
        :class:`~fastio.WireStruct` subclass with an integer tag defined when the
        decoder is created (the seed types and those of ``fastio.fabric_msgs`` and
        ``fastio.weight_msgs``).
    max_message_size:
        Frames adding up to more bytes raise :class:`~fastio.MessageTooLarge` before
        anything is parsed (sizes by ``len()``: bytes for bytes-like frames).
    trusted:
        ``True`` skips the checks of the frame list before parsing (see "Trust" in the
        module docstring); only for frames this program produced itself. Anything read
        from a socket is untrusted, the default.
    device:
        Where decoded torch tensors go: ``None``/``"cpu"`` views the frame without a
        copy; e.g. ``"cuda:0"`` copies onto that device.

    Examples
    --------
    >>> from fastio import Decoder, Encoder, LLMResponse
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
        device: Any = None,
        trusted: bool = False,
    ) -> None:
        if type is None:
            types = message_types()
            type = Union[types]  # noqa: UP007
        self.type = type
        self.device = None if device is None or str(device) == "cpu" else device
        self._max_message_size = max_message_size
        self._trusted = bool(trusted)
        # The size limit the decode checks, None when trusted (one attribute read).
        self._limit = None if trusted else max_message_size
        self._tls = threading.local()
        # Built once here so that a type msgspec cannot decode fails at construction.
        self._thread_state()

    @property
    def max_message_size(self) -> int:
        """The size limit of one message's frames, in bytes (not checked when trusted)."""
        return self._max_message_size

    @property
    def trusted(self) -> bool:
        """Whether the frames come from a trusted source (see "Trust" in the module
        docstring); read-only."""
        return self._trusted

    def _thread_state(self) -> tuple[msgspec.msgpack.Decoder[Any], list[Any]]:
        """This thread's msgspec decoder, whose ext hook reads the frames of the call in
        progress from a one-item box (no thread-local lookup per array)."""
        box: list[Any] = [None]
        codes = _TOKEN_CODES
        frombuffer = np.frombuffer
        unpack = _FRAME_REF.unpack
        new = _new_object
        other = self._ext_hook

        def ext_hook(code: int, payload: memoryview) -> Any:
            entry = codes.get(code)
            if entry is None:
                return other(code, payload, box[0])
            dtype, in_frame = entry
            try:
                if in_frame:
                    k, count = unpack(payload)
                    frames = box[0]
                    if not 0 < k < len(frames):
                        raise _frame_error("token array", k, frames)
                    arr = frombuffer(frames[k], dtype)  # ValueError unless whole items
                    if arr.shape[0] != count:
                        raise ValueError("frame size does not match the array")
                else:
                    arr = frombuffer(payload, dtype)
            except DecodeError:
                raise
            except (ValueError, struct.error, BufferError) as exc:
                raise _token_error(code, payload, box[0], exc) from None
            tokens = new(TokenArray)  # TokenArray._wrap, inlined; _buf, _excl unset
            tokens._a = arr
            return tokens

        dec = msgspec.msgpack.Decoder(
            tuple[int, int, self.type],  # type: ignore[name-defined]
            ext_hook=ext_hook,
            dec_hook=_dec_hook,
        )
        state = (dec, box)
        self._tls.state = state
        return state

    def decode(self, frames: Sequence[Frame]) -> Any:
        """Decode a frame list (bytes, memoryview, bytearray or ``zmq.Frame`` items).

        Raises
        ------
        DecodeError
            Saying what is wrong with the frames (for a value that breaks a field's
            constraint: the field's path and the rule); never any other exception for
            bad input.
        """
        try:
            dec, box = self._tls.state
        except AttributeError:
            dec, box = self._thread_state()
        limit = self._limit
        outer = box[0]  # a decode inside a decode (a user type's hook) on this thread
        box[0] = frames
        try:
            if limit is not None:
                # Frames stay as they are: np.frombuffer reads any of them directly. len()
                # is the size in bytes of bytes, bytearray, zmq.Frame, byte memoryviews.
                total = 0
                for f in frames:
                    total += len(f)
                if total > limit:
                    raise _Rejected
            version, n_buffers, msg = dec.decode(frames[0])
            if version != PROTOCOL_VERSION or n_buffers != len(frames) - 1:
                raise _Rejected
        except Exception as exc:  # boundary: nothing else may escape for bad input
            # Everything about a bad message, in the order a reader checks it, is worked
            # out here, off the hot path.
            raise self._diagnose(frames, exc) from exc
        finally:
            box[0] = outer
        return msg

    def _diagnose(self, frames: Any, exc: Exception) -> DecodeError:
        """The error for frames that failed to decode, checked in the order of the
        protocol: the frame list, each frame, the size limit, the header, the frame
        count, then the body's own error."""
        tf = type(frames)
        if (tf is not list and tf is not tuple) or not frames:
            return DecodeError("expected a non-empty list of frames [header, *buffers]")
        try:
            total = sum(_buffer(f).nbytes for f in frames)
        except DecodeError as err:
            return err
        limit = self._limit
        if limit is not None and total > limit:
            return MessageTooLarge(f"message of {total} bytes exceeds the limit of {limit} bytes")
        try:
            h = _buffer(frames[0])
            if len(h) > 3 and h[0] == 0x93 and h[1] == PROTOCOL_VERSION and h[2] < 0x80:
                n_buffers = h[2]  # what our encoder writes: no general parse needed
            else:
                try:
                    n_buffers, _ = _parse_header(h)
                except RecursionError:
                    raise DecodeError("malformed header: nested too deeply") from None
            if n_buffers != len(frames) - 1:
                raise DecodeError(
                    f"wrong frame count: header announces {n_buffers} buffers, "
                    f"got {len(frames) - 1}"
                )
        except DecodeError as err:
            return err
        if isinstance(exc, DecodeError):
            return exc
        if isinstance(exc, _Rejected):  # pragma: no cover - the header checks above caught it
            return DecodeError("malformed header")
        if isinstance(exc, msgspec.DecodeError):
            return DecodeError(f"invalid message body: {_body_error(self.type, frames[0], exc)}")
        return DecodeError(f"invalid message body: {type(exc).__name__}: {exc}")

    # -- hooks -----------------------------------------------------------------------
    def _data(self, slot: int | bytearray, nbytes: int, what: Any, frames: Any) -> Any:
        """The bytes an extension value refers to; ``what()`` describes it for errors."""
        if type(slot) is int:
            if not 0 < slot < len(frames):
                raise DecodeError(
                    f"{what()} refers to frame {slot}, but the message has "
                    + (f"frames 1..{len(frames) - 1}" if len(frames) > 1 else "no buffer frames")
                )
            data: Any = frames[slot]
            got = data.nbytes if type(data) is memoryview else len(data)
        else:
            got = len(slot)  # type: ignore[arg-type]
            # Inline data: already a private writable copy (a bytearray from msgspec).
            data = slot
        if got != nbytes:
            raise DecodeError(f"{what()} needs {nbytes} bytes of data, got {got}")
        return data

    def _ext_hook(self, code: int, payload: memoryview, frames: Any) -> Any:
        """Extension values other than the compact token arrays (codes 1-4)."""
        if code in _ARRAY_CODES:
            try:
                name, shape, slot = _array_meta_decode(payload)
            except msgspec.DecodeError as exc:
                raise DecodeError(f"malformed array descriptor: {exc}") from exc
            if len(shape) == 1 and code != _EXT_TENSOR:
                # Fast path, every token array: a valid 1-D array, in its own frame (large)
                # or inline in the header (small: ``slot`` is already a private bytearray).
                np_dtype = _NP_DTYPES.get(name)
                count = shape[0]
                if np_dtype is not None and count >= 0:
                    data: Any = slot
                    if type(slot) is int:
                        data = frames[slot] if 0 < slot < len(frames) else None
                        size = (
                            -1
                            if data is None
                            else data.nbytes
                            if type(data) is memoryview
                            else len(data)
                        )
                    else:
                        size = len(slot)  # type: ignore[arg-type]
                    if size == count * np_dtype.itemsize:
                        arr = np.frombuffer(data, np_dtype, count)
                        if code == _EXT_NDARRAY:
                            return arr
                        return TokenArray._wrap(arr)
            arr = self._array(code, name, shape, slot, frames)
            if code != _EXT_TOKENS:
                return arr
            if arr.ndim != 1:
                raise DecodeError(f"token array must be 1-D, got shape {list(arr.shape)}")
            return TokenArray._wrap(arr)
        if code == _EXT_IMAGE:
            return self._image(payload, frames)
        raise DecodeError(
            f"unknown extension type code {code}; known: 1, 2, 3, 4, "
            "16-28 and 32-44 (token arrays, but not bfloat16: 26, 42)"
        )

    def _array(
        self, code: int, name: str, shape: tuple[int, ...], slot: int | bytearray, frames: Any
    ) -> Any:
        """Checks and builds any array or tensor (the fast path's fallback)."""
        if len(shape) > _MAX_NDIM:
            raise DecodeError(f"array has {len(shape)} dimensions, at most {_MAX_NDIM} allowed")
        for d in shape:
            if d < 0:
                raise DecodeError(f"negative dimension in array shape {list(shape)}")
        count = math.prod(shape)
        if code == _EXT_TENSOR:
            return self._tensor(name, shape, count, slot, frames)
        dtype = _NP_DTYPES.get(name)
        if dtype is None:
            raise DecodeError(
                f"unknown array dtype {name!r}; known: {sorted(_NP_DTYPES)}"
                + (" (bfloat16 only as a tensor, ext code 2)" if name == "bfloat16" else "")
            )
        data = self._data(
            slot, count * dtype.itemsize, lambda: f"array {name}{list(shape)}", frames
        )
        arr = np.frombuffer(data, dtype, count)
        return arr if len(shape) == 1 else arr.reshape(shape)

    def _tensor(
        self, name: str, shape: tuple[int, ...], count: int, slot: int | bytearray, frames: Any
    ) -> Any:
        import torch

        if not _torch_dtypes:
            _torch_tables()
        entry = _torch_dtypes.get(name)
        if entry is None:
            raise DecodeError(f"unknown tensor dtype {name!r}; known: {sorted(_torch_dtypes)}")
        dtype, itemsize = entry
        data = self._data(slot, count * itemsize, lambda: f"tensor {name}{list(shape)}", frames)
        if memoryview(data).readonly:
            data = bytearray(data)  # see the module docstring: torch cannot be read-only
        # Through numpy: torch.frombuffer + reshape costs ~2.5 us, this ~1 us. bfloat16
        # is viewed as uint16 there and reinterpreted by torch.
        np_dtype = _NP_DTYPES.get(name, _BF16_STORAGE)
        t = torch.from_numpy(np.frombuffer(data, np_dtype, count).reshape(shape))
        if dtype is not t.dtype:
            t = t.view(dtype)
        if self.device is not None:
            t = t.to(self.device)
        return t

    def _image(self, payload: memoryview, frames: Any) -> Any:
        from PIL import Image

        try:
            mode, w, h, slot = _image_meta.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed image descriptor: {exc}") from exc
        bpp = _IMAGE_MODES.get(mode)
        if bpp is None:
            raise DecodeError(f"unsupported image mode {mode!r}; known: {sorted(_IMAGE_MODES)}")
        if w < 0 or h < 0:
            raise DecodeError(f"invalid image size {w}x{h}")
        data = self._data(slot, w * h * bpp, lambda: f"image {mode} {w}x{h}", frames)
        if w == 0 or h == 0:
            return Image.new(mode, (w, h))
        return Image.frombuffer(mode, (w, h), data, "raw", mode, 0, 1)


class _Rejected(Exception):
    """Raised on the decode hot path for a message :meth:`Decoder._diagnose` explains."""


def _frame_error(what: str, k: int, frames: Any) -> DecodeError:
    return DecodeError(
        f"{what} refers to frame {k}, but the message has "
        + (f"frames 1..{len(frames) - 1}" if len(frames) > 1 else "no buffer frames")
    )


def _token_error(code: int, payload: memoryview, frames: Any, exc: Exception) -> DecodeError:
    """What is wrong with a token-array extension value that failed to decode."""
    dtype, in_frame = _TOKEN_CODES[code]
    if isinstance(exc, BufferError):
        return DecodeError("frame is not a contiguous buffer")
    if not in_frame:
        return DecodeError(
            f"token array of {dtype.name} needs a multiple of {dtype.itemsize} bytes of "
            f"data, got {len(payload)}"
        )
    if len(payload) != _FRAME_REF.size:
        return DecodeError(f"token array frame reference must be 8 bytes, got {len(payload)}")
    k, count = _FRAME_REF.unpack(payload)
    got = memoryview(frames[k]).nbytes
    return DecodeError(
        f"token array {dtype.name}[{count}] needs {count * dtype.itemsize} bytes of data, got {got}"
    )


def _parse_header(h: memoryview) -> tuple[int, memoryview]:
    """General header parse (any msgpack int widths); checks the protocol version."""
    try:
        parts = _header_decoder.decode(h)
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
        raise DecodeError(f"malformed header: version and n_buffers must be ints: {exc}") from exc
    if version != PROTOCOL_VERSION:
        raise DecodeError(
            f"unsupported protocol version {version}; this decoder speaks version "
            f"{PROTOCOL_VERSION}"
        )
    # The body is the header's tail after the two ints (Raw holds a copy we do not need).
    # msgspec accepted an array of 3, so the first byte is fixarray, array16 or array32.
    pos = {0xDC: 3, 0xDD: 5}.get(h[0], 1)
    for _ in range(2):
        parsed = _read_int(h, pos)
        if parsed is None:  # pragma: no cover - msgspec accepted the ints above
            raise DecodeError("malformed header")
        pos = parsed[1]
    return n_buffers, h[pos:]


_PATH = re.compile(r" - at `\$((?:\[\d+\])*)(.*)`$")
_INDEX = re.compile(r"\[(\d+)\]")


def _body_error(tp: Any, header: Any, exc: Exception) -> str:
    """msgspec's message with the path made relative to the body (``$[2]`` of the
    header tuple is ``$``) and the field names it stands for (``array_like`` Structs
    only number their fields), e.g. ``Expected `int` >= 1 - at `$[3][2]`
    (LLMRequest.gconfig.max_new_tokens)``."""
    text = str(exc)
    m = _PATH.search(text)
    if m is None:
        return text
    idx = [int(i) for i in _INDEX.findall(m.group(1))]
    if not idx or idx[0] != 2:
        return text
    idx = idx[1:]
    rest = m.group(2)
    where = "$" + "".join(f"[{i}]" for i in idx) + rest
    try:
        names = _field_names(tp, _any_decoder.decode(_buffer(header))[2], idx)
    except Exception:  # naming is best effort: the path above is exact
        names = ""
    return text[: m.start()] + f" - at `{where}`" + (f" ({names}{rest})" if names else "")


def _field_names(tp: Any, value: Any, idx: list[int]) -> str:
    """Dotted field names along ``idx`` in the raw decoded ``value`` of type ``tp``."""
    import msgspec.inspect as mi

    info: Any = mi.type_info(tp)
    parts: list[str] = []
    for i in idx:
        while isinstance(info, mi.UnionType):  # pick the Struct the tag names
            tag = value[0] if isinstance(value, list) and value else None
            structs = [t for t in info.types if isinstance(t, mi.StructType) and t.tag == tag]
            if not structs:
                return ".".join(parts)
            info = structs[0]
        if isinstance(info, mi.StructType):
            if not parts:
                parts.append(info.cls.__name__)
            if i == 0:
                parts.append("(tag)")
                return ".".join(parts)
            field = info.fields[i - 1]
            parts.append(field.name)
            info = field.type
        elif isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType)):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{i}]"]
            info = info.item_type if not isinstance(info, mi.TupleType) else info.item_types[i]
        else:
            return ".".join(parts)
        value = value[i] if isinstance(value, list) and i < len(value) else None
    return ".".join(parts)


def _dec_hook(tp: Any, obj: Any) -> Any:
    if tp is TokenArray:
        if type(obj) is TokenArray:
            return obj
        if type(obj) is np.ndarray:
            if obj.ndim != 1:
                raise ValueError(f"token array must be 1-D, got shape {obj.shape}")
            return TokenArray._wrap(obj)
        if type(obj) is list:
            # Peers in other languages may send plain msgpack arrays of numbers.
            for x in obj:
                if type(x) is not int and type(x) is not float:
                    raise ValueError(f"token array must hold only numbers, got {type(x).__name__}")
            return TokenArray(obj)
        raise TypeError(f"expected an array, got {type(obj).__name__}")
    if isinstance(tp, type) and isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {getattr(tp, '__name__', tp)}, got {type(obj).__name__}")


def enc_hook(obj: Any) -> Any:
    """``enc_hook`` for msgspec's other encoders: fastio's values as JSON-ready builtins.

    ``TokenArray`` and numpy arrays become lists, numpy scalars Python numbers, torch
    tensors nested lists, PIL images ``data:image/png;base64,...`` URLs (what SGLang
    accepts as ``image_data``), tokenizers and processors their ``name_or_path``.

    Examples
    --------
    >>> import msgspec, fastio
    >>> resp = fastio.LLMResponse(output_tokens=[5, 6], latency=0.5, ttft=0.1)
    >>> msgspec.json.encode(resp, enc_hook=fastio.enc_hook)[:24]
    b'[3,[],[5,6],[],[],"stop"'
    >>> msgspec.to_builtins(msgspec.structs.asdict(resp), enc_hook=fastio.enc_hook)["output_tokens"]
    [5, 6]
    """
    if isinstance(obj, TokenArray):
        return obj.tolist()
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    if _is_tensor(obj):
        return obj.tolist()
    if _is_pil_image(obj):
        import base64
        import io

        out = io.BytesIO()
        obj.save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    name = getattr(obj, "name_or_path", None)
    if isinstance(name, str):
        return name
    raise NotImplementedError(f"fastio.enc_hook cannot convert {type(obj).__qualname__}")


def message_types() -> tuple[type[_s.WireStruct], ...]:
    """Every message type ``decode(frames, type=None)`` accepts right now.

    These are the :class:`~fastio.WireStruct` subclasses with an integer tag defined in
    the ``fastio`` package, in tag order: the seed types and the fabric and
    weight-update messages. Subclasses defined elsewhere (applications, tests) are
    left out, so they can never collide with a wire tag; decode them by passing their
    type explicitly.
    """
    found: dict[int, type[_s.WireStruct]] = {}
    stack: list[type[Any]] = [_s.WireStruct]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if (
            isinstance(tag, int)
            and not isinstance(tag, bool)
            and cls.__module__.split(".", 1)[0] == "fastio"
        ):
            other = found.get(tag)
            if other is not None and other is not cls:
                raise TypeError(f"{cls.__qualname__} and {other.__qualname__} share tag {tag}")
            found[tag] = cls
    return tuple(found[k] for k in sorted(found))


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
    key = (None, _s._registry_generation) if type is None else type
    dec = _default_decoders.get(key)
    if dec is None:
        try:
            dec = _default_decoders[key] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
