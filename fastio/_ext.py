"""The wire format's extension values (``docs/PROTOCOL.md``): dtype and ext-code tables
and payload helpers of the codec, and :func:`diagnose`: why a message was rejected,
checked in the protocol's order, with field paths (``LLMRequest.gconfig.top_p``)."""

from __future__ import annotations

import functools
import re
import struct
import sys
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np

from fastio.errors import DecodeError, EncodeError, FrameError, MessageTooLarge, UnsupportedVersion
from fastio.protocol import DTYPE_NAMES, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, ExtCode

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in CI
    raise ImportError("fastio supports little-endian hosts only")

# Plain ints, in ExtCode's order: the hooks compare them on every extension value.
EXT_NDARRAY, EXT_TENSOR, EXT_IMAGE, EXT_TOKENS, INLINE, FRAME, REF = map(int, ExtCode)

# Wire dtype name -> numpy's own dtype instance (bfloat16 only as a tensor).
NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
# numpy dtype -> wire name, for the dtypes that need no conversion.
WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in NP_DTYPES.items()}

Ext = msgspec.msgpack.Ext
meta_encode = msgspec.msgpack.Encoder().encode
# Inline data decodes into a bytearray: the private copy promised for small arrays.
array_meta_decode = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray]).decode
image_meta_decode = msgspec.msgpack.Decoder(tuple[str, int, int, int | bytearray]).decode

#: dtype of a token-array ext code, else None; 256 entries (negative codes: None).
TOKEN_DTYPES: list[np.dtype[Any] | None] = [None] * 256
for _d, _name in enumerate(DTYPE_NAMES):
    if _name in NP_DTYPES:
        for _base in (INLINE, FRAME, REF):
            TOKEN_DTYPES[_base + _d] = NP_DTYPES[_name]
#: dtype -> inline ext code of token arrays.
INLINE_CODE = {dt: INLINE + DTYPE_NAMES.index(name) for dt, name in WIRE_NAMES.items()}
FRAME_REF = struct.Struct("<II")  # frame index, element count

#: ``REFS[code][k]``: the shared compact reference to frame ``k`` (made on first use),
#: so the encoder's hot path allocates nothing for it.
REFS: list[list[Any]] = [[None] * 256 for _ in range(INLINE + len(DTYPE_NAMES))]


def ref(code: int, k: int) -> Any:
    ref = REFS[code][k] = Ext(code + REF - INLINE, bytes((k,)))
    return ref


EMPTY = memoryview(b"")
BF16_STORAGE = np.dtype("<u2")
MAX_NDIM = 64  # numpy's own limit

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
IMAGE_MODES = {
    **{"L": 1, "LA": 2, "I;16": 2, "RGB": 3, "YCbCr": 3},
    **{"RGBA": 4, "CMYK": 4, "I": 4, "F": 4},
}


@functools.cache
def torch_tables() -> tuple[dict[Any, str], dict[str, tuple[Any, int]]]:
    """``(torch dtype -> wire name, wire name -> (torch dtype, itemsize))``, on first use."""
    import torch

    dtypes = {}
    for name in DTYPE_NAMES:
        dt = getattr(torch, name, None)
        if dt is not None and name not in ("uint16", "uint32", "uint64"):  # few kernels
            dtypes[name] = (dt, torch.empty((), dtype=dt).element_size())
    return {dt: name for name, (dt, _) in dtypes.items()}, dtypes


def is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(obj, pil.Image)


def normalise_dtype(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], str]:
    """Byte-swap ``arr`` or map an equal dtype to its wire name; EncodeError otherwise."""
    dt = arr.dtype
    if dt.byteorder == ">" and dt.newbyteorder("<") in WIRE_NAMES:
        arr = arr.astype(dt.newbyteorder("<"))
        return arr, WIRE_NAMES[arr.dtype]
    for known, name in WIRE_NAMES.items():
        if dt == known:  # equal dtypes that hash differently (with metadata) still map
            return arr.view(known), name
    raise EncodeError(
        f"unsupported array dtype {dt}; supported: {sorted(NP_DTYPES)} "
        "(and bfloat16 as a torch tensor)"
    )


raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
int_decoder = msgspec.msgpack.Decoder(int)
_any_decoder = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


class Rejected(Exception):
    """Raised on the decode hot path for a message :func:`diagnose` explains."""


def buffer(frame: Any) -> memoryview:
    """A 1-D unsigned-byte memoryview of one frame (no copy)."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if not isinstance(buf, memoryview):
        try:
            buf = memoryview(frame)
        except TypeError as exc:
            raise FrameError(f"frame of type {type(frame).__name__} is not bytes-like") from exc
    if not buf.c_contiguous:
        raise FrameError("frame is not a contiguous buffer")
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B") if buf.nbytes else EMPTY
    return buf


def header_ints(h: memoryview) -> tuple[int, int]:
    """``(version, n_buffers)`` of header ``h``; FrameError unless ``[int, int, body]``."""
    if len(h) > 3 and h[0] == 0x93 and h[1] < 0x80 and h[2] < 0x80:
        return h[1], h[2]  # both fixints, as our encoder writes (the body is checked later)
    try:
        parts = raw_list.decode(h)
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed header: {exc}") from exc
    except RecursionError:
        raise FrameError("malformed header: nested too deeply") from None
    if len(parts) != 3:
        raise FrameError(
            f"malformed header: expected [version, n_buffers, body], got {len(parts)} items"
        )
    try:
        return int_decoder.decode(parts[0]), int_decoder.decode(parts[1])
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed header: version and n_buffers must be ints: {exc}") from exc


def diagnose(tp: Any, limit: int | None, frames: Any, exc: Exception) -> DecodeError:
    """The error for ``frames`` that failed to decode into ``tp`` with ``exc``: the frame
    list, each frame, the size ``limit``, the header, the frame count, then the body."""
    if type(frames) not in (list, tuple) or not frames:
        return FrameError("expected a non-empty list of frames [header, *buffers]")
    try:
        total = sum(buffer(f).nbytes for f in frames)
        if limit is not None and total > limit:
            return MessageTooLarge(f"message of {total} bytes exceeds the limit of {limit} bytes")
        version, n_buffers = header_ints(buffer(frames[0]))
        if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raise UnsupportedVersion(
                f"unsupported protocol version {version}; this decoder reads versions "
                f"{MIN_PROTOCOL_VERSION}-{PROTOCOL_VERSION}"
            )
        if n_buffers != len(frames) - 1:
            raise FrameError(
                f"wrong frame count: header announces {n_buffers} buffers, got {len(frames) - 1}"
            )
    except DecodeError as err:
        return err
    if isinstance(exc, DecodeError):
        return exc
    if isinstance(exc, msgspec.DecodeError):
        return DecodeError(f"invalid message body: {_body_error(tp, frames[0], exc)}")
    return DecodeError(f"invalid message body: {type(exc).__name__}: {exc}")


def frame_error(what: str, k: int, frames: Any) -> DecodeError:
    return DecodeError(
        f"{what} refers to frame {k}, but the message has "
        + (f"frames 1..{len(frames) - 1}" if len(frames) > 1 else "no buffer frames")
    )


def token_error(code: int, payload: memoryview, frames: Any) -> DecodeError:
    """What is wrong with a token-array extension value that failed to decode."""
    dtype: Any = TOKEN_DTYPES[code]
    whole = f"needs a multiple of {dtype.itemsize} bytes of data"
    if code < FRAME:
        return DecodeError(f"token array of {dtype.name} {whole}, got {len(payload)}")
    compact = code >= REF
    size = 1 if compact else FRAME_REF.size
    if len(payload) != size:
        what = "compact token array frame reference" if compact else "token array frame reference"
        return DecodeError(
            f"{what} must be {size} byte{'s' if size > 1 else ''}, got {len(payload)}"
        )
    k, count = (payload[0], -1) if compact else FRAME_REF.unpack(payload)
    if not 0 < k < len(frames):
        return frame_error("token array", k, frames)
    try:
        got = buffer(frames[k]).nbytes
    except DecodeError as err:  # not bytes-like, not contiguous
        return err
    if compact:
        return DecodeError(f"token array of {dtype.name} in frame {k} {whole}, got {got}")
    return DecodeError(
        f"token array {dtype.name}[{count}] needs {count * dtype.itemsize} bytes of data, got {got}"
    )


_PATH = re.compile(r" - at `\$((?:\[\d+\])*)(.*)`$")
_INDEX = re.compile(r"\[(\d+)\]")


def _body_error(tp: Any, header: Any, exc: Exception) -> str:
    """msgspec's message with the path relative to the body and its field names, e.g.
    ``Expected `int` >= 1 - at `$[3][2]` (LLMRequest.gconfig.max_new_tokens)``."""
    text = str(exc)
    m = _PATH.search(text)
    if m is None or not m.group(1).startswith("[2]"):  # not inside the body
        return text
    idx = [int(i) for i in _INDEX.findall(m.group(1))][1:]
    rest = m.group(2)
    where = "$" + m.group(1)[3:] + rest
    try:
        names = _field_names(tp, _any_decoder.decode(buffer(header))[2], idx)
    except Exception:  # naming is best effort: the path above is exact
        names = ""
    return text[: m.start()] + f" - at `{where}`" + (f" ({names}{rest})" if names else "")


def _field_names(tp: Any, value: Any, idx: list[int]) -> str:
    """Dotted field names along ``idx`` in the raw decoded ``value`` of type ``tp``."""
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
